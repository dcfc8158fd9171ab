"""The reference backend: the exact arithmetic of ascend-format.md in plain torch.

Every formula is a call into `ascend_quant.numerics`; this file only arranges them. Integer
products are exact (`exact_int8_matmul`: float32 GEMMs over k-chunks short enough that every
partial sum is an exactly representable integer). Epilogues run in float32, as on the NPU,
and are cast to the output dtype last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_quant import numerics


# float32 holds every integer up to 2^24 exactly. With int8 operands (|value| <= 128) a dot
# product over at most 1024 terms, and every partial sum of it in any order, stays within
# 1024 * 128 * 128 = 2^24: so a float32 GEMM over k-chunks of 1024 is an exact integer GEMM.
EXACT_F32_CHUNK = 1024


def exact_int8_matmul(x_q: torch.Tensor, w_q: torch.Tensor | None = None, *,
                      w_f32_t: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [m, n] = x_q [m, k] @ w_q[n, k]^T, exactly (int4 values in int8 included).

    Runs as float32 GEMMs over k-chunks of EXACT_F32_CHUNK (exact, see above; on CPUs without
    VNNI this is far faster than `torch._int_mm`); `w_f32_t` is the weight as float32 [k, n]
    when the caller keeps one."""
    assert x_q.dtype == torch.int8, x_q.dtype
    if w_f32_t is None:
        assert w_q is not None and w_q.dtype == torch.int8, None if w_q is None else w_q.dtype
        w_f32_t = w_q.float().t()
    x = x_q.float()
    k = x.shape[-1]
    acc = None
    for start in range(0, k, EXACT_F32_CHUNK):
        part = (x[:, start:start + EXACT_F32_CHUNK] @ w_f32_t[start:start + EXACT_F32_CHUNK]).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def int8_epilogue(acc: torch.Tensor, scale: torch.Tensor, quant_bias: torch.Tensor | None,
                  pertoken_scale: torch.Tensor | None, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """The float32 epilogue of an int8 GEMM, as the NPU computes it:
    `((acc + quant_bias) * scale[n]) * pertoken_scale[t] + bias`, cast to `out_dtype` last.
    acc: int32 [m, n]."""
    if quant_bias is not None:
        acc = acc + quant_bias.to(torch.int32)
    y = acc.float() * scale
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().reshape(-1, 1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@dataclass
class Int8Weight:
    """An int8 weight prepared for `int8_matmul`: w_q int8 [n, k] (kept as its exact float32
    transpose [k, n]), scale float32 [n]."""
    weight_f32_t: torch.Tensor
    scale: torch.Tensor


@dataclass
class WeightOnly:
    """A weight-only quantized weight, dequantized once: float32 [n, k] (or x dtype)."""
    weight: torch.Tensor


class ReferenceBackend:
    name = "reference"

    def can_implement(self, op: str, **cfg) -> tuple[bool, str]:
        return True, ""

    # ---------------------------------------------------------------- activations
    def quantize_static(self, x, input_scale, input_offset, params=None):
        """`params`: numerics.static_activation_params of the two, precomputed by the caller (the
        scheme's prepare) for backends whose kernels take them; the formula itself here."""
        return numerics.quantize_activation_static(x, input_scale, input_offset, bf16_params=True)

    def quantize_dynamic(self, x):
        return numerics.quantize_activation_dynamic(x)

    # ---------------------------------------------------------------- int8 x int8
    def prepare_int8(self, weight: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> Int8Weight:
        return Int8Weight(weight.to(torch.int8).float().t().contiguous(), scale.float().reshape(-1).contiguous())

    def int8_matmul_dynamic(self, x, w, *, bias=None, out_dtype=None):
        """x quantized per token, then int8_matmul with its scales (W8A8_DYNAMIC, per-channel W4A8)."""
        x_q, s_t = self.quantize_dynamic(x)
        return self.int8_matmul(x_q, w, pertoken_scale=s_t, bias=bias, out_dtype=out_dtype or x.dtype)

    def int8_matmul(self, x_q, w: Int8Weight, *, pertoken_scale=None, quant_bias=None, bias=None,
                    out_dtype=torch.float32):
        """`((x_q @ w^T + quant_bias) * scale[n]) * pertoken_scale[t] + bias`, float32 epilogue."""
        lead = x_q.shape[:-1]
        acc = exact_int8_matmul(x_q.reshape(-1, x_q.shape[-1]), w_f32_t=w.weight_f32_t)
        return int8_epilogue(acc, w.scale, quant_bias, pertoken_scale, bias, out_dtype).reshape(*lead, -1)

    def widen_two_stage(self, weight: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor):
        """Two-stage per-group W4A8 as (int8 weight, channel scale) for `prepare_int8`, or None to
        keep the per-group form (`prepare_weight_only` + `grouped_int8_matmul_dynamic`). The
        reference keeps the format's own arrangement."""
        return None

    def grouped_int8_matmul_dynamic(self, x, w, *, bias=None, out_dtype=None):
        """Two-stage per-group W4A8: x quantized per token, times the dequantized int4 weight
        (`prepare_weight_only`) in float32, the per-token scale after, then bias; cast last."""
        x_q, s_t = self.quantize_dynamic(x)
        y = self.weight_only_matmul(x_q.float(), w, out_dtype=torch.float32) * s_t.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype or x.dtype)

    # ---------------------------------------------------------------- weight-only
    def prepare_weight_only(self, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                            bits: int, dtype: torch.dtype = torch.float32) -> WeightOnly:
        """weight: int values in int8 [n, k] (int4 unpacked); scale/offset [n, 1] or [n, k/g];
        dequantized with msModelSlim's definition `(w - offset) * scale`."""
        return WeightOnly(numerics.dequantize(weight, scale.float(), None if offset is None else offset.float()))

    # ---------------------------------------------------------------- routed experts
    def group_experts(self, experts, dtype: torch.dtype):
        """All of a MoE layer's prepared (w13, w2) experts in one backend kernel, or None:
        `kernels.moe.routed_experts` then runs them expert by expert."""
        return None

    def weight_only_matmul(self, x, w: WeightOnly, bias=None, out_dtype=None):
        y = x.float() @ w.weight.t()
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype or x.dtype)
