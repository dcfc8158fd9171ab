"""Build and load the C kernels of the int8 paged KV cache (`c8_kernel.c`) on first use.

The library is compiled with the host C compiler (`cc -O3 -march=native -fopenmp`), a few
seconds, into `$ASCEND_QUANT_KERNEL_CACHE` (default `~/.cache/ascend_quant/kernels`), named by
a hash of the source, the flags and the CPU, and written atomically, so concurrent processes
(vLLM's engine and workers, parallel tests) neither rebuild it nor see a half-written file. It
links the OpenMP runtime torch already loaded (`libgomp.so.1`). Without a compiler `load()`
returns None and callers use the torch implementation; `ASCEND_QUANT_NATIVE=0` forces that.
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

SOURCE = Path(__file__).with_name("c8_kernel.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lm"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None

_i64, _i32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
SIGNATURES = {
    "c8_write": [_p, _i64, _p, _i64, _i32, _p, _i64, _p, _i64, _i64, _i32, _i32, _i32, _p, _p, _i32],
    "c8_gather": [_p, _i64, _i64, _p, _i64, _i32, _i32, _i32, _p, _p],
    "c8_attention": [_p, _i64, _i32, _p, _p, _i64, _i64, _p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _i32,
                     _i32, _p, _i64, _i32, _p, _i32],
}


def _cpu_tag() -> str:
    try:
        flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cache_dir() -> Path:
    return Path(os.environ.get("ASCEND_QUANT_KERNEL_CACHE", Path.home() / ".cache" / "ascend_quant" / "kernels"))


def library_path() -> Path:
    h = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + LIBS).encode() + _cpu_tag().encode()).hexdigest()[:16]
    return cache_dir() / f"c8_kernel-{h}.so"


def _build(dst: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dst.parent)
    os.close(fd)
    try:
        flags = list(FLAGS)
        r = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, *LIBS, "-lmvec"], capture_output=True, text=True)
        if r.returncode != 0:      # no libmvec (non-glibc): scalar expf
            r = subprocess.run([cc, *[f for f in flags if f != "-ffast-math"], str(SOURCE), "-o", tmp, *LIBS],
                               capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them if needed; None when unavailable (see `error()`)."""
    global _lib, _tried, _error
    if os.environ.get("ASCEND_QUANT_NATIVE", "1") == "0":
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            path = library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            for name, args in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = args
                fn.restype = None
            _lib = lib
        except Exception as e:  # noqa: BLE001  (any failure means: use the torch path)
            _error = f"{type(e).__name__}: {e}"
            logger.warning("ascend-quant: C8 native kernels unavailable (%s); using the torch implementation", _error)
        _tried = True
    return _lib


def error() -> str | None:
    return _error
