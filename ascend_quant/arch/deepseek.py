"""DeepSeek-V2 (`deepseek_v2`) in the V2-Lite layout (`q_lora_rank: null`): MLA attention,
dense MLPs in the first `first_k_dense_replace` layers, then MoE layers with shared experts.

    x -> input_layernorm -> q_proj, kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj (FLOAT)
      -> attention -> o_proj -> + residual
      -> post_attention_layernorm -> mlp.gate (router, FLOAT) -> mlp.experts.E.{gate,up,down}_proj
                                  -> + mlp.shared_experts.{gate,up,down}_proj

q_proj and kv_a_proj_with_mqa read input_layernorm and nothing else: one group, smoothed
there. kv_b_proj stays FLOAT: vllm-ascend splits it into W_UK / W_UV and asserts it is
unquantized (`attention/mla_v1.py`); vLLM serves MLA on CPU only with kv_lora_rank +
qk_rope_head_dim = 576. The shared experts are one gated MLP (vLLM fuses gate/up) beside the
routed ones, both reading post_attention_layernorm with the router: nothing folds there.
The MLA cache holds the compressed KV, not per-head K/V: no int8 KV cache (C8) here.
V2 / V3 with `q_lora_rank` (q_a_proj, q_a_layernorm, q_b_proj) are not specified yet: their
decoder layer lacks `self_attn.q_proj`, which `spec_for_model` names.
"""

from ascend_quant.arch.moe import MoESpec
from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup

SPEC = ArchSpec(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    groups=(
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"), "input_layernorm", "rmsnorm"),
        LinearGroup("o", ("self_attn.o_proj",), row_parallel=True),
        LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "rmsnorm",
                    vllm_fused="gate_up_proj"),
        LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", "linear_rows", row_parallel=True),
    ),
    kv_projections=(),
    attention_module="self_attn",
    float_linears=("self_attn.kv_b_proj",),
    mla_group="qkv",
    mlp=GatedMLP("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    moe=MoESpec(
        ("n_routed_experts", "num_experts"), first_dense_key="first_k_dense_replace",
        shared_groups=(
            LinearGroup("gate_up", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
                        vllm_fused="gate_up_proj"),
            LinearGroup("down", ("mlp.shared_experts.down_proj",), "mlp.shared_experts.up_proj", "linear_rows",
                        row_parallel=True),
        )),
    notes=("MLA: kv_b_proj FLOAT; no C8",),
)
