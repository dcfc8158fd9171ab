"""SmoothQuant: move activation outliers into the weights with a per-channel factor.

`s[j] = max|X[:, j]|^alpha / max|W[:, j]|^(1 - alpha)`; the producer of X divides by s
(an RMSNorm's weight and bias, or a Linear's output rows), the consumers multiply their
input columns by s. The product is unchanged in exact arithmetic.
"""

from __future__ import annotations

import torch


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float,
                      eps: float = 1e-5) -> torch.Tensor:
    """act_absmax: [k]; weights: Linears [n_i, k] sharing the input. Returns s [k] (float32)."""
    w_absmax = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)      # [k]
    s = act_absmax.float().clamp(min=eps).pow(alpha) / w_absmax.clamp(min=eps).pow(1 - alpha)
    return s.clamp(min=eps)


@torch.no_grad()
def apply_smoothing(producer: torch.nn.Module, consumers: list[torch.nn.Module], s: torch.Tensor) -> None:
    """Divide the producer's output channels by s, multiply the consumers' input columns by s."""
    if isinstance(producer, torch.nn.Linear):
        producer.weight.div_(s.to(producer.weight.dtype).unsqueeze(1))       # [k, in] rows
    else:
        producer.weight.div_(s.to(producer.weight.dtype))                   # RMSNorm [k]
    if getattr(producer, "bias", None) is not None:
        producer.bias.div_(s.to(producer.bias.dtype))
    for lin in consumers:
        lin.weight.mul_(s.to(lin.weight.dtype).unsqueeze(0))                # [n, k] columns
