"""The `ascend` quantization config for vLLM: reads the checkpoint's description and picks a
linear method per Linear.

vLLM builds it either from `config.json`'s `quantization_config` (`quant_method: "ascend"`)
or, with `--quantization ascend`, with no arguments; in both cases `maybe_update_config`
(which vLLM calls with the model folder before the model is built) reads
`quant_model_description.json` (or the older names `formats.ascend` accepts) and its
safetensors headers. Every error names the file and the key, and comes before any weight loads.

Norm biases (smoothing): vLLM's RMSNorm has no bias. The checkpoint weight mapper renames a
norm's bias to an `input_bias` of the (vLLM-fused) Linear that alone reads that norm (the
architecture spec's `norm_consumers`: in the Llama layout `input_layernorm` -> `self_attn.qkv_proj`,
`post_attention_layernorm` -> `mlp.gate_up_proj`), and the consuming Linear's method adds it to
its input: `W (norm(x) + b)` is exactly what the checkpoint means, because those norms feed
only those Linears (the residual stream takes the un-normed sum).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ascend_quant.formats.ascend import CheckpointError, DESCRIPTION_NAME, TOP_LEVEL_KEYS, read_checkpoint
from ascend_quant.arch import DEFAULT as DEFAULT_SPEC, ArchSpec, spec_for_config
from ascend_quant.schemes import INPUT_ROTATION, SCHEMES, W4A8_GROUP_TENSORS, is_float, is_kv, is_linear

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

logger = init_logger(__name__)
serving_log = init_logger("vllm.ascend_quant")     # vLLM's handler: shows in the serving log

METHOD_NAME = "ascend"
ALIAS_NAME = "ascend_quant"
NORM_BIAS_PARAM = "input_bias"


class AscendQuantConfig(QuantizationConfig):
    """msModelSlim / vllm-ascend checkpoints served by ascend-quant's kernels."""

    name = METHOD_NAME
    _ignore_unexpected_suffixes = QuantizationConfig._ignore_unexpected_suffixes + (
        ".kv_cache_scale", ".kv_cache_offset")

    def __init__(self, description: dict[str, str] | None = None, meta: dict | None = None,
                 hf_quant_config: dict | None = None):
        super().__init__()
        self.description: dict[str, str] = dict(description or {})
        self.meta: dict = dict(meta or {})
        self.hf_quant_config = dict(hf_quant_config or {})
        self.description_file = DESCRIPTION_NAME
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._shapes_by_module: dict[str, dict[str, tuple[int, ...]]] | None = None
        self.spec: ArchSpec = DEFAULT_SPEC       # the checkpoint's family, from its config.json
        self._warned_c8 = False

    def __repr__(self) -> str:
        return (f"AscendQuantConfig(model_quant_type={self.meta.get('model_quant_type')!r}, "
                f"tensors={len(self.description)})")

    # ------------------------------------------------------------------ vLLM API
    def get_name(self) -> str:
        return self.name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty on purpose: vLLM then builds the config without arguments and calls
        # maybe_update_config with the folder, where a missing file gets our own error.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AscendQuantConfig":
        tensor_keys = {k: v for k, v in config.items() if k not in TOP_LEVEL_KEYS and isinstance(v, str)
                       and k not in ("quant_method",)}
        if any("." in k for k in tensor_keys):            # a description dict itself
            meta = {k: config[k] for k in TOP_LEVEL_KEYS if k in config}
            return cls(tensor_keys, meta)
        return cls(hf_quant_config=config)                 # config.json's quantization_config

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # `--quantization ascend_quant` on a checkpoint whose config.json says "ascend"
        if hf_quant_cfg.get("quant_method") == METHOD_NAME and user_quant == cls.name:
            return cls.name
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        if not os.path.isdir(model_name):
            if self.description:
                return
            raise ValueError(f"{model_name}: --quantization {self.name} needs a local checkpoint folder "
                             f"with {DESCRIPTION_NAME} (download it first)")
        try:
            ckpt = read_checkpoint(model_name)
        except CheckpointError as e:
            raise ValueError(f"--quantization {self.name}: {e}") from None
        self.description = dict(ckpt.description)
        self.meta = dict(ckpt.meta)
        self.description_file = str(ckpt.description_file)
        self.shapes = {k: (tuple(v.shape), v.dtype) for k, v in ckpt.infos.items()}
        self._shapes_by_module = None
        self.spec = spec_for_config(ckpt.config)
        self.validate()

    def validate(self) -> None:
        """Unknown quant types and norm biases this runtime cannot place: one error each."""
        consumers = self.spec.norm_consumers()
        for key, qtype in self.description.items():
            if qtype not in SCHEMES:
                raise ValueError(f"{self.description_file}: key {key!r} has unknown quant type {qtype!r} "
                                 f"(known: {', '.join(SCHEMES)})")
            if key.endswith("norm.bias") and self.spec.layer_index(key) is not None:
                norm = self.spec.relative(key[: -len(".bias")])
                if norm not in consumers:
                    raise ValueError(f"{self.description_file}: key {key!r}: a bias on {norm!r} is not supported "
                                     f"(only {', '.join(consumers)})")
            elif key.endswith("norm.bias"):
                raise ValueError(f"{self.description_file}: key {key!r}: a bias on the final norm is not supported")

    def get_checkpoint_weight_mapper(self):
        from vllm.model_executor.models.utils import WeightsMapper

        spec = self.spec
        renames = {re.compile(rf"\.{re.escape(norm)}\.bias$"): f".{linear}.{NORM_BIAS_PARAM}"
                   for norm, linear in spec.norm_consumers().items()}
        # C8: <layer>.<K projection>.kv_cache_scale -> <layer>.<vLLM attention>.k_cache_scale (the
        # attention layer's parameters, see runtime.vllm.attention); before the q/k/v stacking
        for role, proj in zip("kv", spec.kv_projections):
            renames[re.compile(rf"\.{re.escape(proj)}\.kv_cache_(scale|offset)$")] = \
                f".{spec.vllm_attention}.{role}_cache_\\1"
        return super().get_checkpoint_weight_mapper() | WeightsMapper(orig_to_new_regex=renames)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase

        from ascend_quant.runtime.vllm.linear import AscendQuantFloatLinearMethod, AscendQuantLinearMethod

        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            return self.experts_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return self.kv_cache_method(layer, prefix)
        shards = self.shard_prefixes(prefix)
        schemes = {}
        for p in shards:
            key = f"{p}.weight"
            if key not in self.description:
                raise ValueError(f"{self.description_file}: no key {key!r} (every Linear needs a '.weight' "
                                 "entry; FLOAT marks one left unquantized)")
            schemes[p] = self.description[key]
        if len(set(schemes.values())) > 1:
            detail = ", ".join(f"{p}={s}" for p, s in schemes.items())
            raise ValueError(f"{self.description_file}: fused layers disagree in quant type ({detail})")
        scheme = next(iter(schemes.values()))
        norm_bias = self.norm_bias_key(prefix)
        rotated = [f"{p}.{INPUT_ROTATION}" in self.description for p in shards]
        if any(rotated) and (len(shards) > 1 or not all(rotated)):
            raise ValueError(f"{self.description_file}: {prefix} fuses {', '.join(shards)}; an online input "
                             "rotation is served on unfused Linears only")
        rotation = any(rotated)
        if is_float(scheme):
            return AscendQuantFloatLinearMethod(prefix, norm_bias, rotation)
        if not is_linear(scheme):
            raise ValueError(f"{self.description_file}: key {shards[0] + '.weight'!r} has quant type {scheme!r}, "
                             "which is not a Linear scheme")
        return AscendQuantLinearMethod(self, scheme, prefix, shards, norm_bias, rotation)

    def experts_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for a layer's routed experts: one scheme for all of them, read from each
        expert's `{gate,up,down}.weight` entry (vllm-ascend reads expert 0 only; a layer that
        mixes schemes is refused here rather than served wrong). FLOAT experts: None (vLLM's
        unquantized experts)."""
        from ascend_quant.runtime.vllm.moe import AscendQuantMoEMethod, expert_names

        names = expert_names(layer)
        schemes: dict[str, list[str]] = {}
        for e in range(layer.global_num_experts):
            for name in names:
                key = f"{prefix}.{e}.{name}.weight"
                if key not in self.description:
                    raise ValueError(f"{self.description_file}: no key {key!r} (every expert's {', '.join(names)} "
                                     "need a '.weight' entry, per expert)")
                schemes.setdefault(self.description[key], []).append(key)
        if len(schemes) > 1:
            detail = ", ".join(f"{s} (e.g. {keys[0]!r})" for s, keys in schemes.items())
            raise ValueError(f"{self.description_file}: the experts of {prefix} mix quant types: {detail}; "
                             "one scheme per MoE layer is served (as by vllm-ascend)")
        scheme = next(iter(schemes))
        if is_float(scheme):
            return None
        if not is_linear(scheme):
            raise ValueError(f"{self.description_file}: key {prefix + '.0.' + names[0] + '.weight'!r} has quant type "
                             f"{scheme!r}, which is not a Linear scheme")
        return AscendQuantMoEMethod(self, scheme, prefix, layer.moe_config, names,
                                    route_inside=bool(getattr(layer, "use_grouped_topk", False)))

    def c8_layers(self) -> list[str]:
        """Checkpoint prefixes (e.g. model.layers.3.self_attn) that carry C8 KV-cache scales."""
        return sorted(p for k, v in self.description.items()
                      if is_kv(v) and (p := self.spec.kv_cache_parent(k)) is not None)

    def kv_cache_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The C8 method for an attention layer whose checkpoint has KV-cache scales; None otherwise
        (that layer's cache stays in the model dtype)."""
        from vllm.model_executor.layers.attention import Attention

        if not isinstance(layer, Attention):
            return None
        keys = [f"{self.spec.layer_prefix(prefix)}.{p}.kv_cache_scale" for p in self.spec.kv_projections]
        present = [k in self.description for k in keys]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(f"{self.description_file}: C8 needs both {keys[0]!r} and {keys[1]!r}")
        from ascend_quant.runtime.vllm.attention import AscendC8KVCacheMethod

        if not self._warned_c8:
            self._warned_c8 = True
            serving_log.info("ascend-quant: KV cache int8 (C8) on the %d attention layers with kv_cache_scale in %s "
                        "(others stay in the model dtype)", len(self.c8_layers()), self.description_file)
        return AscendC8KVCacheMethod(self, prefix)

    # ------------------------------------------------------------------ helpers
    def shard_prefixes(self, prefix: str) -> list[str]:
        """Checkpoint prefixes behind a vLLM Linear (q/k/v behind qkv_proj)."""
        parent, _, leaf = prefix.rpartition(".")
        if f"{prefix}.weight" in self.description:     # fused on disk (GLM-4's gate_up_proj, Phi-3's)
            return [prefix]
        members = self.packed_modules_mapping.get(leaf) or self.spec.vllm_fused_members(leaf)
        if not members:
            return [prefix]
        return [f"{parent}.{m}" if parent else m for m in members]

    def norm_bias_key(self, prefix: str) -> str | None:
        for norm, linear in self.spec.norm_consumers().items():
            if prefix.endswith("." + linear):
                key = f"{prefix[: -len(linear)]}{norm}.bias"
                return key if key in self.description else None
        return None

    def layout(self, prefix: str, scheme_name: str) -> tuple[int, bool]:
        """(group size, two-stage?) of the stored Linear `prefix` of a scheme: from the file
        headers, else (no headers) from the description's group_size and keys."""
        scheme = SCHEMES[scheme_name]
        requested = int(self.meta.get("group_size") or 0)
        shapes = self.shapes_of(prefix)
        if "weight" not in shapes:
            two_stage = any(f"{prefix}.{s}" in self.description for s in W4A8_GROUP_TENSORS)
            g = scheme.group_size_for(requested)
            return (g if two_stage or scheme.activation_bits is None else 0), two_stage
        group_size, two_stage = scheme.layout_of(shapes, requested)
        if group_size < 0:
            raise ValueError(f"{prefix}: its scales do not divide its in-features into groups")
        return group_size, two_stage

    def shapes_of(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """suffix -> stored shape of one module's tensors (`weight`, `weight_scale`, ...) from the
        file headers; {} without headers (a description passed in directly)."""
        if self._shapes_by_module is None:
            self._shapes_by_module = {}
            for key, (shape, _) in self.shapes.items():
                module, _, suffix = key.rpartition(".")
                self._shapes_by_module.setdefault(module, {})[suffix] = shape
        return self._shapes_by_module.get(prefix, {})


class AscendQuantAliasConfig(AscendQuantConfig):
    """The same method under `ascend_quant`, for hosts where vllm-ascend owns `ascend`."""

    name = ALIAS_NAME
