"""The fast CPU backend: exact int8 GEMM and a per-token quantizer equal to the reference's.

The int8 x int8 product is exact on every path; which one runs (`gemm`):
  * "amx": our AMX-INT8 kernel (`native/wq_gemv.c`: wq_int8_linear, through the C++ operator
    `ascend_quant_cpu::int8_linear`), the default where the CPU has AMX-INT8: weights packed once
    into its tile layout (`AmxInt8Weight`, one int8 copy), TDPBSSD's exact int32 sums, the
    reference's epilogue; for W8A8_DYNAMIC and per-channel W4A8 the activations are quantized
    inside the same call by the reference's quantizer (`int8_matmul_dynamic`), so compiled mode
    traces one operator per Linear;
  * "onednn": vLLM's `onednn_scaled_mm`, only where the CPU has VNNI (see below);
  * "gemv": our integer GEMV (`native/wq_gemv.c`: wq_int8_gemv, through the C++ operator
    `ascend_quant_cpu::int8_gemv_linear`), the default without VNNI: AVX2's VPMADDUBSW with
    operands that cannot saturate (int4: the weight + 8 against x_q; int8: |w| against x_q with
    w's sign, or for a call whose x_q holds a -128 |x_q| against w with x_q's sign; a call with
    both an x_q and a weight of -128 goes to the float32 GEMMs below), exact int32 sums, the
    reference's epilogue, the weights read once per call in the GEMV layout (one int8 byte or
    half a byte per weight); the dynamic quantizer inside the same call, as on "amx";
  * "f32": float32 GEMMs over k-chunks of 1024 (`reference.exact_int8_matmul`; exact because
    every partial sum stays an integer below 2^24), where "gemv" cannot run (no C compiler):
    measured on an AVX2 CPU (1 thread, 512x576x1536) MKL's sgemm is ~20x faster than
    `torch._int_mm`, whose CPU kernel has no int8 fast path on such CPUs;
  * "int_mm": `torch._int_mm` (int32 accumulate), kept for comparison in the benchmark.

On CPUs without VNNI (AVX2 only, like the 2-core machine this was written on) oneDNN's
s8 x s8 GEMM multiplies through `vpmaddubsw`, whose int16 pair sums saturate: measured here,
full-range int8 operands come out wrong by up to a third. It is therefore used only when
/proc/cpuinfo names avx512_vnni, avx_vnni or amx_int8; `torch._int_mm` is exact everywhere.

`ASCEND_QUANT_CPU_GEMM=gemv` (or `f32`, `onednn`, `int_mm`) forces a path, so the integer
GEMV, the default of AVX2 machines, is tested and served on a VNNI machine too. Forcing `onednn`
without VNNI is refused: its results would be wrong.

Decode and small batches (at most `GEMV_MAX_M` tokens) of the weight-only schemes run our C
GEMV (`native/wq_gemv.c`): it reads the int8 / int4 weights once per call and converts them
in registers. Its AMX build (AMX-BF16 tiles for bfloat16 activations from 4 tokens on,
prefill included: the weights converted per block of 32 output
channels into a panel every tile of tokens reuses), AVX-512-BF16 (bfloat16 activations through
VDPBF16PS), AVX-512 or AVX2 build is chosen from /proc/cpuinfo; `ASCEND_QUANT_CPU_ISA=avx2`
(or `amx`, `avx512bf16`, `avx512`, `off`) forces one, so each narrower path is tested on wider
machines too (`off`: the torch path). The AVX512-BF16 build also serves bfloat16 prefill, on
panels of bfloat16 pairs converted once per block of 32 channels and span of tokens. Other
larger batches run float32 GEMMs over k-chunks converted from the same weights (or oneDNN,
see above).

Weight-only Linears reach the GEMV through a C++ torch operator, `ascend_quant_cpu::wq_linear`
(`native/wq_op.cpp`, built on first use against the running torch), so vLLM's compiled graph
calls the kernel with the layer's tensors and no Python in between (`traceable`);
`ASCEND_QUANT_CPU_OP=0` calls the same kernels through ctypes instead (the path taken where the
operator cannot be built).

Routed experts whose Linears take int8 activations (W8A8_DYNAMIC, per-channel W4A8_DYNAMIC)
run, on CPUs with AVX-512 VNNI, all experts of a layer in one call per projection
(`native/int8_experts.c`, `group_experts`): exact int32 sums, the reference's epilogue,
one int8 / packed int4 copy of the weights. `ASCEND_QUANT_CPU_MOE=loop` forces the expert by
expert path of `kernels.moe` (the path of CPUs without VNNI).

The per-token activation quantizer is the same library's `wq_quant_dynamic` (the reference's
formula with its IEEE division; the torch one with `off`), so every path's int8 activations
equal the reference's bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
from dataclasses import dataclass, field

import torch

from ascend_quant import native, numerics
from ascend_quant.runtime.kernels.reference import EXACT_F32_CHUNK, ReferenceBackend, exact_int8_matmul, int8_epilogue

GEMMS = ("amx", "onednn", "gemv", "f32", "int_mm")
GEMM_ENV = "ASCEND_QUANT_CPU_GEMM"
# How weights are kept: "compact" (default) keeps the integers (int4 packed two per byte), in
# the GEMV kernel's layout when it is available, and large batches convert one k-chunk at a
# time inside each call, so serving memory is what the checkpoint promises (1 byte per int8
# weight, half a byte per int4 weight); "float32" keeps a float32 copy (4 bytes per weight,
# no GEMV kernel), for the "f32" GEMM, a little faster for prefill there.
WEIGHTS_ENV = "ASCEND_QUANT_CPU_WEIGHTS"
ISA_ENV = "ASCEND_QUANT_CPU_ISA"
ISAS = ("amx", "avx512bf16", "avx512", "avx2", "off")
# tokens up to which the GEMV kernel runs (beyond: GEMMs). Measured on an AVX-512 CPU, one
# thread, 576x3072: at 64 tokens the GEMV took 1.8 ms (AVX512-BF16) / 2.8 ms (AVX-512), the
# float32 GEMMs over dequantized chunks 6.8 ms
GEMV_MAX_M = 64
# the amx build's tile path and the avx512bf16 build's panel path (bfloat16 activations,
# native/wq_gemv.c) serve every token count, prefill included: they never hand a batch to the
# float32 GEMMs
AMX_MAX_M = 1 << 62
MOE_ENV = "ASCEND_QUANT_CPU_MOE"      # "grouped" (default with AVX-512 VNNI) or "loop"
# "0": weight-only Linears call the GEMV through ctypes from Python instead of through the C++
# operator `ascend_quant_cpu::wq_linear` (native/wq_op.cpp), which compiled mode traces
OP_ENV = "ASCEND_QUANT_CPU_OP"
# two-stage per-group W4A8: "int8" (default) holds w4 * s2 as one int8 weight per channel
# (numerics.two_stage_int8: exact), so it runs every int8 path W8A8_DYNAMIC runs (AMX-INT8,
# oneDNN, the integer GEMV) at 1 byte per weight; "int4" keeps the packed int4 weight and its
# group scales (half a byte per weight; the integer GEMV up to GEMV_MAX_M tokens, float32
# GEMMs beyond)
TWO_STAGE_ENV = "ASCEND_QUANT_CPU_W4A8_GROUPED"
GEMV_PAD = 32            # the kernel's groups are padded to a multiple of this many values
_XDT = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_YDT = {torch.float32: 0, torch.bfloat16: 1}


def _weight_mode() -> str:
    import os

    mode = os.environ.get(WEIGHTS_ENV, "compact")
    if mode not in ("compact", "float32"):
        raise ValueError(f"{WEIGHTS_ENV}={mode!r}: use compact or float32")
    return mode


def _two_stage_mode() -> str:
    mode = os.environ.get(TWO_STAGE_ENV, "int8")
    if mode not in ("int8", "int4"):
        raise ValueError(f"{TWO_STAGE_ENV}={mode!r}: expected int8 or int4")
    return mode


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The words of /proc/cpuinfo (its flags among them), read once; empty where it is unreadable."""
    try:
        return frozenset(open("/proc/cpuinfo").read().split())
    except OSError:
        return frozenset()


def cpu_has_vnni() -> bool:
    return not cpu_flags().isdisjoint(("avx512_vnni", "avx_vnni", "amx_int8"))


def cpu_has_amx_int8() -> bool:
    return {"amx_tile", "amx_int8"} <= cpu_flags()


@functools.lru_cache(maxsize=1)
def vllm_cpu_ops():
    """vLLM's compiled CPU ops module, or None (vLLM absent or a GPU build)."""
    try:
        import vllm._custom_ops as ops  # noqa: F401  (loads vllm._C)
        torch.ops._C.onednn_scaled_mm  # noqa: B018
        return ops
    except Exception:   # ImportError, or the op is not compiled into this build
        return None


def moe_mode() -> str:
    """`ASCEND_QUANT_CPU_MOE` if set (grouped refused without AVX-512 VNNI), else grouped where it runs."""
    has = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()
    mode = os.environ.get(MOE_ENV) or ("grouped" if has else "loop")
    if mode not in ("grouped", "loop"):
        raise ValueError(f"{MOE_ENV}={mode!r}: use grouped or loop")
    if mode == "grouped" and not has:
        raise ValueError(f"{MOE_ENV}=grouped needs AVX-512 VNNI, which this CPU lacks; use loop")
    return mode


def cpu_isa() -> str:
    """The widest GEMV build this CPU runs: "amx" (AMX tiles with BF16, and AVX-512-BF16),
    "avx512bf16" (AVX-512 F, BW, VL and BF16), "avx512" (F and BW), "avx2" (with FMA) or "off"."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx2", "fma"} <= flags:
        if not {"avx512vl", "avx512_bf16"} <= flags:
            return "avx512"
        return "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512bf16"
    return "avx2" if {"avx2", "fma"} <= flags else "off"


def gemv_isa() -> str:
    """`ASCEND_QUANT_CPU_ISA` if set (refused where the CPU lacks it), else `cpu_isa()`."""
    forced = os.environ.get(ISA_ENV)
    if not forced:
        return cpu_isa()
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r}: use one of {', '.join(ISAS)}")
    if forced != "off" and ISAS.index(forced) < ISAS.index(cpu_isa()):
        raise ValueError(f"{ISA_ENV}={forced}: this CPU has no {forced} (it runs {cpu_isa()})")
    return forced


def default_gemm(amx: bool = True) -> str:
    """The int8 GEMM path: `ASCEND_QUANT_CPU_GEMM` if set, else our AMX-INT8 kernel where the CPU
    has it and the amx GEMV build is selected (`amx=False`: the choice without it), else oneDNN
    where it is exact and fast, else our integer GEMV (the exact-f32 GEMMs with the GEMV off)."""
    forced = os.environ.get(GEMM_ENV)
    if forced:
        return forced
    if amx and cpu_has_amx_int8() and gemv_isa() == "amx":
        return "amx"
    if cpu_has_vnni() and vllm_cpu_ops() is not None:
        return "onednn"
    return "gemv" if gemv_isa() != "off" else "f32"


def check_env() -> None:
    """Raise ValueError (one line) for a bad CPU-backend switch (`ASCEND_QUANT_CPU_GEMM`, `_ISA`,
    `_OP`, `_WEIGHTS`, `_MOE`, `_W4A8_GROUPED`), so that a command can refuse it before it starts a
    vLLM engine, whose worker would otherwise fail on it with a traceback. Nothing to check when
    none is set."""
    if not any(os.environ.get(v) for v in (GEMM_ENV, ISA_ENV, OP_ENV, WEIGHTS_ENV, MOE_ENV, TWO_STAGE_ENV)):
        return
    _weight_mode()
    _two_stage_mode()
    if os.environ.get(MOE_ENV):
        moe_mode()
    CpuBackend()


@dataclass
class GemvWeight:
    """Integer weights in the layout of `native/wq_gemv.c`: per output channel, `groups` groups
    of `gp` values (the group's `group_size` in-features, then zeros up to a multiple of
    GEMV_PAD); int8 [n, groups * gp], or int4 packed along k [n, groups * gp / 2] (in each block
    of 32 values, byte i holds value i in its low nibble and value i + 16 in its high one).
    Per-channel: one group of k. scale / offset float32 [n, groups]."""
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    k: int
    group_size: int
    gp: int
    full_range: bool = False        # int8 values hold -128 (wq_int8_gemv's choice of form needs it)
    _args: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int) -> "GemvWeight":
        """q: integer values in int8 [n, k]; scale / offset [n, groups] (or [n])."""
        n, k = q.shape
        scale = scale.float().reshape(n, -1).contiguous()
        groups = scale.shape[1]
        gsz = k // groups
        gp = -(-gsz // GEMV_PAD) * GEMV_PAD
        w = torch.zeros(n, groups, gp, dtype=torch.int8)
        w[:, :, :gsz] = q.to(torch.int8).reshape(n, groups, gsz)
        w = w.reshape(n, groups * gp)
        if bits == 4:
            w = w.view(n, -1, 2, 16)
            w = ((w[:, :, 0] & 0xF) | (w[:, :, 1] << 4)).reshape(n, -1)
        off = None if offset is None else offset.float().reshape(n, groups).contiguous()
        return cls(w.contiguous(), scale, off, bits, k, gsz, gp, bits == 8 and bool((q == -128).any()))

    @property
    def n(self) -> int:
        return self.q.shape[0]

    def values(self, start: int, end: int) -> torch.Tensor:
        """Columns start:end of the integer weight [n, k], as int8."""
        gsz, groups = self.group_size, self.scale.shape[1]
        g0, g1 = start // gsz, -(-end // gsz)
        w = self.q.view(self.n, groups, -1)[:, g0:g1]
        if self.bits == 4:
            w = w.reshape(self.n, g1 - g0, -1, 1, 16)
            w = torch.cat(((w << 4) >> 4, w >> 4), dim=-2).reshape(self.n, g1 - g0, self.gp)
        return w[:, :, :gsz].reshape(self.n, -1)[:, start - g0 * gsz:end - g0 * gsz]

    def dequantized(self, start: int, end: int) -> torch.Tensor:
        """Columns start:end of `(w - offset) * scale`, float32 [n, end - start]."""
        gsz = self.group_size
        g0, g1 = start // gsz, -(-end // gsz)
        cols = slice(start - g0 * gsz, end - g0 * gsz)
        w = self.values(start, end).float()
        if self.offset is not None:
            w = w - self.offset[:, g0:g1].repeat_interleave(gsz, 1)[:, cols]
        return w * self.scale[:, g0:g1].repeat_interleave(gsz, 1)[:, cols]


def _gemv(lib, w: GemvWeight, x2: torch.Tensor, mode: int, out_dtype: torch.dtype, bias=None, pertoken=None):
    """One call of `wq_gemv` on x2 [m, k] (float32, bfloat16 or int8 for mode 1)."""
    m = x2.shape[0]
    ydt = _YDT.get(out_dtype, 0)
    y = torch.empty((m, w.n), dtype=out_dtype if out_dtype in _YDT else torch.float32)
    bias = None if bias is None else bias.float().contiguous()
    pertoken = None if pertoken is None else pertoken.float().reshape(-1).contiguous()
    status = ctypes.c_int(0)
    if w._args is None:         # the weight's pointers and shape, fixed once it is built
        w._args = (w.q.data_ptr(), w.bits, w.n, w.scale.shape[1], w.group_size, w.gp, w.scale.data_ptr(),
                   None if w.offset is None else w.offset.data_ptr())
    lib.wq_gemv(x2.data_ptr(), _XDT[x2.dtype], m, w.k, x2.stride(0), *w._args,
                None if bias is None else bias.data_ptr(), None if pertoken is None else pertoken.data_ptr(),
                mode, y.data_ptr(), ydt, w.n, torch.get_num_threads(), ctypes.byref(status))
    if status.value:
        raise MemoryError("wq_gemv: could not allocate its activation buffer")
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _gemv_ops(isa: str, gemv_lib):
    """(`torch.ops.ascend_quant_cpu.wq_linear`, `...int8_gemv_linear`) with this GEMV build's
    kernels registered in them (their slot is the build's index in ISAS, the ops' `isa`
    argument), or (None, None): no GEMV build, no C++ compiler or torch headers, or
    `ASCEND_QUANT_CPU_OP=0` (the same kernels called through ctypes)."""
    if gemv_lib is None or os.environ.get(OP_ENV, "1") == "0":
        return None, None
    lib = native.WQ_OP.load()
    if lib is None:
        return None, None
    slot, fn = ISAS.index(isa), lambda name: ctypes.cast(getattr(gemv_lib, name), ctypes.c_void_p)
    lib.wq_op_register(slot, fn("wq_gemv"), fn("wq_dequant"))
    lib.wq_op_register_int8_gemv(slot, fn("wq_int8_gemv"), fn("wq_quant_dynamic"))
    _register_wq_fake()
    _register_int8_gemv_fake()
    return torch.ops.ascend_quant_cpu.wq_linear, torch.ops.ascend_quant_cpu.int8_gemv_linear


def _int8_op(isa: str, gemv_lib):
    """`torch.ops.ascend_quant_cpu.int8_linear` with the amx build's AMX-INT8 kernel registered in
    it, or None: another build selected, no AMX-INT8, no C++ operator, or `ASCEND_QUANT_CPU_OP=0`."""
    if isa != "amx" or gemv_lib is None or not cpu_has_amx_int8() or os.environ.get(OP_ENV, "1") == "0":
        return None
    lib = native.WQ_OP.load()
    if lib is None:
        return None
    lib.wq_op_register_int8(ctypes.cast(gemv_lib.wq_int8_linear, ctypes.c_void_p))
    _register_int8_fake()
    return torch.ops.ascend_quant_cpu.int8_linear


def hadamard_op() -> tuple[object, int] | None:
    """(`torch.ops.ascend_quant_cpu.hadamard`, the `isa` slot to pass it) with the selected GEMV
    build's `wq_hadamard` registered (the online input rotation's butterflies, native/wq_gemv.c),
    or None: no GEMV build, no C++ compiler or torch headers, or `ASCEND_QUANT_CPU_OP=0` (callers
    then take numerics.rotate_activation's torch ops)."""
    isa = gemv_isa()
    if isa == "off" or os.environ.get(OP_ENV, "1") == "0":
        return None
    gemv_lib = native.WQ_GEMV[isa].load()
    lib = native.WQ_OP.load() if gemv_lib is not None else None
    if lib is None:
        return None
    lib.wq_op_register_hadamard(ISAS.index(isa), ctypes.cast(gemv_lib.wq_hadamard, ctypes.c_void_p))
    _register_hadamard_fake()
    return torch.ops.ascend_quant_cpu.hadamard, ISAS.index(isa)


def _static_ops(isa: str, gemv_lib):
    """(`torch.ops.ascend_quant_cpu.quant_static`, `...int_mm_linear`) with this GEMV build's
    `wq_quant_static` and `wq_int8_epilogue` registered, or None: no GEMV build, no C++ operator,
    or `ASCEND_QUANT_CPU_OP=0` (the same kernels through ctypes)."""
    if gemv_lib is None or os.environ.get(OP_ENV, "1") == "0":
        return None
    lib = native.WQ_OP.load()
    if lib is None:
        return None
    fn = lambda name: ctypes.cast(getattr(gemv_lib, name), ctypes.c_void_p)  # noqa: E731
    lib.wq_op_register_static(ISAS.index(isa), fn("wq_quant_static"), fn("wq_int8_epilogue"))
    _register_static_fakes()
    return torch.ops.ascend_quant_cpu.quant_static, torch.ops.ascend_quant_cpu.int_mm_linear


@functools.lru_cache(maxsize=1)
def _register_static_fakes() -> None:
    """The outputs' shapes and dtypes of `quant_static` and `int_mm_linear` for tracing."""
    @torch.library.register_fake("ascend_quant_cpu::quant_static")
    def _(x, params, isa):
        return torch.empty_like(x, dtype=torch.int8)

    @torch.library.register_fake("ascend_quant_cpu::int_mm_linear")
    def _(x, pertoken, w_kn, scale, quant_bias, bias, isa, out_dtype):
        return x.new_empty((*x.shape[:-1], w_kn.shape[1]), dtype=out_dtype if out_dtype is not None else torch.float32)


@functools.lru_cache(maxsize=1)
def _register_hadamard_fake() -> None:
    """The output's shape and dtype of `hadamard` (x's) for tracing (vLLM's compiled mode)."""
    @torch.library.register_fake("ascend_quant_cpu::hadamard")
    def _(x, signs, core, isa):
        return torch.empty_like(x)


@functools.lru_cache(maxsize=1)
def _register_int8_gemv_fake() -> None:
    """The output's shape and dtype of `int8_gemv_linear` for tracing (vLLM's compiled mode)."""
    @torch.library.register_fake("ascend_quant_cpu::int8_gemv_linear")
    def _(x, pertoken, q, scale, quant_bias, bias, isa, bits, full_range, max_m, out_dtype):
        dt = out_dtype if out_dtype is not None else (torch.float32 if x.dtype == torch.int8 else x.dtype)
        return x.new_empty((*x.shape[:-1], q.shape[0]), dtype=dt)


@functools.lru_cache(maxsize=1)
def _register_int8_fake() -> None:
    """The output's shape and dtype of `int8_linear` for tracing (vLLM's compiled mode)."""
    @torch.library.register_fake("ascend_quant_cpu::int8_linear")
    def _(x, pertoken, wp, scale, quant_bias, bias, n, out_dtype):
        dt = out_dtype if out_dtype is not None else (torch.float32 if x.dtype == torch.int8 else x.dtype)
        return x.new_empty((*x.shape[:-1], n), dtype=dt)


@functools.lru_cache(maxsize=1)
def _register_wq_fake() -> None:
    """The output's shape and dtype of `wq_linear` for tracing (vLLM's compiled mode)."""
    @torch.library.register_fake("ascend_quant_cpu::wq_linear")
    def _(x, q, scale, offset, bias, isa, bits, k, group_size, gp, max_m):
        return x.new_empty((*x.shape[:-1], q.shape[0]))


def _onednn_out_dtype(out_dtype: torch.dtype, has_bias: bool) -> torch.dtype:
    """The output dtype of the oneDNN handler a call uses: bfloat16 straight from oneDNN when
    there is no bias (measured equal to the float32 epilogue cast last; with a bias oneDNN
    rounds twice), else float32, cast afterwards."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 and not has_bias else torch.float32


def _gemv_exact(w: GemvWeight) -> bool:
    """Whether mode 1 (int8 x_q, `wq_int8_gemv`) is exact for `w`: one group (per channel) and
    int32 sums that cannot overflow (kp * 128 * 128 < 2^31)."""
    return w.scale.shape[1] == 1 and w.gp * 128 * 128 < 2 ** 31


@dataclass
class AmxInt8Weight:
    """Integer weights [n, k] in the tile layout of `native/wq_gemv.c`'s wq_int8_linear: n padded
    to a multiple of 32 channels and k to kp (a multiple of 64) with zeros; per block of 32
    channels and 64 in-features two 1 KiB B tiles, [16 rows of 4 in-features][16 channels][4]:
    wp[b, c, h, r, j, q] = w[32 b + 16 h + j, 64 c + 4 r + q]. int4 values (W4A8) are kept as
    int8 here (TDPBSSD multiplies bytes); `bits` remembers them."""
    wp: torch.Tensor
    n: int
    k: int
    bits: int

    @classmethod
    def build(cls, q: torch.Tensor, bits: int = 8) -> "AmxInt8Weight":
        n, k = q.shape
        np_, kp = -(-n // 32) * 32, -(-k // 64) * 64
        w = torch.zeros(np_, kp, dtype=torch.int8)
        w[:n, :k] = q
        # [b, h, j, c, r, q] -> [b, c, h, r, j, q]
        wp = w.view(np_ // 32, 2, 16, kp // 64, 16, 4).permute(0, 3, 1, 4, 2, 5).contiguous().reshape(-1)
        return cls(wp, n, k, bits)

    def values(self) -> torch.Tensor:
        """The integer weight int8 [n, k]."""
        np_ = -(-self.n // 32) * 32
        kp = self.wp.numel() // np_
        w = self.wp.view(np_ // 32, kp // 64, 2, 16, 16, 4).permute(0, 2, 4, 1, 3, 5).reshape(np_, kp)
        return w[:self.n, :self.k]


@dataclass
class CpuInt8Weight:
    # "f32": float32 [k, n], or compact int8 [k, n] / int4 packed along k [k/2, n];
    # "int_mm": int8 [n, k]^T view; None when `gemv` (int4 with the GEMV kernel) or `amx` holds the weight
    weight_t: torch.Tensor | None
    scale: torch.Tensor             # float32 [n]
    onednn: dict | None = None      # vLLM oneDNN handlers by output dtype, made on first use (VNNI CPUs only)
    n: int = 0
    packed: bool = False            # int4 values packed two per byte along k
    gemv: GemvWeight | None = None
    amx: AmxInt8Weight | None = None    # the "amx" GEMM's layout (weight_t None then)

    @property
    def bits(self) -> int:
        """4 when the integers are int4 values (packed, in the GEMV's int4 layout, or AMX's int8 copy of them), else 8."""
        if self.amx is not None:
            return self.amx.bits
        return 4 if self.packed or (self.gemv is not None and self.gemv.bits == 4) else 8

    def holds_integers(self) -> bool:
        """False once `CpuBackend.finalize_linear` left the weight to oneDNN's own copy."""
        return self.weight_t is not None or self.gemv is not None or self.amx is not None

    def int8_kn(self) -> torch.Tensor:
        """The integer weight as int8 [k, n], the transpose of a contiguous [n, k] (as oneDNN takes it)."""
        if self.amx is not None:
            return self.amx.values().contiguous().t()
        if self.gemv is not None:
            w_nk = self.gemv.values(0, self.gemv.k)
        else:
            w_nk = (numerics.unpack_int4(self.weight_t) if self.packed else self.weight_t.to(torch.int8)).t()
        return w_nk.contiguous().t()

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Rows start:end of the [k, n] weight as float32 (exact integers)."""
        if self.amx is not None:
            return self.amx.values()[:, start:end].float().t()
        if self.gemv is not None:
            return self.gemv.values(start, end).float().t()
        if self.packed:
            return numerics.unpack_int4(self.weight_t[start // 2:end // 2]).float()
        return self.weight_t[start:end].float()


@dataclass
class CpuWeightOnly:
    # float32 mode: the dequantized [k, n] in the serving dtype (weight_t). Compact mode: the
    # GEMV kernel's layout (`gemv`, weight_t None), or without the kernel the integers as
    # [k, n] int8 (int4 packed along k: [k/2, n]) with scale/offset [groups, n].
    weight_t: torch.Tensor | None
    scale_t: torch.Tensor | None = None
    offset_t: torch.Tensor | None = None
    group_size: int = 0
    packed: bool = False
    gemv: GemvWeight | None = None

    def chunk(self, start: int, end: int) -> torch.Tensor:
        """Rows start:end of the dequantized [k, n] weight, float32 ((w - offset) * scale)."""
        q = numerics.unpack_int4(self.weight_t[start // 2:end // 2]) if self.packed else self.weight_t[start:end]
        rows = slice(start // self.group_size, -(-end // self.group_size)) if self.group_size else slice(None)
        scale = self.scale_t[rows]
        offset = None if self.offset_t is None else self.offset_t[rows]
        if self.group_size:
            scale = scale.repeat_interleave(self.group_size, 0)[start % self.group_size:][: end - start]
            offset = None if offset is None else offset.repeat_interleave(self.group_size, 0)[
                start % self.group_size:][: end - start]
        w = q.float()
        if offset is not None:
            w = w - offset
        return w * scale


@dataclass
class VnniExperts:
    """One projection of every expert of a layer in `native/int8_experts.c`'s layout: int8
    bytes [E, n/16 * 16 * kp] (int8 [n/16][kp/4][16][4], or int4 [n/16][kp/8][16][4] bytes, see the
    C file), n padded to 16 channels and k to kp (a multiple of 8) with zeros; per-channel
    scale float32 [E, n]; wsum int32 [E, n], each channel's sum of its integer weights."""
    w: torch.Tensor
    scale: torch.Tensor
    wsum: torch.Tensor
    bits: int
    n: int
    k: int
    kp: int

    def bytes_per_expert(self) -> int:
        return self.w.shape[1]

    @classmethod
    def build(cls, weights: list["CpuInt8Weight"], bits: int) -> "VnniExperts":
        n, k = weights[0].n, weights[0].int8_kn().shape[0]
        nb, kp = -(-n // 16), -(-k // 8) * 8
        packed, scales, sums = [], [], []
        for w in weights:
            q = torch.zeros(nb * 16, kp, dtype=torch.int8)
            q[:n, :k] = w.int8_kn().t()
            sums.append(q[:n].sum(1, dtype=torch.int32))
            scales.append(w.scale.float().reshape(-1))
            if bits == 8:       # [nb, 16, kp/4, 4] -> [nb, kp/4, 16, 4]
                blocks = q.view(nb, 16, kp // 4, 4).permute(0, 2, 1, 3)
            else:               # value 8s + 4h + b: byte b of step s, low nibble for h = 0
                v = q.view(nb, 16, kp // 8, 2, 4)
                blocks = ((v[:, :, :, 0] & 0xF) | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3)
            packed.append(blocks.contiguous().reshape(-1))
        return cls(torch.stack(packed), torch.stack(scales).contiguous(), torch.stack(sums).contiguous(), bits, n, k, kp)


@dataclass
class CpuGroupedExperts:
    """A MoE layer's experts (w13 = [gate; up], w2) for `int8_experts.c`: per-token int8
    activations (our quantizer), one kernel call per projection for all experts, the SiLU gate
    in torch between them, the same arithmetic as the expert by expert path."""
    w13: VnniExperts
    w2: VnniExperts
    backend: "CpuBackend" = field(repr=False)

    def __len__(self) -> int:
        return self.w13.w.shape[0]

    def _call(self, lib, p: VnniExperts, x_q, rows, x_scale, offsets, ydt, *, y=None, out=None, out_rows=None,
              topw=None):
        """One `ie_experts` call: projection `p` on int8 rows `x_q` (gathered by `rows`, or in pair
        order), into `y` per pair or, with `out`, the weighted combine at `out_rows`."""
        status = ctypes.c_int(0)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        lib.ie_experts(x_q.data_ptr(), x_q.stride(0), ptr(rows), x_scale.data_ptr(), int(offsets[-1]),
                       len(self), offsets.data_ptr(), p.w.data_ptr(), p.w.stride(0), p.bits, p.n, p.k,
                       p.kp, p.scale.data_ptr(), p.wsum.data_ptr(), ptr(y), ydt, 0 if y is None else y.stride(0),
                       ptr(out), 0 if out is None else out.stride(0), ptr(out_rows),
                       ptr(topw), torch.get_num_threads(), ctypes.byref(status))
        if status.value:
            raise MemoryError("int8_experts: could not allocate its activation buffer")

    def run_grouped(self, x: torch.Tensor, weight: torch.Tensor, token: torch.Tensor, counts: list[int]):
        """`kernels.moe.routed_experts` for the pairs sorted by expert (`token`, their `weight`)."""
        lib = native.INT8_EXPERTS.load()
        out = torch.zeros(x.shape, dtype=torch.float32)
        pairs = token.numel()
        if pairs == 0:
            return out.to(x.dtype)
        offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
        ydt = 1 if x.dtype == torch.bfloat16 else 0
        x_q, s_x = self.backend.quantize_dynamic(x)
        token = token.contiguous()
        s_x = s_x.float().reshape(-1).contiguous()
        h = torch.empty((pairs, self.w13.n), dtype=torch.bfloat16 if ydt else torch.float32)
        self._call(lib, self.w13, x_q, token, s_x, offsets, ydt, y=h)
        if h.dtype != x.dtype:
            h = h.to(x.dtype)
        i = self.w13.n // 2
        torch.nn.functional.silu(h[:, :i], inplace=True)      # torch's SiLU: the reference's bits
        a_q, s_a = self.backend.quantize_glu_dynamic(h)
        s_a = s_a.float().reshape(-1).contiguous()
        # a_q is already in pair order; the combine adds pair p into its token's row
        self._call(lib, self.w2, a_q, None, s_a, offsets, ydt, out=out, out_rows=token,
                   topw=weight.float().contiguous())
        return out.to(x.dtype)


class CpuBackend(ReferenceBackend):
    name = "cpu"

    def __init__(self, gemm: str | None = None):
        forced = gemm or os.environ.get(GEMM_ENV)
        gemm = gemm or default_gemm()
        if gemm not in GEMMS:
            raise ValueError(f"{GEMM_ENV}={gemm!r}: use one of {', '.join(GEMMS)}")
        if gemm == "onednn" and not (cpu_has_vnni() and vllm_cpu_ops() is not None):
            raise ValueError(f"{GEMM_ENV}=onednn needs vLLM's CPU ops and a CPU with VNNI or AMX "
                             "(without them oneDNN's int8 GEMM saturates); use f32")
        self.isa = gemv_isa()
        self.gemv_lib = None if self.isa == "off" else native.WQ_GEMV[self.isa].load()
        # the GEMV's operators: `wq_linear` (weight-only) and `int8_gemv_linear` (the "gemv" GEMM,
        # and two-stage per-group W4A8 on every GEMM); None: called through ctypes
        self.wq_op, self.int8_gemv_op = _gemv_ops(self.isa, self.gemv_lib)
        # static W8A8's quantizer and the oneDNN GEMM's int8 Linear for it, as operators (or None)
        self.static_ops = _static_ops(self.isa, self.gemv_lib)
        self.int8_op = _int8_op(self.isa, self.gemv_lib) if gemm == "amx" else None
        if gemm == "amx" and self.int8_op is None:
            if forced:
                raise ValueError(f"{GEMM_ENV}=amx needs a CPU with AMX-INT8, the amx GEMV build "
                                 f"({ISA_ENV} unset or amx) and the C++ operator ({OP_ENV} not 0)")
            gemm = default_gemm(amx=False)      # no compiler here: the next path
        if gemm == "gemv" and self.gemv_lib is None:
            if forced:
                raise ValueError(f"{GEMM_ENV}=gemv needs the GEMV library ({ISA_ENV} not off, a C compiler)")
            gemm = "f32"
        self.gemm = gemm
        self.use_onednn = gemm == "onednn"
        self._static_params: dict[tuple[float, float], tuple[float, float]] = {}   # quantize_static's

    def can_implement(self, op: str, **cfg) -> tuple[bool, str]:
        device = cfg.get("device", "cpu")
        if torch.device(device).type != "cpu":
            return False, f"cpu backend: tensors are on {device}"
        if self.gemm == "int_mm" and not hasattr(torch, "_int_mm"):
            return False, "cpu backend: this torch build has no torch._int_mm"
        return True, ""

    def quantize_dynamic(self, x):
        """numerics.quantize_activation_dynamic bit for bit, in C (`wq_quant_dynamic`: one
        pass for the max, one for the IEEE division and rounding). vLLM's own quantizer
        multiplies by 1 / s_t, which rounds a boundary value the other way now and then; on a
        real model one such flip grows into a different greedy continuation."""
        if torch.compiler.is_compiling() or self.gemv_lib is None or x.dtype not in (torch.float32, torch.bfloat16):
            # traced (see `traceable`): numerics' own torch ops, which inductor compiles into one
            # fused loop; the same values bit for bit (the C one against numerics:
            # tests/test_cpu_kernels.py; traced against eager: tests/test_kernels.py)
            return super().quantize_dynamic(x)
        # vLLM hands 2-D tokens: no reshapes then (each costs ~1 us, a decode step has ~100 calls)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m, k = x2.shape
        out = torch.empty((m, k), dtype=torch.int8)
        scale = torch.empty((m, 1), dtype=torch.float32)
        self.gemv_lib.wq_quant_dynamic(x2.data_ptr(), _XDT[x2.dtype], m, k, x2.stride(0),
                                       out.data_ptr(), scale.data_ptr(), torch.get_num_threads())
        if x.dim() == 2:
            return out, scale
        return out.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)

    def quantize_static(self, x, input_scale, input_offset, params=None):
        """numerics.quantize_activation_static bit for bit (its bf16-rounded parameters), in one C
        pass (`wq_quant_static`) instead of torch's five: through the operator `quant_static`
        where it is loaded, else through ctypes. `params` (the scheme's precomputed float32
        [1/s, offset]) lets a compiled graph call the operator; without them compiled mode
        takes numerics' torch ops (not computed in the graph: inductor drops their bf16 round trip)."""
        if (self.gemv_lib is None or x.dtype not in (torch.float32, torch.bfloat16)
                or input_scale.numel() != 1 or input_offset.numel() != 1):
            return super().quantize_static(x, input_scale, input_offset)
        if params is not None and self.static_ops is not None:
            return self.static_ops[0](x, params, ISAS.index(self.isa))
        if torch.compiler.is_compiling():
            return super().quantize_static(x, input_scale, input_offset)
        key = (input_scale.item(), input_offset.item())
        floats = self._static_params.get(key)
        if floats is None:      # numerics' torch ops cost ~13 us a call: once per (scale, offset)
            inv, offset = numerics.static_activation_params(input_scale, input_offset, bf16_params=True)
            floats = self._static_params[key] = (inv.item(), offset.item())
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m, k = x2.shape
        out = torch.empty((m, k), dtype=torch.int8)
        self.gemv_lib.wq_quant_static(x2.data_ptr(), _XDT[x2.dtype], m, k, x2.stride(0), *floats, out.data_ptr(),
                                      torch.get_num_threads())
        return out if x.dim() == 2 else out.reshape(x.shape)

    def _int8_epilogue(self, acc, scale, quant_bias, pertoken_scale, bias, out_dtype):
        """reference.int8_epilogue bit for bit, in one C pass (`wq_int8_epilogue`) where it runs."""
        if self.gemv_lib is None or out_dtype not in _YDT or acc.dim() != 2 or not acc.is_contiguous():
            return int8_epilogue(acc, scale, quant_bias, pertoken_scale, bias, out_dtype)
        m, n = acc.shape
        if scale.numel() != n or any(t is not None and t.numel() != want for t, want in
                                     ((quant_bias, n), (bias, n), (pertoken_scale, m))):
            return int8_epilogue(acc, scale, quant_bias, pertoken_scale, bias, out_dtype)     # broadcasts
        def f(t, dt):       # a flat view of the right dtype (no calls where it already is: ~1 us each)
            return None if t is None else t if t.dtype == dt and t.is_contiguous() else t.to(dt).contiguous()
        qb, pt, b, sc = f(quant_bias, torch.int32), f(pertoken_scale, torch.float32), f(bias, torch.float32), \
            f(scale, torch.float32)
        y = torch.empty((m, n), dtype=out_dtype)
        p = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.gemv_lib.wq_int8_epilogue(acc.data_ptr(), m, n, p(qb), sc.data_ptr(), p(pt), p(b), y.data_ptr(),
                                       _YDT[out_dtype], torch.get_num_threads())
        return y

    def quantize_glu_dynamic(self, h):
        """quantize_dynamic(h[:, :k] * h[:, k:]) for h [m, 2k] (a gated MLP's [SiLU(gate), up]),
        bit for bit, in one C pass (`wq_glu_quant_dynamic`) that never writes the product."""
        k = h.shape[1] // 2
        if self.gemv_lib is None or h.dtype not in (torch.float32, torch.bfloat16) or h.stride(-1) != 1:
            return self.quantize_dynamic(h[:, :k] * h[:, k:])
        m = h.shape[0]
        out = torch.empty((m, k), dtype=torch.int8)
        scale = torch.empty((m, 1), dtype=torch.float32)
        self.gemv_lib.wq_glu_quant_dynamic(h.data_ptr(), _XDT[h.dtype], m, k, h.stride(0), out.data_ptr(),
                                           scale.data_ptr(), torch.get_num_threads())
        return out, scale

    def widen_two_stage(self, weight, s1, s2):
        """w4 * s2 as int8 per channel where that is exact (`TWO_STAGE_ENV`, above)."""
        return numerics.two_stage_int8(weight, s1, s2) if _two_stage_mode() == "int8" else None

    def prepare_int8(self, weight, scale, bits: int = 8):
        weight = weight.to(torch.int8)
        scale = scale.float().reshape(-1).contiguous()
        if self.int8_op is not None:
            return CpuInt8Weight(None, scale, None, weight.shape[0], amx=AmxInt8Weight.build(weight, bits))
        handler = {} if self.use_onednn else None
        if self.gemm == "gemv":
            gemv = GemvWeight.build(weight, scale.reshape(-1, 1), None, bits)
            if _gemv_exact(gemv):
                return CpuInt8Weight(None, scale, None, weight.shape[0], gemv=gemv)
        # _int_mm is fastest with the [n, k] weight seen as a column-major [k, n]; so is the
        # oneDNN GEMM's own copy, whose static-activation Linears (quant_bias) take _int_mm
        if self.gemm == "int_mm" or (self.use_onednn and bits == 8 and _weight_mode() != "float32"):
            return CpuInt8Weight(weight.contiguous().t(), scale, handler, weight.shape[0])
        if _weight_mode() == "float32":
            return CpuInt8Weight(weight.float().t().contiguous(), scale, handler, weight.shape[0])
        if bits == 4 and self.gemv_lib is not None:
            gemv = GemvWeight.build(weight, scale.reshape(-1, 1), None, 4)
            if _gemv_exact(gemv):
                return CpuInt8Weight(None, scale, handler, weight.shape[0], gemv=gemv)
        packed = bits == 4 and weight.shape[1] % 2 == 0
        weight_t = numerics.pack_int4(weight.t().contiguous()) if packed else weight.t().contiguous()
        return CpuInt8Weight(weight_t, scale, handler, weight.shape[0], packed=packed)

    def _on_int_mm(self, w) -> bool:
        """Whether int8 weight `w` is the oneDNN GEMM's int8 [k, n] copy, which serves through
        _int_mm the calls its handler cannot take (static W8A8's quant_bias)."""
        return self.use_onednn and w.weight_t is not None and w.weight_t.dtype == torch.int8 and not w.packed

    def _on_int_mm_op(self, w) -> bool:
        """`_on_int_mm` with the `int_mm_linear` operator loaded (_int_mm and the C epilogue, one
        operator call)."""
        return self.static_ops is not None and self._on_int_mm(w)

    def _on_int8_gemv(self, w) -> bool:
        """Whether int8 weight `w` runs on the integer GEMV: the "gemv" GEMM, which prepared it in the
        GEMV layout (`prepare_int8`; never with a oneDNN handler)."""
        return self.gemm == "gemv" and w.gemv is not None

    def _int8_gemv(self, x2, g: GemvWeight, scale, pertoken, quant_bias, bias, out_dtype):
        """`wq_int8_gemv` through ctypes (`ASCEND_QUANT_CPU_OP=0`) on x_q [m, k], contiguous int8;
        scale float32 [n] (per channel) or g.scale [n, groups]. None where the kernel declines
        x_q (a -128 with int8 weights holding -128): the caller takes the float32 GEMMs."""
        m = x2.shape[0]
        y = torch.empty((m, g.n), dtype=out_dtype if out_dtype in _YDT else torch.float32)
        f = lambda t, dt: None if t is None else t.to(dt).reshape(-1).contiguous()  # noqa: E731
        pt, qb, b = f(pertoken, torch.float32), f(quant_bias, torch.int32), f(bias, torch.float32)
        status = ctypes.c_int(0)
        self.gemv_lib.wq_int8_gemv(x2.data_ptr(), _XDT[x2.dtype], m, g.k, x2.stride(0),
                                   None if pt is None else pt.data_ptr(), g.q.data_ptr(), g.bits, g.full_range, g.n,
                                   g.scale.shape[1], g.gp, scale.data_ptr(), None if qb is None else qb.data_ptr(),
                                   None if b is None else b.data_ptr(), y.data_ptr(), _YDT.get(y.dtype, 0), g.n,
                                   torch.get_num_threads(), ctypes.byref(status))
        if status.value == 3:
            return None
        if status.value:
            raise MemoryError("wq_int8_gemv: could not allocate its activation buffer")
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def int8_matmul(self, x_q, w, *, pertoken_scale=None, quant_bias=None, bias=None, out_dtype=torch.float32):
        if w.amx is not None:
            return self.int8_op(x_q, pertoken_scale, w.amx.wp, w.scale, quant_bias, bias, w.n, out_dtype)
        if self._on_int8_gemv(w) and self.int8_gemv_op is not None:
            return self.int8_gemv_op(x_q, pertoken_scale, w.gemv.q, w.scale, quant_bias, bias, ISAS.index(self.isa),
                                     w.gemv.bits, w.gemv.full_range, GEMV_MAX_M, out_dtype)
        lead = x_q.shape[:-1]
        x2 = x_q if x_q.dim() == 2 and x_q.is_contiguous() else x_q.reshape(-1, x_q.shape[-1]).contiguous()
        if self._on_int8_gemv(w) and x2.shape[0] <= GEMV_MAX_M:
            y = self._int8_gemv(x2, w.gemv, w.scale, pertoken_scale, quant_bias, bias, out_dtype)
            if y is not None:
                return y.reshape(*lead, w.n)
        # oneDNN first where it runs: with VNNI it beat the float-lane GEMV on int4 weights at
        # every token count measured (1 to 16)
        if (w.gemv is not None and w.gemv.bits == 4 and w.onednn is None and x2.shape[0] <= GEMV_MAX_M
                and quant_bias is None and self.gemv_lib is not None):
            return _gemv(self.gemv_lib, w.gemv, x2, 1, out_dtype, bias, pertoken_scale).reshape(*lead, w.n)
        if w.onednn is not None and quant_bias is None:
            dt = _onednn_out_dtype(out_dtype, bias is not None)
            handler = w.onednn.get(dt)
            if handler is None and not w.holds_integers():
                # finalized for another output: a float32 handler serves any dtype exactly (cast last)
                dt = torch.float32
                handler = w.onednn.get(dt)
                if handler is None:
                    raise RuntimeError("cpu backend: this int8 weight was finalized for bfloat16 output without "
                                       "a bias; it cannot serve a float32 output or a bias")
            if handler is None:
                handler = w.onednn[dt] = self._onednn_handler(w, dt)
            out = torch.empty((x2.shape[0], w.n), dtype=dt)
            if pertoken_scale is None:
                s_a = torch.ones((x2.shape[0], 1))
            elif pertoken_scale.dtype == torch.float32 and pertoken_scale.dim() == 2 and pertoken_scale.is_contiguous():
                s_a = pertoken_scale            # the quantizer's [m, 1] as it comes
            else:
                s_a = pertoken_scale.float().reshape(-1, 1).contiguous()
            # vLLM's op itself, not its Python wrapper: this branch is traced in compiled mode
            torch.ops._C.onednn_scaled_mm(out, x2, s_a, None, None, None if bias is None else bias.float().contiguous(),
                                          handler.handler_tensor)
            if dt != out_dtype:
                out = out.to(out_dtype)
            return out if x_q.dim() == 2 else out.reshape(*lead, -1)
        if self._on_int_mm_op(w) and x2.dtype == torch.int8:
            return self.static_ops[1](x2, pertoken_scale, w.weight_t, w.scale, quant_bias, bias, ISAS.index(self.isa),
                                      out_dtype).reshape(*lead, w.n)
        if self.gemm == "int_mm" or self._on_int_mm(w):
            # int32 sums, exact (on VNNI CPUs oneDNN's s8s8 kernel); for the oneDNN GEMM, the
            # Linears its handler cannot take: static W8A8, whose quant_bias joins the int32 sums
            acc = torch._int_mm(x2, w.weight_t)
        elif w.weight_t is not None and w.weight_t.dtype == torch.float32:
            acc = exact_int8_matmul(x2, w_f32_t=w.weight_t)
        else:           # compact: convert one k-chunk at a time (exact, see reference.py)
            x = x2.float()
            acc = None
            for start in range(0, x.shape[-1], EXACT_F32_CHUNK):
                end = min(start + EXACT_F32_CHUNK, x.shape[-1])
                part = (x[:, start:end] @ w.chunk(start, end)).to(torch.int32)
                acc = part if acc is None else acc + part
        return self._int8_epilogue(acc, w.scale, quant_bias, pertoken_scale, bias, out_dtype).reshape(*lead, w.n)

    def int8_matmul_dynamic(self, x, w, *, bias=None, out_dtype=None):
        """int8_matmul(*quantize_dynamic(x)): on the "amx" GEMM one operator call that quantizes
        x inside (the same quantizer, so the same values bit for bit)."""
        if w.amx is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self.int8_op(x, None, w.amx.wp, w.scale, None, bias, w.n, out_dtype or x.dtype)
        if self._on_int8_gemv(w) and self.int8_gemv_op is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self.int8_gemv_op(x, None, w.gemv.q, w.scale, None, bias, ISAS.index(self.isa), w.gemv.bits,
                                     w.gemv.full_range, GEMV_MAX_M, out_dtype or x.dtype)
        return super().int8_matmul_dynamic(x, w, bias=bias, out_dtype=out_dtype)

    def grouped_int8_matmul_dynamic(self, x, w, *, bias=None, out_dtype=None):
        """Two-stage per-group W4A8 on the integer GEMV (`wq_int8_gemv` with the group scales:
        exact int32 sums per group, then float32 as the reference), the activations quantized
        inside the operator; through ctypes (`ASCEND_QUANT_CPU_OP=0`) with our quantizer first,
        up to GEMV_MAX_M tokens; else the reference's arrangement on this backend's kernels."""
        g = w.gemv if isinstance(w, CpuWeightOnly) else None
        out_dtype = out_dtype or x.dtype
        if g is None or g.offset is not None or g.bits != 4 or x.dtype not in (torch.float32, torch.bfloat16):
            return super().grouped_int8_matmul_dynamic(x, w, bias=bias, out_dtype=out_dtype)
        if self.int8_gemv_op is not None:
            return self.int8_gemv_op(x, None, g.q, g.scale, None, bias, ISAS.index(self.isa), 4, False, GEMV_MAX_M,
                                     out_dtype)
        x_q, s_t = self.quantize_dynamic(x.reshape(-1, x.shape[-1]))
        if x_q.shape[0] > GEMV_MAX_M:
            return super().grouped_int8_matmul_dynamic(x, w, bias=bias, out_dtype=out_dtype)
        y = self._int8_gemv(x_q, g, g.scale, s_t, None, bias, out_dtype)
        if y is None:       # declined: cannot happen for int4 weights
            return super().grouped_int8_matmul_dynamic(x, w, bias=bias, out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], g.n)

    def traceable(self, linear) -> bool:
        """Whether `linear`'s forward is torch ops only, so that vLLM's compiled mode may trace it
        instead of calling it through the opaque `ascend_quant::linear` op (a Python call per
        Linear, ~7 us of a decode step's ~120): a dynamic-activation int8 weight on the AMX-INT8
        operator (`ascend_quant_cpu::int8_linear`, quantizer inside), or one finalized to its
        oneDNN handler (`finalize_linear`), where the forward is the quantizer (numerics' torch
        ops when traced) and vLLM's `onednn_scaled_mm`, both of which inductor keeps; or a
        weight in the GEMV layout with the C++ operator loaded (`ascend_quant_cpu::wq_linear`,
        which inductor calls directly); or static W8A8 on the integer GEMV or the oneDNN GEMM,
        where the forward is the `quant_static` operator and `int8_gemv_linear` / `int_mm_linear`."""
        w = linear.prepared
        if isinstance(w, CpuWeightOnly):
            # W8A16, W4A16: `wq_linear`; two-stage W4A8: `int8_gemv_linear`, quantizer inside (both
            # operators come from the same library: loaded together or not at all)
            return w.gemv is not None and self.wq_op is not None
        if isinstance(w, CpuInt8Weight) and (
                w.amx is not None or (self._on_int8_gemv(w) and self.int8_gemv_op is not None)):
            # the AMX-INT8 or integer-GEMV operator, which quantizes dynamic activations inside.
            # Static W8A8 on the integer GEMV: its quantizer is the `quant_static` operator (traced
            # as numerics' torch ops, inductor fused `x * (1/s) + o` into one FMA, which rounded
            # some values the other way: a different greedy token). Not yet on AMX-INT8 (not run
            # on an AMX CPU since): the opaque op there.
            if linear.scheme.activation_mode == "static":
                return self.static_ops is not None and w.amx is None
            return linear.scheme.activation_mode == "dynamic"
        if isinstance(w, CpuInt8Weight) and linear.scheme.activation_mode == "static":
            return self._on_int_mm_op(w)       # oneDNN GEMM: `quant_static`, then `int_mm_linear`
        return (linear.scheme.activation_mode == "dynamic" and isinstance(w, CpuInt8Weight)
                and w.onednn is not None and len(w.onednn) == 1 and not w.holds_integers())

    @staticmethod
    def _onednn_handler(w: CpuInt8Weight, dt: torch.dtype):
        return vllm_cpu_ops().create_onednn_scaled_mm(w.int8_kn(), w.scale, dt, True, False, 32)

    def finalize_linear(self, linear, out_dtype: torch.dtype, has_bias: bool) -> None:
        """For a Linear whose output dtype and bias are fixed (a vLLM layer): build the one oneDNN
        handler its calls will use and drop our integer copy of the weight, which oneDNN has
        prepacked into its own (otherwise both stay: twice the int8 bytes). Only for dynamic
        activations: static W8A8 adds its quant_bias in our own GEMM, from our copy."""
        w = linear.prepared
        if not isinstance(w, CpuInt8Weight) or w.onednn is None or linear.scheme.activation_mode != "dynamic":
            return
        dt = _onednn_out_dtype(out_dtype, has_bias)
        if dt not in w.onednn:
            w.onednn[dt] = self._onednn_handler(w, dt)
        w.weight_t = None
        w.gemv = None

    def group_experts(self, experts, dtype: torch.dtype):
        """`CpuGroupedExperts` when every expert Linear quantizes its input per token and holds
        its int8 / int4 integers (`prepare_int8`), the serving dtype is float32 or bfloat16 and
        `moe_mode()` is grouped (AVX-512 VNNI); else None (expert by expert)."""
        if dtype not in (torch.float32, torch.bfloat16) or not experts or moe_mode() != "grouped":
            return None
        linears = [lin for pair in experts for lin in pair]
        if not all(lin.scheme.activation_mode == "dynamic" and isinstance(lin.prepared, CpuInt8Weight)
                   and lin.prepared.holds_integers() for lin in linears):
            return None
        bits = {lin.prepared.bits for lin in linears}
        if len(bits) != 1 or native.INT8_EXPERTS.load() is None:
            return None
        bit = bits.pop()
        return CpuGroupedExperts(VnniExperts.build([w13.prepared for w13, _ in experts], bit),
                                 VnniExperts.build([w2.prepared for _, w2 in experts], bit), self)

    def gemv_max_m(self, dtype: torch.dtype) -> int:
        """Tokens up to which a weight-only Linear runs the GEMV kernel (beyond: float32 GEMMs
        over dequantized k-chunks): every count on the amx and avx512bf16 builds with bfloat16
        activations (their bfloat16 panel paths), else GEMV_MAX_M."""
        return AMX_MAX_M if self.isa in ("amx", "avx512bf16") and dtype == torch.bfloat16 else GEMV_MAX_M

    def prepare_weight_only(self, weight, scale, offset, bits, dtype=torch.float32):
        if _weight_mode() == "float32":
            ref = super().prepare_weight_only(weight, scale, offset, bits, dtype)
            return CpuWeightOnly(ref.weight.t().contiguous().to(dtype))
        n, k = weight.shape
        groups = scale.shape[-1]
        group_size = 0 if groups == 1 else k // groups
        if self.gemv_lib is not None:
            return CpuWeightOnly(None, gemv=GemvWeight.build(weight, scale, offset, bits))
        packed = bits == 4 and k % 2 == 0 and (group_size == 0 or group_size % 2 == 0)
        q_t = weight.to(torch.int8).t().contiguous()
        return CpuWeightOnly(numerics.pack_int4(q_t) if packed else q_t,
                             scale.float().reshape(n, groups).t().contiguous(),
                             None if offset is None else offset.float().reshape(n, groups).t().contiguous(),
                             group_size, packed)

    def weight_only_matmul(self, x, w, bias=None, out_dtype=None):
        out_dtype = out_dtype or x.dtype
        if w.gemv is not None and self.wq_op is not None:
            g = w.gemv
            y = self.wq_op(x, g.q, g.scale, g.offset, bias, ISAS.index(self.isa), g.bits, g.k, g.group_size, g.gp,
                           self.gemv_max_m(x.dtype))
            return y if y.dtype == out_dtype else y.to(out_dtype)
        if w.gemv is not None:
            g = w.gemv
            x2 = x.reshape(-1, x.shape[-1])
            if x2.shape[0] <= self.gemv_max_m(x.dtype) and self.gemv_lib is not None:
                if x2.dtype not in (torch.float32, torch.bfloat16):
                    x2 = x2.float()
                if x2.stride(-1) != 1:
                    x2 = x2.contiguous()
                return _gemv(self.gemv_lib, g, x2, 0, out_dtype, bias).reshape(*x.shape[:-1], -1)
            # larger batches: float32 GEMMs over k-chunks dequantized from the same layout
            x2 = x2.float()
            step = max(g.group_size, EXACT_F32_CHUNK // g.group_size * g.group_size)
            y = None
            for start in range(0, g.k, step):
                end = min(start + step, g.k)
                part = x2[:, start:end] @ g.dequantized(start, end).t()
                y = part if y is None else y + part
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(out_dtype).reshape(*x.shape[:-1], -1)
        if w.scale_t is None:           # float32 mode: one GEMM on the dequantized copy
            y = x.to(w.weight_t.dtype) @ w.weight_t
        else:                           # compact: dequantize one k-chunk at a time, float32 GEMMs
            x2 = x.float()
            k = x2.shape[-1]
            step = EXACT_F32_CHUNK if not w.group_size else max(w.group_size, EXACT_F32_CHUNK // w.group_size * w.group_size)
            y = None
            for start in range(0, k, step):
                end = min(start + step, k)
                part = x2[..., start:end] @ w.chunk(start, end)
                y = part if y is None else y + part
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out_dtype)
