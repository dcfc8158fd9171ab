"""Routed experts, grouped by expert: each expert's two Linears run through their scheme's
kernels (so int8 weights stay int8 and int4 weights stay packed, as `prepare` keeps them).

    y = routed_experts(x, topk_weights, topk_ids, experts)

`experts[e]` is expert e's `(w13, w2)`: two `schemes.PreparedLinear`, w13 the fused
[gate; up] projection (2I out-features), w2 the down projection. For every expert that
received tokens:

    h = w13(x[tokens])                      # the scheme's forward: per-token int8 quantization
    a = silu(h[:, :I]) * h[:, I:]           #   and an exact int8 GEMM for W8A8_DYNAMIC / W4A8_DYNAMIC
    y[tokens] += topk_weight * w2(a)        # a is quantized per token again inside w2

which is the CPU reference of moe.md §2. The combine accumulates in float32 and casts to x's
dtype once. A backend may group a layer's experts into one kernel (`backend.group_experts`,
e.g. the cpu backend's `int8_experts.c` on AVX-512 VNNI): `experts` is then that object and
runs the same arithmetic in one call per projection (`run_grouped`).

The NPU form of W8A8_DYNAMIC experts (moe.md §2, vllm-ascend's unfused chain) runs all experts
in one grouped matmul per projection, on the tokens sorted by expert:

    w = prepare_npu_int8_experts(w13_q, s13, w2_q, s2)          # int8 [E, n, k], scales [E, n]
    y = npu_int8_experts(x, topk_weights, topk_ids, w)

`npu_dynamic_quant` -> `npu_grouped_matmul` (per-token and per-channel scales, bf16 out) ->
`npu_swiglu` -> `npu_dynamic_quant` -> `npu_grouped_matmul` -> weighted combine. The npu
backend's `group_experts` stacks a layer's W8A8_DYNAMIC experts into this form, so the vLLM
method runs it; on a CPU the tests run it through `npu_emulation`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(order, token, counts): `order` sorts the T*k (token, slot) pairs by expert (stable, so
    tokens keep their order inside an expert), `token[j]` is the token of pair `order[j]`,
    `counts[e]` how many pairs expert e received."""
    flat = topk_ids.reshape(-1).long()
    if flat.numel():
        lo, hi = (int(v) for v in torch.aminmax(flat))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert ids must lie in [0, {num_experts}), got {lo}..{hi}")
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
    order, token, counts = group_by_expert(topk_ids, len(experts))
    weight = topk_weights.reshape(-1)[order].float()
    run_grouped = getattr(experts, "run_grouped", None)
    if run_grouped is not None:
        return run_grouped(x, weight, token, counts)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
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


@dataclass
class NpuInt8Experts:
    w13: torch.Tensor       # int8 [E, H, 2I] ([k, n] per expert, as the grouped matmul takes it)
    s13: torch.Tensor       # [E, 2I], float32 or bf16
    w2: torch.Tensor        # int8 [E, I, H]
    s2: torch.Tensor        # [E, H]
    out_dtype: torch.dtype = torch.bfloat16

    def __len__(self) -> int:
        return self.w13.shape[0]

    def run_grouped(self, x, weight, token, counts):
        """`routed_experts` of a layer the npu backend grouped (`NpuBackend.group_experts`)."""
        return npu_int8_experts_sorted(x, weight, token, counts, self, self.out_dtype)


def prepare_npu_int8_experts(w13_q: torch.Tensor, s13: torch.Tensor, w2_q: torch.Tensor, s2: torch.Tensor,
                             scale_dtype: torch.dtype = torch.bfloat16, nz: bool = False) -> NpuInt8Experts:
    """Stacked per-expert int8 weights [E, n, k] and per-channel scales ([E, n] or [E, n, 1]) in
    the grouped matmul's layout; `scale_dtype` bf16 as vllm-ascend keeps W8A8_DYNAMIC expert
    scales (its params_dtype), `nz` casts the weights to FRACTAL_NZ (a layout change only)."""
    from ascend_quant.runtime.kernels.npu import ACL_FORMAT_FRACTAL_NZ, _torch_npu

    def layout(w):
        w = w.to(torch.int8).transpose(1, 2).contiguous()
        return _torch_npu().npu_format_cast(w, ACL_FORMAT_FRACTAL_NZ) if nz else w

    e = w13_q.shape[0]
    return NpuInt8Experts(layout(w13_q), s13.reshape(e, -1).to(scale_dtype), layout(w2_q),
                          s2.reshape(e, -1).to(scale_dtype))


def npu_int8_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: NpuInt8Experts,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`routed_experts` for W8A8_DYNAMIC experts with the torch_npu grouped ops (see above)."""
    order, token, counts = group_by_expert(topk_ids, w.w13.shape[0])
    return npu_int8_experts_sorted(x, topk_weights.reshape(-1)[order].float(), token, counts, w, out_dtype)


def npu_int8_experts_sorted(x: torch.Tensor, weight: torch.Tensor, token: torch.Tensor, counts: list[int],
                            w: NpuInt8Experts, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`npu_int8_experts` on pairs already sorted by expert: `token[j]` and `weight[j]` (float)
    of pair j, `counts[e]` pairs per expert (what `group_by_expert` gives)."""
    from ascend_quant.runtime.kernels.npu import _torch_npu

    npu = _torch_npu()
    group_list = torch.tensor(counts, dtype=torch.int64, device=x.device)
    gmm = dict(split_item=2, group_type=0, group_list_type=1, group_list=group_list, output_dtype=out_dtype)
    x_q, s_x = npu.npu_dynamic_quant(x[token])
    h = npu.npu_grouped_matmul([x_q], [w.w13], scale=[w.s13], per_token_scale=[s_x.reshape(-1)], **gmm)[0]
    a_q, s_a = npu.npu_dynamic_quant(npu.npu_swiglu(h))
    y = npu.npu_grouped_matmul([a_q], [w.w2], scale=[w.s2], per_token_scale=[s_a.reshape(-1)], **gmm)[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weight[:, None])
    return out.to(x.dtype)


__all__ = ["group_by_expert", "routed_experts", "NpuInt8Experts", "prepare_npu_int8_experts", "npu_int8_experts",
           "npu_int8_experts_sorted"]
