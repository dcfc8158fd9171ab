"""DeepSeek-V2 (`deepseek_v2`) and DeepSeek-V3 (`deepseek_v3`): MLA attention, dense MLPs in the
first `first_k_dense_replace` layers, then MoE layers with shared experts. Two attention layouts,
chosen by `q_lora_rank` (`ArchSpec.variant`):

    q_lora_rank null (V2-Lite, Moonlight):
      x -> input_layernorm -> q_proj, kv_a_proj_with_mqa
    q_lora_rank set (V2, V3, R1):
      x -> input_layernorm -> q_a_proj, kv_a_proj_with_mqa     (vLLM: one fused_qkv_a_proj)
           q_a_proj -> q_a_layernorm -> q_b_proj
    both:
      kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj (FLOAT) -> attention -> o_proj -> + residual
      -> post_attention_layernorm -> mlp.gate (router, FLOAT) -> mlp.experts.E.{gate,up,down}_proj
                                  -> + mlp.shared_experts.{gate,up,down}_proj

input_layernorm feeds the query and kv_a_proj_with_mqa and nothing else: one group, smoothed
there; q_a_layernorm feeds q_b_proj alone: a group of its own, smoothed into that norm.
kv_b_proj stays FLOAT: vllm-ascend splits it into W_UK / W_UV and asserts it is unquantized
(`attention/mla_v1.py`); vLLM serves MLA on CPU only with kv_lora_rank + qk_rope_head_dim =
576. The shared experts are one gated MLP (vLLM fuses gate/up) beside the routed ones, both
reading post_attention_layernorm with the router: nothing folds there. The MLA cache holds the
compressed KV, not per-head K/V: no int8 KV cache (C8) here.

V3's router carries a persistent buffer `e_score_correction_bias` (float32 in transformers and
vLLM), written FLOAT. V3 checkpoints also store `num_nextn_predict_layers` MTP layers after the
model's own (`model.layers.{num_hidden_layers}`), which transformers does not build: they are
copied FLOAT (`ArchSpec.is_extra_layer`), as vllm-ascend asks of msModelSlim's outputs.
"""

from dataclasses import replace

from ascend_quant.arch.moe import MoESpec
from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup

_MLP = (
    LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "rmsnorm",
                vllm_fused="gate_up_proj"),
    LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", "linear_rows", row_parallel=True),
)
_O = LinearGroup("o", ("self_attn.o_proj",), row_parallel=True)
_MOE = MoESpec(
    ("n_routed_experts", "num_experts"), first_dense_key="first_k_dense_replace",
    shared_groups=(
        LinearGroup("gate_up", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
                    vllm_fused="gate_up_proj"),
        LinearGroup("down", ("mlp.shared_experts.down_proj",), "mlp.shared_experts.up_proj", "linear_rows",
                    row_parallel=True),
    ))

# q_lora_rank null: q_proj
SPEC = ArchSpec(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    variant=("q_lora_rank", False),
    groups=(
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"), "input_layernorm", "rmsnorm"),
        _O, *_MLP,
    ),
    kv_projections=(),
    attention_module="self_attn",
    float_linears=("self_attn.kv_b_proj",),
    mla_group="qkv",
    kv_cache_width=("kv_lora_rank", "qk_rope_head_dim"),     # MLA caches the latent and the RoPE key
    mlp=GatedMLP("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    moe=_MOE,
    notes=("MLA: kv_b_proj FLOAT; no C8",),
)

# q_lora_rank set: q_a_proj -> q_a_layernorm -> q_b_proj; vLLM fuses q_a_proj with kv_a_proj_with_mqa
SPEC_Q_LORA = replace(
    SPEC,
    name="deepseek_v2_q_lora",
    variant=("q_lora_rank", True),
    groups=(
        LinearGroup("qkv", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "input_layernorm", "rmsnorm",
                    vllm_fused="fused_qkv_a_proj"),
        LinearGroup("q_b", ("self_attn.q_b_proj",), "self_attn.q_a_layernorm", "rmsnorm"),
        _O, *_MLP,
    ),
)

_MOE_V3 = replace(_MOE, router_tensors=("e_score_correction_bias",))
SPEC_V3 = replace(SPEC_Q_LORA, name="deepseek_v3", model_types=("deepseek_v3",), moe=_MOE_V3)
SPEC_V3_NO_Q_LORA = replace(SPEC, name="deepseek_v3_no_q_lora", model_types=("deepseek_v3",), moe=_MOE_V3)

SPECS = (SPEC, SPEC_Q_LORA, SPEC_V3, SPEC_V3_NO_Q_LORA)
