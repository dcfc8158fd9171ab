"""Per-architecture knowledge, as data: which Linears share an input, which are row-parallel.

The names below are those of the Llama family (Llama, Mistral, Qwen2, Qwen3), which is
what the calibrator and runtime support; per-architecture adapters build on them.
"""

# Linears that vLLM fuses into one parameter and that therefore share one input and,
# for static W8A8, one input_scale / input_offset.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Linears whose input features are split across tensor-parallel ranks.
ROW_PARALLEL = ("o_proj", "down_proj")
# The attention projections that carry C8 KV-cache scales.
KV_PROJECTIONS = ("k_proj", "v_proj")


def fused_siblings(prefix: str) -> tuple[str, ...] | None:
    """The prefixes fused with `prefix` (itself included), or None if it is not fused."""
    parent, _, leaf = prefix.rpartition(".")
    for members in FUSED_GROUPS.values():
        if leaf in members:
            return tuple(f"{parent}.{m}" if parent else m for m in members)
    return None


def is_row_parallel(prefix: str) -> bool:
    return prefix.rpartition(".")[2] in ROW_PARALLEL
