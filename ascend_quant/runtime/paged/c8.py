"""Paged attention over an int8 (C8) KV cache: quantize on write, dequantize per channel on read.

Cache: vLLM's CPU page tensor `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`, int8.
Within one (block, kv head) the 2 * block_size * head_dim bytes hold K transposed
(`[head_dim][block_size]`) then V (`[block_size][head_dim]`) — a layout private to this module
(`page_views` gives both as tensors); only these functions write and read C8 pages.

Scales: the checkpoint's per-channel `kv_cache_scale` vectors, `[num_kv_heads * head_dim]`,
head-major (index h * head_dim + d). Write: `k_q = clamp(round(k / s_k), -128, 127)` into the
slots of `slot_mapping` (-1 = padding, skipped). Read: `k = k_q * s_k`, `v = v_q * s_v`.

Attention metadata (vLLM v1's): `query_start_loc [R+1]`, `seq_lens [R]` (context length
including this step's tokens), `block_table [R, max_blocks]`. Request r's queries are the last
`q_len` positions of its context; with `causal`, query i (absolute position ctx - q_len + i)
sees keys 0..position (chunked prefill, prefix-cache hits and decode alike).

Sliding window (vLLM's `sliding_window`, an int W; None, -1 or 0 = none): a query at position p
sees only keys in (p - W, p], i.e. the W most recent positions including its own (HF's and
vLLM's semantics). Causal only. vLLM's sliding-window KV manager may replace the block-table
entries of blocks wholly outside every query's window by its null block: no implementation
relies on their contents (they are masked, and the C kernel does not read them at all).

Logits soft-cap (Gemma-2's `attn_logit_softcapping`, vLLM's `logits_soft_cap`; 0/None = none):
scores s = scale * q.k become cap * tanh(s / cap) before the mask and softmax.

Three implementations with one signature (`out[T, H, D]` float32):
  * `attention_reference`: a per-request loop that dequantizes whole contexts and runs a plain
    masked softmax — the test oracle.
  * `attention_torch`: batched torch: gathers only the blocks in the block table, folds the
    scales (q * s_k, out * s_v, so pages are only converted, not rescaled) and runs
    `scaled_dot_product_attention` with GQA and a causal mask over all requests at once.
  * `attention_native`: the C kernel (`c8_kernel.c`, OpenMP over (request, query tile, kv head),
    online softmax over blocks, int8 pages read directly). The default on CPUs.
`attention()` picks native when it is available (`ASCEND_QUANT_C8_ATTENTION=native|torch|reference`
forces one).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ascend_quant import native

IMPL_ENV = "ASCEND_QUANT_C8_ATTENTION"


# ----------------------------------------------------------------------------- layout

def page_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K [num_blocks, Hkv, D, bs], V [num_blocks, Hkv, bs, D]) views of the int8 pages."""
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.reshape(nb, hkv, 2 * bs * d)
    return flat[..., : bs * d].view(nb, hkv, d, bs), flat[..., bs * d:].view(nb, hkv, bs, d)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] -> int8 with the per-channel scale [Hkv * D]."""
    s = scale.float().reshape(1, x.shape[1], x.shape[2])
    return torch.clamp(torch.round(x.float() / s), -128, 127).to(torch.int8)


def _check(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype != torch.int8 or kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"C8 pages must be int8 [blocks, kv_heads, block_size, 2*head_dim], got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}")


def _window(sliding_window) -> int:
    """vLLM's sliding_window as an int W > 0, or 0 for none (None, -1, 0)."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, (tuple, list)):
        raise ValueError(f"C8 attention: sliding_window must be an int (vLLM CPU semantics), got {sliding_window!r}")
    w = int(sliding_window)
    return w if w > 0 else 0


def _check_options(causal: bool, sliding_window, softcap) -> tuple[int, float]:
    w = _window(sliding_window)
    if w and not causal:
        raise NotImplementedError("C8 attention: a sliding window is only supported with causal attention")
    cap = float(softcap or 0.0)
    if cap < 0:
        raise ValueError(f"C8 attention: logits soft-cap must be >= 0, got {cap}")
    return w, cap


# ----------------------------------------------------------------------------- write

def write_reference(kv_cache, key, value, slot_mapping, k_scale, v_scale) -> None:
    """Quantize key/value [T, Hkv, D] into the slots of `slot_mapping` (plain torch)."""
    _check(kv_cache)
    kc, vc = page_views(kv_cache)
    bs = kc.shape[-1]
    n = min(key.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    keep = slots >= 0
    slots = slots[keep]
    kq, vq = quantize_kv(key[:n][keep], k_scale), quantize_kv(value[:n][keep], v_scale)
    blk, off = slots // bs, slots % bs
    kc[blk, :, :, off] = kq
    vc[blk, :, off, :] = vq


_DT = {torch.float32: 0, torch.bfloat16: 1}


def _native_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] as float32 or bf16 with a contiguous (head, dim) part (a row stride is allowed)."""
    if x.dtype not in _DT:
        x = x.float()
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    return x


def write_native(kv_cache, key, value, slot_mapping, k_scale, v_scale, lib=None) -> None:
    _check(kv_cache)
    lib = lib or native.load()
    n = min(key.shape[0], slot_mapping.shape[0])
    k = _native_rows(key[:n])
    v = _native_rows(value[:n])
    if v.dtype != k.dtype:
        k, v = k.float(), v.float()
    slots = slot_mapping[:n]
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    ks, vs = _f32(k_scale), _f32(v_scale)
    nb, hkv, bs, two_d = kv_cache.shape
    lib.c8_write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), _DT[k.dtype], slots.data_ptr(), n,
                 kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), hkv, two_d // 2, bs,
                 ks.data_ptr(), vs.data_ptr(), torch.get_num_threads())


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def write(kv_cache, key, value, slot_mapping, k_scale, v_scale) -> None:
    if kv_cache.device.type == "cpu" and choose_impl() == "native":
        write_native(kv_cache, key, value, slot_mapping, k_scale, v_scale)
    else:
        write_reference(kv_cache, key, value, slot_mapping, k_scale, v_scale)


# ----------------------------------------------------------------------------- read

def gather_dequantized(kv_cache, block_ids: torch.Tensor, length: int, k_scale, v_scale):
    """K, V [length, Hkv, D] float32 of one request (its blocks in order)."""
    kc, vc = page_views(kv_cache)
    hkv, d = kc.shape[1], kc.shape[2]
    k = kc[block_ids.long()].permute(0, 3, 1, 2).reshape(-1, hkv, d)[:length]   # [blocks*bs, Hkv, D]
    v = vc[block_ids.long()].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:length]
    return k.float() * k_scale.float().view(1, hkv, d), v.float() * v_scale.float().view(1, hkv, d)


def attention_reference(query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table,
                        scale: float, causal: bool = True, sliding_window=None, softcap=None) -> torch.Tensor:
    """out [T, H, D] float32: per request, dequantize its whole context and run a masked softmax."""
    _check(kv_cache)
    window, cap = _check_options(causal, sliding_window, softcap)
    t_total, h, d = query.shape
    bs = kv_cache.shape[2]
    hkv = kv_cache.shape[1]
    out = torch.zeros(t_total, h, d, dtype=torch.float32)
    qsl = query_start_loc.tolist()
    for r, ctx in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[r], qsl[r + 1]
        qlen = q1 - q0
        if qlen == 0:
            continue
        nblk = (ctx + bs - 1) // bs
        k, v = gather_dequantized(kv_cache, block_table[r, :nblk], ctx, k_scale, v_scale)
        k = k.repeat_interleave(h // hkv, dim=1)            # GQA: query head j uses kv head j // G
        v = v.repeat_interleave(h // hkv, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        if causal:
            pos = torch.arange(ctx - qlen, ctx).unsqueeze(1)
            key_pos = torch.arange(ctx).unsqueeze(0)
            hidden = key_pos > pos
            if window:
                hidden = hidden | (key_pos <= pos - window)
            scores = scores.masked_fill(hidden, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def fold_scales(k_scale, v_scale, num_heads: int, num_kv_heads: int, scale: float):
    """(q multiplier [H, D] = scale * s_k of the head's kv head, output multiplier [H, D] = s_v)."""
    d = k_scale.numel() // num_kv_heads
    return _fold(k_scale.float(), v_scale.float(), num_heads, num_kv_heads, d, scale)


def _fold(ks, vs, h, hkv, d, scale):
    g = h // hkv
    qmul = (ks.view(hkv, 1, d) * scale).expand(hkv, g, d).reshape(h, d).contiguous()
    omul = vs.view(hkv, 1, d).expand(hkv, g, d).reshape(h, d).contiguous()
    return qmul, omul


def attention_torch(query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table,
                    scale: float, causal: bool = True, folded=None, sliding_window=None, softcap=None) -> torch.Tensor:
    """Batched over requests: pad queries to [R, max_q], gather each request's blocks (int8 ->
    float, no rescale), one `scaled_dot_product_attention` with GQA and a bottom-right causal mask
    (narrowed to the sliding window when there is one; with a soft-cap, an explicit softmax)."""
    _check(kv_cache)
    window, cap = _check_options(causal, sliding_window, softcap)
    t_total, h, d = query.shape
    nb, hkv, bs, _ = kv_cache.shape
    qmul, omul = folded or fold_scales(k_scale, v_scale, h, hkv, scale)
    qsl = query_start_loc.long()
    qlens = qsl[1:] - qsl[:-1]
    ctx = seq_lens.long()
    r = ctx.shape[0]
    max_q = int(qlens.max())
    max_ctx = int(ctx.max())
    nblk = (max_ctx + bs - 1) // bs
    kc, vc = page_views(kv_cache)
    ids = block_table[:, :nblk].long()
    k = kc[ids].permute(0, 2, 1, 4, 3).reshape(r, hkv, nblk * bs, d)[:, :, :max_ctx].float()
    v = vc[ids].permute(0, 2, 1, 3, 4).reshape(r, hkv, nblk * bs, d)[:, :, :max_ctx].float()
    # queries -> [R, H, max_q, D]
    tok = torch.arange(t_total)
    req = torch.repeat_interleave(torch.arange(r), qlens, output_size=t_total)
    row = tok - qsl[req]
    q = torch.zeros(r, max_q, h, d, dtype=torch.float32)
    q[req, row] = query.float() * qmul
    q = q.transpose(1, 2)
    key_pos = torch.arange(max_ctx).view(1, 1, max_ctx)
    if causal:
        q_pos = (ctx - qlens).view(r, 1, 1) + torch.arange(max_q).view(1, max_q, 1)
        mask = key_pos <= q_pos
        if window:
            mask = mask & (key_pos > q_pos - window)
    else:
        mask = key_pos < ctx.view(r, 1, 1)
    mask = mask & (key_pos < ctx.view(r, 1, 1))
    mask = mask | (torch.arange(max_q).view(1, max_q, 1) >= qlens.view(r, 1, 1))   # padded rows: see all (dropped)
    if cap:
        g = h // hkv
        kk = k.repeat_interleave(g, dim=1)
        vv = v.repeat_interleave(g, dim=1)
        scores = q @ kk.transpose(-1, -2)                  # scale already folded into q
        scores = (cap * torch.tanh(scores / cap)).masked_fill(~mask.unsqueeze(1), float("-inf"))
        o = torch.softmax(scores, -1) @ vv
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=1.0, enable_gqa=True)
    return o.transpose(1, 2)[req, row] * omul


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def attention_native(query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table,
                     scale: float, causal: bool = True, folded=None, out=None, q_tile: int = 16,
                     lib=None, sliding_window=None, softcap=None) -> torch.Tensor:
    """The C kernel. `out` ([T, H, D] or [T, H*D], float32 or bf16) is written in place when given
    (the scales are applied inside the kernel; bf16 queries are read as they are)."""
    _check(kv_cache)
    window, cap = _check_options(causal, sliding_window, softcap)
    lib = lib or native.load()
    t_total, h, d = query.shape
    nb, hkv, bs, _ = kv_cache.shape
    qmul, omul = folded or fold_scales(k_scale, v_scale, h, hkv, scale)
    q = _native_rows(query)
    if out is None or out.dtype not in _DT:
        res = torch.empty(t_total, h, d, dtype=torch.float32)
    else:
        res = out
    if res.stride(-1) != 1 or res[0].numel() != h * d or (res.dim() == 3 and res.stride(1) != d):
        raise ValueError("attention_native: out needs contiguous rows of H*D")
    qsl, sl = _i32(query_start_loc), _i32(seq_lens)
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(1) == 1 else _i32(block_table)
    lib.c8_attention(q.data_ptr(), q.stride(0), _DT[q.dtype], qmul.data_ptr(), kv_cache.data_ptr(),
                     kv_cache.stride(0), kv_cache.stride(1), qsl.data_ptr(), sl.data_ptr(), bt.data_ptr(),
                     bt.stride(0), sl.shape[0], h, hkv, d, bs, int(bool(causal)), window, cap, q_tile, res.data_ptr(),
                     res.stride(0), _DT[res.dtype], omul.data_ptr(), torch.get_num_threads())
    if out is not None and res is not out:
        out.copy_(res.reshape(out.shape))
        return out
    return res


def choose_impl() -> str:
    forced = os.environ.get(IMPL_ENV)
    if forced:
        if forced not in ("native", "torch", "reference"):
            raise ValueError(f"{IMPL_ENV}={forced!r}: expected native, torch or reference")
        return forced
    return "native" if native.load() is not None else "torch"


IMPLS = {"reference": attention_reference, "torch": attention_torch, "native": attention_native}


def attention(query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table, scale: float,
              causal: bool = True, impl: str | None = None, folded=None, out=None, sliding_window=None,
              softcap=None) -> torch.Tensor:
    """out [T, H, D] (float32, or `out` filled in place)."""
    impl = impl or (choose_impl() if kv_cache.device.type == "cpu" else "torch")
    opts = dict(sliding_window=sliding_window, softcap=softcap)
    if impl == "native":
        return attention_native(query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table, scale,
                                causal, folded=folded, out=out, **opts)
    res = _attention_other(impl, query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table, scale,
                           causal, folded, **opts)
    if out is not None:
        out.copy_(res.reshape(out.shape))
        return out
    return res


def _attention_other(impl, query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table, scale,
                     causal, folded, **opts):
    if impl == "reference":
        return attention_reference(query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table,
                                   scale, causal, **opts)
    return IMPLS[impl](query, kv_cache, k_scale, v_scale, query_start_loc, seq_lens, block_table, scale,
                       causal, folded=folded, **opts)
