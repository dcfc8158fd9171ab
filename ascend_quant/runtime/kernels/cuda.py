"""The CUDA backend: vLLM's CUTLASS `cutlass_scaled_mm` where the vLLM build has it,
otherwise `torch._int_mm` (int32 accumulate; it wants m > 16 and k, n multiples of 8, so
small batches are padded). Not exercised on the CPU-only test machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_quant.runtime.kernels.reference import ReferenceBackend, int8_epilogue


def _cutlass():
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415
        return ops if hasattr(ops, "cutlass_scaled_mm") else None
    except Exception:
        return None


@dataclass
class CudaInt8Weight:
    weight_t: torch.Tensor      # int8 [k, n] column-major view (what both GEMMs take)
    scale: torch.Tensor         # float32 [n]


class CudaBackend(ReferenceBackend):
    name = "cuda"

    def can_implement(self, op: str, **cfg) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "cuda backend: no CUDA device"
        if torch.device(cfg.get("device", "cuda")).type != "cuda":
            return False, "cuda backend: tensors are not on a CUDA device"
        if op == "int8_matmul" and (cfg.get("k", 8) % 8 or cfg.get("n", 8) % 8):
            return False, "cuda backend: int8 GEMM needs k and n divisible by 8"
        return True, ""

    def prepare_int8(self, weight, scale, bits: int = 8):
        # [n, k] row-major transposed is a column-major [k, n]: what CUTLASS and _int_mm take
        return CudaInt8Weight(weight.to(torch.int8).contiguous().t(), scale.float().reshape(-1))

    def int8_matmul(self, x_q, w, *, pertoken_scale=None, quant_bias=None, bias=None, out_dtype=torch.float32):
        lead = x_q.shape[:-1]
        x2 = x_q.reshape(-1, x_q.shape[-1]).contiguous()
        m = x2.shape[0]
        ops = _cutlass()
        if ops is not None and quant_bias is None and out_dtype in (torch.float16, torch.bfloat16):
            s_a = (pertoken_scale.float().reshape(-1, 1) if pertoken_scale is not None
                   else torch.ones((1, 1), device=x2.device))
            y = ops.cutlass_scaled_mm(x2, w.weight_t, s_a, w.scale.reshape(-1, 1), out_dtype,
                                      None if bias is None else bias.to(out_dtype))
            return y.reshape(*lead, -1)
        pad = max(0, 17 - m)
        if pad:
            x2 = torch.cat([x2, x2.new_zeros((pad, x2.shape[1]))])
        acc = torch._int_mm(x2, w.weight_t)[:m]
        return int8_epilogue(acc, w.scale, quant_bias, pertoken_scale, bias, out_dtype).reshape(*lead, -1)

    def prepare_weight_only(self, weight, scale, offset, bits, dtype=torch.bfloat16):
        ref = super().prepare_weight_only(weight, scale, offset, bits, dtype)
        ref.weight = ref.weight.to(dtype)
        return ref

    def weight_only_matmul(self, x, w, bias=None, out_dtype=None):
        y = x.to(w.weight.dtype) @ w.weight.t()
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out_dtype or x.dtype)
