"""The group step: smooth -> observe -> quantize one group of Linears that share an input.

Pure functions on tensors, called in this order by the runner's hook (runner.py) once it
holds the group's input: `choose_smoothing` (SmoothQuant factors, or none) or `choose_awq`
(AWQ factors, or none; the runner folds either into the producer and the members),
`observe_activations` (static W8A8: one range for the whole group), `fake_quantized_inputs`
(what the members compute with, per scheme) and `quantize_linears` (an optional AWQ clip
search, then GPTQ with the group's shared Hessian or min-max rounding). Where a post-norm
reads the group's output (arch `LinearGroup.output_norm`), `output_norm_weights` gives each
token's error the weight the norm gives it, in AWQ's, the clip search's and GPTQ's losses.
Nothing here changes a module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from ascend_quant import numerics
from ascend_quant.calibration import CalibrationError
from ascend_quant.calibration.awq import activation_mean, clip_ratios, search_clip, search_scales
from ascend_quant.calibration.gptq import float_target_weight, gptq_quantize, hessian, refit_scales
from ascend_quant.calibration.observers import RangeObserver, mse_activation_range, mse_weight_scale
from ascend_quant.calibration.recipe import Recipe
from ascend_quant.calibration.smoothquant import search_alpha, smoothing_factors
from ascend_quant.schemes import SCHEMES, QuantizedLinear

# Tokens used for the per-Linear error report (a fixed subsample keeps it cheap).
ERROR_TOKENS = 256
# SmoothQuant's alpha search compares its candidates on this many tokens (evenly strided),
# ~5% of the calibration time. Its choice depends on the sample: W8A8_DYNAMIC on SmolLM2-135M
# scored +0.75% to +1.17% for different samples of 256 or 512 (recipe.py keeps it for W4A8)
SEARCH_TOKENS = 256
# AWQ's clip search scores each row's groups on X_g^T X_g from this many (evenly strided) tokens
CLIP_TOKENS = 1024


@dataclass
class ActivationQParams:
    """A group's static activation range (all None: no static W8A8 member)."""
    input_scale: torch.Tensor | None = None     # [1]
    input_offset: torch.Tensor | None = None    # [1]
    running: tuple[torch.Tensor, torch.Tensor] | None = None   # per-sample (scale, offset) [B, 1, 1]


def stride(x: torch.Tensor, count: int) -> torch.Tensor:
    """At most `count` rows of x, an even stride through all of them, as a view (count 0:
    all rows)."""
    if not count or x.shape[0] <= count:
        return x
    return x[::-(-x.shape[0] // count)]


def weigh(x: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """Tokens x [t, k] with row i scaled by token_weights[i] (a copy), or x itself (None)."""
    return x if token_weights is None else x * token_weights[:, None].to(x.dtype)


def sample(tokens: torch.Tensor, count: int, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`stride(tokens, count)`, each row scaled by its token's weight (`output_norm_weights`)."""
    return weigh(stride(tokens, count), None if token_weights is None else stride(token_weights, count))


def hessian_count(k: int, recipe: Recipe) -> int:
    """How many tokens of a group with k in-features GPTQ's Hessian takes: at most
    max(gptq.hessian_tokens, 4 k) (0: all)."""
    cap = recipe.gptq.hessian_tokens
    return cap and max(cap, 4 * k)


def hessian_sample(tokens: torch.Tensor, recipe: Recipe, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens [t, k] GPTQ's Hessian is computed on: an even stride of `hessian_count` of
    them, weighted by `token_weights` [t] if given."""
    return sample(tokens, hessian_count(tokens.shape[-1], recipe), token_weights)


def hessian_sample_weights(token_weights: torch.Tensor | None, k: int, recipe: Recipe) -> torch.Tensor | None:
    """The weights of `hessian_sample`'s tokens, for a group with k in-features (None: none)."""
    return None if token_weights is None else stride(token_weights, hessian_count(k, recipe))


def output_norm_weights(tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float, chunk: int = 4096) -> torch.Tensor:
    """float32 [t]: how much each token's output error counts where a post-norm reads the
    Linear's output y = x W^T + b (arch `LinearGroup.output_norm`; tokens x [t, k]). The norm
    divides y_t by RMS(y_t) = sqrt(mean(y_t^2) + eps), so an error e_t in y_t reaches the
    residual as about e_t / RMS(y_t) (times the norm's per-channel gain, which weighs output
    rows, not tokens, and leaves each row's GPTQ problem as it is): tokens whose output is small
    get their error amplified. Scaled to a mean square of 1, so a Hessian of the weighted tokens
    keeps its size."""
    w = weight.detach().float()
    rms = torch.empty(tokens.shape[0])
    for i in range(0, tokens.shape[0], chunk):
        y = tokens[i:i + chunk].float() @ w.t()
        if bias is not None:
            y += bias.detach().float()
        rms[i:i + chunk] = y.pow(2).mean(-1).add(eps).sqrt()
    weights = rms.reciprocal()
    return weights / weights.pow(2).mean().sqrt().clamp(min=1e-30)


def error_sample(tokens: torch.Tensor) -> torch.Tensor:
    """The tokens [t, k] the error report is computed on: ERROR_TOKENS evenly spaced ones (a copy)."""
    return tokens[torch.linspace(0, tokens.shape[0] - 1, min(ERROR_TOKENS, tokens.shape[0])).long()]


# ------------------------------------------------------------------------ smooth

def smooths(recipe: Recipe, schemes: Iterable[str], through_linear: bool) -> bool:
    """Whether a group with a producer is smoothed: smoothing helps activation quantization,
    weight-only groups skip it, and smoothing through a Linear (up_proj -> down_proj) is optional."""
    sq = recipe.smoothquant
    if sq is None:
        return False
    if not any(SCHEMES[s].activation_bits is not None for s in schemes):
        return False
    return sq.smooth_down or not through_linear


def choose_smoothing(tokens: torch.Tensor, weights: dict[str, torch.Tensor], quantized: dict[str, str],
                     recipe: Recipe, group_name: str) -> tuple[float | None, torch.Tensor | None]:
    """(alpha, s [k]) for a group with input tokens [t, k] and members' weights [n_i, k]: the
    recipe's alpha for this group (`group_alpha`), else the best of its `alphas` on a token
    sample (alpha and s None: not smoothing is best), else its `alpha`. `quantized`: the
    members that are quantized -> their scheme."""
    sq = recipe.smoothquant
    act_absmax = torch.maximum(tokens.amax(0), -tokens.amin(0))
    if group_name in sq.group_alpha or not sq.alphas:
        alpha = sq.group_alpha.get(group_name, sq.alpha)
        return alpha, smoothing_factors(act_absmax, list(weights.values()), alpha)
    scheme = next(s for s in quantized.values() if SCHEMES[s].activation_bits is not None)
    info = SCHEMES[scheme]
    gs = info.group_size_for(recipe.group_size)

    def quantize_weight(w):
        return numerics.dequantize(*numerics.quantize_weight(w, info.weight_bits, gs))

    alpha, s = search_alpha(stride(tokens, SEARCH_TOKENS), act_absmax, [weights[n] for n in quantized],
                            sq.alphas, _input_quantizer(info), quantize_weight)
    return alpha, (None if alpha is None else s)


def _input_quantizer(info):
    """x -> x as a scheme's Linears compute with it, for scoring candidates on a token sample
    (static W8A8: the sample's own min-max range). Overwrites x where it can."""
    def quantize_input(x):
        if info.activation_mode == "dynamic":
            return numerics.fake_quantize_activation_dynamic(x, in_place=True)
        if info.activation_mode == "static":
            scale, offset = numerics.activation_qparams(x.min(), x.max())
            return numerics.dequantize(numerics.quantize(x, scale, 8, offset=offset), scale, offset)
        return x
    return quantize_input


def symmetric_weights(scheme: str, recipe: Recipe) -> bool:
    """Whether a member of `scheme` gets symmetric weights (zero points only where the scheme stores them)."""
    return recipe.weights.symmetric or not SCHEMES[scheme].weight_zero_points


def weight_qparams(scheme: str, w: torch.Tensor, gs: int, symmetric: bool, ratio: torch.Tensor | float = 1.0,
                   group_scale=None) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """The scheme's weight quantizer: (scale, offset or None, (s1, s2) or None) of w [n, k] with its
    range shrunk by `ratio` (two-stage int4: s1 from the row, s2 from the shrunk per-group scale,
    scale = s1 * s2; `group_scale`: that per-group scale given instead, e.g. an MSE observer's)."""
    info = SCHEMES[scheme]
    scale, offset = numerics.weight_qparams(w, info.weight_bits, gs, symmetric, ratio)
    two_stage = info.fixed_scales(w, gs, group_scale or (lambda: scale))
    if two_stage is not None:
        return two_stage[0] * two_stage[1], None, two_stage
    return scale, offset, None


def choose_awq(tokens: torch.Tensor, weights: dict[str, torch.Tensor], quantized: dict[str, str],
               recipe: Recipe, prefix: str = "", group_size: int | None = None,
               token_weights: torch.Tensor | None = None) -> tuple[float | str | None, torch.Tensor | None]:
    """(alpha, s [k]) of the AWQ scaling for a group with input tokens [t, k] and members'
    weights [n_i, k]: the best of the recipe's `awq.alphas` or no scaling (alpha and s None),
    scored on a token sample with the first quantized member's scheme: its activation
    quantizer and (`awq.score` minmax) its min-max weights, or (`final`) each member's own
    rounding as `quantize_linears` does it (clip search, GPTQ on the scaled inputs' Hessian).
    `prefix` names the layer; `group_size`: instead of the recipe's (per-channel experts).
    `token_weights` [t]: each token's error counts with its weight (`output_norm_weights`; the
    activation quantizer must then be per token, so that it commutes with the weighting)."""
    scheme = next(iter(quantized.values()))
    info = SCHEMES[scheme]
    gs = info.group_size_for(recipe.group_size if group_size is None else group_size)
    symmetric = symmetric_weights(scheme, recipe)

    def minmax_weight(w, _s):
        scale, offset, _ = weight_qparams(scheme, w, gs, symmetric)
        return numerics.fake_quantize_weight(w, scale, info.weight_bits, offset)

    names = list(quantized)
    rows = [weights[n].shape[0] for n in names]
    fit = hessian_sample(tokens, recipe)
    fit_weights = hessian_sample_weights(token_weights, tokens.shape[-1], recipe)

    # A weight-only scheme's input is fit / s itself, whose Hessian is D H D with D = diag(1 / s)
    # and H the Hessian of fit: formed once for all candidates (GPTQ's Hessian over tens of
    # thousands of tokens is most of a candidate's cost), not once per candidate.
    unscaled: dict[str, torch.Tensor] = {}

    def final_weight(w, s):
        inputs = {sch: weigh(_input_quantizer(SCHEMES[sch])(fit / s), fit_weights)
                  for sch in dict.fromkeys(quantized.values())}
        plans = {n: _plan(n, quantized[n], part, recipe, prefix, None, group_size, inputs[quantized[n]])
                 for n, part in zip(names, w.split(rows))}
        hessians = {}
        for sch in inputs:
            if SCHEMES[sch].activation_mode == "none" and any(p["method"] == "gptq" for p in plans.values()):
                if sch not in unscaled:
                    unscaled[sch] = hessian(weigh(fit, fit_weights))
                d = 1.0 / s.double()
                hessians[sch] = unscaled[sch] * d[:, None] * d[None, :]
        rounded = _round(plans, inputs, recipe, hessians)
        return torch.cat([numerics.dequantize(*rounded[n], plans[n]["offset"]) for n in names])

    alpha, s = search_scales(sample(tokens, SEARCH_TOKENS, token_weights), activation_mean(tokens, token_weights),
                             [weights[n] for n in quantized], recipe.awq.alphas, _input_quantizer(info),
                             final_weight if recipe.awq.score == "final" else minmax_weight,
                             recipe.awq.duo, gs)
    return alpha, (None if alpha is None else s)


# ----------------------------------------------------------------------- observe

def running_qparams(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """msModelSlim's running observer, vectorized over the batch: sample b of x [B, L, k] is
    quantized with the min/max of samples 0..b (its calibration forwards run one sample at a
    time); `valid` [B, L] marks real tokens. Returns (scale, offset), each [B, 1, 1]."""
    b = x.shape[0]
    xs = x.reshape(b, -1, x.shape[-1]).float()
    valid = valid.reshape(b, -1, 1)
    mins = torch.where(valid, xs, torch.inf).amin((1, 2))
    maxs = torch.where(valid, xs, -torch.inf).amax((1, 2))
    scale, offset = numerics.activation_qparams(torch.cummin(mins, 0).values, torch.cummax(maxs, 0).values)
    return scale.reshape(b, 1, 1), offset.reshape(b, 1, 1)


def observe_activations(x: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                        weights: dict[str, torch.Tensor], quantized: dict[str, str],
                        recipe: Recipe) -> ActivationQParams:
    """The group's static activation range, one for all its members, from its input x
    [B, L, k] (`tokens` [t, k]: its real tokens, `valid` [B, L] marks them), by the recipe's
    observer (mse weighs input channels by the members' squared weights)."""
    if not any(SCHEMES[s].activation_mode == "static" for s in quantized.values()):
        return ActivationQParams()
    observer = recipe.activations.observer
    if observer == "running":
        running = running_qparams(x, valid)
        return ActivationQParams(running[0][-1].reshape(1), running[1][-1].reshape(1), running)
    if observer == "mse":
        importance = sum(weights[n].float().pow(2).sum(0) for n in quantized)
        return ActivationQParams(*numerics.activation_qparams(*mse_activation_range(tokens, importance)))
    obs = RangeObserver(recipe.activations.percentile if observer == "percentile" else 100.0)
    obs.update(tokens)
    return ActivationQParams(*obs.qparams())


def fake_quantized_inputs(x: torch.Tensor, subsample: torch.Tensor, quantized: dict[str, str],
                          qparams: ActivationQParams, in_place: bool = False
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per scheme of the group's members: the input x they compute with (fake-quantized;
    `in_place` overwrites x) and the same for the error report's `subsample`."""
    inputs: dict[str, torch.Tensor] = {}
    sub_inputs: dict[str, torch.Tensor] = {}
    for scheme in dict.fromkeys(quantized.values()):
        probe = QuantizedLinear(scheme, torch.empty(0), torch.empty(0), None,
                                input_scale=qparams.input_scale, input_offset=qparams.input_offset)
        sub_inputs[scheme] = SCHEMES[scheme].fake_quant_input(subsample, probe)
        inputs[scheme] = SCHEMES[scheme].fake_quant_input(x, probe, in_place=in_place)
    return inputs, sub_inputs


# ---------------------------------------------------------------------- quantize

def _plan(name: str, scheme: str, w: torch.Tensor, recipe: Recipe, prefix: str,
          method: str | None = None, group_size: int | None = None, tokens: torch.Tensor | None = None,
          token_weights: torch.Tensor | None = None) -> dict:
    """How one member's weight w [n, k] is rounded: method, group size and the scales fixed
    before rounding, if any: two-stage int4's s1 [n, 1] and s2 [n, k // g], an AWQ clip
    search's (on `tokens` [t, k], the input the member computes with; not for an expert's
    min-max fallback) or asymmetric min-max ones with their zero points (`method`,
    `group_size`: instead of the recipe's; `token_weights` [t]: the tokens' weights)."""
    info = SCHEMES[scheme]
    fallback = method == "minmax"
    method = method or recipe.method_for(f"{prefix}.{name}")
    k = w.shape[1]
    gs = info.group_size_for(recipe.group_size if group_size is None else group_size)
    if gs and k % gs:
        raise CalibrationError(
            f"{prefix}.{name}: in-features {k} are not divisible by --group-size {gs}; "
            f"use a group size that divides {k} (e.g. 64 or 32)")
    bits = info.weight_bits
    symmetric = symmetric_weights(scheme, recipe)
    awq = recipe.awq
    ratio = None
    if awq is not None and awq.clip and not fallback and tokens is not None and tokens.shape[0]:
        def qparams(wt, r):
            return weight_qparams(scheme, wt, gs, symmetric, r)[:2]
        _, _, ratio = search_clip(w, sample(tokens, CLIP_TOKENS, token_weights), qparams, bits, gs,
                                  clip_ratios(awq.clip_min, awq.clip_grid))
        fixed, offset, two_stage = weight_qparams(scheme, w, gs, symmetric, ratio)
    elif symmetric:           # fixed only for two-stage int4; else GPTQ or min-max chooses
        fixed, offset, two_stage = weight_qparams(
            scheme, w, gs, True, group_scale=lambda: mse_weight_scale(w, bits, gs) if method == "gptq"
            else numerics.weight_scale(w, bits, gs))
        if two_stage is None:
            fixed = None
    else:
        fixed, offset, two_stage = weight_qparams(scheme, w, gs, False)
    s1, s2 = two_stage or (None, None)
    return dict(scheme=scheme, method=method, w=w, gs=gs, s1=s1, s2=s2, fixed=fixed, offset=offset,
                clip=None if ratio is None else ratio.mean().item())


# ------------------------------------------------------------------------ gated MLP rows

KMEANS_TOKENS = 1024        # evenly spaced tokens each row's weights are clustered on
ROW_WEIGHT_FLOOR = 0.05     # every token keeps this share of a row's mean weight
ROW_CHUNK = 2048            # tokens per pass (the [tokens, rows] weights are never held whole)


def gate_up_sensitivities(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens x [t, k] of a gated MLP act(x W_gate^T) * (x W_up^T): the squared factor by
    which an error in each row's output reaches the product, (act'(g) u)^2 for gate's rows and
    act(g)^2 for up's, both [t, n] (act' by autograd, so any elementwise activation works)."""
    g = x @ w_gate.t()
    u = x @ w_up.t()
    with torch.enable_grad():
        g = g.requires_grad_(True)
        a = act(g)
        (slope,) = torch.autograd.grad(a.sum(), g)
    return slope.mul_(u).square_(), a.detach().square_()


def kmeans(points: torch.Tensor, clusters: int, iterations: int = 15, seed: int = 0) -> torch.Tensor:
    """Labels [n] in [0, min(clusters, n)) of points [n, d]: Lloyd's k-means from `clusters`
    points drawn with `seed`."""
    n = points.shape[0]
    count = min(clusters, n)
    centres = points[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count]].clone()
    labels = torch.zeros(n, dtype=torch.long)
    for _ in range(iterations):
        labels = torch.cdist(points, centres).argmin(1)
        for c in range(count):
            members = labels == c
            if members.any():
                centres[c] = points[members].mean(0)
    return labels


@torch.no_grad()
def gate_up_row_weights(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, act, clusters: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq.gate_up_clusters`: (labels [n_gate + n_up], token weights [C, t]) for GPTQ on
    tokens x [t, k]. Each row's token weights (`gate_up_sensitivities`; gate's rows first) are
    divided by their mean and mixed with ROW_WEIGHT_FLOOR of uniform, rows with similar
    weights are clustered (k-means on KMEANS_TOKENS tokens), and a cluster's token weights are
    the mean of its rows': its GPTQ Hessian is then X^T diag(weights) X."""
    x, w_gate, w_up = x.float(), w_gate.float(), w_up.float()
    t, n = x.shape[0], w_gate.shape[0] + w_up.shape[0]

    def row_weights(lo: int, hi: int) -> torch.Tensor:        # [hi - lo, n]
        return torch.cat(gate_up_sensitivities(x[lo:hi], w_gate, w_up, act), 1)

    sums = torch.zeros(n, dtype=torch.float64)
    for lo in range(0, t, ROW_CHUNK):
        sums += row_weights(lo, lo + ROW_CHUNK).sum(0, dtype=torch.float64)
    inv_mean = (t / sums.clamp(min=1e-30)).float()
    points = torch.cat(gate_up_sensitivities(stride(x, KMEANS_TOKENS), w_gate, w_up, act), 1).t() * inv_mean[:, None]
    labels = kmeans(points.mul_(1 - ROW_WEIGHT_FLOOR).add_(ROW_WEIGHT_FLOOR), clusters)
    count = int(labels.max()) + 1
    members = torch.zeros(n, count)
    members[torch.arange(n), labels] = 1.0
    sizes = members.sum(0)
    average = members * inv_mean[:, None] / sizes.clamp(min=1.0)        # [n, C]: each cluster's mean
    weights = torch.empty(count, t)
    for lo in range(0, t, ROW_CHUNK):
        weights[:, lo:lo + ROW_CHUNK] = (row_weights(lo, lo + ROW_CHUNK) @ average).t()
    return labels, weights.mul_(1 - ROW_WEIGHT_FLOOR).add_(ROW_WEIGHT_FLOOR)


def _gptq_by_cluster(w: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor, x: torch.Tensor,
                     bits: int, gs: int, g, scale: torch.Tensor | None, offset: torch.Tensor | None,
                     unrounded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ on rows w [n, k] cluster by cluster (`labels` [n]), cluster c on the Hessian of
    tokens x [t, k] weighted by token_weights[c] [t]; fixed `scale` / `offset` rows go along
    (and `unrounded` is filled as `gptq_quantize` fills it)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scales: torch.Tensor | None = None
    for c in range(token_weights.shape[0]):
        rows = (labels == c).nonzero().flatten()
        if not rows.numel():
            continue
        values = None if unrounded is None else torch.empty(rows.numel(), w.shape[1])
        qc, sc = gptq_quantize(w[rows], hessian(x * token_weights[c].sqrt()[:, None].to(x.dtype)), bits, gs,
                               g.damp, g.block_size, g.act_order, g.mse_scales,
                               scale=None if scale is None else scale[rows],
                               offset=None if offset is None else offset[rows], unrounded=values)
        if scales is None:
            scales = torch.empty(w.shape[0], sc.shape[1], dtype=sc.dtype)
        q[rows], scales[rows] = qc, sc
        if unrounded is not None:
            unrounded[rows] = values
    return q, scales


def _round(plans: dict[str, dict], inputs: dict[str, torch.Tensor], recipe: Recipe,
           hessians: dict[str, torch.Tensor] | None = None, token_weights: torch.Tensor | None = None,
           gate_up: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every member's (q, scale): min-max, or GPTQ on the Hessian of its scheme's input
    tokens `inputs[scheme]` [t, k], weighted by `token_weights` [t] if given (or
    `hessians[scheme]`, that Hessian already formed).
    Members of one scheme share that input, so their GPTQ runs once on the rows stacked;
    `gate_up` (`gate_up_row_weights`: labels by member, cluster token weights at the Hessian's
    tokens), where it names a batch's members, makes that batch's GPTQ run per row cluster.
    With the recipe's `tune` each plan also gets `unrounded` [n, k], the values its codes were
    rounded from in code units (calibration/blocktune.py moves the rounding around them)."""
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    keep_values = recipe.tune is not None
    batches: dict[tuple, list[str]] = {}
    for name, plan in plans.items():
        bits = SCHEMES[plan["scheme"]].weight_bits
        if plan["method"] == "gptq":
            batches.setdefault((plan["scheme"], plan["gs"], plan["fixed"] is not None,
                                plan["offset"] is not None), []).append(name)
        else:
            scale = plan["fixed"] if plan["fixed"] is not None else numerics.weight_scale(plan["w"], bits, plan["gs"])
            rounded[name] = (numerics.quantize(plan["w"], scale, bits, plan["offset"]), scale)
            if keep_values:
                plan["unrounded"] = numerics.unrounded_codes(plan["w"], scale, plan["offset"])
    hessians = dict(hessians or {})

    def hessian_of(scheme: str) -> torch.Tensor:
        if scheme not in hessians:
            hessians[scheme] = hessian(hessian_sample(inputs[scheme], recipe, token_weights))
        return hessians[scheme]

    for (scheme, gs, has_fixed, has_offset), names in batches.items():
        g = recipe.gptq
        rows = [plans[n]["w"].shape[0] for n in names]
        fixed = torch.cat([plans[n]["fixed"] for n in names]) if has_fixed else None
        offset = torch.cat([plans[n]["offset"] for n in names]) if has_offset else None
        values = torch.empty(sum(rows), plans[names[0]]["w"].shape[1]) if keep_values else None
        if gate_up is not None and sorted(names) == sorted(gate_up[0]):
            q, scale = _gptq_by_cluster(torch.cat([plans[n]["w"] for n in names]),
                                        torch.cat([gate_up[0][n] for n in names]), gate_up[1],
                                        hessian_sample(inputs[scheme], recipe, token_weights),
                                        SCHEMES[scheme].weight_bits, gs, g, fixed, offset, values)
        else:
            q, scale = gptq_quantize(torch.cat([plans[n]["w"] for n in names]), hessian_of(scheme),
                                     SCHEMES[scheme].weight_bits, gs, g.damp, g.block_size, g.act_order,
                                     g.mse_scales, scale=fixed, offset=offset, unrounded=values)
        rounded.update(zip(names, zip(q.split(rows), scale.split(rows))))
        if values is not None:
            for n, v in zip(names, values.split(rows)):
                plans[n]["unrounded"] = v
    if recipe.weights.refit:
        for name, plan in plans.items():
            x = inputs.get(plan["scheme"])
            if x is None or not x.shape[0]:
                continue
            q, scale = rounded[name]
            if plan["s2"] is not None:          # two-stage int4: s2 stays an integer, s1 moves
                s1, _ = refit_scales(plan["w"], q, plan["s1"], None, hessian_of(plan["scheme"]),
                                     codes_scale=numerics.expand_groups(plan["s2"].float(), q.shape[1]))
                plan["s1"] = s1
                rounded[name] = (q, s1 * plan["s2"])
            else:
                scale, plan["offset"] = refit_scales(plan["w"], q, scale, plan["offset"], hessian_of(plan["scheme"]))
                rounded[name] = (q, scale)
    return rounded


def quantize_linears(weights: dict[str, torch.Tensor], biases: dict[str, torch.Tensor | None],
                     quantized: dict[str, str], inputs: dict[str, torch.Tensor], subsample: torch.Tensor,
                     sub_inputs: dict[str, torch.Tensor], qparams: ActivationQParams, row_parallel: bool,
                     recipe: Recipe, prefix: str, method: str | None = None,
                     group_size: int | None = None,
                     float_target: tuple[torch.Tensor, torch.Tensor] | None = None,
                     token_weights: torch.Tensor | None = None,
                     gate_up: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
                     ) -> dict[str, QuantizedLinear]:
    """The quantized members (`quantized`: name -> scheme) from their weights [n, k] and
    biases, their scheme's input tokens `inputs[scheme]` [t, k] (GPTQ's Hessian) and the
    group's activation range. Each one's `error` is its relative output error on the float
    `subsample` against its fake-quantized copy `sub_inputs[scheme]` (weight and activation
    rounding both count). `prefix` names the layer (recipe overrides, errors); `method` and
    `group_size` replace the recipe's (an expert's min-max fallback, per-channel experts).
    With the recipe's `awq.clip` each member's scales come from a clip search on its input.
    `float_target` (`gptq.float_target`): the float model's input to the group and the group's
    own input before its activation quantizer, both at the Hessian's tokens (`hessian_sample`);
    GPTQ members then round the weight whose output on their own input best matches the float
    model's output (`gptq.float_target_weight`). The fit sees the upstream drift only: fitted
    to the activation-quantized input it would also chase this input's per-token rounding.
    `token_weights` [t] (`output_norm_weights`): each token's error counts with its weight in
    the clip search and GPTQ (a given `float_target` is weighted already). `gate_up`
    (`gate_up_row_weights`): GPTQ per row cluster of a gated MLP's gate and up (see `_round`)."""
    originals = {name: weights[name].float() for name in quantized}
    targets = dict(originals)
    if float_target is not None and method != "minmax":
        names = [n for n in quantized if recipe.method_for(f"{prefix}.{n}") == "gptq"]
        if names:
            rows = [originals[n].shape[0] for n in names]
            fitted = float_target_weight(torch.cat([originals[n] for n in names]), float_target[1],
                                         float_target[0], recipe.gptq.damp, recipe.gptq.float_target_share)
            targets.update(zip(names, fitted.split(rows)))
    plans = {name: _plan(name, scheme, targets[name], recipe, prefix, method, group_size,
                         inputs.get(scheme), token_weights) for name, scheme in quantized.items()}
    rounded = _round(plans, inputs, recipe, token_weights=token_weights, gate_up=gate_up)
    linears: dict[str, QuantizedLinear] = {}
    for name, plan in plans.items():
        scheme, w = plan["scheme"], originals[name]
        q, scale = rounded[name]
        bias = biases[name].detach().float().clone() if biases[name] is not None else None
        qlin = QuantizedLinear(scheme, q, plan["s1"] if plan["s1"] is not None else scale, bias, plan["s2"],
                               qparams.input_scale, qparams.input_offset, running=qparams.running,
                               row_parallel=row_parallel, offset=plan["offset"])
        qlin.clip_ratio = plan["clip"]
        qlin.unrounded = plan.get("unrounded")
        wq = qlin.dequantized()
        ref = subsample @ w.t()
        err = sub_inputs[scheme] @ wq.t() - ref
        qlin.error = (err.norm() / ref.norm().clamp(min=1e-12)).item()
        linears[name] = qlin
    return linears
