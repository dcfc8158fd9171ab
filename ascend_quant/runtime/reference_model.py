"""The exact reference forward of an Ascend checkpoint, outside vLLM.

`load_reference_model(dir)` builds the transformers model named by the checkpoint's
config.json and swaps every quantized Linear for a module that computes the reference
kernels from the stored tensors (each scheme's `prepare`/`forward` in `ascend_quant.schemes`, reference backend). FLOAT
tensors load as they are; RMSNorm `.bias` tensors left by smoothing are added after the norm;
a Linear with `input_rotation` signs reads x·Q (RotatedInput);
with `kv_cache=True` the C8 scales fake-quantize post-RoPE keys and values per channel.
The evaluation's quantized perplexity and the vLLM tests compare against this model.
MoE layers run per-expert Linears (arch/moe.py: each expert through its scheme, the router
FLOAT, the eager routing); checkpoint names are mapped to module names by the spec
(Mixtral's `block_sparse_moe` is `mlp` in memory). Layers stored after the model's own
(DeepSeek-V3's MTP layers) are not part of the forward and are left out.

Speed: weight-only schemes (W8A16, W4A16) precompute the dequantized weight once and run a
float matmul; int8 x int8 products use `torch._int_mm` (exact int32 accumulation) with the
float32 epilogue of the format, so the result is exact without float64.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ascend_quant import numerics
from ascend_quant.formats.ascend import CheckpointError, read_checkpoint
from ascend_quant.arch import ArchSpec, replace_experts, spec_for_config
from ascend_quant.arch.attention import install_attention_hook
from ascend_quant.runtime.kernels import backend as kernel_backend
from ascend_quant.schemes import INPUT_ROTATION, LINEAR_SCHEMES, PreparedLinear, is_float, is_kv


class ReferenceQuantLinear(nn.Module):
    """A Linear computed by its scheme (`PreparedLinear`) (its float `bias`, if any, is passed along; W8A8
    ignores it because it is folded into quant_bias)."""

    def __init__(self, qlinear: PreparedLinear, bias: torch.Tensor | None, prefix: str):
        super().__init__()
        self.qlinear = qlinear
        self.prefix = prefix
        self.in_features, self.out_features = qlinear.k, qlinear.n
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qlinear(x, self.bias)

    def extra_repr(self) -> str:
        return f"{self.qlinear.scheme.name}, in={self.in_features}, out={self.out_features}"


class NormWithBias(nn.Module):
    """`norm(x) + bias`: an RMSNorm carrying the bias that smoothing moved into it."""

    def __init__(self, norm: nn.Module, bias: torch.Tensor):
        super().__init__()
        self.norm = norm
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.bias.to(x.dtype)


class RotatedInput(nn.Module):
    """`linear(x·Q)`: a Linear stored with an online input rotation (its weight holds w·Q; Q
    from the `input_rotation` signs, `numerics.input_rotation`), computed in float32."""

    def __init__(self, linear: nn.Module, signs: torch.Tensor):
        super().__init__()
        self.linear = linear
        factors = numerics.rotation_factors(signs.numel())
        if factors is None:
            raise CheckpointError(f"no Hadamard matrix of order {signs.numel()} for an input_rotation")
        self.register_buffer("signs", signs.float(), persistent=False)
        for i, f in enumerate(factors):                   # buffers: they follow the model's device
            self.register_buffer(f"factor{i}", f.float(), persistent=False)
        self.n_factors = len(factors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factors = tuple(getattr(self, f"factor{i}") for i in range(self.n_factors))
        return self.linear(numerics.rotate_activation(x.float(), self.signs, factors).to(x.dtype))


def _set_module(model: nn.Module, prefix: str, module: nn.Module) -> None:
    parent_name, _, leaf = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def load_reference_model(ckpt_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, *,
                         kv_cache: bool = False, backend: str = "reference") -> nn.Module:
    """A transformers causal LM computing the checkpoint's exact quantized forward (eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = read_checkpoint(ckpt_dir)
    if ckpt.config is None:
        raise CheckpointError(f"{ckpt.path}: no config.json; the reference model needs the architecture")
    config = AutoConfig.from_pretrained(str(ckpt.path))
    # an attention logit softcap (Gemma-2) exists only in transformers' eager attention (sdpa
    # drops it); vLLM applies it, so the reference does too
    softcap = getattr(getattr(config, "text_config", config), "attn_logit_softcapping", None)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **({"attn_implementation": "eager"} if softcap else {}))
    model.eval()
    spec = spec_for_config(ckpt.config)
    replace_experts(model, spec)
    tensors = {spec.from_disk(n): t for n, t in ckpt.tensors().items()}
    b = kernel_backend(backend)
    # layers stored after the model's own (MTP) have no module here: not loaded
    modules = {spec.from_disk(p): m for p, m in ckpt.modules().items()
               if not spec.is_extra_layer(p, ckpt.config)}
    float_state: dict[str, torch.Tensor] = {}
    norm_biases: dict[str, torch.Tensor] = {}
    kv_scales: dict[str, torch.Tensor] = {}
    rotations: dict[str, torch.Tensor] = {}
    for prefix, mod in modules.items():
        scheme = mod.weight_scheme
        if INPUT_ROTATION in mod.suffixes:    # an online input rotation, whatever the Linear's scheme
            rotations[prefix] = tensors[f"{prefix}.{INPUT_ROTATION}"]
        for suffix in mod.suffixes:           # C8 scales sit on the K/V projections, quantized or not
            if is_kv(mod.scheme_of(suffix)):
                kv_scales[f"{prefix}.{suffix}"] = tensors[f"{prefix}.{suffix}"]
        if scheme in LINEAR_SCHEMES:
            suffixes = mod.schemes[scheme]
            t = {s: tensors[f"{prefix}.{s}"] for s in suffixes}
            bias = tensors.get(f"{prefix}.bias")
            ql = PreparedLinear.build(scheme, t, backend=b, dtype=dtype)
            _set_module(model, prefix, ReferenceQuantLinear(ql, bias, prefix))
            continue
        for suffix in mod.suffixes:
            name = f"{prefix}.{suffix}"
            if is_kv(mod.scheme_of(suffix)) or suffix == INPUT_ROTATION:
                continue
            if scheme is not None and not is_float(scheme):
                raise CheckpointError(f"{ckpt.description_file}: {prefix}.weight has quant type {scheme!r}, "
                                      "which the reference model does not serve")
            target = model.get_submodule(prefix) if prefix else model
            if suffix == "bias" and not isinstance(target, nn.Linear) and not hasattr(target, "bias"):
                norm_biases[prefix] = tensors[name].to(dtype)      # smoothing left a norm bias
            else:
                float_state[name] = tensors[name]
    missing, unexpected = model.load_state_dict(float_state, strict=False)
    if unexpected:
        raise CheckpointError(f"{ckpt.path}: tensors the model has no place for: {unexpected[:5]}")
    replaced = {n for n, m in model.named_modules() if isinstance(m, ReferenceQuantLinear)}
    missing = [m for m in missing if m.rpartition(".")[0] not in replaced]
    if getattr(config, "tie_word_embeddings", False):
        missing = [m for m in missing if m != "lm_head.weight"]
        model.tie_weights()
    if missing:
        raise CheckpointError(f"{ckpt.description_file}: no tensor for {missing[:5]} (every parameter of "
                              "the model needs a description entry)")
    for prefix, bias in norm_biases.items():
        _set_module(model, prefix, NormWithBias(model.get_submodule(prefix), bias))
    for prefix, signs in rotations.items():
        _set_module(model, prefix, RotatedInput(model.get_submodule(prefix), signs))
    if kv_cache and kv_scales:
        enable_c8_simulation(model, kv_scales, spec)
    return model


def enable_c8_simulation(model: nn.Module, kv_scales: dict[str, torch.Tensor], spec: ArchSpec) -> None:
    """Fake-quantize post-RoPE K and V per channel with each layer's C8 scale, as the int8
    cache would store them: `k = clamp(round(k / s), -128, 127) * s`, s indexed h * head_dim + d."""
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in kv_scales.items():
        if not name.endswith(".kv_cache_scale"):
            continue
        projection = name.rpartition(".")[0]
        by_layer.setdefault(spec.layer_index(name), {})[spec.kv_role(projection)] = t.float()

    def fake_quant(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        _, heads, _, head_dim = t.shape
        s = scale.reshape(1, heads, 1, head_dim)
        return numerics.dequantize(numerics.quantize(t, s, 8), s).to(t.dtype)

    def hook(module, key, value):
        scales = by_layer.get(module.layer_idx)
        if not scales:
            return None
        return fake_quant(key, scales["k"]), fake_quant(value, scales["v"])

    install_attention_hook(model, hook)
