"""Value checks on single tensors of an Ascend checkpoint, shared by `verify` and the loaders.

A header can be perfect and the numbers still unusable: nothing fails at load when a scale
is NaN, infinite, zero or negative; the NPU (and our CPU kernels) multiply by it, and every
output of the layer turns into NaN or noise with no error anywhere. So the rules live here,
once, keyed by the tensor's suffix, for `verify` (which reads the files) and for the vLLM
method (which sees the loaded parameters) to apply alike:

| suffix | rule |
|---|---|
| weight_scale, weight_scale_second, input_scale, kv_cache_scale (k/v_cache_scale in vLLM) | finite and > 0 |
| deq_scale | the same, after decoding (int64 holds float32 bits, and nothing above them) |
| input_offset | finite, integral, in [-128, 127] (an int8 zero point) |
| quant_bias | int32 (a float one must at least be finite) |
| input_rotation | +1 / -1 signs, as many as a Hadamard order here (an online input rotation) |
| any other floating-point tensor (FLOAT weights, offsets, scale_bias, biases) | finite |

Integer weights (int8, packed int4) hold no invalid byte; their shapes are `verify`'s business.
"""

from __future__ import annotations

from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from ascend_quant import numerics
from ascend_quant.formats.ascend import Checkpoint
from ascend_quant.schemes import INPUT_ROTATION, is_float

SCALE_SUFFIXES = frozenset({"weight_scale", "weight_scale_second", "input_scale", "deq_scale",
                            "kv_cache_scale", "k_cache_scale", "v_cache_scale"})
_INT64_FLOAT_BITS = (-(1 << 31), (1 << 32) - 1)   # sign-extended or unsigned float32 bit patterns


def tensor_problems(name: str, qtype: str | None, tensor: torch.Tensor) -> list[str]:
    """What is wrong with the values of one tensor, as lines that start with `name`; [] if nothing.

    `name` is the checkpoint key or a vLLM parameter name (only its last dotted part, the
    suffix, picks the rule); `qtype` is its quant type from the description (None if unknown),
    used in the messages. `tensor` is read as stored: a deq_scale may be either encoding.
    """
    suffix = name.rpartition(".")[2]
    what = f"{qtype} {suffix}" if qtype and not is_float(qtype) else suffix
    if suffix == "deq_scale" and tensor.dtype == torch.int64:
        outside = (tensor < _INT64_FLOAT_BITS[0]) | (tensor > _INT64_FLOAT_BITS[1])
        if bool(outside.any()):
            return [_line(name, tensor, {"non-float32": outside},
                          "an int64 deq_scale holds the 32 bits of a float32 scale")]
        tensor = numerics.decode_deq_scale(tensor)
    if suffix in SCALE_SUFFIXES:
        return _scale_problems(name, what, tensor)
    if suffix == "quant_bias" and not tensor.is_floating_point():
        return [] if tensor.dtype == torch.int32 else [f"{name} is {_dtype(tensor)}; quant_bias must be int32"]
    if suffix == "input_offset":
        return _zero_point_problems(name, tensor)
    if suffix == INPUT_ROTATION:
        if not bool(torch.all(tensor.abs() == 1)):
            return [f"{name} holds values other than +1 and -1"]
        if numerics.hadamard_parts(tensor.numel()) is None:
            return [f"{name}: no Hadamard matrix of order {tensor.numel()} (2^a times a Paley order)"]
        return []
    if tensor.is_floating_point():
        return _finite_problems(name, tensor)
    return []


def reads_values(name: str, dtype: torch.dtype) -> bool:
    """Whether `tensor_problems` needs the data of this tensor (integer weights are skipped
    unread: they are the bulk of a checkpoint's bytes and hold no invalid value)."""
    suffix = name.rpartition(".")[2]
    return dtype.is_floating_point or suffix in SCALE_SUFFIXES or suffix in ("deq_scale", "quant_bias",
                                                                             "input_offset")


def checkpoint_value_problems(ckpt: Checkpoint) -> Iterator[str]:
    """`tensor_problems` over a whole checkpoint, each line prefixed with the file's name.

    Tensors are read one at a time through safe_open (memory stays at one tensor, however
    large the checkpoint), and only those `reads_values` asks for.
    """
    for file in ckpt.weight_files:
        names = [n for n, f in ckpt.tensor_files.items() if f == file and reads_values(n, ckpt.infos[n].dtype)]
        if not names:
            continue
        try:
            with safe_open(str(file), "pt") as f:
                for name in names:
                    for problem in tensor_problems(name, ckpt.description.get(name), f.get_tensor(name)):
                        yield f"{file.name}: {problem}"
        except (SafetensorError, OSError) as e:
            yield f"{file.name}: tensor data unreadable ({' '.join(str(e).split())})"


# ------------------------------------------------------------------------ rules

def _scale_problems(name: str, what: str, tensor: torch.Tensor) -> list[str]:
    values = tensor.double()
    kinds = {"NaN": values.isnan(), "Inf": values.isinf(), "zero": values == 0, "negative": values < 0}
    if not any(bool(mask.any()) for mask in kinds.values()):
        return []
    return [_line(name, tensor, kinds, f"a {what} must be finite and > 0")]


def _zero_point_problems(name: str, tensor: torch.Tensor) -> list[str]:
    values = tensor.double()
    finite = values.isfinite()
    kinds = {"NaN": values.isnan(), "Inf": values.isinf(),
             "non-integral": finite & (values != values.round()),
             "out-of-range": finite & ((values < numerics.INT8_MIN) | (values > numerics.INT8_MAX))}
    if not any(bool(mask.any()) for mask in kinds.values()):
        return []
    return [_line(name, tensor, kinds, "input_offset is an int8 zero point (an integer in [-128, 127])")]


def _finite_problems(name: str, tensor: torch.Tensor) -> list[str]:
    values = tensor if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) \
        else tensor.double()
    if bool(values.isfinite().all()):
        return []
    return [_line(name, tensor, {"NaN": values.isnan(), "Inf": values.isinf()}, "values must be finite")]


def _line(name: str, tensor: torch.Tensor, kinds: dict[str, torch.Tensor], why: str) -> str:
    """`name has 2 NaN, 1 zero value(s) of 128 (first at [5, 0]: nan); why`: counts per kind
    and the first bad element, so a reader can find it without a debugger."""
    found = {kind: int(mask.sum()) for kind, mask in kinds.items() if bool(mask.any())}
    bad = torch.zeros_like(next(iter(kinds.values())))
    for mask in kinds.values():
        bad |= mask
    index = torch.nonzero(bad)[0].tolist() if tensor.dim() else []
    value = tensor[tuple(index)] if index else tensor.reshape(-1)[0]
    counts = ", ".join(f"{n} {kind}" for kind, n in found.items())
    where = f"first at {index}: {value.item()!r}" if index else f"value {value.item()!r}"
    return f"{name} has {counts} value(s) of {tensor.numel()} ({where}); {why}"


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")
