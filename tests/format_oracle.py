"""A second, independent reading of ../shared/docs/ascend-format.md: any Ascend checkpoint
simulated in plain transformers, for holding the vLLM method to the document rather than to
itself.

The runtime's reference forward (`ascend_quant.runtime.reference_model`) builds its Linears with
the same code as the vLLM method, so a misreading of the format shared by both would pass every
runtime test. This module imports nothing from `ascend_quant`: it reads the safetensors and the
description JSON itself and writes each formula of the document (section 2) out again in float
arithmetic:

| scheme | weight used by the float Linear | its input | its bias |
|---|---|---|---|
| FLOAT | `W` | `x` | `bias` |
| W8A8 | `w_q * deq_scale[n]` | `x_q = clamp(round(x * bf16(1/s_x) + o_x), -128, 127)` | `quant_bias * deq_scale` (`bias` is folded in) |
| W8A8_DYNAMIC | `w_q * s_w[n]` | `round(x / s_t) * s_t`, `s_t = max_k abs(x[t]) / 127` | `bias` |
| W8A16 | `w_q * s_w[n]` | `x` | `bias` |
| W4A16 | `(w4 - offset[n, k // g]) * s[n, k // g]` (offset: zero points, msModelSlim's sign) | `x` | `bias` |
| W4A8_DYNAMIC | `w4 * s1[n]` or `w4 * bf16(s2[n, k // g]) * bf16(s1[n])` | per token as W8A8_DYNAMIC | `bias` |

plus `norm(x) + b` for a `<norm>.bias` tensor and, with C8, K (after RoPE) and V replaced by
`clamp(round(k / scale), -128, 127) * scale` per channel before attention reads them. Integer
products are exact in float32 at these sizes, so the oracle differs from an integer kernel only
in summation order.

The document says where vllm-ascend rounds a scale to bf16 but not what a float32 model does
there. Those three places are marked "open:" below; the oracle takes the reading the runtime
takes (found by comparing outputs, not by reading its code), so that everything else is held to
the document and the three stay visible decisions rather than silent ones. A fourth "open:"
is W4A16's zero point, whose sign the document does not give (msModelSlim's is taken).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

ATTENTION = "ascend_format_oracle"
# How close a runtime's log-probs must come to the oracle's. The oracle multiplies the same
# integers exactly but sums the scaled products in another order (~1e-7 relative), so a quantizer
# input that close to a rounding boundary lands one int8 step away: worst seen 7e-4 over the vLLM
# test's tokens. The readings the document leaves open ("open:" below) move log-probs by 4e-3 to
# 2e-2, and a 5% error in any one scale tensor by 3e-3 or more, so this still tells them apart.
TOLERANCE = 2e-3
ActQuant = Callable[[torch.Tensor], torch.Tensor]


def load_oracle_model(checkpoint_dir: str | Path) -> PreTrainedModel:
    """The float32 transformers model of `checkpoint_dir`'s config.json whose forward computes what
    the document says the checkpoint means, C8 cache included; eval mode."""
    folder = Path(checkpoint_dir)
    tensors, desc = read_checkpoint(folder)
    config = AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "quantization_config"):     # our marker for vLLM, meaningless to transformers
        del config.quantization_config
    _register_attention()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
    modules = dict(model.named_modules())
    linears = {name for name, m in modules.items() if isinstance(m, torch.nn.Linear)}
    _require_shared_static_input(tensors, desc, linears)
    for name in linears:
        weight, bias, act_quant = dequantized_linear(tensors, desc, name)
        linear = modules[name]
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        # static W8A8 gives a bias (quant_bias * deq_scale) to Linears that had none, e.g. o_proj
        linear.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        if act_quant is not None:
            linear.register_forward_pre_hook(lambda _m, args, q=act_quant: (q(args[0]),) + args[1:])
    float_names = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in linears:
            continue
        if name in float_names:
            state[name] = t.float()
        elif leaf == "bias" and prefix in modules:          # section 1: smoothing's norm bias, norm(x) + b
            modules[prefix].register_forward_hook(lambda _m, _i, out, b=t.float(): out + b)
        else:
            raise ValueError(f"{folder}: tensor {name} has no place in {config.architectures}")
    missing = [k for k in model.load_state_dict(state, strict=False).missing_keys
               if k.rpartition(".")[0] not in linears]
    if missing:
        raise ValueError(f"{folder}: no tensors for {missing}")
    for name, module in modules.items():
        if name.endswith("self_attn") and f"{name}.k_proj.kv_cache_scale" in tensors:
            module.c8_scales = tuple(_c8_scale(tensors, f"{name}.{p}", config) for p in ("k_proj", "v_proj"))
    return model.eval()


def read_checkpoint(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of every *.safetensors file (what vLLM loads, section 1) and the description."""
    descs = sorted(folder.glob("quant_model_description*.json"))
    if not descs:
        raise FileNotFoundError(f"{folder}: no quant_model_description.json")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors, json.loads(descs[0].read_text())


def dequantized_linear(tensors: dict[str, torch.Tensor], desc: dict, prefix: str
                       ) -> tuple[torch.Tensor, torch.Tensor | None, ActQuant | None]:
    """(float weight [n, k], float bias or None, input transform or None) of the Linear `prefix`,
    such that `linear(act_quant(x), weight, bias)` is the document's runtime math for its scheme."""
    qtype = desc[f"{prefix}.weight"]
    t = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    bias = t["bias"].float() if "bias" in t else None
    if qtype == "FLOAT":
        return t["weight"].float(), bias, None
    if qtype == "W8A8":
        # y = (x_q @ w_q^T + quant_bias) * deq_scale: exact integers times deq_scale per channel
        deq = decode_deq_scale(t["deq_scale"])
        weight = t["weight"].float() * deq[:, None]
        return weight, t["quant_bias"].float() * deq, static_quant(t["input_scale"], t["input_offset"])
    if qtype == "W4A16":                                                # per group: scale [n, k/g]
        # open: section 2 lists weight_offset [n, k/g] without its formula; taken as msModelSlim
        # defines it, subtracted from the integer weight before the scale
        w4, scale = unpack_int4(t["weight"]).float(), t["weight_scale"].float()
        offset = t["weight_offset"].float() if "weight_offset" in t else torch.zeros_like(scale)
        per = w4.shape[1] // scale.shape[1]
        return (w4 - offset.repeat_interleave(per, dim=1)) * scale.repeat_interleave(per, dim=1), bias, None
    _require_zero(t, "weight_offset", prefix)
    if qtype == "W8A8_DYNAMIC":
        # open: section 2 has weight_scale "held in bf16 at runtime", i.e. in a bf16 model's dtype;
        # for a float32 model it is taken as stored
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1), bias, per_token_quant
    if qtype == "W8A16":
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1), bias, None
    w4 = unpack_int4(t["weight"]).float()
    scale = t["weight_scale"].float()
    if qtype == "W4A8_DYNAMIC":
        if "weight_scale_second" in t:                                  # two-stage: s2[n, k//g] * s1[n]
            _require_zero(t, "weight_offset_second", prefix)
            # open: section 2 rounds both scales to bf16 for scale_bias (msModelSlim's own
            # scale_bias agrees); the matmul is taken to use the same rounded scales
            s2 = _bf16(t["weight_scale_second"])
            scale = (s2 * _bf16(scale).reshape(-1, 1)).repeat_interleave(w4.shape[1] // s2.shape[1], dim=1)
        return w4 * scale.reshape(w4.shape[0], -1), bias, per_token_quant
    raise ValueError(f"{prefix}.weight: quant type {qtype!r} is not in the format document")


def decode_deq_scale(t: torch.Tensor) -> torch.Tensor:
    """deq_scale as float32: stored as is for bf16 models, as the float32 bit pattern in an int64
    for fp16 models (section 2, W8A8)."""
    if t.dtype == torch.int64:
        return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return t.float()


def static_quant(input_scale: torch.Tensor, input_offset: torch.Tensor) -> ActQuant:
    """npu_quantize as section 3 calls it, with `1/s_x (bf16)`; returns the int8 values (in
    float), not x back, since deq_scale already holds s_x."""
    # open: section 2's "rounds input_scale and its reciprocal to bf16" is read as bf16(1/s_x);
    # bf16(1/bf16(s_x)), what a bf16 model's held scale gives, moves some x_q by one step
    inv = _bf16(1 / input_scale.float())
    offset = input_offset.float()
    return lambda x: torch.clamp(torch.round(x * inv + offset), -128, 127)


def per_token_quant(x: torch.Tensor) -> torch.Tensor:
    """npu_dynamic_quant then the per-token scale applied back: `round(x / s_t) * s_t` with
    `s_t = max|x[t, :]| / 127` (an all-zero token stays zero)."""
    s_t = x.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(s_t > 0, s_t, torch.ones_like(s_t))
    return torch.round(x / safe) * s_t


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [n/2, k] -> int8 [n, k]: row 2j in the low nibble of packed row j, row 2j+1 in the high
    one, both signed (section 2, W4A8_DYNAMIC)."""
    p = packed.to(torch.int8)
    low = torch.bitwise_right_shift(torch.bitwise_left_shift(p, 4), 4)   # arithmetic shift: sign-extends
    high = torch.bitwise_right_shift(p, 4)
    return torch.stack([low, high], dim=1).reshape(-1, p.shape[1])


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to the nearest bf16 and back, as a scale held in bf16 reads."""
    return t.float().to(torch.bfloat16).float()


def c8_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What attention reads back from the int8 cache: `clamp(round(x / scale), -128, 127) * scale`."""
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


def _c8_scale(tensors: dict[str, torch.Tensor], proj: str, config) -> torch.Tensor:
    """kv_cache_scale [num_kv_heads * head_dim], head-major, shaped [heads, 1, head_dim] to meet
    attention's key/value states [batch, heads, tokens, head_dim]."""
    _require_zero({"kv_cache_offset": tensors[f"{proj}.kv_cache_offset"]}, "kv_cache_offset", proj)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return tensors[f"{proj}.kv_cache_scale"].float().reshape(-1, 1, head_dim)


def _c8_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa over K (already rotated by the model) and V as read from a C8 cache, for layers that
    carry scales; plain sdpa elsewhere."""
    scales = getattr(module, "c8_scales", None)
    if scales is not None:
        key, value = c8_fake_quant(key, scales[0]), c8_fake_quant(value, scales[1])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    AttentionInterface.register(ATTENTION, _c8_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _require_shared_static_input(tensors: dict[str, torch.Tensor], desc: dict, linears: set[str]) -> None:
    """Section 1: shards fused by vLLM (q/k/v, gate/up) keep one static input scale and offset, so a
    checkpoint whose shards disagree has no single meaning."""
    for name in linears:
        for first, rest in (("q_proj", ("k_proj", "v_proj")), ("gate_proj", ("up_proj",))):
            if not name.endswith("." + first) or desc.get(f"{name}.weight") != "W8A8":
                continue
            for sibling in (name[: -len(first)] + r for r in rest):
                for key in ("input_scale", "input_offset"):
                    if not torch.equal(tensors[f"{name}.{key}"], tensors[f"{sibling}.{key}"]):
                        raise ValueError(f"{name}.{key} != {sibling}.{key}: fused shards need one static {key}")


def _require_zero(t: dict[str, torch.Tensor], key: str, prefix: str) -> None:
    """The document defines only the symmetric forms (W8A16, W4A8, C8 offsets must be zero)."""
    if key in t and t[key].any():
        raise ValueError(f"{prefix}.{key}: non-zero offsets have no runtime meaning in the format document")
