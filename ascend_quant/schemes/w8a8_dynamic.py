"""W8A8_DYNAMIC: int8 per-channel symmetric weights, int8 per-token symmetric activations
quantized at run time (`s_t = max|x_t| / 127`)."""

from __future__ import annotations

import torch

from ascend_quant import numerics
from ascend_quant.schemes.base import PreparedLinear, QuantizedLinear, Scheme, TensorSpec, weight_values

_SCALE_DTYPES = (torch.float32, torch.bfloat16)


class W8A8Dynamic(Scheme):
    name = "W8A8_DYNAMIC"
    cli_name = "w8a8-dynamic"
    fallback = "FLOAT"
    linear = True
    weight_bits = 8
    weight_granularity = "channel"
    activation_bits = 8
    activation_mode = "dynamic"
    served_by_vllm_ascend = "dense Linears and MoE"
    # SmoothQuant alpha per group, then min-max weights. Chosen on calibration text only by
    # `benchmarks/choose_preset.py --threads 1 --num-samples 64 --select-tokens 8192` (fit on
    # 3/4 of the calibration paragraphs, scored on the last 1/4; results/choose_preset.md): of
    # 18 candidates (uniform alphas, per-group coordinate descent over 0.3/0.5/0.7/0.9, the
    # per-group search, GPTQ, and these alphas, the earlier preset tuned on eval tokens) these
    # rose least, +0.58% (next: qkv/gate_up 0.7, down 0.5 +0.89%; the search +1.06%; GPTQ on
    # the runner-up +1.07%). o_proj has no producer in the Llama family, so its alpha is
    # untested there. The eval split scores it once, after the choice (README).
    # Then a rotation (R1 + R2, Hadamard) first, where the family takes one: on the same kind
    # of split (`choose_preset.py --write-split`, 128 x 512 fit windows, 16k selection tokens)
    # it rose +0.55% against the alphas' +0.99%. Elsewhere (Gemma, GLM-4, MoE, discovered) the
    # model is calibrated unrotated; `--no-rotate` turns it off. A tied head is untied.
    # Unrotated, AWQ's scale search (alphas 0-1 or none, scored with min-max weights and
    # dynamic activations, no clip search) replaces the fixed alphas (`awq.rotated: false`):
    # selection split, 64 x 512 fit windows, 8192 tokens, Gemma-3-270m +0.75% against the
    # alphas' +2.14% (with the clip search +1.24%); SmolLM2 unrotated (128 x 512, 16384 tokens)
    # +0.86% against +0.98%. Rotated, the alphas stay: SmolLM2 +0.63% against AWQ's
    # +1.06% (+0.69% with the clip search).
    preset = {"method": "minmax", "gptq": {"mse_scales": False},
              "smoothquant": {"alpha": 0.8, "group_alpha": {"gate_up": 0.9, "down": 0.5}},
              "awq": {"alphas": [i / 10 for i in range(11)], "clip": False, "rotated": False},
              "rotation": {"where_supported": True}}

    def tensor_specs(self, n, k, group_size=0, *, two_stage=False, row_parallel=False, tp_size=1):
        return {
            "weight": TensorSpec(torch.int8, (n, k), "weight"),
            "weight_scale": TensorSpec(torch.float32, (n, 1), "channel", _SCALE_DTYPES),
            "weight_offset": TensorSpec(torch.float32, (n, 1), "channel", _SCALE_DTYPES),
        }

    def pack(self, ql, model_dtype):
        return {"weight": ql.q, "weight_scale": ql.scale.float(),
                "weight_offset": torch.zeros_like(ql.scale, dtype=torch.float32)}

    def unpack(self, t, where=""):
        q = weight_values(t, 8)
        return QuantizedLinear(self.name, q, t["weight_scale"].float().reshape(-1, 1), None)

    def fake_quant_input(self, x, ql, in_place=False):
        return numerics.fake_quantize_activation_dynamic(x, in_place=in_place)

    def prepare(self, t, backend, dtype=torch.float32, add_quant_bias=True):
        w = weight_values(t, 8)
        n, k = w.shape
        return PreparedLinear(self, backend, backend.prepare_int8(w, t["weight_scale"].float().reshape(-1)), n, k)

    def forward(self, linear, x, bias):
        return linear.backend.int8_matmul_dynamic(x, linear.prepared, bias=bias, out_dtype=x.dtype)


SCHEME = W8A8Dynamic()
