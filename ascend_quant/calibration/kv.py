"""C8 KV-cache scales: per-channel symmetric int8 scales for post-RoPE keys and values.

Methods
- "mse" (default): per channel, the clipping of `absmax` that minimises the squared
  quantization error over the calibration tokens. A score error is `sum_d q_d e_d`, so with
  independent channels the attention error is a per-channel weighted sum of these errors
  and each channel's best scale is its own MSE minimiser.
- "absmax": the true per-channel maximum / 127 (never clips).
- "msmodelslim": the per-channel maximum of the *last* calibration sample only, which is
  what msModelSlim 26.1.0 writes (its observer resets on every forward; on SmolLM2 that
  is 0.5-1.0x the true maximum and clips). Offered to reproduce its files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ascend_quant import numerics

KV_METHODS = ("mse", "absmax", "msmodelslim")
_GRID = torch.linspace(1.0, 0.5, 26)


@dataclass
class KVObserver:
    """Collects one layer's post-RoPE K or V, flattened to [tokens, kv_heads * head_dim]."""
    absmax: torch.Tensor | None = None
    sample_max: list[torch.Tensor] = field(default_factory=list)
    hist_err: torch.Tensor | None = None        # [grid, channels]: squared error per candidate ratio

    def update(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """x: [batch, kv_heads, seq, head_dim] (transformers' layout inside attention);
        valid: [batch, seq] bool, False for padding."""
        b, h, s, d = x.shape
        x = x.detach().float().permute(0, 2, 1, 3).reshape(b, s, h * d)
        if valid is None:
            valid = torch.ones(b, s, dtype=torch.bool)
        if not torch.isfinite(x[valid]).all():
            raise FloatingPointError("NaN or Inf in calibration keys/values")
        per_sample = (x.abs() * valid.unsqueeze(-1)).amax(1)               # [b, C]
        self.sample_max += list(per_sample)
        batch_max = per_sample.amax(0)
        self.absmax = batch_max if self.absmax is None else torch.maximum(self.absmax, batch_max)
        self._pending = getattr(self, "_pending", []) + [x[valid]]

    def scale(self, method: str = "mse") -> torch.Tensor:
        if method not in KV_METHODS:
            raise ValueError(f"unknown KV scale method {method!r} ({', '.join(KV_METHODS)})")
        if method == "absmax":
            return numerics.absmax_scale(self.absmax, numerics.INT8_MAX)
        if method == "msmodelslim":
            return numerics.absmax_scale(self.sample_max[-1], numerics.INT8_MAX)
        tokens = torch.cat(self._pending)                                   # [T, C]
        buf = torch.empty_like(tokens)        # the rounding error, in place: one buffer for the grid
        best, best_err = None, None
        for r in _GRID:
            s = numerics.absmax_scale(self.absmax * r, numerics.INT8_MAX)
            torch.div(tokens, s, out=buf).round_().clamp_(numerics.INT8_MIN, numerics.INT8_MAX)
            err = buf.mul_(s).sub_(tokens).square_().sum(0)
            if best is None:
                best, best_err = s, err
            else:
                better = err < best_err
                best = torch.where(better, s, best)
                best_err = torch.where(better, err, best_err)
        return best

    def release(self) -> None:
        self._pending = []


def fake_quant_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round K or V ([batch, kv_heads, seq, head_dim]) to int8 with a C8 scale
    ([kv_heads * head_dim], head-major) and back: what the int8 cache stores and returns."""
    s = scale.float().reshape(1, x.shape[1], 1, x.shape[3])
    return (torch.clamp(torch.round(x.float() / s), numerics.INT8_MIN, numerics.INT8_MAX) * s).to(x.dtype)
