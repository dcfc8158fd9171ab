"""AWQ-style weight rounding (Lin et al., 2023): activation-aware scaling, then a clip search.

1. Scaling, per group of Linears sharing an input with a producer: the input channels that
   carry large activations matter most, so they get a larger share of each weight group's
   range. With `s = mean|x|^alpha` (`numerics.awq_factors`) the producer divides its output by
   s and the Linears multiply their input columns by s (the SmoothQuant fold,
   `smoothquant.apply_smoothing`); the product is unchanged in exact arithmetic. The alpha (or
   no scaling: alpha 0) whose quantized output is closest to the float one on a token sample
   wins, scored with the scheme's own weight quantizer (and activation quantizer, if any).
2. Clipping, per Linear: each row's (or group's) range is shrunk by the ratio in
   [clip_min, 1] that minimises that group's part of the output error,
   `sum_t (x_g[t] . (w_g - Q(w_g)))^2 = e_g^T H_g e_g` with `H_g = X_g^T X_g` over the tokens,
   again with the scheme's own quantizer. Ratio 1 (min-max) is a candidate.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ascend_quant import numerics
from ascend_quant.calibration.smoothquant import best_factors

# (scale, offset or None) of a weight [n, k] at a clip ratio (a float or one per row / group)
QParams = Callable[[torch.Tensor, "torch.Tensor | float"], tuple[torch.Tensor, torch.Tensor | None]]


def activation_mean(tokens: torch.Tensor, token_weights: torch.Tensor | None = None, chunk: int = 4096
                    ) -> torch.Tensor:
    """Mean |x| per input channel of tokens [t, k] (float32 [k]), without a copy of them; with
    `token_weights` [t], of each token's |x| times its weight (a chunk of tokens at a time)."""
    n = max(tokens.shape[0], 1)
    if token_weights is None:
        return torch.linalg.vector_norm(tokens.float() if tokens.dtype != torch.float32 else tokens, 1, dim=0) / n
    total = torch.zeros(tokens.shape[-1])
    for i in range(0, tokens.shape[0], chunk):
        total += token_weights[i:i + chunk].float() @ tokens[i:i + chunk].float().abs()
    return total / n


@torch.no_grad()
def search_scales(x: torch.Tensor, act_mean: torch.Tensor, weights: list[torch.Tensor], alphas: Sequence[float],
                  quantize_input: Callable[[torch.Tensor], torch.Tensor],
                  quantize_weight: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  duo: bool = False, group_size: int = 0) -> tuple[float | str | None, torch.Tensor]:
    """(alpha, s [k]) of the AWQ factors for `alphas` (or no scaling: alpha None, s all ones)
    with the smallest `||Qa(x / s) Qw(W * s)^T - x W^T||^2` on tokens x [t, k]; `act_mean` [k]:
    mean |x| over all the group's tokens; `quantize_weight(W * s, s)` gives Qw(W * s) (s: for a
    rounding that depends on the scaled inputs, GPTQ). Never worse on that loss than no scaling.
    `duo`: the two-sided factors (`numerics.awq_duo_factors`, weights' groups of `group_size`)
    are candidates too, labelled "duo ALPHA"."""
    candidates: dict = {float(a): numerics.awq_factors(act_mean, a) for a in alphas if a > 0}
    if duo:
        w_mean = numerics.awq_weight_mean(torch.cat([w.detach() for w in weights]), group_size)
        candidates.update({f"duo {float(a)}": numerics.awq_duo_factors(act_mean, w_mean, a)
                           for a in alphas if a < 1})
    return best_factors(x, weights, candidates, quantize_input, quantize_weight)


def clip_ratios(clip_min: float, grid: int) -> list[float]:
    """1.0 down to clip_min in `grid` equal steps."""
    return [1.0 - (1.0 - clip_min) * i / grid for i in range(grid + 1)]


def _group_hessians(x: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """X_g^T X_g per group of input channels: float32 [G, g, g] (one [1, k, k] per channel)."""
    g = group_size or k
    xg = x.float().reshape(-1, k // g, g).transpose(0, 1)          # [G, t, g]
    return xg.transpose(1, 2) @ xg


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, qparams: QParams, bits: int, group_size: int,
                ratios: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per row (group_size 0) or group of w [n, k], the clip ratio of `ratios` whose quantized
    weights give the smallest output error on tokens x [t, k] (the input the Linear computes
    with). `qparams(w, ratio)` is the scheme's quantizer. Returns (scale, offset, ratio), each
    [n, 1] or [n, k // g]; the first ratio wins ties."""
    n, k = w.shape
    g = group_size or k
    w = w.float()
    h = _group_hessians(x, k, group_size)
    best_err = best_ratio = None
    for r in ratios:
        scale, offset = qparams(w, r)
        e = (w - numerics.fake_quantize_weight(w, scale, bits, offset)).reshape(n, k // g, g).transpose(0, 1)
        err = ((e @ h) * e).sum(-1).t()                                 # [n, G]
        if best_err is None:
            best_err, best_ratio = err, torch.full_like(err, r)
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, torch.full_like(err, r), best_ratio)
    scale, offset = qparams(w, best_ratio)
    return scale, offset, best_ratio
