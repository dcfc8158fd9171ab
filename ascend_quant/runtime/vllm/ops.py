"""Our quantized Linear as one torch custom op, so vLLM's default compiled mode keeps it whole.

vLLM (without `enforce_eager`) traces the model with dynamo in fullgraph mode. The kernels
behind a scheme's `forward` branch on tensor values (an all-zero token, a chunk loop over k), hold
objects that are not tensors (oneDNN handles, packed layouts) and call C code: dynamo cannot
trace them, and should not. Defined with a schema and a fake implementation (the output's
shape and dtype), the whole quantized forward is one opaque node in the graph, as vLLM does for
its own attention (`unified_attention_with_output`). The ops are registered with
`torch.library.Library` define + impl, as vLLM registers its own, not `torch.library.custom_op`,
whose Python wrapper costs more on every call (an empty op in inference mode: 4.3 against
2.7 us), and a decode step calls the op once per Linear.

The op takes the layer's name, not its weights: the layer registers itself in vLLM's
`static_forward_context` while the model is built, and the op finds it in the forward
context of the engine that is running (so two engines in one process never mix their
layers, and the traced graph holds only a string, stable across processes for vLLM's
compile cache).

    y = torch.ops.ascend_quant.linear(x, bias, layer_name, out_features)
    y = torch.ops.ascend_quant.moe(x, topk_weights, topk_ids, layer_name)   # routed experts
    y = torch.ops.ascend_quant.moe_routed(x, router_logits, layer_name)     # routing inside too
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

# where a layer registers in vLLM's static forward context (kept apart from LoRA's prefix keys)
KEY_PREFIX = "ascend_quant:"


def register_layer(layer: torch.nn.Module, prefix: str) -> str:
    """Make `layer` reachable by the op for the engine being built; returns its key."""
    from vllm.config import get_current_vllm_config

    key = KEY_PREFIX + prefix
    context = get_current_vllm_config().compilation_config.static_forward_context
    if key in context and context[key] is not layer:
        raise ValueError(f"duplicate quantized layer name {prefix!r} in one model")
    context[key] = layer
    return key


def _layer(key: str) -> torch.nn.Module:
    if not is_forward_context_available():
        raise RuntimeError(f"{key}: the ascend_quant ops run inside a vLLM forward only")
    return get_forward_context().no_compile_layers[key]


def _linear(x: torch.Tensor, bias: torch.Tensor | None, layer_name: str, out_features: int) -> torch.Tensor:
    """The quantized forward of the layer registered as `layer_name` (its `ascend_qlinear`)."""
    y = _layer(layer_name).ascend_qlinear(x, bias)
    # an op's output may not be (a view of) its input
    return y.clone() if y.data_ptr() == x.data_ptr() else y


def _linear_fake(x, bias, layer_name, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    """The routed, top-k weighted expert sum of the RoutedExperts layer registered as
    `layer_name` (its `ascend_experts`, see runtime.vllm.moe)."""
    from ascend_quant.runtime.kernels.moe import routed_experts

    return routed_experts(x, topk_weights, topk_ids, _layer(layer_name).ascend_experts)


def _moe_routed(x: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    """`moe` with the routing done here, from the router logits (runtime.vllm.moe.select_experts)."""
    from ascend_quant.runtime.kernels.moe import routed_experts
    from ascend_quant.runtime.vllm.moe import select_experts

    layer = _layer(layer_name)
    topk_weights, topk_ids = select_experts(layer, x, router_logits)
    return routed_experts(x, topk_weights, topk_ids, layer.ascend_experts)


def _like_x(x, *args):
    return torch.empty_like(x)


_LIB = torch.library.Library("ascend_quant", "DEF")


def _define(schema: str, impl, fake) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    # one implementation for every device: the layer's backend picks the kernel
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    _LIB._register_fake(name, fake)


_define("linear(Tensor x, Tensor? bias, str layer_name, SymInt out_features) -> Tensor", _linear, _linear_fake)
_define("moe(Tensor x, Tensor topk_weights, Tensor topk_ids, str layer_name) -> Tensor", _moe, _like_x)
_define("moe_routed(Tensor x, Tensor router_logits, str layer_name) -> Tensor", _moe_routed, _like_x)

linear = torch.ops.ascend_quant.linear
moe = torch.ops.ascend_quant.moe
moe_routed = torch.ops.ascend_quant.moe_routed
