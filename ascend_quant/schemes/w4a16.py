"""W4A16: int4 symmetric weights per group of in-features (packed two per byte along the
out-features), float activations. vllm-ascend 0.23 serves it for MoE experts only: dense
Linears are served by our runtime."""

from __future__ import annotations

from ascend_quant.schemes.base import WeightOnlyScheme


class W4A16(WeightOnlyScheme):
    name = "W4A16"
    cli_name = "w4a16"
    weight_bits = 4
    weight_granularity = "group"
    default_group_size = 64
    served_by_vllm_ascend = "not for dense Linears (served by ascend-quant's own runtime)"
    preset = {"method": "gptq"}

    def group_size_for(self, requested):
        return requested


SCHEME = W4A16()
