"""Phi-3 (`phi3`): the Llama layout with q/k/v and gate/up fused on disk, no biases.

    x -> input_layernorm -> qkv_proj -> attention -> o_proj -> + residual
      -> post_attention_layernorm -> gate_up_proj -> chunk(2): silu(gate) * up -> down_proj -> + residual

On disk (decided from vllm-ascend 0.23): the checkpoint keeps the FUSED names,
`...self_attn.qkv_proj.weight` and `...mlp.gate_up_proj.weight`, one entry each, as the HF
checkpoint has them. Evidence: vllm-ascend's `packed_modules_model_mapping`
(quantization/modelslim_config.py) has no `phi3` entry, so `AscendModelSlimConfig` keeps the
mapping vLLM hands every quant config (`configure_quant_config`), the model class's
`Phi3ForCausalLM.packed_modules_mapping = {"qkv_proj": ["qkv_proj"], "gate_up_proj":
["gate_up_proj"]}` (vllm models/phi3.py); `get_linear_quant_type` and `is_layer_skipped_ascend`
then look up `prefix.replace("qkv_proj", "qkv_proj") + ".weight"`, i.e. the fused name, and a
split file (`q_proj.weight`) would be a KeyError there. The weights load through Llama's
`load_weights`, whose stacked mapping (`.q_proj` -> `qkv_proj`) does not match the fused
name, so each tensor goes whole to the fused parameter (`weight_loader(shard_id=None)`).

Each fused Linear is one member of its group (one Hessian, one weight). down_proj reads
`silu(gate) * up`, so its smoothing folds into the up half of gate_up_proj's rows only
(`producer_chunk=(1, 2)`; HF's `chunk(2)` puts gate first).

C8 (int8 KV cache): the scales stay under the attention's `self_attn.k_proj.kv_cache_scale`
/ `v_proj.kv_cache_*` names although no `k_proj` Linear exists on disk. They belong to the
attention layer, not to a Linear: vllm-ascend's `get_cache_scale` maps the suffix
`k_proj.kv_cache_scale` to `attn.k_cache_scale` by name alone, and finds C8 layers by keys
containing `k_proj.kv_cache_scale` (a `qkv_proj.kv_cache_scale` would match neither), and
its `ModelSlimConfig` never splits them by `packed_modules_mapping`. Our vLLM config renames
them the same way (`kv_projections`); tests/test_families_fused.py serves Phi-3 W8A8 + C8.
vllm-ascend 0.23 itself routes those names only for Qwen3 / GLM4-MoE / MiniMax-M2 classes.
"""

from ascend_quant.arch.spec import ArchSpec, LinearGroup

SPEC = ArchSpec(
    name="phi3",
    model_types=("phi3",),
    groups=(
        LinearGroup("qkv", ("self_attn.qkv_proj",), "input_layernorm", "rmsnorm", vllm_fused="qkv_proj",
                    on_disk=("q_proj", "k_proj", "v_proj")),
        LinearGroup("o", ("self_attn.o_proj",), row_parallel=True),
        LinearGroup("gate_up", ("mlp.gate_up_proj",), "post_attention_layernorm", "rmsnorm",
                    vllm_fused="gate_up_proj", on_disk=("gate_proj", "up_proj")),
        LinearGroup("down", ("mlp.down_proj",), "mlp.gate_up_proj", "linear_rows", row_parallel=True,
                    producer_chunk=(1, 2)),
    ),
)
