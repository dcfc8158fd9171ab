"""GLM-4-0414 (`glm4`): q/k/v separate with bias, gate/up fused on disk, sandwich norms.

    x -> input_layernorm -> q/k/v_proj (+bias) -> attention -> o_proj -> post_self_attn_layernorm
      -> + residual -> post_attention_layernorm -> gate_up_proj -> chunk(2): silu(gate) * up
      -> down_proj -> post_mlp_layernorm -> + residual

The post norms read o_proj's and down_proj's outputs and feed no Linear: no fold goes into
them. post_attention_layernorm feeds the MLP (the gate_up group). Norm -> q/k/v smoothing
scales input columns only, so the q/k/v biases stay as they are.

On disk the checkpoint keeps `...mlp.gate_up_proj.weight` fused, as the HF checkpoint has
it; vLLM loads it whole (`Glm4ForCausalLM` via `AutoWeightsLoader`: the stacked mapping
`.gate_proj` -> `gate_up_proj` does not match the fused name). vLLM's class says
`packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}` (models/glm4.py) although
the file is fused, so our config's `shard_prefixes` takes `prefix.weight` first when the
description has it. vllm-ascend 0.23 has no `glm4` entry in `packed_modules_model_mapping`
and looks up `mlp.gate_proj.weight`: a KeyError on this layout; it would need gate/up split on
disk (a gap, not handled here: see the report of issue 14).
"""

from ascend_quant.arch.spec import ArchSpec, LinearGroup

SPEC = ArchSpec(
    name="glm4",
    model_types=("glm4",),
    groups=(
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "input_layernorm", "rmsnorm", vllm_fused="qkv_proj"),
        LinearGroup("o", ("self_attn.o_proj",), row_parallel=True),
        LinearGroup("gate_up", ("mlp.gate_up_proj",), "post_attention_layernorm", "rmsnorm",
                    vllm_fused="gate_up_proj", on_disk=("gate_proj", "up_proj")),
        LinearGroup("down", ("mlp.down_proj",), "mlp.gate_up_proj", "linear_rows", row_parallel=True,
                    producer_chunk=(1, 2)),
    ),
)
