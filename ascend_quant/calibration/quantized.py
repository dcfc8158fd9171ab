"""The in-memory quantized Linear of calibration and the activation fake-quantization it implies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_quant import numerics
from ascend_quant.schemes import SCHEMES


@dataclass
class QuantizedLinear:
    """One Linear's quantized form, enough to write every tensor of its scheme."""
    scheme: str
    q: torch.Tensor                          # int8 [n, k] (int4 values for 4-bit)
    scale: torch.Tensor                      # [n, 1] or [n, k // g] (two-stage: s1 [n, 1])
    bias: torch.Tensor | None
    scale_second: torch.Tensor | None = None  # two-stage int4: s2 [n, k // g]
    input_scale: torch.Tensor | None = None  # static W8A8
    input_offset: torch.Tensor | None = None
    running: tuple[torch.Tensor, torch.Tensor] | None = None  # per-sample (scale, offset) [B, 1, 1]
    row_parallel: bool = False
    error: float = 0.0                       # relative output error on calibration tokens

    def effective_scale(self) -> torch.Tensor:
        if self.scale_second is not None:
            return self.scale_second * self.scale
        return self.scale

    def dequantized(self) -> torch.Tensor:
        return numerics.dequantize(self.q, self.effective_scale())

    def scale_rows(self, factor: torch.Tensor, rows: slice = slice(None)) -> None:
        """Output rows (`rows` of them) divided by `factor` after quantization (smoothing through this Linear)."""
        if rows != slice(None):
            full = torch.ones(self.q.shape[0], dtype=factor.dtype, device=factor.device)
            full[rows] = factor
            factor = full
        self.scale = self.scale / factor.unsqueeze(1)
        if self.bias is not None:
            self.bias = self.bias / factor

    def tensors(self, prefix: str, model_dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, str]]:
        """Checkpoint tensors: name -> (tensor, description type)."""
        s = self.scheme
        n = self.q.shape[0]
        out: dict[str, tuple[torch.Tensor, str]] = {}
        if s == "W8A8":
            deq = numerics.deq_scale(self.input_scale, self.scale)
            out["weight"] = (self.q, s)
            out["input_scale"] = (self.input_scale.float().reshape(1), s)
            out["input_offset"] = (self.input_offset.float().reshape(1), s)
            out["deq_scale"] = (numerics.encode_deq_scale(deq, model_dtype), s)
            out["quant_bias"] = (numerics.quant_bias(self.bias, deq, self.input_offset, self.q), s)
        elif s in ("W8A8_DYNAMIC", "W8A16"):
            out["weight"] = (self.q, s)
            out["weight_scale"] = (self.scale.float(), s)
            out["weight_offset"] = (torch.zeros_like(self.scale, dtype=torch.float32), s)
        elif s == "W4A16":
            out["weight"] = (numerics.pack_int4(self.q), s)
            out["weight_scale"] = (self.scale.float(), s)
            out["weight_offset"] = (torch.zeros_like(self.scale, dtype=torch.float32), s)
        elif s == "W4A8_DYNAMIC":
            chunks = numerics.scale_bias_chunks(self.row_parallel)
            out["weight"] = (numerics.pack_int4(self.q), s)
            out["weight_scale"] = (self.scale.float(), s)
            out["weight_offset"] = (torch.zeros(n, 1), s)
            if self.scale_second is not None:
                out["weight_scale_second"] = (self.scale_second.float(), s)
                out["weight_offset_second"] = (torch.zeros_like(self.scale_second, dtype=torch.int64), s)
                sb_scale = numerics.two_stage_scale(self.scale, self.scale_second)
            else:
                sb_scale = self.scale
            out["scale_bias"] = (numerics.scale_bias(self.q, sb_scale, chunks), s)
        else:
            raise AssertionError(s)
        if self.bias is not None:
            out["bias"] = (self.bias.float(), "FLOAT")
        return {f"{prefix}.{k}": v for k, v in out.items()}


def _fake_quant_activation(x: torch.Tensor, scheme: str, qlin: QuantizedLinear, in_place: bool = False
                           ) -> torch.Tensor:
    """x as the scheme's Linears compute with it (quantized, dequantized); `in_place`
    (float32 x only) overwrites x with the same values."""
    info = SCHEMES[scheme]
    if info.activation_mode == "dynamic":
        return numerics.fake_quantize_activation_dynamic(x, in_place=in_place)
    if info.activation_mode == "static" and qlin.running is None and in_place:
        scale, offset = qlin.input_scale, qlin.input_offset
        return x.div_(scale).round_().add_(offset).clamp_(numerics.INT8_MIN, numerics.INT8_MAX).sub_(offset).mul_(scale)
    if info.activation_mode == "static" and qlin.running is not None:
        scale, offset = qlin.running            # each sample with the range seen up to it
        return numerics.dequantize(numerics.quantize(x, scale, 8, offset=offset), scale, offset).to(x.dtype)
    if info.activation_mode == "static":
        # msModelSlim's definition (a true division); the NPU's bf16 reciprocal differs by <1 LSB
        q = numerics.quantize(x, qlin.input_scale, 8, offset=qlin.input_offset)
        return numerics.dequantize(q, qlin.input_scale, qlin.input_offset).to(x.dtype)
    return x
