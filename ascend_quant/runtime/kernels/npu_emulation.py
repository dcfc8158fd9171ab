"""A stand-in `torch_npu` module for CPU tests: the ops the NPU backend calls, computed
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


def _group_rows(group_list: torch.Tensor, group_list_type: int, groups: int, m: int) -> list[tuple[int, int]]:
    """(start, end) rows of each group: group_list holds counts (type 1) or cumulative ends (type 0)."""
    assert group_list.dtype == torch.int64 and group_list.shape == (groups,), \
        f"group_list must be int64 [{groups}], got {group_list.dtype} {tuple(group_list.shape)}"
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    ends = [int(e) for e in ends]
    assert ends == sorted(ends) and ends[-1] <= m, f"group_list {group_list.tolist()} does not fit {m} rows"
    return list(zip([0] + ends[:-1], ends))


def npu_grouped_matmul(x: list, weight: list, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list: torch.Tensor | None = None,
                       split_item: int = 0, group_type: int | None = None, group_list_type: int = 0,
                       act_type: int = 0, output_dtype: torch.dtype | None = None, **_unused) -> list:
    """The MoE form only: one x [m, k] whose rows are split into E groups (`group_type=0`,
    `group_list` int64 [E]: counts with `group_list_type=1`, cumulative ends with 0), one stacked
    weight [E, k, n], one output [m, n] (`split_item` 2 or 3). Group e computes `x[rows_e] @ w[e]`:
    int8 x int8 accumulated exactly, times `scale[e]` ([E, n], float32 or bf16) and the row's
    `per_token_scale` ([m]), cast to `output_dtype` (bf16 / fp16); float x with float w as is."""
    assert len(x) == 1 and len(weight) == 1, "emulation: one x and one stacked weight"
    assert split_item in (2, 3) and group_type == 0 and act_type == 0, (split_item, group_type, act_type)
    assert bias is None and offset is None and antiquant_scale is None and antiquant_offset is None, \
        "emulation: bias, offset and antiquant arguments are not modelled"
    a, w = x[0], weight[0]
    assert w.dim() == 3 and a.dim() == 2 and a.shape[1] == w.shape[1], \
        f"x must be [m, k] and weight [E, k, n]: x {tuple(a.shape)} weight {tuple(w.shape)}"
    groups, _, n = w.shape
    quantized = a.dtype == torch.int8
    if quantized:
        assert w.dtype == torch.int8, "int8 x needs an int8 weight"
        assert scale is not None and len(scale) == 1 and scale[0].shape == (groups, n), \
            f"scale must be [[E, n]], got {None if scale is None else [tuple(t.shape) for t in scale]}"
        assert scale[0].dtype in (torch.float32, torch.bfloat16), scale[0].dtype
        assert per_token_scale is not None and per_token_scale[0].shape == (a.shape[0],), "per_token_scale is [m]"
        assert output_dtype in (torch.bfloat16, torch.float16), "quantized grouped matmul outputs bf16 / fp16"
    out = torch.zeros(a.shape[0], n, dtype=torch.float32)
    for e, (start, end) in enumerate(_group_rows(group_list, group_list_type, groups, a.shape[0])):
        if end == start:
            continue
        if quantized:
            acc = (a[start:end].double() @ w[e].double()).to(torch.int64)
            out[start:end] = acc.float() * scale[0][e].float() * per_token_scale[0][start:end].float().unsqueeze(-1)
        else:
            out[start:end] = a[start:end].float() @ w[e].float()
    return [out.to(output_dtype or a.dtype)]


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`silu(a) * b` with x split into halves (a, b) along `dim`, in x's dtype."""
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_scatter_pa_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, cache_mode: str = "Norm",
                            **_unused) -> None:
    """In place: `key_cache[slot // bs, slot % bs] = key[t]` (and value) for each token t, with the
    ND paged layout [num_blocks, block_size, num_kv_heads, head_dim] ("Norm"). The cache dtype
    must equal key's (int8 for C8: quantize first); slots must be valid (>= 0)."""
    assert cache_mode == "Norm", f"emulation knows the ND ('Norm') layout only, got {cache_mode!r}"
    assert key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, (key.dtype, key_cache.dtype)
    assert key_cache.dim() == 4 and key.shape[1:] == key_cache.shape[2:], (tuple(key.shape), tuple(key_cache.shape))
    assert slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == (key.shape[0],)
    assert bool((slot_mapping >= 0).all()), "npu_scatter_pa_kv_cache: negative slot"
    bs = key_cache.shape[1]
    s = slot_mapping.long()
    key_cache[s // bs, s % bs] = key
    value_cache[s // bs, s % bs] = value


def npu_fused_infer_attention_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                    block_table: torch.Tensor, actual_seq_lengths_kv, num_heads: int,
                                    num_key_value_heads: int, input_layout: str, scale: float, block_size: int,
                                    key_antiquant_scale: torch.Tensor | None = None,
                                    value_antiquant_scale: torch.Tensor | None = None,
                                    key_antiquant_mode: int = 0, value_antiquant_mode: int = 0,
                                    actual_seq_lengths=None, sparse_mode: int = 0, atten_mask=None,
                                    antiquant_mode: int = 0, inner_precise: int = 0, **_unused):
    """Paged attention, the arithmetic only. key/value: paged [num_blocks, block_size, Hkv * D]
    (int8 with per-channel antiquant scales [Hkv, 1, D], mode 0: `k = k_q * scale`).
    "BNSD": query [B, H, 1, D], one query per request (decode), sees its whole context.
    "TND": query [T, H, D], `actual_seq_lengths` = cumulative query ends; `sparse_mode=3` is
    the bottom-right causal mask (query i of a request with q_len queries and kv_len keys sees
    keys 0 .. kv_len - q_len + i), `sparse_mode=0` none. Returns (out in query's dtype, lse)."""
    assert input_layout in ("BNSD", "TND"), input_layout
    assert block_size % 32 == 0 and key.shape[1] == block_size, (block_size, tuple(key.shape))
    h, hkv = num_heads, num_key_value_heads
    d = query.shape[-1]
    assert key.shape[-1] == hkv * d, f"paged key must be [blocks, block_size, Hkv*D]: {tuple(key.shape)}"
    quantized = key.dtype == torch.int8
    if quantized:
        assert key_antiquant_scale is not None and value_antiquant_scale is not None, "int8 KV needs antiquant scales"
        assert key_antiquant_mode == 0 and value_antiquant_mode == 0, "per-channel antiquant is mode 0"
        assert key_antiquant_scale.numel() == hkv * d and value_antiquant_scale.numel() == hkv * d
        ks = key_antiquant_scale.float().reshape(1, hkv, d)
        vs = value_antiquant_scale.float().reshape(1, hkv, d)
    kv_lens = [int(x) for x in actual_seq_lengths_kv]
    if input_layout == "BNSD":
        assert query.dim() == 4 and query.shape[2] == 1, "BNSD emulation: one query per request"
        q_all = query[:, :, 0, :]
        q_ends = list(range(1, query.shape[0] + 1))
        causal = False
    else:
        assert query.dim() == 3 and actual_seq_lengths is not None
        q_all = query
        q_ends = [int(x) for x in actual_seq_lengths]
        assert sparse_mode in (0, 3), sparse_mode
        causal = sparse_mode == 3
    out = torch.zeros(q_all.shape, dtype=torch.float32)
    lse = torch.zeros(q_all.shape[0], h, dtype=torch.float32)
    start = 0
    for r, (end, kv_len) in enumerate(zip(q_ends, kv_lens)):
        qlen = end - start
        nblk = (kv_len + block_size - 1) // block_size
        ids = block_table[r, :nblk].long()
        k = key[ids].reshape(-1, hkv, d)[:kv_len]
        v = value[ids].reshape(-1, hkv, d)[:kv_len]
        k = k.float() * ks if quantized else k.float()
        v = v.float() * vs if quantized else v.float()
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q_all[start:end].float(), k) * scale
        if causal:
            pos = torch.arange(kv_len - qlen, kv_len).unsqueeze(1)
            s = s.masked_fill(torch.arange(kv_len).unsqueeze(0) > pos, float("-inf"))
        lse[start:end] = torch.logsumexp(s, -1).transpose(0, 1)
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        start = end
    if input_layout == "BNSD":
        out = out.unsqueeze(2)
    return out.to(query.dtype), lse


def module() -> types.ModuleType:
    """This emulation as a module object named `torch_npu`."""
    mod = types.ModuleType("torch_npu")
    mod.__doc__ = __doc__
    for name in ("npu_format_cast", "npu_quantize", "npu_dynamic_quant", "npu_quant_matmul",
                 "npu_weight_quant_batchmatmul", "npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score",
                 "npu_grouped_matmul", "npu_swiglu"):
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
