"""Block tuning (the recipe's `tune`): a decoder layer's weight-only codes and scales tuned to the
layer's output.

Min-max rounding and GPTQ round each Linear for that Linear's own output. What the model passes
on is the layer's output, after attention, the gated MLP's product and (Gemma) the post-norms.
AutoRound (Cheng et al., 2023, "Optimize Weight Rounding via Signed Gradient Descent") tunes the
rounding for the block's output directly; this does the same, started from the layer's own
rounding:

- For each value v a code was rounded from (`QuantizedLinear.unrounded`: w / scale + zero point
  for min-max rounding, AutoRound's start; GPTQ's updated weight in code units after GPTQ), a
  shift in [-0.5, 0.5]; for each group scale, a gain in [-max_gain, max_gain].
- The weight is `numerics.tuned_weight`: the codes clamp(round(v + shift)) with the scales
  times (1 + gain). The rounding passes gradients straight through.
- Both are stepped by the sign of the gradient of the layer's output error against a target,
  each token's squared error relative to its target's mean square (`_loss`), on `batch`
  calibration samples per step. The step size falls linearly from `lr` to 0.
- At zero shift the codes are the rounding's, so a code moves (one step at most) only where the
  layer's output asks for it. The tuned layer replaces the rounding's only if its error over
  all calibration samples is lower.

The target is a float copy of the layer (taken before calibration touched it) on the same
input, or (`target: float`, and always with `gptq.float_target`) the float model's own hidden
states, which the runner carries alongside. Only dense layers are tuned: a routed expert's
tokens depend on the router, and a float copy of a whole MoE layer is large.

Started from GPTQ the shifts mostly undo its error compensation: on the tests' tiny Qwen2 every
layer's error rose and the rounding's codes stayed (README, "Block tuning").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.func import functional_call

from ascend_quant import numerics
from ascend_quant.calibration.recipe import Tune
from ascend_quant.schemes import SCHEMES, QuantizedLinear


@dataclass
class TuneResult:
    before: float          # the layer's output error (`_loss`) over all calibration samples
    after: float           # the same with the tuned codes and scales
    kept: bool             # the tuned ones replaced the rounding's (after < before)
    moved: int             # codes that changed (0 when not kept)
    seconds: float


def tunable(results: dict[str, QuantizedLinear], prefix: str) -> list[str]:
    """The layer's Linears block tuning moves: weight-only ones whose rounding kept its values."""
    return [n for n, ql in results.items() if n.startswith(prefix + ".") and ql.unrounded is not None
            and SCHEMES[ql.scheme].activation_bits is None]


def _rows(value, index: torch.Tensor, n: int):
    """A layer keyword argument for the samples `index` of n: tensors (and tuples or dicts of
    them) with one row per sample are sliced, anything else (shared positions) is kept."""
    if torch.is_tensor(value):
        return value[index] if value.dim() and value.shape[0] == n and n > 1 else value
    if isinstance(value, tuple):
        return tuple(_rows(v, index, n) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, index, n) for k, v in value.items()}
    return value


def _forward(layer, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict, index: torch.Tensor):
    n = x.shape[0]
    out = functional_call(layer, weights, (x[index],), {k: _rows(v, index, n) for k, v in kwargs.items()})
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def layer_outputs(layer, x: torch.Tensor, kwargs: dict, chunk: int = 8) -> torch.Tensor:
    """`layer` on the samples x [N, L, H], `chunk` samples at a time."""
    n = x.shape[0]
    return torch.cat([_forward(layer, {}, x, kwargs, torch.arange(i, min(i + chunk, n)))
                      for i in range(0, n, chunk)])


def _errors(out: torch.Tensor, target: torch.Tensor, inv_power: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each real token's squared error relative to its target's mean square, per channel: the
    next layer's input norm divides each token by its RMS, so that is the error it passes on (a
    plain squared error would be ruled by the few tokens with huge hidden states)."""
    return ((out - target).square() * inv_power)[valid]


def _loss(out: torch.Tensor, target: torch.Tensor, inv_power: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of `_errors`: what the steps descend."""
    return _errors(out, target, inv_power, valid).mean()


@torch.no_grad()
def _error(layer, weights, x, target, inv_power, kwargs, valid, chunk: int = 8) -> float:
    """`_loss` over all samples."""
    n, total, count = x.shape[0], 0.0, 0
    for i in range(0, n, chunk):
        index = torch.arange(i, min(i + chunk, n))
        d = _errors(_forward(layer, weights, x, kwargs, index), target[index], inv_power[index], valid[index])
        total += d.double().sum().item()
        count += d.numel()
    return total / max(count, 1)


def tune_layer(layer: torch.nn.Module, prefix: str, results: dict[str, QuantizedLinear], x: torch.Tensor,
               target: torch.Tensor, kwargs: dict, valid: torch.Tensor, cfg: Tune, seed: int = 0
               ) -> TuneResult | None:
    """Tune the weight-only Linears of `layer` (module `prefix`) in `results` so that the layer's
    output on x [N, L, H] (with its keyword arguments) comes closer to `target` [N, L, H] on the
    real tokens `valid` [N, L]. Kept: their codes, scales and the module weights are updated in
    place. None if the layer has nothing to tune."""
    names = tunable(results, prefix)
    if not names:
        return None
    start = time.perf_counter()
    modules = {n: layer.get_submodule(n[len(prefix) + 1:]) for n in names}
    params = {n: f"{n[len(prefix) + 1:]}.weight" for n in names}
    dtype = {n: modules[n].weight.dtype for n in names}
    shift = {n: torch.zeros(results[n].q.shape, requires_grad=True) for n in names}
    gain = {n: torch.zeros(results[n].scale.shape, requires_grad=True) for n in names}
    offsets = {n: None if results[n].offset is None else results[n].offset.float() for n in names}

    def weights() -> dict[str, torch.Tensor]:
        return {params[n]: numerics.tuned_weight(results[n].unrounded, shift[n], results[n].scale.float(), gain[n],
                                                 offsets[n], SCHEMES[results[n].scheme].weight_bits).to(dtype[n])
                for n in names}

    inv_power = 1.0 / target.square().mean(-1, keepdim=True).clamp(min=1e-12)
    with torch.no_grad():
        before = _error(layer, weights(), x, target, inv_power, kwargs, valid)
    n_samples = x.shape[0]
    batch = min(cfg.batch, n_samples)
    generator = torch.Generator().manual_seed(seed)
    tensors = [*shift.values(), *gain.values()]
    with torch.enable_grad():
        for step in range(cfg.iters):
            index = torch.randperm(n_samples, generator=generator)[:batch]
            loss = _loss(_forward(layer, weights(), x, kwargs, index), target[index], inv_power[index], valid[index])
            grads = torch.autograd.grad(loss, tensors, allow_unused=True)
            size = cfg.lr * (1.0 - step / cfg.iters)
            with torch.no_grad():
                for t, g in zip(tensors, grads):
                    if g is not None:
                        t.sub_(size * torch.sign(g))
                for n in names:
                    shift[n].clamp_(-0.5, 0.5)
                    gain[n].clamp_(-cfg.max_gain, cfg.max_gain)
    with torch.no_grad():
        tuned = weights()
        after = _error(layer, tuned, x, target, inv_power, kwargs, valid)
        kept, moved = after < before, 0
        if kept:
            for n in names:
                ql = results[n]
                qmin, qmax = numerics.qrange(SCHEMES[ql.scheme].weight_bits)
                codes = torch.clamp(torch.round(ql.unrounded + shift[n]), qmin, qmax).to(torch.int8)
                moved += int((codes != ql.q).sum())
                ql.q = codes
                ql.scale = (ql.scale.float() * (1 + gain[n])).to(ql.scale.dtype)
                modules[n].weight.data = ql.dequantized().to(dtype[n])
    return TuneResult(before, after, kept, moved, time.perf_counter() - start)
