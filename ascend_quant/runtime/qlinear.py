"""The forward of one quantized Linear per scheme, from its checkpoint tensors.

Shared by the vLLM linear methods (after loading, on each rank's shard) and by the
reference model, so the two compute the same thing; the kernels come from a backend.

    ql = QuantLinear.build("W8A8_DYNAMIC", {"weight": ..., "weight_scale": ...}, backend=b)
    y = ql(x, bias)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ascend_quant import numerics
from ascend_quant.schemes import SCHEMES

# Schemes this runtime serves for Linear layers (FLOAT stays a plain Linear).
LINEAR_SCHEMES = ("W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC")


@dataclass
class QuantLinear:
    scheme: str
    backend: object
    prepared: object
    n: int
    k: int
    input_scale: torch.Tensor | None = None     # W8A8
    input_offset: torch.Tensor | None = None    # W8A8
    quant_bias: torch.Tensor | None = None      # W8A8 (None on TP ranks > 0 of row-parallel layers)
    group_size: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def build(cls, scheme: str, t: dict[str, torch.Tensor], *, backend, dtype=torch.float32,
              add_quant_bias: bool = True) -> "QuantLinear":
        """`t`: this Linear's tensors by suffix (`weight`, `weight_scale`, ...), as stored
        (deq_scale in either encoding; packed int4 weights as int8 [n/2, k])."""
        if scheme not in LINEAR_SCHEMES:
            raise ValueError(f"scheme {scheme!r} is not a quantized Linear scheme ({', '.join(LINEAR_SCHEMES)})")
        bits = SCHEMES[scheme].weight_bits
        w = t["weight"].to(torch.int8)
        w = numerics.unpack_int4(w) if bits == 4 else w          # [n, k] integer values
        n, k = w.shape
        if scheme == "W8A8":
            deq = numerics.decode_deq_scale(t["deq_scale"]).reshape(-1)
            return cls(scheme, backend, backend.prepare_int8(w, deq), n, k,
                       input_scale=t["input_scale"].float().reshape(-1)[-1:],
                       input_offset=t["input_offset"].float().reshape(-1)[-1:],
                       quant_bias=t["quant_bias"].to(torch.int32).reshape(-1) if add_quant_bias else None)
        if scheme == "W8A8_DYNAMIC":
            return cls(scheme, backend, backend.prepare_int8(w, t["weight_scale"].float().reshape(-1)), n, k)
        if scheme == "W4A8_DYNAMIC":
            if "weight_scale_second" in t:       # two-stage per-group: s2 * bf16(s1)
                scale = numerics.two_stage_scale(t["weight_scale"].float(), t["weight_scale_second"].float())
                if getattr(backend, "name", "") == "npu":
                    prep = backend.prepare_weight_only(w, scale, None, 4, dtype)
                else:       # int8 activations times the dequantized int4 weight, per-token scale after
                    prep = backend.prepare_weight_only(w, scale, None, 4, torch.float32)
                return cls(scheme, backend, prep, n, k, group_size=k // scale.shape[-1],
                           extra={"per_group": True})
            scale = t["weight_scale"].float().reshape(-1)
            if getattr(backend, "name", "") == "npu":
                return cls(scheme, backend, backend.prepare_weight_only(w, scale.reshape(-1, 1), None, 4, dtype),
                           n, k, extra={"per_group": False})
            return cls(scheme, backend, backend.prepare_int8(w, scale, bits=4), n, k, extra={"per_group": False})
        # weight-only: W8A16 (per-channel or per-group), W4A16 (per-group)
        scale = t["weight_scale"].float()
        scale = scale.reshape(n, -1)
        offset = t.get("weight_offset")
        offset = None if offset is None or not torch.any(offset != 0) else offset.float().reshape(n, -1)
        return cls(scheme, backend, backend.prepare_weight_only(w, scale, offset, bits, dtype), n, k,
                   group_size=0 if scale.shape[-1] == 1 else k // scale.shape[-1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b = self.backend
        if self.scheme == "W8A8":
            # the float bias is folded into quant_bias: `bias` is ignored on purpose
            x_q = b.quantize_static(x, self.input_scale, self.input_offset)
            return b.int8_matmul(x_q, self.prepared, quant_bias=self.quant_bias, out_dtype=x.dtype)
        if self.scheme == "W8A8_DYNAMIC":
            x_q, s_t = b.quantize_dynamic(x)
            return b.int8_matmul(x_q, self.prepared, pertoken_scale=s_t, bias=bias, out_dtype=x.dtype)
        if self.scheme == "W4A8_DYNAMIC":
            if getattr(b, "name", "") == "npu":
                # vllm-ascend runs dense W4A8 as an int4 weight-only matmul (ascend-format.md §3)
                return b.weight_only_matmul(x, self.prepared, bias=bias)
            x_q, s_t = b.quantize_dynamic(x)
            if self.extra["per_group"]:
                y = b.weight_only_matmul(x_q.float(), self.prepared, out_dtype=torch.float32) * s_t.float()
                if bias is not None:
                    y = y + bias.float()
                return y.to(x.dtype)
            return b.int8_matmul(x_q, self.prepared, pertoken_scale=s_t, bias=bias, out_dtype=x.dtype)
        return b.weight_only_matmul(x, self.prepared, bias=bias)
