"""W4A16: int4 weights per group of in-features (packed two per byte along the out-features),
symmetric or with zero points (`weight_offset` per group, `(w - offset) * scale`), float
activations. vllm-ascend 0.23 serves it for MoE experts only (symmetric, llm-compressor's
layout): dense Linears are served by our runtime."""

from __future__ import annotations

import torch

from ascend_quant.schemes.base import WeightOnlyScheme


class W4A16(WeightOnlyScheme):
    name = "W4A16"
    cli_name = "w4a16"
    fallback = "W8A8_DYNAMIC"
    weight_bits = 4
    weight_granularity = "group"
    default_group_size = 64
    weight_zero_points = True
    served_by_vllm_ascend = "not for dense Linears (served by ascend-quant's own runtime)"
    # A rotation where the family takes one, AWQ scored through each Linear's own rounding,
    # zero points, then GPTQ. Chosen on calibration text only (`choose_preset.py --write-split`,
    # SmolLM2-135M g64, README): 128 x 512 fit windows, 16k selection tokens, +8.25% against
    # GPTQ alone +10.04% and rotation + zero points +10.65%; with 32 windows and 8192 selection
    # tokens AWQ's alphas 0-0.5 gave what 0-1 gave (+9.30%, rotation + zero points +12.6%) in
    # 0.7x the time; GPTQ's Hessian over 16384 tokens instead of 4096: +8.28%. MoE experts stay
    # symmetric (vllm-ascend's W4A16 experts have no offsets).
    # Stop 33: GPTQ fitted to the float model's output (`gptq.float_target`) where the model is
    # rotated: SmolLM2 128 x 512 fit windows, 16k selection tokens, +7.80% / +7.65% (seeds 0 / 1)
    # against +8.90% / +8.05%; unrotated Gemma-3-270m (64 windows, 8192 tokens) +9.84% against
    # +7.17%, so not there (`float_target_unrotated: false`).
    # Stop 39: with the float target, its fit and GPTQ's Hessian on all 65536 fit tokens instead of
    # 16384 (`float_target_tokens`): SmolLM2 +6.48% / +6.82% (seeds 0 / 1) against +7.80% / +7.65%;
    # on unrotated Gemma (no float target) all tokens lost (+8.18% against +7.56%, 64 windows),
    # so hessian_tokens stays.
    # Stop 40: where a post-norm reads o_proj / down_proj (Gemma, GLM-4), each token's error counts
    # with 1 / RMS of that output (recipe `weights.post_norm`, on by default, so not listed here):
    # Gemma-3-270m, 64 fit windows, 16k selection tokens, seeds 0-3: +7.45% mean against +7.84%.
    # Stop 43: gate_proj / up_proj rounded for the MLP's product, GPTQ per row cluster
    # (`gptq.gate_up_clusters`; not where the float target applies, so not on rotated SmolLM2):
    # Gemma-3-270m, same split, seeds 0-2 (AMD EPYC Zen 4): +6.92% mean against +7.53%.
    preset = {"method": "gptq", "rotation": {"where_supported": True},
              "gptq": {"hessian_tokens": 16384, "float_target": True, "float_target_unrotated": False,
                       "float_target_tokens": 65536, "gate_up_clusters": 8},
              "awq": {"score": "final", "alphas": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]},
              "weights": {"symmetric": False}}

    def group_size_for(self, requested):
        return requested

    def value_notes(self, name, read):
        off = read(f"{name}.weight_offset")
        if off is not None and bool(torch.any(off != 0)):
            return ["W4A16 with zero points (nonzero weight_offset): served by ascend-quant's runtime; vllm-ascend "
                    "loads W4A16 for MoE experts only, symmetric (llm-compressor's layout, no offsets)"]
        return []


SCHEME = W4A16()
