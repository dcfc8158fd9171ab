"""GLM-4-0414 (`glm4`): q/k/v separate with bias, gate/up fused on disk, sandwich norms.

    x -> input_layernorm -> q/k/v_proj (+bias) -> attention -> o_proj -> post_self_attn_layernorm
      -> + residual -> post_attention_layernorm -> gate_up_proj -> chunk(2): silu(gate) * up
      -> down_proj -> post_mlp_layernorm -> + residual

The post norms read o_proj's and down_proj's outputs and feed no Linear: no fold goes into
them. post_attention_layernorm feeds the MLP (the gate_up group). Norm -> q/k/v smoothing
scales input columns only, so the q/k/v biases stay as they are.

On disk the checkpoint keeps `...mlp.gate_up_proj.weight` fused, as the HF checkpoint has
it; vLLM loads it whole (`Glm4ForCausalLM` via `AutoWeightsLoader`: the stacked mapping
`.gate_proj` -> `gate_up_proj` does not match the fused name, so the tensor goes to the fused
parameter with `shard_id=None`). vLLM's class says `packed_modules_mapping = {"gate_up_proj":
["gate_proj", "up_proj"]}` (models/glm4.py) although the file is fused, so our config's
`shard_prefixes` takes `prefix.weight` first when the description has it.

vllm-ascend 0.23 (decided by running its own code, tests/test_vllm_ascend_layout.py): glm4
has no entry in its `packed_modules_model_mapping`, so it keeps the class's mapping above, and
both `get_linear_quant_type` and `is_layer_skipped_ascend` look up `mlp.gate_proj.weight`
and `mlp.up_proj.weight` in the description for the vLLM Linear `mlp.gate_up_proj`: a
KeyError, whatever the scheme (FLOAT included); q/k/v, o_proj and down_proj pick their
schemes. Kept fused anyway, and `verify` notes the gap (`vllm_ascend_gap`): the two ways
out are unproven there. Typing the split names in the description without their tensors
lets the scheme lookup pass (the test shows it) but the loading of a fused quantized tensor
through vllm-ascend's NPU Linears cannot be run here, and writing gate/up split on disk
changes the writer, reader and reference model for one family. Our runtime serves the fused
file in vLLM (tests/test_families_fused.py).
"""

from ascend_quant.arch.spec import ArchSpec, LinearGroup

SPEC = ArchSpec(
    name="glm4",
    model_types=("glm4",),
    groups=(
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "input_layernorm", "rmsnorm", vllm_fused="qkv_proj"),
        LinearGroup("o", ("self_attn.o_proj",), row_parallel=True, output_norm="post_self_attn_layernorm"),
        LinearGroup("gate_up", ("mlp.gate_up_proj",), "post_attention_layernorm", "rmsnorm",
                    vllm_fused="gate_up_proj", on_disk=("gate_proj", "up_proj")),
        LinearGroup("down", ("mlp.down_proj",), "mlp.gate_up_proj", "linear_rows", row_parallel=True,
                    producer_chunk=(1, 2), output_norm="post_mlp_layernorm"),
    ),
    post_norms=("post_self_attn_layernorm", "post_mlp_layernorm"),
    vllm_ascend_gap=("glm4: vllm-ascend 0.23 does not load this checkpoint: for mlp.gate_up_proj (fused "
                     "on disk, as in HF's GLM-4) it looks up mlp.gate_proj.weight / mlp.up_proj.weight in "
                     "the description (vLLM's Glm4 packed mapping) and raises KeyError; ascend-quant's "
                     "vLLM runtime serves it"),
)
