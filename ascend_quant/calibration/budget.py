"""The quality budget (`calibrate --max-ppl-increase P`): the fewest Linear groups kept in a
higher-precision scheme so that perplexity rises at most P percent on held-out calibration data.

1. The calibration rows are split: the last quarter (at least one row) is held out, the rest
   calibrates. The held-out rows come from the calibration text, never from the eval split.
2. The recipe is calibrated as usual (run A); with a quantized fallback scheme (W8A8_DYNAMIC
   for the 4-bit schemes, `Scheme.fallback`) the fallback is calibrated everywhere too (run B).
3. A mixed model simulates any choice without calibrating it: the float model with each
   Linear computed by A's or B's quantized form (the reference kernels of its scheme) or left
   float. Smoothing is undone around each form (its input divided by the group's factor s,
   a producing Linear's rows multiplied back), so forms of different runs fit together.
4. Sensitivity of a group (a LinearGroup of one layer: q/k/v or gate/up share a scheme, as
   vLLM fuses them): one forward of the held-out rows with A everywhere, the squared
   difference between the group's output in A and in the fallback, relative to the
   fallback's. Groups are ranked by it; the fewest of the top ones whose mixed model meets
   the budget on the held-out rows is found by bisection over the count (one held-out
   forward per step; the increase falls as groups move to the fallback).
5. The recipe with those groups overridden to the fallback is calibrated again (what is
   written) and its held-out increase measured; if it misses the budget, half as many groups
   again are added, at most three times. An unreachable budget (every group in the fallback
   still misses it) is refused before that, and nothing is written.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ascend_quant.arch import ArchSpec
from ascend_quant.calibration import CalibrationError
from ascend_quant.calibration.data import Samples
from ascend_quant.calibration.recipe import Override, Recipe
from ascend_quant.schemes import SCHEMES, PreparedLinear, get_scheme, is_float, more_precise

HOLDOUT = 0.25          # share of the calibration rows held out
RETRIES = 3             # extra calibrations when the written model misses the budget


@dataclass
class Budget:
    max_increase: float            # percent of the float model's held-out perplexity
    fallback: str | None = None    # a scheme name; None: the recipe scheme's `fallback`


@dataclass
class Run:
    """One calibration: the loaded model it ran on and what quantize_model returned."""
    loaded: object
    results: dict
    kv_scales: dict
    reports: list


@dataclass
class Candidate:
    layer: int
    group: str
    linears: tuple[str, ...]       # module names
    params: int                    # weights of its Linears


def fallback_for(recipe: Recipe, budget: Budget) -> str:
    """The fallback scheme's name; a CalibrationError if it is not more precise."""
    if not (isinstance(budget.max_increase, (int, float)) and math.isfinite(budget.max_increase)
            and budget.max_increase > 0):
        raise CalibrationError(f"--max-ppl-increase must be a positive percentage, got {budget.max_increase}")
    scheme = get_scheme(recipe.scheme)
    name = budget.fallback or scheme.fallback
    if not name:
        raise CalibrationError(f"{scheme.name} has no higher-precision fallback; nothing for a budget to keep")
    try:
        fallback = get_scheme(name)
    except KeyError as e:
        raise CalibrationError(str(e).strip("'\"")) from None
    if not more_precise(fallback.name, scheme.name):
        raise CalibrationError(f"--fallback-scheme {fallback.cli_name or fallback.name} is not more precise than "
                               f"{scheme.name} (it needs at least its weight and activation bits, and more of one)")
    return fallback.name


def check_supported(recipe: Recipe, spec: ArchSpec) -> None:
    if spec.moe is not None:
        raise CalibrationError(f"{spec.name}: --max-ppl-increase is for dense models (a MoE layer's experts "
                               "take one scheme); use recipe overrides there")
    if recipe.online_rotation is not None:
        raise CalibrationError("--max-ppl-increase does not take a recipe with online_rotation yet (its mixed "
                               "model has no online rotation); calibrate without one of them")


def split_rows(samples: Samples) -> tuple[Samples, Samples]:
    """(calibration rows, held-out rows): the last quarter of the rows, at least one, held out."""
    n = samples.ids.shape[0]
    held = max(1, round(n * HOLDOUT))
    if n - held < 1:
        raise CalibrationError(f"--max-ppl-increase holds out {HOLDOUT:.0%} of the calibration samples: "
                               f"{n} row(s) are too few (give --num-samples 2 or more)")
    cut = n - held
    return (Samples(samples.ids[:cut], samples.valid[:cut], samples.position_ids[:cut]),
            Samples(samples.ids[cut:], samples.valid[cut:], samples.position_ids[cut:]))


# ------------------------------------------------------------------ the mixed model

@dataclass
class Form:
    """One Linear's quantized form from one calibration, in the float model's input domain."""
    linear: PreparedLinear
    bias: torch.Tensor | None
    s_in: torch.Tensor | None      # the group's smoothing factor: the form reads x / s
    s_out: torch.Tensor | None     # rows of a producing Linear divided by its consumer's s: multiplied back

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.s_in is not None:
            x = x / self.s_in.to(x.dtype)
        y = self.linear(x, self.bias)
        return y if self.s_out is None else y * self.s_out.to(y.dtype)


class Switch(nn.Module):
    """A float Linear that computes with a Form instead when one is set; with a probe it
    also accumulates the squared difference to another form (None: float) and that form's
    squared output."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.form: Form | None = None
        self.probe: tuple[Form | None, list[float]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) if self.form is None else self.form(x)
        if self.probe is not None:
            other, acc = self.probe
            ref = self.linear(x) if other is None else other(x)
            acc[0] += float(((y - ref) ** 2).sum())
            acc[1] += float((ref ** 2).sum())
        return y


def forms_of(run: Run, spec: ArchSpec, config, model_dtype: torch.dtype) -> dict[str, Form]:
    """Every quantized Linear of a calibration as a Form (reference kernels, stored tensors)."""
    from ascend_quant.runtime.kernels import backend as kernel_backend

    b = kernel_backend("reference")
    s_in: dict[str, torch.Tensor] = {}
    s_out: dict[str, torch.Tensor] = {}
    for report in run.reports:
        prefix = f"{spec.layers_path}.{report.index}"
        for g in spec.layer_groups(report.index, config):
            s = report.factors.get(g.name)
            if s is None:
                continue
            for name in g.linears:
                s_in[f"{prefix}.{name}"] = s
            producer = f"{prefix}.{g.producer}"
            if g.producer_kind == "linear_rows" and producer in run.results:
                full = torch.ones(run.results[producer].q.shape[0], dtype=s.dtype)
                full[g.producer_rows(full.shape[0])] = s
                s_out[producer] = full
    forms = {}
    for prefix, ql in run.results.items():
        tensors = SCHEMES[ql.scheme].pack(ql, model_dtype)
        linear = PreparedLinear.build(ql.scheme, tensors, backend=b, dtype=torch.float32)
        bias = None if ql.bias is None else ql.bias.float()
        forms[prefix] = Form(linear, bias, s_in.get(prefix), s_out.get(prefix))
    return forms


class MixedModel:
    """The float model with a Switch on every candidate Linear; `use` picks the forms."""

    def __init__(self, model: nn.Module, candidates: list[Candidate]):
        self.model = model
        self.attention = model.config._attn_implementation     # without any C8 simulation
        self.switches: dict[str, Switch] = {}
        for c in candidates:
            for name in c.linears:
                parent, _, leaf = name.rpartition(".")
                switch = Switch(model.get_submodule(name))
                setattr(model.get_submodule(parent), leaf, switch)
                self.switches[name] = switch

    def use(self, forms: dict[str, Form | None], kv_scales: dict | None = None, spec: ArchSpec | None = None) -> None:
        """Each candidate Linear's form (missing: float); with `kv_scales`, that calibration's C8
        scales fake-quantize K and V (the reference model's simulation), replacing earlier ones."""
        for name, switch in self.switches.items():
            switch.form = forms.get(name)
        if kv_scales:
            from ascend_quant.runtime.reference_model import enable_c8_simulation
            from ascend_quant.schemes import kv_entries

            named = {}
            for layer_prefix, scales in kv_scales.items():
                for proj, scale in zip(spec.kv_projections, scales):
                    named.update({n: t for n, (t, _) in kv_entries(f"{layer_prefix}.{proj}", scale).items()})
            self.model.set_attn_implementation(self.attention)
            enable_c8_simulation(self.model, named, spec)

    @torch.inference_mode()
    def nll(self, held: Samples, batch: int = 2) -> float:
        """Mean next-token NLL over the held-out rows' scored tokens (a token is scored when it
        and the one before are real and it does not start a sample)."""
        total, count = 0.0, 0
        for i in range(0, held.ids.shape[0], batch):
            ids, valid, pos = (t[i:i + batch] for t in held)
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            scored = valid[:, 1:] & valid[:, :-1] & (pos[:, 1:] > 0)
            nll = nn.functional.cross_entropy(logits[:, :-1][scored], ids[:, 1:][scored], reduction="sum")
            total, count = total + float(nll), count + int(scored.sum())
        if count == 0:
            raise CalibrationError("the held-out calibration rows have no scored tokens")
        return total / count


def candidates_of(spec: ArchSpec, config, recipe: Recipe, num_layers: int, model: nn.Module) -> list[Candidate]:
    """Every layer's Linear groups with a quantized member under the recipe."""
    out = []
    for i in range(num_layers):
        prefix = f"{spec.layers_path}.{i}"
        for g in spec.layer_groups(i, config):
            names = tuple(f"{prefix}.{n}" for n in g.linears)
            if all(is_float(recipe.scheme_for(n, g.name)) for n in names):
                continue
            params = sum(model.get_submodule(n).weight.numel() for n in names)
            out.append(Candidate(i, g.name, names, params))
    return out


def with_fallback(recipe: Recipe, chosen: list[Candidate], fallback: str) -> Recipe:
    """The recipe with the chosen groups' Linears overridden to the fallback (saved with it)."""
    out = copy.deepcopy(recipe)
    name = SCHEMES[fallback].cli_name or fallback
    out.overrides = out.overrides + [Override(match=n, scheme=name) for c in chosen for n in c.linears]
    return out


def _increase(nll: float, float_nll: float) -> float:
    return 100.0 * (math.exp(nll - float_nll) - 1.0)


def select(recipe: Recipe, budget: Budget, spec: ArchSpec, held: Samples, model_dtype: torch.dtype,
           calibrate_on: Callable[[Recipe], Run], float_model: Callable[[], nn.Module],
           log: Callable[[str], None] = lambda s: None) -> tuple[Recipe, Run, dict]:
    """Steps 2-5 of the module docstring: (the recipe written, its calibration, the report)."""
    fallback = fallback_for(recipe, budget)
    check_supported(recipe, spec)
    runs = 1
    first = calibrate_on(recipe)
    model = float_model()
    config = model.config
    cands = candidates_of(spec, config, recipe, len(spec.layers(model)), model)
    if not cands:
        raise CalibrationError("the recipe quantizes no Linear: nothing for --max-ppl-increase to choose")
    mixed = MixedModel(model, cands)
    a = forms_of(first, spec, config, model_dtype)
    b: dict[str, Form] = {}
    if not is_float(fallback):
        runs += 1
        b = forms_of(calibrate_on(with_fallback(recipe, cands, fallback)), spec, config, model_dtype)
    mixed.use({})
    float_nll = mixed.nll(held)
    mixed.use(a, first.kv_scales, spec)      # C8, where the recipe has it, from here on
    acc = {c.linears: [0.0, 0.0] for c in cands}
    for c in cands:
        for n in c.linears:
            mixed.switches[n].probe = (b.get(n), acc[c.linears])
    before = mixed.nll(held)
    for switch in mixed.switches.values():
        switch.probe = None
    sensitivity = {c.linears: acc[c.linears][0] / max(acc[c.linears][1], 1e-30) for c in cands}
    ranked = sorted(cands, key=lambda c: sensitivity[c.linears], reverse=True)
    log(f"held-out float perplexity {math.exp(float_nll):.4f}, {recipe.scheme} everywhere "
        f"{_increase(before, float_nll):+.2f}%")

    estimates: dict[int, float] = {0: _increase(before, float_nll)}

    def estimate(k: int) -> float:
        if k not in estimates:
            forms = dict(a)
            for c in ranked[:k]:
                for n in c.linears:
                    forms[n] = b.get(n)
            mixed.use(forms)
            estimates[k] = _increase(mixed.nll(held), float_nll)
            log(f"  {k} group(s) in {fallback}: {estimates[k]:+.2f}%")
        return estimates[k]

    limit = budget.max_increase
    if estimate(len(ranked)) > limit:
        raise CalibrationError(f"--max-ppl-increase {limit:g}% is unreachable: with all {len(ranked)} Linear groups "
                               f"in {fallback} the held-out perplexity still rises {estimate(len(ranked)):+.2f}% "
                               f"(float {math.exp(float_nll):.4f}); raise the budget or pick --fallback-scheme")
    lo, hi = 0, len(ranked)            # estimate(lo) misses (or lo == 0 meets), estimate(hi) meets
    if estimate(0) <= limit:
        hi = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(mid) <= limit:
            hi = mid
        else:
            lo = mid
    k = hi
    final, final_recipe = first, recipe
    for attempt in range(RETRIES + 1):
        if k > 0:
            final_recipe = with_fallback(recipe, ranked[:k], fallback)
            final = calibrate_on(final_recipe)
            runs += 1
        mixed.use(forms_of(final, spec, config, model_dtype), final.kv_scales, spec)
        after_nll = mixed.nll(held)
        after = _increase(after_nll, float_nll)
        log(f"calibrated with {k} group(s) in {fallback}: {after:+.2f}%")
        if after <= limit:
            break
        if k == len(ranked) or attempt == RETRIES:
            raise CalibrationError(f"--max-ppl-increase {limit:g}%: not met after {runs} calibrations (the last, "
                                   f"with {k} of {len(ranked)} groups in {fallback}, rose {after:+.2f}%); "
                                   "raise the budget")
        k = min(len(ranked), max(k + 1, math.ceil(k * 1.5)))
    tokens = int((held.valid[:, 1:] & held.valid[:, :-1] & (held.position_ids[:, 1:] > 0)).sum())
    report = {
        "max_ppl_increase": limit,
        "scheme": recipe.scheme,
        "fallback": fallback,
        "held_out": {"rows": int(held.ids.shape[0]), "scored_tokens": tokens},
        "float_ppl": math.exp(float_nll),
        "before": {"ppl": math.exp(before), "increase_pct": _increase(before, float_nll)},
        "after": {"ppl": math.exp(after_nll), "increase_pct": after},
        "estimate_pct": estimates.get(k),
        "calibrations": runs,
        "candidate_groups": len(ranked),
        "kept": [{"layer": c.layer, "group": c.group, "linears": list(c.linears), "scheme": fallback,
                  "sensitivity": sensitivity[c.linears], "params": c.params} for c in ranked[:k]],
    }
    return final_recipe, final, report


def format_report(report: dict) -> str:
    """The budget's lines in the calibrate command's output."""
    kept = report["kept"]
    lines = [f"quality budget: held-out perplexity within +{report['max_ppl_increase']:g}% "
             f"({report['held_out']['rows']} held-out rows, {report['held_out']['scored_tokens']} tokens, "
             f"float {report['float_ppl']:.4f}): {len(kept)} of {report['candidate_groups']} Linear groups in "
             f"{report['fallback']}",
             f"  {report['scheme']} everywhere {report['before']['increase_pct']:+.2f}%, written "
             f"{report['after']['increase_pct']:+.2f}% ({report['calibrations']} calibrations)"]
    if kept:
        lines.append(f"  {'layer':>5}  {'group':<8} {'params':>9}  sensitivity  linears")
        for c in kept:
            lines.append(f"  {c['layer']:>5}  {c['group']:<8} {c['params']:>9}  {c['sensitivity']:>11.3g}  "
                         + ", ".join(n.rpartition(".")[2] for n in c["linears"]))
    size = report.get("size")
    if size:
        lines.append(f"  size: {size['bytes']} bytes, {size['ratio']:.3f}x of float ({size['float_dtype']}, "
                     f"{size['float_bytes']} bytes)")
    return "\n".join(lines)
