"""One interface per operation of the Ascend format, with a backend chosen by device.

    x_q = quantize_static(x, input_scale, input_offset)           # W8A8 activations
    x_q, s_t = quantize_dynamic(x)                                 # per-token int8
    y = int8_matmul(x_q, w_q, scale, pertoken_scale=s_t, quant_bias=qb, bias=b)
    y = weight_only_matmul(x, w_int, scale, offset, bits=4)        # W8A16 / W4A16 / int4

Backends (one file each): `npu` (torch_npu, §3 of ascend-format.md), `cuda` (CUTLASS or
`torch._int_mm`), `cpu` (`torch._int_mm`, vLLM's oneDNN ops on VNNI CPUs) and `reference`
(the exact format arithmetic through `ascend_quant.numerics`). Each answers
`can_implement(op, **cfg) -> (ok, reason)`; `get_backend` takes the first that accepts
and, when none does, raises one error listing every rejection. The environment variable
`ASCEND_QUANT_KERNEL_BACKEND` (npu, cuda, cpu, reference) forces a choice, and
`ASCEND_QUANT_CPU_GEMM` (onednn, f32, int_mm) the int8 GEMM of the cpu backend and
`ASCEND_QUANT_CPU_ISA` (avx512, avx2, off) its GEMV kernel for small batches.

Layer code prepares weights once (`backend.prepare_int8`, `backend.prepare_weight_only`)
and calls the backend's methods; the module-level functions below prepare on every call
and are meant for tests and one-off use.
"""

from __future__ import annotations

import os

import torch

from ascend_quant.runtime.kernels.cpu import GEMM_ENV, ISA_ENV, OP_ENV, CpuBackend
from ascend_quant.runtime.kernels.cuda import CudaBackend
from ascend_quant.runtime.kernels.npu import NpuBackend
from ascend_quant.runtime.kernels.reference import ReferenceBackend

BACKENDS = {"npu": NpuBackend, "cuda": CudaBackend, "cpu": CpuBackend, "reference": ReferenceBackend}
# Which backends to try, in order, for a device type.
PREFERENCE = {"npu": ("npu",), "cuda": ("cuda", "reference"), "cpu": ("cpu", "reference")}
ENV_VAR = "ASCEND_QUANT_KERNEL_BACKEND"

_instances: dict[tuple[str, str], object] = {}


def backend(name: str):
    """The (shared) backend object called `name` (one per setting of the CPU GEMM, ISA and operator switches)."""
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}/backend: unknown kernel backend {name!r} (known: {', '.join(BACKENDS)})")
    key = (name, os.environ.get(GEMM_ENV, ""), os.environ.get(ISA_ENV, ""), os.environ.get(OP_ENV, ""))
    if key not in _instances:
        _instances[key] = BACKENDS[name]()
    return _instances[key]


def get_backend(device: torch.device | str = "cpu", op: str = "any", **cfg):
    """The first backend for `device` that can implement `op` with `cfg`; one error naming
    every rejection when none can."""
    device = torch.device(device)
    forced = os.environ.get(ENV_VAR)
    names = (forced,) if forced else PREFERENCE.get(device.type, ("reference",))
    reasons = []
    for name in names:
        b = backend(name)
        ok, reason = b.can_implement(op, device=device, **cfg)
        if ok:
            return b
        reasons.append(reason or f"{name}: rejected")
    raise RuntimeError(f"no kernel backend can run {op} on {device}: " + "; ".join(reasons))


def quantize_static(x, input_scale, input_offset, *, backend_=None):
    """int8 `clamp(round(x * bf16(1/input_scale) + bf16(input_offset)), -128, 127)`."""
    b = backend_ or get_backend(x.device, "quantize_static")
    return b.quantize_static(x, input_scale, input_offset)


def quantize_dynamic(x, *, backend_=None):
    """(int8 x_q, float32 per-token scale [..., 1]) with `s_t = max|x_t| / 127`."""
    b = backend_ or get_backend(x.device, "quantize_dynamic")
    return b.quantize_dynamic(x)


def int8_matmul(x_q, weight, scale, *, pertoken_scale=None, quant_bias=None, bias=None,
                out_dtype=torch.float32, backend_=None):
    """`((x_q @ weight^T + quant_bias) * scale[n]) * pertoken_scale[t] + bias`.

    x_q int8 [..., k]; weight int8 [n, k] (int4 values allowed); scale float32 [n] or [n, 1];
    quant_bias int32 [n]; bias float [n]."""
    b = backend_ or get_backend(x_q.device, "int8_matmul", n=weight.shape[0], k=weight.shape[1])
    return b.int8_matmul(x_q, b.prepare_int8(weight, scale), pertoken_scale=pertoken_scale,
                         quant_bias=quant_bias, bias=bias, out_dtype=out_dtype)


def weight_only_matmul(x, weight, scale, offset=None, *, bits=8, bias=None, backend_=None):
    """`x @ ((weight - offset) * scale)^T + bias` (msModelSlim's offset sign).

    weight: integer values in int8 [n, k] (int4 unpacked); scale/offset [n, 1] or [n, k/g]."""
    b = backend_ or get_backend(x.device, "weight_only_matmul", bits=bits, n=weight.shape[0])
    return b.weight_only_matmul(x, b.prepare_weight_only(weight, scale, offset, bits, x.dtype), bias=bias)


__all__ = ["backend", "get_backend", "quantize_static", "quantize_dynamic", "int8_matmul",
           "weight_only_matmul", "BACKENDS", "ENV_VAR"]
