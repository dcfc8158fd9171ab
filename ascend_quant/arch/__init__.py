"""Architecture specs, one file per family, and how a model or checkpoint finds its spec.

    spec = spec_for_model(model)             # a transformers model; checked against its modules
    spec = spec_for_config(config_dict)      # config.json (or None): checkpoint tools
    spec.fused_siblings("model.layers.0.self_attn.k_proj")   # q/k/v, fused by vLLM

A new family is one new file here with a `SPEC`, added to `FAMILIES`.
"""

from __future__ import annotations

from ascend_quant.arch import deepseek, gemma, glm4, llama, mixtral, phi3, qwen_moe
from ascend_quant.arch.moe import LinearExperts, MoESpec, experts_of, replace_experts
from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup, lean_mlp

FAMILIES: tuple[ArchSpec, ...] = (llama.SPEC, gemma.SPEC, gemma.SPEC_MULTIMODAL, phi3.SPEC, glm4.SPEC,
                                  qwen_moe.SPEC_QWEN3, qwen_moe.SPEC_QWEN2, mixtral.SPEC, deepseek.SPEC)
SPECS: dict[str, ArchSpec] = {t: spec for spec in FAMILIES for t in spec.model_types}
# Checkpoint tools (verify, convert, inspect) read folders without a config.json (msModelSlim's
# v0 outputs) or of a family not listed: they check names against the Llama layout, the one
# msModelSlim's and vllm-ascend's dense naming follows.
DEFAULT = llama.SPEC


class UnsupportedModelError(Exception):
    """The model's architecture has no spec; the message names what is missing."""


def spec_for_model(model) -> ArchSpec:
    """The spec for a transformers model, checked against its actual modules."""
    model_type = getattr(model.config, "model_type", None)
    spec = SPECS.get(model_type)
    if spec is None:
        archs = ", ".join(getattr(model.config, "architectures", None) or [])
        raise UnsupportedModelError(f"architecture {model_type!r} ({archs}) has no spec in ascend_quant.arch; "
                                    f"supported: {', '.join(sorted(SPECS))}")
    layers = spec.layers(model)
    kinds = {spec.is_moe_layer(i, model.config): i for i in reversed(range(len(layers)))}
    for moe, i in kinds.items():     # the first layer of each kind (dense, MoE)
        groups = spec.groups if not moe else \
            tuple(g for g in spec.layer_groups(i, model.config) if g.expert is None)
        missing = spec.missing_modules(layers[i], groups)
        if moe:
            missing += [n for n in (spec.moe.router_path, spec.moe.experts_path, *spec.moe.float_modules)
                        if n not in dict(layers[i].named_modules())]
        if missing:
            raise UnsupportedModelError(f"{model_type}: decoder layer {i} has no {', '.join(missing)}")
    return spec


def spec_for_config(config: dict | None) -> ArchSpec:
    """The spec for a checkpoint's config.json (a dict, or None when the folder has none)."""
    model_type = (config or {}).get("model_type")
    if model_type is None and isinstance((config or {}).get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    return SPECS.get(model_type, DEFAULT)


__all__ = ["ArchSpec", "GatedMLP", "LinearGroup", "lean_mlp", "LinearExperts", "MoESpec", "experts_of",
           "replace_experts", "FAMILIES", "SPECS", "DEFAULT",
           "UnsupportedModelError", "spec_for_model", "spec_for_config"]
