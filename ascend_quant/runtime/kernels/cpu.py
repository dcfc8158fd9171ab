"""The fast CPU backend: exact int8 GEMM and vLLM's fused per-token quantizer.

The int8 x int8 product is exact on every path; which one runs (`gemm`):
  * "onednn": vLLM's `onednn_scaled_mm`, only where the CPU has VNNI (see below);
  * "f32": float32 GEMMs over k-chunks of 1024 (`reference.exact_int8_matmul`; exact because
    every partial sum stays an integer below 2^24), the default without VNNI: measured here
    (AVX2, 1 thread, 512x576x1536) MKL's sgemm is ~20x faster than `torch._int_mm`, whose CPU
    kernel has no int8 fast path on such CPUs, and ~6x faster than a bf16 matmul;
  * "int_mm": `torch._int_mm` (int32 accumulate), kept for comparison in the benchmark.

On CPUs without VNNI (AVX2 only, like the 2-core machine this was written on) oneDNN's
s8 x s8 GEMM multiplies through `vpmaddubsw`, whose int16 pair sums saturate: measured here,
full-range int8 operands come out wrong by up to a third. It is therefore used only when
/proc/cpuinfo names avx512_vnni, avx_vnni or amx_int8; `torch._int_mm` is exact everywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ascend_quant.runtime.kernels.reference import ReferenceBackend, exact_int8_matmul

GEMMS = ("onednn", "f32", "int_mm")


@functools.lru_cache(maxsize=1)
def cpu_has_vnni() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


@functools.lru_cache(maxsize=1)
def vllm_cpu_ops():
    """vLLM's compiled CPU ops module, or None (vLLM absent or a GPU build)."""
    try:
        import vllm._custom_ops as ops  # noqa: F401  (loads vllm._C)
        torch.ops._C.dynamic_scaled_int8_quant  # noqa: B018
        return ops
    except Exception:   # ImportError, or the op is not compiled into this build
        return None


@dataclass
class CpuInt8Weight:
    weight_t: torch.Tensor          # float32 [k, n] ("f32") or int8 [n, k]^T view ("int_mm")
    scale: torch.Tensor             # float32 [n]
    onednn: object | None = None    # vLLM oneDNN handler (VNNI CPUs only)
    n: int = 0


@dataclass
class CpuWeightOnly:
    weight_t: torch.Tensor          # dequantized [k, n] in the serving dtype


class CpuBackend(ReferenceBackend):
    name = "cpu"

    def __init__(self, gemm: str | None = None):
        if gemm is None:
            gemm = "onednn" if cpu_has_vnni() and vllm_cpu_ops() is not None else "f32"
        assert gemm in GEMMS, gemm
        self.gemm = gemm
        self.use_onednn = gemm == "onednn"

    def can_implement(self, op: str, **cfg) -> tuple[bool, str]:
        device = cfg.get("device", "cpu")
        if torch.device(device).type != "cpu":
            return False, f"cpu backend: tensors are on {device}"
        if self.gemm == "int_mm" and not hasattr(torch, "_int_mm"):
            return False, "cpu backend: this torch build has no torch._int_mm"
        return True, ""

    def quantize_dynamic(self, x):
        ops = vllm_cpu_ops()
        if ops is None or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return super().quantize_dynamic(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(x2, dtype=torch.int8)
        scale = torch.empty((x2.shape[0], 1), dtype=torch.float32)
        torch.ops._C.dynamic_scaled_int8_quant(out, x2, scale, None)
        # an all-zero token: the reference (numerics) defines its scale as 1.0
        zero = scale == 0
        if bool(zero.any()):
            out = torch.where(zero, torch.zeros_like(out), out)
            scale = torch.where(zero, torch.ones_like(scale), scale)
        return out.reshape(x.shape), scale.reshape(*lead, 1)

    def prepare_int8(self, weight, scale):
        weight = weight.to(torch.int8)
        scale = scale.float().reshape(-1).contiguous()
        handler = None
        if self.use_onednn:
            ops = vllm_cpu_ops()
            handler = ops.create_onednn_scaled_mm(weight.t(), scale, torch.float32, True, False, 32)
        # _int_mm is fastest with the [n, k] weight seen as a column-major [k, n]
        weight_t = weight.contiguous().t() if self.gemm == "int_mm" else weight.float().t().contiguous()
        return CpuInt8Weight(weight_t, scale, handler, weight.shape[0])

    def int8_matmul(self, x_q, w, *, pertoken_scale=None, quant_bias=None, bias=None, out_dtype=torch.float32):
        lead = x_q.shape[:-1]
        x2 = x_q.reshape(-1, x_q.shape[-1]).contiguous()
        if w.onednn is not None and quant_bias is None:
            ops = vllm_cpu_ops()
            out = torch.empty((x2.shape[0], w.n), dtype=torch.float32)
            s_a = (pertoken_scale.float().reshape(-1, 1).contiguous() if pertoken_scale is not None
                   else torch.ones((x2.shape[0], 1)))
            ops.onednn_scaled_mm(w.onednn, x2, out, s_a, None, None,
                                 None if bias is None else bias.float().contiguous())
            return out.to(out_dtype).reshape(*lead, -1)
        if self.gemm == "int_mm":
            acc = torch._int_mm(x2, w.weight_t)
        else:
            acc = exact_int8_matmul(x2, w_f32_t=w.weight_t)
        if quant_bias is not None:
            acc = acc + quant_bias.to(torch.int32)
        y = acc.float() * w.scale
        if pertoken_scale is not None:
            y = y * pertoken_scale.float().reshape(-1, 1)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype).reshape(*lead, -1)

    def prepare_weight_only(self, weight, scale, offset, bits, dtype=torch.float32):
        ref = super().prepare_weight_only(weight, scale, offset, bits, dtype)
        return CpuWeightOnly(ref.weight.t().contiguous().to(dtype))

    def weight_only_matmul(self, x, w, bias=None, out_dtype=None):
        y = x.to(w.weight_t.dtype) @ w.weight_t
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out_dtype or x.dtype)
