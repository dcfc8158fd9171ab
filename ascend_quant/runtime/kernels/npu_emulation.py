"""A stand-in `torch_npu` module for CPU tests: the five ops the NPU backend calls, computed
with the arithmetic ascend-format.md documents for them, so that the backend's wiring
(transposes, int32-packed int4, encoded deq_scale, which argument goes where) runs on a CPU.

    with installed():          # puts this module into sys.modules["torch_npu"]
        y = NpuBackend().int8_matmul(...)

It checks the argument conventions the real ops enforce (dtypes and shapes) and raises on a
mismatch; it is not a performance model, and it knows nothing the format page does not say.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from ascend_quant import numerics


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """A layout change only (ND -> FRACTAL_NZ is 29): the values are unchanged."""
    assert acl_format in (2, 29), acl_format
    return tensor


def npu_quantize(x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 dtype, axis: int = -1, div_mode: bool = True) -> torch.Tensor:
    """div_mode False: `clamp(round(x * scales + zero_points), -128, 127)` as int8, with
    scales/zero_points given per element of the last axis ([k])."""
    assert dtype == torch.qint8 and axis == -1
    assert scales.shape == (x.shape[-1],), f"npu_quantize scales must be [k], got {tuple(scales.shape)}"
    if div_mode:
        q = x.float() / scales.float()
    else:
        q = x.float() * scales.float()
    if zero_points is not None:
        assert zero_points.shape == scales.shape
        q = q + zero_points.float()
    return torch.clamp(torch.round(q), -128, 127).to(torch.int8)


def npu_dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: `s = max|x[t]| / 127`, `x_q = round(x / s)`; s is [tokens]."""
    absmax = x.float().abs().amax(-1)
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.clamp(torch.round(x.float() / scale.unsqueeze(-1)), -128, 127).to(torch.int8)
    return q, scale


def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset=None,
                     pertoken_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """int8 x1 [m, k] @ int8 x2 [k, n] accumulated in int32; `scale` [n] (or [1]) is float32,
    bf16, or int64 holding float32 bits; an int32 bias is added to the accumulator, a float
    bias after scaling; `pertoken_scale` [m] multiplies rows."""
    assert x1.dtype == torch.int8 and x2.dtype == torch.int8, (x1.dtype, x2.dtype)
    assert x1.shape[-1] == x2.shape[0], f"npu_quant_matmul: x1 {tuple(x1.shape)} x2 {tuple(x2.shape)} (x2 is [k, n])"
    n = x2.shape[1]
    assert scale.shape in ((n,), (1,)), f"scale must be [n] or [1], got {tuple(scale.shape)}"
    if output_dtype == torch.bfloat16:
        assert scale.dtype in (torch.float32, torch.bfloat16), "bf16 output takes a float32/bf16 scale"
    elif scale.dtype == torch.float32 and pertoken_scale is None:
        raise TypeError("npu_quant_matmul: fp16 output without pertoken_scale needs an int64 deq_scale")
    acc = (x1.double() @ x2.double()).to(torch.int64)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    s = numerics.decode_deq_scale(scale) if scale.dtype == torch.int64 else scale.float()
    y = acc.float() * s
    if pertoken_scale is not None:
        assert pertoken_scale.shape == (x1.shape[0],), f"pertoken_scale must be [m], got {tuple(pertoken_scale.shape)}"
        y = y * pertoken_scale.float().unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype or torch.float16)


def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset: torch.Tensor | None = None, quant_scale=None,
                                 quant_offset=None, bias: torch.Tensor | None = None,
                                 antiquant_group_size: int = 0) -> torch.Tensor:
    """`x @ ((w + antiquant_offset) * antiquant_scale) + bias` with w int8 [k, n] or int4 as
    int32 [k, n/8]; scale/offset [n] per channel or [k/g, n] per group, in x's dtype."""
    assert antiquant_scale.dtype == x.dtype, "antiquant_scale must have x's dtype"
    k = x.shape[-1]
    if weight.dtype == torch.int32:
        w = numerics.npu_int32_to_int4(weight).t().float()        # [k, n]
    else:
        assert weight.dtype == torch.int8
        w = weight.float()
    assert w.shape[0] == k, f"weight must be [k, n]: k={k}, weight {tuple(weight.shape)}"
    n = w.shape[1]

    def expand(t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        if antiquant_group_size:
            assert t.shape == (k // antiquant_group_size, n), f"per-group antiquant tensors are [k/g, n]: {tuple(t.shape)}"
            return t.repeat_interleave(antiquant_group_size, dim=0)
        assert t.numel() == n, f"per-channel antiquant tensors are [n]: {tuple(t.shape)}"
        return t.reshape(1, n)

    if antiquant_offset is not None:
        w = w + expand(antiquant_offset)
    w = w * expand(antiquant_scale)
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def module() -> types.ModuleType:
    """This emulation as a module object named `torch_npu`."""
    mod = types.ModuleType("torch_npu")
    mod.__doc__ = __doc__
    for name in ("npu_format_cast", "npu_quantize", "npu_dynamic_quant", "npu_quant_matmul",
                 "npu_weight_quant_batchmatmul"):
        setattr(mod, name, globals()[name])
    mod.ASCEND_QUANT_EMULATION = True
    return mod


@contextlib.contextmanager
def installed():
    """Put the emulation into sys.modules['torch_npu'] for the duration of a block."""
    saved = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = module()
    try:
        yield sys.modules["torch_npu"]
    finally:
        if saved is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved
