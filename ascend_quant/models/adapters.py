"""Per-architecture adapters: where the decoder layers are and how each layer's Linears group.

An adapter is data, not code paths: the pipeline walks `groups` in execution order; each
group is a set of Linears that read the same input, optionally preceded by the module whose
output is that input (the RMSNorm for q/k/v and gate/up, up_proj for down_proj), which is
what SmoothQuant folds its factors into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedModelError(Exception):
    """The model's architecture has no adapter; the message names what is missing."""


@dataclass(frozen=True)
class LinearGroup:
    name: str                      # "qkv", "o", "gate_up", "down"
    linears: tuple[str, ...]       # paths relative to the decoder layer
    smooth_into: str | None        # module that absorbs 1/s: an RMSNorm (weight) or a Linear (rows)
    row_parallel: bool = False
    # the input is read by this group only (a norm's output, the attention output, act * up),
    # so the calibrator may transform it in place
    private_input: bool = True


@dataclass(frozen=True)
class Adapter:
    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    attention: str = "self_attn"
    groups: tuple[LinearGroup, ...] = (
        LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
        LinearGroup("o", ("self_attn.o_proj",), None, row_parallel=True),
        LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
        LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", row_parallel=True),
    )

    def layers(self, model) -> torch.nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> list[str]:
        return [name for g in self.groups for name in g.linears]


LLAMA_LIKE = Adapter(model_types=("llama", "mistral", "qwen2", "qwen3"))
ADAPTERS = {t: LLAMA_LIKE for t in LLAMA_LIKE.model_types}


def adapter_for(model) -> Adapter:
    """The adapter for a transformers model, checked against its actual modules."""
    model_type = getattr(model.config, "model_type", None)
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise UnsupportedModelError(
            f"architecture {model_type!r} ({', '.join(getattr(model.config, 'architectures', None) or [])}) has no "
            f"adapter; supported: {', '.join(sorted(ADAPTERS))}")
    layers = adapter.layers(model)
    layer = layers[0]
    missing = [n for n in adapter.linear_names() + [g.smooth_into for g in adapter.groups if g.smooth_into]
               if not _has(layer, n)]
    if missing:
        raise UnsupportedModelError(f"{model_type}: decoder layer has no {', '.join(missing)}")
    return adapter


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False
