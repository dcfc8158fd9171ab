"""The Llama layout: Llama, Mistral, Qwen2 and Qwen3 (Qwen3's q_norm/k_norm sit inside the
attention, after the projections, and change nothing here).

    x -> input_layernorm -> q/k/v_proj -> attention -> o_proj -> + residual
      -> post_attention_layernorm -> gate/up_proj -> silu(gate) * up -> down_proj -> + residual

Offline rotations (R1/R2) fold here (`rotation`): both norms are x̂ · w pre-norms, the
residual is read only through them, and o_proj / down_proj write it.
"""

from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup, ResidualRotation

SPEC = ArchSpec(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    groups=(
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "input_layernorm", "rmsnorm", vllm_fused="qkv_proj"),
        LinearGroup("o", ("self_attn.o_proj",), row_parallel=True),
        LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "rmsnorm",
                    vllm_fused="gate_up_proj"),
        LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", "linear_rows", row_parallel=True),
    ),
    mlp=GatedMLP("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    # pre-norms only, x̂ · w: the residual stream takes an offline rotation (R1, R2)
    rotation=ResidualRotation(),
)
