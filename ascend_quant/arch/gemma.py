"""The Gemma-2 / Gemma-3 text layout: four norms per layer, two of them on outputs.

    x -> input_layernorm -> q/k/v_proj -> attention -> o_proj -> post_attention_layernorm -> + residual
      -> pre_feedforward_layernorm -> gate/up_proj -> gelu_tanh(gate) * up -> down_proj
      -> post_feedforward_layernorm -> + residual

Every norm computes x̂ · (1 + w) (`rmsnorm_offset`), so a smoothing factor folds as
w' = (1 + w) / s - 1. `post_attention_layernorm` and `post_feedforward_layernorm` normalise a
Linear's output before the residual add: no group reads them, nothing folds into them, and
o_proj's input (the attention output) has no producer to fold into either. Gemma-3's
q_norm / k_norm sit inside the attention after the projections and change nothing here.
No Gemma norm ever takes a `.bias` (vllm-ascend's Gemma RMSNorm has none):
`ArchSpec.norm_consumers` lists plain `rmsnorm` producers only, so the vLLM config refuses one.
"""

from dataclasses import replace

from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup

SPEC = ArchSpec(
    name="gemma",
    model_types=("gemma2", "gemma3_text"),
    groups=(
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "input_layernorm", "rmsnorm_offset", vllm_fused="qkv_proj"),
        LinearGroup("o", ("self_attn.o_proj",), row_parallel=True, output_norm="post_attention_layernorm"),
        LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "pre_feedforward_layernorm", "rmsnorm_offset",
                    vllm_fused="gate_up_proj"),
        LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", "linear_rows", row_parallel=True,
                    output_norm="post_feedforward_layernorm"),
    ),
    mlp=GatedMLP("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", activation="gelu_pytorch_tanh"),
    notes=("post_attention_layernorm / post_feedforward_layernorm: on o_proj's / down_proj's output, no fold",),
    post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
)

# Gemma3ForConditionalGeneration (`gemma3`): the same decoder under the multimodal wrapper;
# its checkpoint names are `language_model.model.layers.<i>.` (the layer pattern still matches)
SPEC_MULTIMODAL = replace(SPEC, name="gemma3", model_types=("gemma3",), layers_path="model.language_model.layers")
