"""The schemes of the Ascend checkpoint format, one file each, and the registry.

    scheme = get_scheme("W8A8_DYNAMIC")            # or a CLI spelling: get_scheme("w8a8-dynamic")
    specs = scheme.tensor_specs(n, k)              # suffix -> TensorSpec (dtype, shape, vLLM kind)
    tensors = scheme.pack(quantized_linear, torch.bfloat16)
    linear = scheme.prepare(tensors, backend)      # then linear(x, bias)

Names are exactly the strings of `quant_model_description.json`. A new scheme is one new file
with a `SCHEME`, added to `_MODULES`; nothing outside this package compares a scheme name.
"""

from __future__ import annotations

from ascend_quant.schemes import c8, unquantized, w4a8_dynamic, w4a16, w8a8, w8a8_dynamic, w8a16
from ascend_quant.schemes.base import (
    INPUT_ROTATION, PARAM_KINDS, PreparedLinear, QuantizedLinear, Scheme, SchemeError, TensorSpec, WeightOnlyScheme,
)

_MODULES = (w8a8, w8a8_dynamic, w8a16, w4a16, w4a8_dynamic, c8, unquantized)
SCHEMES: dict[str, Scheme] = {m.SCHEME.name: m.SCHEME for m in _MODULES}
W8A8, W8A8_DYNAMIC, W8A16, W4A16, W4A8_DYNAMIC, C8, FLOAT = (m.SCHEME for m in _MODULES)

# Command-line spellings -> scheme names (C8 is asked for with --kv-cache int8).
CLI_NAMES: dict[str, str] = {s.cli_name: s.name for s in SCHEMES.values() if s.cli_name}
# Schemes our runtime serves as quantized Linears (FLOAT stays a plain Linear).
LINEAR_SCHEMES: tuple[str, ...] = tuple(s.name for s in SCHEMES.values() if s.linear)
KV_SUFFIXES = c8.KV_SUFFIXES
W4A8_GROUP_TENSORS = w4a8_dynamic.SECOND_STAGE


def get_scheme(name: str) -> Scheme:
    """The scheme called `name` (description-file spelling or CLI spelling)."""
    key = CLI_NAMES.get(name.lower(), name)
    try:
        return SCHEMES[key]
    except KeyError:
        raise KeyError(f"unknown quant type {name!r} (known: {', '.join(SCHEMES)})") from None


def is_float(qtype: str | None) -> bool:
    return qtype == FLOAT.name


def is_kv(qtype: str | None) -> bool:
    return qtype in SCHEMES and SCHEMES[qtype].kv_cache


def is_linear(qtype: str | None) -> bool:
    """A quantized-Linear type (its `.weight` is integer)."""
    return qtype in SCHEMES and SCHEMES[qtype].linear


def matching(weight_bits: int, activation_mode: str) -> Scheme | None:
    """The Linear scheme with these weight bits and activation mode ("static", "dynamic",
    "none"), if the format has one (convert maps other formats' schemes with it)."""
    return next((s for s in SCHEMES.values()
                 if s.linear and s.weight_bits == weight_bits and s.activation_mode == activation_mode), None)


def more_precise(fallback: str, scheme: str) -> bool:
    """Whether `fallback` keeps more of a Linear than `scheme`: more weight bits, or as many
    and more activation bits (float counts as more than any; W8A8_DYNAMIC beats W4A16, whose
    int4 weights lose far more than per-token int8 activations do; FLOAT beats everything)."""
    a, b = SCHEMES[fallback], SCHEMES[scheme]
    if not (a.linear or a.name == FLOAT.name):
        return False
    def bits(x):
        return float("inf") if x is None else x
    return (bits(a.weight_bits), bits(a.activation_bits)) > (bits(b.weight_bits), bits(b.activation_bits))


def checkpoint_entries(ql: QuantizedLinear, prefix: str, model_dtype) -> dict[str, tuple]:
    """Every checkpoint tensor of one quantized Linear: name -> (tensor, description type);
    its float bias, if any, is FLOAT (static W8A8 also folds it into quant_bias)."""
    scheme = SCHEMES[ql.scheme]
    out = {f"{prefix}.{suffix}": (t, scheme.name) for suffix, t in scheme.pack(ql, model_dtype).items()}
    if ql.bias is not None:
        out[f"{prefix}.bias"] = (ql.bias.float(), FLOAT.name)
    return out


def kv_entries(prefix: str, scale) -> dict[str, tuple]:
    """The C8 tensors of one K or V projection: name -> (tensor, description type)."""
    return {f"{prefix}.{suffix}": (t, C8.name) for suffix, t in C8.pack_kv(scale).items()}


__all__ = ["INPUT_ROTATION", "Scheme", "TensorSpec", "QuantizedLinear", "PreparedLinear", "WeightOnlyScheme", "SchemeError",
           "PARAM_KINDS", "SCHEMES", "CLI_NAMES", "LINEAR_SCHEMES", "KV_SUFFIXES", "W4A8_GROUP_TENSORS",
           "W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC", "C8", "FLOAT",
           "get_scheme", "matching", "more_precise", "is_float", "is_kv", "is_linear", "checkpoint_entries", "kv_entries"]
