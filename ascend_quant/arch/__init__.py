"""Architecture specs, one file per family, and how a model or checkpoint finds its spec.

    spec = spec_for_model(model)             # a transformers model; checked against its modules
    spec = spec_for_config(config_dict)      # config.json (or None): checkpoint tools
    spec.fused_siblings("model.layers.0.self_attn.k_proj")   # q/k/v, fused by vLLM

A new family is one new file here with a `SPEC`, added to `FAMILIES`. A model type whose layout
depends on its config has several specs, each with a `variant` (a config key set or not);
`explicit_spec` picks the one the config fits. A model type without
one gets a spec discovered by probing its first decoder layer (discovery.py); explicit specs
always win. Calibration saves a discovered spec in the output's config.json under
`SAVED_SPEC_KEY`, where `spec_for_config` finds it again for the checkpoint tools and vLLM.
"""

from __future__ import annotations

from ascend_quant.arch import deepseek, gemma, glm4, llama, mixtral, phi3, qwen_moe
from ascend_quant.arch.moe import LinearExperts, MoESpec, experts_of, replace_experts
from ascend_quant.arch.spec import ArchSpec, GatedMLP, LinearGroup, UnsupportedModelError, lean_mlp

FAMILIES: tuple[ArchSpec, ...] = (llama.SPEC, gemma.SPEC, gemma.SPEC_MULTIMODAL, phi3.SPEC, glm4.SPEC,
                                  qwen_moe.SPEC_QWEN3, qwen_moe.SPEC_QWEN2, mixtral.SPEC, *deepseek.SPECS)
# model type -> its specs (several only where `variant` tells them apart by the config)
SPECS: dict[str, tuple[ArchSpec, ...]] = {}
for _spec in FAMILIES:
    for _t in _spec.model_types:
        SPECS[_t] = SPECS.get(_t, ()) + (_spec,)
for _t, _specs in SPECS.items():
    if len(_specs) > 1 and any(s.variant is None for s in _specs):
        raise ValueError(f"arch: model type {_t} has several specs, not all with a variant")
del _spec, _t, _specs
# Checkpoint tools (verify, convert, inspect) read folders without a config.json (msModelSlim's
# v0 outputs) or of a family not listed: they check names against the Llama layout, the one
# msModelSlim's and vllm-ascend's dense naming follows.
DEFAULT = llama.SPEC
# config.json key of a discovered spec (ArchSpec.to_dict), written by calibration
SAVED_SPEC_KEY = "ascend_quant_arch_spec"
_CACHE_ATTR = "_ascend_quant_discovered_spec"


def explicit_spec(config) -> ArchSpec | None:
    """The family spec of a config (transformers object or config.json dict) by its model type,
    the one whose variant it fits; None for a model type without one."""
    if isinstance(config, dict):
        model_type = config.get("model_type")
        if model_type is None and isinstance(config.get("text_config"), dict):
            model_type = config["text_config"].get("model_type")
    else:
        model_type = getattr(config, "model_type", None)
    return next((s for s in SPECS.get(model_type, ()) if s.fits(config)), None)


def spec_for_model(model) -> ArchSpec:
    """The spec for a transformers model, checked against its actual modules; without an
    explicit one, discovered (once per model object: call it while the weights are float)."""
    model_type = getattr(model.config, "model_type", None)
    spec = explicit_spec(model.config)
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
        if moe:
            router = layers[i].get_submodule(spec.moe.router_path)
            missing += [f"{spec.moe.router_path}.{t}" for t in spec.moe.router_tensors if not hasattr(router, t)]
        if missing:
            raise UnsupportedModelError(f"{model_type}: decoder layer {i} has no {', '.join(missing)}")
    return spec


def spec_for_config(config: dict | None) -> ArchSpec:
    """The spec for a checkpoint's config.json (a dict, or None when the folder has none)."""
    spec = explicit_spec(config or {})
    saved = (config or {}).get(SAVED_SPEC_KEY)
    if spec is None and isinstance(saved, dict):
        return ArchSpec.from_dict(saved)
    return spec or DEFAULT


__all__ = ["ArchSpec", "GatedMLP", "LinearGroup", "lean_mlp", "LinearExperts", "MoESpec", "experts_of",
           "replace_experts", "FAMILIES", "SPECS", "DEFAULT",
           "UnsupportedModelError", "SAVED_SPEC_KEY", "explicit_spec", "spec_for_model", "spec_for_config"]
