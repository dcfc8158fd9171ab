"""The NPU backend: the torch_npu calls of ascend-format.md §3, with their argument conventions.

Weights are transposed to [k, n] once (and cast to FRACTAL_NZ where asked: a layout change
only); int4 weights travel as int32 [k, n/8]; the static activation scale is the bf16-rounded
reciprocal, repeated to k, with the offset likewise; deq_scale is int64 (float32 bits) for
fp16 output and float32 for bf16 output. `torch_npu` is imported lazily, so on a machine
without it the tests install `npu_emulation` into `sys.modules` and exercise this wiring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_quant import numerics

ACL_FORMAT_FRACTAL_NZ = 29


def _torch_npu():
    import torch_npu  # noqa: PLC0415  (only on Ascend hosts, or the emulation in tests)
    return torch_npu


@dataclass
class NpuInt8Weight:
    weight_t: torch.Tensor      # int8 [k, n]
    scale: torch.Tensor         # float32 [n] (encoded per output dtype at call time)


@dataclass
class NpuWeightOnly:
    weight_t: torch.Tensor                  # int8 [k, n] or int32 [k, n/8] (int4)
    scale: torch.Tensor                     # float32 [n] or [k/g, n]
    offset: torch.Tensor | None             # the NPU's additive offset (= -msModelSlim offset)
    group_size: int


class NpuBackend:
    name = "npu"

    def __init__(self, nz: bool = False):
        self.nz = nz        # cast weights to FRACTAL_NZ (faster on the NPU)

    def can_implement(self, op: str, **cfg) -> tuple[bool, str]:
        try:
            _torch_npu()
        except ImportError:
            return False, "npu backend: torch_npu is not installed"
        device = cfg.get("device", "npu")
        if torch.device(device).type not in ("npu", "cpu") and not cfg.get("emulated"):
            return False, f"npu backend: tensors are on {device}"
        if op == "weight_only_matmul" and cfg.get("bits") == 4 and cfg.get("n", 8) % 8:
            return False, "npu backend: int4 weights need out-features divisible by 8"
        return True, ""

    def _maybe_nz(self, w: torch.Tensor) -> torch.Tensor:
        return _torch_npu().npu_format_cast(w, ACL_FORMAT_FRACTAL_NZ) if self.nz else w

    # ---------------------------------------------------------------- activations
    def quantize_static(self, x, input_scale, input_offset):
        k = x.shape[-1]
        inv = (1.0 / input_scale.float().reshape(1)).to(torch.bfloat16).repeat(k)
        offset = input_offset.float().reshape(1).to(torch.bfloat16).repeat(k)
        return _torch_npu().npu_quantize(x, inv, offset, torch.qint8, -1, False)

    def quantize_dynamic(self, x):
        x_q, scale = _torch_npu().npu_dynamic_quant(x)
        return x_q, scale.reshape(*x.shape[:-1], 1)

    # ---------------------------------------------------------------- int8 x int8
    def prepare_int8(self, weight, scale):
        return NpuInt8Weight(self._maybe_nz(weight.to(torch.int8).t().contiguous()), scale.float().reshape(-1))

    def int8_matmul(self, x_q, w, *, pertoken_scale=None, quant_bias=None, bias=None, out_dtype=torch.float32):
        npu = _torch_npu()
        lead = x_q.shape[:-1]
        x2 = x_q.reshape(-1, x_q.shape[-1])
        if pertoken_scale is None:
            # static W8A8: deq_scale encoded for the output dtype, int32 quant_bias
            deq = numerics.encode_deq_scale(w.scale, torch.bfloat16 if out_dtype == torch.bfloat16
                                            else torch.float16)
            y = npu.npu_quant_matmul(x2, w.weight_t, deq, bias=None if quant_bias is None
                                     else quant_bias.to(torch.int32), output_dtype=out_dtype)
            if bias is not None:
                y = y + bias.to(y.dtype)
        else:
            scale = w.scale.to(torch.bfloat16) if out_dtype == torch.bfloat16 else w.scale
            assert quant_bias is None, "dynamic int8 matmul takes a float bias"
            y = npu.npu_quant_matmul(x2, w.weight_t, scale, pertoken_scale=pertoken_scale.float().reshape(-1),
                                     bias=None if bias is None else bias.to(scale.dtype), output_dtype=out_dtype)
        return y.reshape(*lead, -1)

    # ---------------------------------------------------------------- weight-only
    def prepare_weight_only(self, weight, scale, offset, bits, dtype=torch.bfloat16):
        n, k = weight.shape
        groups = scale.shape[-1]
        group_size = 0 if groups == 1 else k // groups
        if bits == 4:
            w = numerics.int4_to_npu_int32(weight)          # int32 [k, n/8]
        else:
            w = weight.to(torch.int8).t().contiguous()      # int8 [k, n]
        # per-channel: [n]; per-group: [k/g, n]
        s = scale.float().reshape(n) if groups == 1 else scale.float().t().contiguous()
        o = None
        if offset is not None and torch.any(offset != 0):
            # the NPU adds its offset ((w + o) * s); msModelSlim's is subtracted: negate it here
            o = -(offset.float().reshape(n) if groups == 1 else offset.float().t().contiguous())
        return NpuWeightOnly(self._maybe_nz(w), s.to(dtype), None if o is None else o.to(dtype), group_size)

    def weight_only_matmul(self, x, w, bias=None, out_dtype=None):
        lead = x.shape[:-1]
        y = _torch_npu().npu_weight_quant_batchmatmul(
            x.reshape(-1, x.shape[-1]), w.weight_t, antiquant_scale=w.scale.to(x.dtype),
            antiquant_offset=None if w.offset is None else w.offset.to(x.dtype),
            bias=None if bias is None else bias.to(x.dtype), antiquant_group_size=w.group_size)
        return y.to(out_dtype or x.dtype).reshape(*lead, -1)
