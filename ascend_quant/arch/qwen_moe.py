"""Qwen3-MoE (`qwen3_moe`) and Qwen2-MoE (`qwen2_moe`): the Llama attention, a sparse MoE
block in most layers (arch/moe.py), the Llama MLP in the others.

    x -> post_attention_layernorm -> mlp.gate (router, FLOAT) -> mlp.experts.E.{gate,up,down}_proj
                                  -> Qwen2-MoE: + sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)

transformers 5 writes the expert count as `num_local_experts`; Qwen's own configs say
`num_experts`. Layer i is MoE unless it is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0.
The shared expert is an ordinary gated MLP (vLLM fuses its gate/up into `gate_up_proj`);
its gate/up read post_attention_layernorm, which also feeds the router, so nothing folds
there; up -> down inside it is an equivalence. vllm-ascend 0.23 maps `qwen3_moe`'s experts,
not `qwen2_moe`'s.
"""

from dataclasses import replace

from ascend_quant.arch import llama
from ascend_quant.arch.moe import MoESpec
from ascend_quant.arch.spec import LinearGroup

_EXPERTS = ("num_experts", "num_local_experts")
_QWEN_LAYERS = dict(dense_layers_key="mlp_only_layers", sparse_step_key="decoder_sparse_step")

# no offline rotation: the router reads the residual too, and the map names dense Linears only
SPEC_QWEN3 = replace(llama.SPEC, name="qwen3_moe", model_types=("qwen3_moe",),
                     moe=MoESpec(_EXPERTS, **_QWEN_LAYERS), rotation=None)

SPEC_QWEN2 = replace(
    llama.SPEC, name="qwen2_moe", model_types=("qwen2_moe",), rotation=None,
    moe=MoESpec(
        _EXPERTS, float_modules=("mlp.shared_expert_gate",), vllm_ascend_maps=False,
        shared_groups=(
            LinearGroup("gate_up", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                        vllm_fused="gate_up_proj"),
            LinearGroup("down", ("mlp.shared_expert.down_proj",), "mlp.shared_expert.up_proj", "linear_rows",
                        row_parallel=True),
        ),
        **_QWEN_LAYERS),
)
