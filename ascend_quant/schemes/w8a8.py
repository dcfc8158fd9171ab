"""W8A8 (static): int8 per-channel symmetric weights, int8 per-tensor asymmetric activations
with a calibrated range. The weight scale is not stored: `deq_scale = input_scale * weight_scale`
(float32, or its bit pattern as int64 for bf16 models) and the float bias with the activation
offset folds into `quant_bias` (int32)."""

from __future__ import annotations

import torch

from ascend_quant import numerics
from ascend_quant.schemes.base import PreparedLinear, QuantizedLinear, Scheme, SchemeError, TensorSpec, weight_values

_ULP_SEARCH = 4      # how far (in float32 ulps) a weight scale may sit from deq_scale / input_scale


def recover_weight_scale(deq: torch.Tensor, input_scale: torch.Tensor, stored: torch.Tensor | None = None,
                         where: str = "") -> torch.Tensor:
    """The float32 per-channel weight scale `s_w` [n] with `numerics.deq_scale(s_x, s_w) == deq`
    bit for bit: the stored weight_scale when it reproduces deq_scale, else `deq / s_x` moved by
    up to a few ulp until the product matches (it exists whenever deq was made as s_x * s_w)."""
    deq = deq.float().reshape(-1)
    if stored is not None:
        s = stored.float().reshape(-1)
        if s.shape == deq.shape and torch.equal(numerics.deq_scale(input_scale, s), deq):
            return s
    s = deq / input_scale.float().reshape(-1)
    ok = numerics.deq_scale(input_scale, s) == deq
    if bool(ok.all()):
        return s
    best = s.clone()
    for direction in (float("inf"), float("-inf")):
        cand = s.clone()
        for _ in range(_ULP_SEARCH):
            cand = torch.nextafter(cand, torch.full_like(cand, direction))
            hit = (numerics.deq_scale(input_scale, cand) == deq) & ~ok
            best[hit] = cand[hit]
            ok |= hit
    if not bool(ok.all()):
        raise SchemeError(f"{where}: deq_scale of {int((~ok).sum())} channel(s) is not input_scale times any "
                          "float32 weight scale")
    return best


class W8A8(Scheme):
    name = "W8A8"
    cli_name = "w8a8"
    fallback = "FLOAT"
    linear = True
    weight_bits = 8
    weight_granularity = "channel"
    activation_bits = 8
    activation_mode = "static"
    activation_symmetric = False
    served_by_vllm_ascend = "dense Linears"
    # down_proj stays float: its input (silu(gate) * up) carries token outliers of several
    # hundred in late layers, which one per-tensor int8 range cannot hold; percentile clipping
    # of such outliers costs more than it saves, while the range that minimises the Linears'
    # output error ("mse") beats plain min-max (measured, see README)
    preset = {"method": "gptq", "smoothquant": {"alpha": 0.8}, "gptq": {"mse_scales": False},
              "activations": {"observer": "mse"}, "float_groups": ["down"]}

    def tensor_specs(self, n, k, group_size=0, *, two_stage=False, row_parallel=False, tp_size=1):
        return {
            "weight": TensorSpec(torch.int8, (n, k), "weight"),
            "input_scale": TensorSpec(torch.float32, (1,), "per_shard"),
            "input_offset": TensorSpec(torch.float32, (1,), "per_shard"),
            "deq_scale": TensorSpec(torch.float32, (n,), "channel", (torch.float32, torch.int64),
                                    on_load=numerics.decode_deq_scale),
            "quant_bias": TensorSpec(torch.int32, (n,), "channel"),
        }

    def optional_suffixes(self):
        return ("weight_scale",)      # msModelSlim's v0 files keep it; deq_scale is what is served

    def pack(self, ql, model_dtype):
        deq = numerics.deq_scale(ql.input_scale, ql.scale)
        return {
            "weight": ql.q,
            "input_scale": ql.input_scale.float().reshape(1),
            "input_offset": ql.input_offset.float().reshape(1),
            "deq_scale": numerics.encode_deq_scale(deq, model_dtype),
            "quant_bias": numerics.quant_bias(ql.bias, deq, ql.input_offset, ql.q),
        }

    def unpack(self, t, where=""):
        q = weight_values(t, 8)
        s_x = t["input_scale"].float().reshape(-1)[-1:]
        s_w = recover_weight_scale(numerics.decode_deq_scale(t["deq_scale"]), s_x, t.get("weight_scale"), where)
        return QuantizedLinear(self.name, q, s_w.reshape(-1, 1), None, input_scale=s_x,
                               input_offset=t["input_offset"].float().reshape(-1)[-1:])

    def fake_quant_input(self, x, ql, in_place=False):
        if ql.running is not None:             # each sample with the range seen up to it
            scale, offset = ql.running
            return numerics.dequantize(numerics.quantize(x, scale, 8, offset=offset), scale, offset).to(x.dtype)
        scale, offset = ql.input_scale, ql.input_offset
        if in_place:
            return x.div_(scale).round_().add_(offset).clamp_(numerics.INT8_MIN, numerics.INT8_MAX) \
                .sub_(offset).mul_(scale)
        # msModelSlim's definition (a true division); the NPU's bf16 reciprocal differs by <1 LSB
        return numerics.dequantize(numerics.quantize(x, scale, 8, offset=offset), scale, offset).to(x.dtype)

    def prepare(self, t, backend, dtype=torch.float32, add_quant_bias=True):
        w = weight_values(t, 8)
        n, k = w.shape
        deq = numerics.decode_deq_scale(t["deq_scale"]).reshape(-1)
        extra = {"input_scale": t["input_scale"].float().reshape(-1)[-1:],
                 "input_offset": t["input_offset"].float().reshape(-1)[-1:],
                 "quant_bias": t["quant_bias"].to(torch.int32).reshape(-1) if add_quant_bias else None}
        # the quantizer's float32 [1/s, offset], once: a compiled graph that computed them would
        # lose their bf16 rounding (inductor drops a float32 -> bf16 -> float32 round trip)
        extra["input_params"] = torch.cat([p.reshape(1) for p in numerics.static_activation_params(
            extra["input_scale"], extra["input_offset"], bf16_params=True)])
        return PreparedLinear(self, backend, backend.prepare_int8(w, deq), n, k, extra=extra)

    def forward(self, linear, x, bias):
        # the float bias is folded into quant_bias: `bias` is ignored on purpose
        b, e = linear.backend, linear.extra
        x_q = b.quantize_static(x, e["input_scale"], e["input_offset"], params=e["input_params"])
        return b.int8_matmul(x_q, linear.prepared, quant_bias=e["quant_bias"], out_dtype=x.dtype)


SCHEME = W8A8()
