"""Build and load our C kernels on first use: the int8 paged KV cache (`c8_kernel.c`), GPTQ's
column sweep (`gptq_kernel.c`) and the quantized-weight GEMV of the CPU backend (`wq_gemv.c`,
built once per instruction set: `WQ_GEMV["amx"]`, `["avx512bf16"]`, `["avx512"]`, `["avx2"]`) and the
routed experts of int8-activation MoE layers on AVX-512 VNNI CPUs (`int8_experts.c`).

Every `wq_gemv.c` build also holds `wq_hadamard`, the online input rotation's butterflies
(x·Q of numerics.rotate_activation). Its `amx` build also holds the AMX-INT8 Linear (`wq_int8_linear`: int8 x int8 with
TDPBSSD, the activations' quantizer inside). `wq_op.cpp` holds the C++ torch operators over them
(`ascend_quant_cpu::wq_linear` over the GEMV builds, `ascend_quant_cpu::int8_linear`,
`ascend_quant_cpu::hadamard`),
compiled with the host C++ compiler against the running torch's headers and libraries
(`TorchOpLibrary`) and loaded with `torch.ops.load_library`.

Each library is compiled with the host C compiler (`cc -O3 -march=native -fopenmp`), a few
seconds, into `$ASCEND_QUANT_KERNEL_CACHE` (default `~/.cache/ascend_quant/kernels`), named by
a hash of the source, the flags and the CPU, and written atomically, so concurrent processes
(vLLM's engine and workers, parallel tests) neither rebuild it nor see a half-written file. It
links the OpenMP runtime torch already loaded (`libgomp.so.1`). Without a compiler `load()`
returns None and callers use their torch implementation; `ASCEND_QUANT_NATIVE=0` forces that.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
_i64, _i32, _p, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


def _cpu_tag() -> str:
    try:
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cache_dir() -> Path:
    return Path(os.environ.get("ASCEND_QUANT_KERNEL_CACHE", Path.home() / ".cache" / "ascend_quant" / "kernels"))


class NativeLibrary:
    """One C source built on first use; `load()` gives the ctypes library or None."""

    def __init__(self, source: Path, signatures: dict[str, list], flags: list[str], libs: list[str],
                 fast_math_fallback: bool = False):
        self.source, self.signatures, self.flags, self.libs = source, signatures, flags, libs
        self.fast_math_fallback = fast_math_fallback
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self.error: str | None = None

    def library_path(self) -> Path:
        h = hashlib.sha256(self.source.read_bytes() + " ".join(self.flags + self.libs).encode()
                           + _cpu_tag().encode()).hexdigest()[:16]
        return cache_dir() / f"{self.source.stem}-{h}.so"

    def _build(self, dst: Path) -> None:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise RuntimeError("no C compiler (cc/gcc) on PATH")
        cc = self.compiler(cc)
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=dst.parent)
        os.close(fd)
        try:
            extra = ["-lmvec"] if self.fast_math_fallback else []
            r = subprocess.run([cc, *self.flags, str(self.source), "-o", tmp, *self.libs, *extra],
                               capture_output=True, text=True)
            if r.returncode != 0 and self.fast_math_fallback:      # no libmvec (non-glibc): scalar expf
                r = subprocess.run([cc, *[f for f in self.flags if f != "-ffast-math"], str(self.source), "-o", tmp,
                                    *self.libs], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def compiler(self, cc: str) -> str:
        return cc

    def open(self, path: Path) -> ctypes.CDLL:
        return ctypes.CDLL(str(path))

    def load(self) -> ctypes.CDLL | None:
        """The compiled kernels, building them if needed; None when unavailable (see `error`)."""
        if os.environ.get("ASCEND_QUANT_NATIVE", "1") == "0":
            return None
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            try:
                path = self.library_path()
                if not path.exists():
                    self._build(path)
                lib = self.open(path)
                for name, args in self.signatures.items():
                    fn = getattr(lib, name)
                    fn.argtypes = args
                    fn.restype = None
                self._lib = lib
            except Exception as e:  # noqa: BLE001  (any failure means: use the torch path)
                self.error = f"{type(e).__name__}: {e}"
                logger.warning("ascend-quant: native %s unavailable (%s); using the torch implementation",
                               self.source.stem, self.error)
            self._tried = True
        return self._lib


_C8_SIG = {"c8_write": [_p, _i64, _p, _i64, _i32, _p, _i64, _p, _i64, _i64, _i32, _i32, _i32, _p, _p, _i32],
           "c8_gather": [_p, _i64, _i64, _p, _i64, _i32, _i32, _i32, _p, _p],
           "c8_attention": [_p, _i64, _i32, _p, _p, _i64, _i64, _p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _i32,
                            _i32, _f32, _i32, _p, _i64, _i32, _p, _i32]}
_C8_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"]
C8 = NativeLibrary(HERE / "c8_kernel.c", _C8_SIG, ["-march=native", *_C8_FLAGS], ["-lm"], fast_math_fallback=True)
# the AVX2 build, which `ASCEND_QUANT_CPU_ISA=avx2` selects (so AVX-512 machines test that path too)
C8_AVX2 = NativeLibrary(HERE / "c8_kernel.c", _C8_SIG, ["-mavx2", "-mfma", *_C8_FLAGS], ["-lm"],
                        fast_math_fallback=True)

# no -ffast-math: the sweep must round and accumulate exactly as written (IEEE, no reassociation)
GPTQ = NativeLibrary(
    HERE / "gptq_kernel.c",
    {"gptq_sweep_block": [_p, _p, _p, _p, _p, _i64, _i64, _i64, _f32, _f32]},
    ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"], ["-lm"])


# not -march=native: each build is limited to its instruction set, so the AVX2 one is the AVX2
# path even on an AVX-512 machine (where the tests force and check it)
_WQ_SIG = {"wq_gemv": [_p, _i32, _i64, _i64, _i64, _p, _i32, _i64, _i64, _i64, _i64, _p, _p, _p, _p,
                       _i32, _p, _i32, _i64, _i32, _p],
           "wq_quant_dynamic": [_p, _i32, _i64, _i64, _i64, _p, _p, _i32],
           "wq_glu_quant_dynamic": [_p, _i32, _i64, _i64, _i64, _p, _p, _i32],
           "wq_dequant": [_p, _i32, _i64, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i32],
           "wq_int8_linear": [_p, _i32, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _p, _p, _i32, _i64, _i32, _p],
           "wq_int8_gemv": [_p, _i32, _i64, _i64, _i64, _p, _p, _i32, _i32, _i64, _i64, _i64, _p, _p, _p, _p, _i32,
                            _i64, _i32, _p],
           "wq_hadamard": [_p, _i32, _i64, _i64, _i64, _p, _p, _i64, _f32, _p, _i32, _i64, _i32, _p],
           "wq_quant_static": [_p, _i32, _i64, _i64, _i64, _f32, _f32, _p, _i32],
           "wq_int8_epilogue": [_p, _i64, _i64, _p, _p, _p, _p, _p, _i32, _i32]}
_WQ_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx2", "-mfma"]
WQ_GEMV = {
    "amx": NativeLibrary(HERE / "wq_gemv.c", _WQ_SIG, [*_WQ_FLAGS, *_AVX512, "-mavx512vl", "-mavx512bf16", "-mamx-tile",
                                                       "-mamx-bf16", "-mamx-int8"], []),
    "avx512bf16": NativeLibrary(HERE / "wq_gemv.c", _WQ_SIG, [*_WQ_FLAGS, *_AVX512, "-mavx512vl", "-mavx512bf16"], []),
    "avx512": NativeLibrary(HERE / "wq_gemv.c", _WQ_SIG, [*_WQ_FLAGS, *_AVX512], []),
    "avx2": NativeLibrary(HERE / "wq_gemv.c", _WQ_SIG, [*_WQ_FLAGS, "-mavx2", "-mfma"], []),
}


class TorchOpLibrary(NativeLibrary):
    """A C++ source that registers torch operators (TORCH_LIBRARY): built against the running
    torch's headers and libraries (its version and C++ ABI are part of the cache name), loaded
    with `torch.ops.load_library`; `load()` also gives it as a ctypes library for its plain C
    entry points."""

    def __init__(self, source: Path, signatures: dict[str, list]):
        super().__init__(source, signatures, [], [])

    def library_path(self) -> Path:
        if not self.flags:      # torch's paths, read on first use (cpp_extension takes ~0.1 s to import)
            import torch
            from torch.utils import cpp_extension

            lib_dir = cpp_extension.library_paths()[0]
            self.flags = ["-O2", "-std=c++20", "-shared", "-fPIC",
                          f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                          *(f"-I{p}" for p in cpp_extension.include_paths()), f"-DTORCH_VERSION_TAG={torch.__version__}"]
            self.libs = [f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
        return super().library_path()

    def compiler(self, cc: str) -> str:
        return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or cc

    def open(self, path: Path) -> ctypes.CDLL:
        import torch

        torch.ops.load_library(str(path))
        return ctypes.CDLL(str(path))


# `torch.ops.ascend_quant_cpu.wq_linear`: the weight-only Linear on wq_gemv.c's kernels without
# Python in between (runtime/kernels/cpu.py registers each GEMV build it loads)
WQ_OP = TorchOpLibrary(HERE / "wq_op.cpp", {"wq_op_register": [_i32, _p, _p], "wq_op_register_int8": [_p],
                                            "wq_op_register_int8_gemv": [_i32, _p, _p],
                                            "wq_op_register_hadamard": [_i32, _p],
                                            "wq_op_register_static": [_i32, _p, _p]})

INT8_EXPERTS = NativeLibrary(
    HERE / "int8_experts.c",
    {"ie_experts": [_p, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _i32, _i64, _i64, _i64, _p, _p, _p, _i32, _i64,
                    _p, _i64, _p, _p, _i32, _p]},
    [*_WQ_FLAGS, *_AVX512, "-mavx512vl", "-mavx512vnni"], [])


def _c8() -> NativeLibrary:
    return C8_AVX2 if os.environ.get("ASCEND_QUANT_CPU_ISA") == "avx2" else C8


def load() -> ctypes.CDLL | None:
    """The C8 paged-attention kernels (kept for the callers in runtime/paged): the -march=native
    build, or the AVX2 one under `ASCEND_QUANT_CPU_ISA=avx2`."""
    return _c8().load()


def error() -> str | None:
    return _c8().error
