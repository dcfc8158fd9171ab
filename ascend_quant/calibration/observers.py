"""Observers: activation ranges (min-max, percentile) and weight scales (min-max, MSE clip search)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_quant import numerics


@dataclass
class RangeObserver:
    """Running min/max of a tensor stream. `percentile` < 100 clips each batch's tails
    (per-tensor, over all values) before taking min/max."""
    percentile: float = 100.0
    min: float = float("inf")
    max: float = float("-inf")

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1)
        if not torch.isfinite(x).all():
            raise FloatingPointError("NaN or Inf in calibration activations")
        if self.percentile >= 100.0:
            lo, hi = x.min().item(), x.max().item()
        else:
            # the k-th largest / smallest value (topk is far cheaper than a sort), on an evenly
            # strided subsample of at most 4M values
            x = x[:: max(1, x.numel() // (1 << 22))]
            k = max(1, int(round(x.numel() * (1.0 - self.percentile / 100.0))))
            hi = torch.topk(x, k, largest=True, sorted=True).values[-1].item()
            lo = torch.topk(x, k, largest=False, sorted=True).values[-1].item()
        self.min, self.max = min(self.min, lo), max(self.max, hi)

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return numerics.activation_qparams(self.min, self.max)


def mse_weight_scale(w: torch.Tensor, bits: int, group_size: int = 0,
                     grid: int = 20, min_ratio: float = 0.5,
                     col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric scale per row (or per group) chosen among `absmax * r / qmax`,
    r in [min_ratio, 1], to minimise the (optionally column-weighted) squared
    quantization error. Never worse than min-max (r = 1 is in the grid)."""
    n, k = w.shape
    w = w.float()
    g = group_size or k
    numerics.check_group_size(k, g)
    cw = None if col_weight is None else col_weight.float().reshape(1, k // g, g)
    base = numerics.weight_scale(w, bits, group_size)            # [n, groups]
    qmin, qmax = numerics.qrange(bits)
    best = base.clone()
    # rows in chunks of about 256 KiB, so that the grid's passes run in cache
    rows = max(1, (1 << 16) // k)
    for r0 in range(0, n, rows):
        wg = w[r0:r0 + rows].reshape(-1, k // g, g)
        b = base[r0:r0 + rows]
        best_err = torch.full_like(b, float("inf"))
        err = torch.empty_like(wg)
        for i in range(grid + 1):
            r = 1.0 - (1.0 - min_ratio) * i / grid
            s = (b * r).unsqueeze(-1)
            torch.div(wg, s, out=err).round_().clamp_(qmin, qmax).mul_(s).sub_(wg).square_()
            if cw is not None:
                err.mul_(cw)
            e = err.sum(-1)
            better = e < best_err
            best[r0:r0 + rows] = torch.where(better, b * r, best[r0:r0 + rows])
            best_err = torch.where(better, e, best_err)
    return best


def mse_activation_range(x: torch.Tensor, importance: torch.Tensor | None = None, grid: int = 40,
                         min_ratio: float = 0.2, max_tokens: int = 4096, outlier_tokens: int = 256
                         ) -> tuple[float, float]:
    """A per-tensor range for static asymmetric int8 that minimises the quantization error of
    the Linears' outputs rather than of the input: the candidates shrink the observed
    [min, max] by r in [min_ratio, 1], and each is scored by `sum_t sum_j e[t, j]^2 * w_j`,
    where e is the input's quantization error and w_j = sum_n W[n, j]^2 over the Linears
    that read x (the diagonal of W^T W: how much channel j's error reaches the output).

    x: [tokens, k]; importance: [k] (None: plain input MSE). Never worse than min-max
    (r = 1 is a candidate). The range is always the full tensor's; beyond `max_tokens` the
    score is estimated on the `outlier_tokens` tokens of largest magnitude (counted once:
    they decide the clipping) plus an even stride of the rest (weighted up to their number).
    """
    x = x.detach().float()
    if not torch.isfinite(x).all():
        raise FloatingPointError("NaN or Inf in calibration activations")
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    imp = torch.ones(x.shape[-1]) if importance is None else importance.float()
    weights = None
    if x.shape[0] > max_tokens:
        peak = x.abs().amax(1)
        top = torch.topk(peak, outlier_tokens).indices
        rest = torch.ones(x.shape[0], dtype=torch.bool)
        rest[top] = False
        rest = rest.nonzero().squeeze(1)
        pick = rest[torch.linspace(0, rest.numel() - 1, max_tokens - outlier_tokens).long()]
        weights = torch.cat([torch.ones(outlier_tokens), torch.full((pick.numel(),), rest.numel() / pick.numel())])
        x = x[torch.cat([top, pick])]
    err = torch.empty_like(x)
    best, best_err = (lo, hi), float("inf")
    for i in range(grid + 1):
        r = 1.0 - (1.0 - min_ratio) * i / grid
        scale, offset = numerics.activation_qparams(lo * r, hi * r)
        # (clamp(round(x / s) + o) - o) * s - x, in place
        torch.div(x, scale, out=err).round_().add_(offset).clamp_(numerics.INT8_MIN, numerics.INT8_MAX)
        err.sub_(offset).mul_(scale).sub_(x).square_()
        per_token = err @ imp
        total = (per_token.sum() if weights is None else per_token @ weights).item()
        if total < best_err:
            best, best_err = (lo * r, hi * r), total
    return best
