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
from ascend_quant.runtime.kernels.reference import ReferenceBackend

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
    def quantize_static(self, x, input_scale, input_offset, params=None):
        k = x.shape[-1]
        inv = (1.0 / input_scale.float().reshape(1)).to(torch.bfloat16).repeat(k)
        offset = input_offset.float().reshape(1).to(torch.bfloat16).repeat(k)
        return _torch_npu().npu_quantize(x, inv, offset, torch.qint8, -1, False)

    def quantize_dynamic(self, x):
        x_q, scale = _torch_npu().npu_dynamic_quant(x)
        return x_q, scale.reshape(*x.shape[:-1], 1)

    # ---------------------------------------------------------------- int8 x int8
    # quantize_dynamic, then int8_matmul with its scales: the reference's composition of this
    # backend's own two ops (npu_dynamic_quant, npu_quant_matmul)
    int8_matmul_dynamic = ReferenceBackend.int8_matmul_dynamic

    def prepare_int8(self, weight, scale, bits: int = 8):
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

    # ---------------------------------------------------------------- routed experts
    def group_experts(self, experts, dtype: torch.dtype):
        """W8A8_DYNAMIC experts (int8 weights, per-token int8 activations) as one
        `kernels.moe.NpuInt8Experts`: the grouped-matmul chain (moe.md §2) instead of two
        matmuls per expert. None (expert by expert) for other experts, or with FRACTAL_NZ
        weights, which cannot be stacked once cast."""
        from ascend_quant.runtime.kernels.moe import NpuInt8Experts

        linears = [lin for pair in experts for lin in pair]
        if self.nz or not linears or not all(
                lin.scheme.activation_mode == "dynamic" and lin.scheme.weight_bits == 8
                and isinstance(lin.prepared, NpuInt8Weight) for lin in linears):
            return None
        stack = lambda key, j: torch.stack([getattr(pair[j].prepared, key) for pair in experts])  # noqa: E731
        scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        return NpuInt8Experts(stack("weight_t", 0), stack("scale", 0).to(scale_dtype), stack("weight_t", 1),
                              stack("scale", 1).to(scale_dtype), out_dtype=dtype)

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


class NpuC8PagedAttention:
    """C8 paged attention with the torch_npu ops of ascend-format.md §3 (C8 row).

    Cache (ND, `cache_mode="Norm"`): key_cache / value_cache int8 `[num_blocks, block_size,
    num_kv_heads, head_dim]`; block_size and head_dim must be multiples of 32 on the NPU.
    Write: `npu_quantize(k, s_k [Hkv*D], div_mode=True)` (`round(k / s)`, clamp) then
    `npu_scatter_pa_kv_cache` into the slots (padding slots, -1, are dropped first).
    Read: `npu_fused_infer_attention_score` with per-channel `key_antiquant_scale` /
    `value_antiquant_scale` ([Hkv, 1, D], mode 0, no offset: symmetric C8 only) over the block
    table: "BNSD" for decode-only batches (query [B, H, 1, D]), "TND" with `sparse_mode=3`
    (bottom-right causal) for prefill / chunked prefill. The argument conventions follow
    vllm-ascend's C8 decode call; the TND + antiquant combination is unverified on hardware.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, block_size: int, dtype=torch.bfloat16):
        if block_size % 32 or head_dim % 32:
            raise ValueError(f"C8 on the NPU needs block_size and head_dim divisible by 32 "
                             f"(got {block_size}, {head_dim})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.block_size, self.dtype = scale, block_size, dtype
        self.k_scale = k_scale.float().reshape(-1)
        self.v_scale = v_scale.float().reshape(-1)
        self.k_antiquant = self.k_scale.view(num_kv_heads, 1, head_dim).to(dtype)
        self.v_antiquant = self.v_scale.view(num_kv_heads, 1, head_dim).to(dtype)

    def new_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)

    def write(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        npu = _torch_npu()
        n = min(key.shape[0], slot_mapping.shape[0])
        keep = slot_mapping[:n] >= 0
        k, v = key[:n][keep], value[:n][keep]
        t = k.shape[0]
        k_q = npu.npu_quantize(k.reshape(t, -1), self.k_scale, None, torch.qint8, -1, True)
        v_q = npu.npu_quantize(v.reshape(t, -1), self.v_scale, None, torch.qint8, -1, True)
        npu.npu_scatter_pa_kv_cache(k_q.view(t, self.num_kv_heads, self.head_dim),
                                    v_q.view(t, self.num_kv_heads, self.head_dim), key_cache, value_cache,
                                    slot_mapping[:n][keep].to(torch.int32), cache_mode="Norm")

    def forward(self, query, key_cache, value_cache, query_start_loc, seq_lens, block_table) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] in query's dtype."""
        npu = _torch_npu()
        nb = key_cache.shape[0]
        k = key_cache.view(nb, self.block_size, -1)
        v = value_cache.view(nb, self.block_size, -1)
        qsl = query_start_loc.tolist()
        common = dict(key_antiquant_scale=self.k_antiquant, value_antiquant_scale=self.v_antiquant,
                      key_antiquant_mode=0, value_antiquant_mode=0, block_table=block_table.to(torch.int32),
                      actual_seq_lengths_kv=seq_lens.tolist(), num_heads=self.num_heads,
                      num_key_value_heads=self.num_kv_heads, scale=self.scale, block_size=self.block_size,
                      inner_precise=1)
        q = query.to(self.dtype)
        if all(b - a == 1 for a, b in zip(qsl, qsl[1:])):          # decode only
            out, _ = npu.npu_fused_infer_attention_score(q.unsqueeze(2), k, v, input_layout="BNSD",
                                                         sparse_mode=0, **common)
            return out.squeeze(2)
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
        out, _ = npu.npu_fused_infer_attention_score(q, k, v, input_layout="TND", sparse_mode=3, atten_mask=mask,
                                                     actual_seq_lengths=qsl[1:], **common)
        return out
