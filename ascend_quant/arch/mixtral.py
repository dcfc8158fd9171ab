"""Mixtral (`mixtral`): the Llama attention and a sparse MoE block in every layer.

transformers 5 names the block `mlp` in memory; the checkpoint and vLLM keep
`block_sparse_moe` (`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.E.{w1,w3,w2}`,
w1 = gate, w3 = up, w2 = down), so names are mapped to disk when written and back when read.
vllm-ascend 0.23 has no `experts` mapping for `mixtral` (a KeyError at load); vLLM loads it.
"""

from dataclasses import replace

from ascend_quant.arch import llama
from ascend_quant.arch.moe import MoESpec

SPEC = replace(llama.SPEC, name="mixtral", model_types=("mixtral",),
               moe=MoESpec(("num_local_experts",), ("w1", "w3", "w2"), disk_block="block_sparse_moe",
                           vllm_ascend_maps=False),
               rotation=None)     # no offline rotation for MoE (the router reads the residual)
