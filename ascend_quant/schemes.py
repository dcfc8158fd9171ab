"""The quantization schemes of the Ascend checkpoint format, as data.

Names are exactly the strings of `quant_model_description.json`. Everything else in the
package asks this table what a scheme is (bits, granularity, symmetry, activation mode)
instead of testing scheme names one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Scheme:
    name: str                      # as written in quant_model_description.json
    weight_bits: Optional[int]     # None: weights stay float
    weight_granularity: str        # "channel", "group" or "none"
    weight_symmetric: bool
    activation_bits: Optional[int]  # None: activations stay float
    activation_mode: str           # "static" (per-tensor, calibrated), "dynamic" (per-token), "none"
    activation_symmetric: bool
    default_group_size: int = 0    # 0 = per-channel
    # tensors each quantized Linear carries besides `.weight` (and an optional float `.bias`)
    linear_tensors: tuple[str, ...] = ()
    kv_cache: bool = False         # a KV-cache scheme, not a Linear scheme
    served_by_vllm_ascend: str = ""  # what vllm-ascend 0.23 does with it (for the model card / inspect)

    @property
    def is_quantized(self) -> bool:
        return self.weight_bits is not None or self.kv_cache

    @property
    def weight_qmin(self) -> int:
        assert self.weight_bits is not None
        return -(1 << (self.weight_bits - 1))

    @property
    def weight_qmax(self) -> int:
        assert self.weight_bits is not None
        return (1 << (self.weight_bits - 1)) - 1


W8A8 = Scheme(
    "W8A8", 8, "channel", True, 8, "static", False,
    linear_tensors=("input_scale", "input_offset", "deq_scale", "quant_bias"),
    served_by_vllm_ascend="dense Linears",
)
W8A8_DYNAMIC = Scheme(
    "W8A8_DYNAMIC", 8, "channel", True, 8, "dynamic", True,
    linear_tensors=("weight_scale", "weight_offset"),
    served_by_vllm_ascend="dense Linears and MoE",
)
W8A16 = Scheme(
    "W8A16", 8, "channel", True, None, "none", True,
    linear_tensors=("weight_scale", "weight_offset"),
    served_by_vllm_ascend="dense Linears, per-channel only",
)
W4A16 = Scheme(
    "W4A16", 4, "group", True, None, "none", True, default_group_size=64,
    linear_tensors=("weight_scale", "weight_offset"),
    served_by_vllm_ascend="not for dense Linears (served by ascend-quant's own runtime)",
)
W4A8_DYNAMIC = Scheme(
    "W4A8_DYNAMIC", 4, "channel", True, 8, "dynamic", True,
    linear_tensors=("weight_scale", "weight_offset", "scale_bias"),
    served_by_vllm_ascend="per-group for dense Linears, per-channel for MoE experts",
)
C8 = Scheme(
    "C8", None, "none", True, 8, "static", True,
    linear_tensors=("kv_cache_scale", "kv_cache_offset"),
    kv_cache=True,
    served_by_vllm_ascend="Qwen3, GLM4-MoE and MiniMax-M2 model classes only",
)
FLOAT = Scheme("FLOAT", None, "none", True, None, "none", True)

SCHEMES: dict[str, Scheme] = {s.name: s for s in (W8A8, W8A8_DYNAMIC, W8A16, W4A16, W4A8_DYNAMIC, C8, FLOAT)}

# Extra tensors of the two-stage per-group W4A8 variant (msModelSlim's older Calibrator).
W4A8_GROUP_TENSORS = ("weight_scale_second", "weight_offset_second")

# Command-line spellings -> scheme names.
CLI_NAMES = {
    "w8a8": "W8A8",
    "w8a8-dynamic": "W8A8_DYNAMIC",
    "w8a16": "W8A16",
    "w4a8": "W4A8_DYNAMIC",
    "w4a16": "W4A16",
    "float": "FLOAT",     # weights stay float (e.g. --kv-cache int8 alone)
}


def get_scheme(name: str) -> Scheme:
    """The scheme called `name` (description-file spelling or CLI spelling)."""
    key = CLI_NAMES.get(name.lower(), name) if name.lower() in CLI_NAMES else name
    try:
        return SCHEMES[key]
    except KeyError:
        known = ", ".join(SCHEMES)
        raise KeyError(f"unknown quant type {name!r} (known: {known})") from None
