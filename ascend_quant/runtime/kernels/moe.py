"""Routed experts, grouped by expert: each expert's two Linears run through their scheme's
kernels (so int8 weights stay int8 and int4 weights stay packed, as `prepare` keeps them).

    y = routed_experts(x, topk_weights, topk_ids, experts)

`experts[e]` is expert e's `(w13, w2)`: two `schemes.PreparedLinear`, w13 the fused
[gate; up] projection (2I out-features), w2 the down projection. For every expert that
received tokens:

    h = w13(x[tokens])                      # the scheme's forward: per-token int8 quantization
    a = silu(h[:, :I]) * h[:, I:]           #   and an exact int8 GEMM for W8A8_DYNAMIC / W4A8_DYNAMIC
    y[tokens] += topk_weight * w2(a)        # a is quantized per token again inside w2

which is the CPU reference of moe.md §2 (the NPU's grouped matmul does the same per expert).
The combine accumulates in float32 and casts to x's dtype once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(order, token, counts): `order` sorts the T*k (token, slot) pairs by expert (stable, so
    tokens keep their order inside an expert), `token[j]` is the token of pair `order[j]`,
    `counts[e]` how many pairs expert e received."""
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got {int(flat.min())}..{int(flat.max())}")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // topk_ids.shape[-1], counts


def routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts) -> torch.Tensor:
    """The routed, top-k weighted sum `y[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`.

    x [T, H]; topk_weights [T, k] (float); topk_ids [T, k] (int); experts: a sequence of
    (w13, w2) PreparedLinear pairs, one per expert. Returns [T, H] in x's dtype."""
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"routed_experts: x {tuple(x.shape)}, topk_weights {tuple(topk_weights.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)} (want [T, H], [T, k], [T, k])")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order, token, counts = group_by_expert(topk_ids, len(experts))
    weight = topk_weights.reshape(-1)[order].float()
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        rows = token[start:start + count]
        w13, w2 = experts[e]
        h = w13(x[rows])
        gate, up = h.chunk(2, dim=-1)
        y = w2(F.silu(gate) * up)
        out.index_add_(0, rows, y.float() * weight[start:start + count, None])
        start += count
    return out.to(x.dtype)


__all__ = ["group_by_expert", "routed_experts"]
