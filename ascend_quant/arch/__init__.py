"""Architecture specs, one file per family, and how a model or checkpoint finds its spec.

    spec = spec_for_model(model)             # a transformers model; checked against its modules
    spec = spec_for_config(config_dict)      # config.json (or None): checkpoint tools
    spec.fused_siblings("model.layers.0.self_attn.k_proj")   # q/k/v, fused by vLLM

A new family is one new file here with a `SPEC`, added to `FAMILIES`. A model type without
one gets a spec discovered by probing its first decoder layer (discovery.py); explicit specs
always win. Calibration saves a discovered spec in the output's config.json under
`SAVED_SPEC_KEY`, where `spec_for_config` finds it again for the checkpoint tools and vLLM.
"""

from __future__ import annotations

from ascend_quant.arch import deepseek, gemma, glm4, llama, mixtral, phi3, qwen_moe
from ascend_quant.arch.moe import LinearExperts, MoESpec, experts_of, replace_experts
from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup, UnsupportedModelError, lean_mlp

FAMILIES: tuple[ArchSpec, ...] = (llama.SPEC, gemma.SPEC, gemma.SPEC_MULTIMODAL, phi3.SPEC, glm4.SPEC,
                                  qwen_moe.SPEC_QWEN3, qwen_moe.SPEC_QWEN2, mixtral.SPEC, deepseek.SPEC)
SPECS: dict[str, ArchSpec] = {t: spec for spec in FAMILIES for t in spec.model_types}
# Checkpoint tools (verify, convert, inspect) read folders without a config.json (msModelSlim's
# v0 outputs) or of a family not listed: they check names against the Llama layout, the one
# msModelSlim's and vllm-ascend's dense naming follows.
DEFAULT = llama.SPEC
# config.json key of a discovered spec (ArchSpec.to_dict), written by calibration
SAVED_SPEC_KEY = "ascend_quant_arch_spec"
_CACHE_ATTR = "_ascend_quant_discovered_spec"


def spec_for_model(model) -> ArchSpec:
    """The spec for a transformers model, checked against its actual modules; without an
    explicit one, discovered (once per model object: call it while the weights are float)."""
    model_type = getattr(model.config, "model_type", None)
    spec = SPECS.get(model_type)
    if spec is None:
        spec = getattr(model, _CACHE_ATTR, None)
        if spec is None:
            from ascend_quant.arch.discovery import discover
            try:
                spec = discover(model)
            except UnsupportedModelError as e:
                archs = ", ".join(getattr(model.config, "architectures", None) or [type(model).__name__])
                raise UnsupportedModelError(f"architecture {model_type!r} ({archs}) has no spec in ascend_quant.arch "
                                            f"and discovery failed: {e} (with a spec: {', '.join(sorted(SPECS))})"
                                            ) from None
            setattr(model, _CACHE_ATTR, spec)
        return spec
    layers = spec.layers(model)
    kinds = {spec.is_moe_layer(i, model.config): i for i in reversed(range(len(layers)))}
    for moe, i in kinds.items():     # the first layer of each kind (dense, MoE)
        groups = spec.groups if not moe else \
            tuple(g for g in spec.layer_groups(i, model.config) if g.expert is None)
        wanted = [n for g in groups for n in g.linears] + [g.producer for g in groups if g.producer]
        if moe:
            wanted += [spec.moe.router_path, spec.moe.experts_path, *spec.moe.float_modules]
        missing = spec.missing_modules(layers[i], wanted)
        if missing:
            raise UnsupportedModelError(f"{model_type}: decoder layer {i} has no {', '.join(missing)}")
    return spec


def spec_for_config(config: dict | None) -> ArchSpec:
    """The spec for a checkpoint's config.json (a dict, or None when the folder has none)."""
    model_type = (config or {}).get("model_type")
    if model_type is None and isinstance((config or {}).get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    spec = SPECS.get(model_type)
    saved = (config or {}).get(SAVED_SPEC_KEY)
    if spec is None and isinstance(saved, dict):
        return ArchSpec.from_dict(saved)
    return spec or DEFAULT


__all__ = ["ArchSpec", "GatedMLP", "LinearGroup", "lean_mlp", "LinearExperts", "MoESpec", "experts_of",
           "replace_experts", "FAMILIES", "SPECS", "DEFAULT",
           "UnsupportedModelError", "SAVED_SPEC_KEY", "spec_for_model", "spec_for_config"]
