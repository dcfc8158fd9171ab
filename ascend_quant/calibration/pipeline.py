"""The layer-by-layer calibrator.

For each decoder layer: run it once on the calibration inputs with hooks in place. When a
group of Linears that share an input (q/k/v, o, gate/up, down) is reached, its hook holds
that input for every calibration token and does the recipe's steps there: SmoothQuant
factors (folded into the producing norm or Linear), the activation observer (static W8A8:
one range for the whole group), GPTQ with the group's shared Hessian or min-max rounding,
then the Linears continue with fake-quantized weights and activations. The attention hook
sees post-RoPE K/V, chooses the C8 scales and fake-quantizes them. So every observation is
made on the smoothed, already-quantized-upstream activations, in a single forward per
layer, and the layer's output (what the next layer is calibrated on) is the quantized one.
"""

from __future__ import annotations

import fnmatch
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ascend_quant import memory, numerics
from ascend_quant.calibration.gptq import gptq_quantize, hessian
from ascend_quant.calibration.kv import KVObserver
from ascend_quant.calibration.observers import RangeObserver, mse_activation_range, mse_weight_scale
from ascend_quant.calibration.recipe import Recipe
from ascend_quant.calibration.smoothquant import apply_smoothing, search_alpha, smoothing_factors
from ascend_quant.calibration.kv import fake_quant_kv
from ascend_quant.arch import SAVED_SPEC_KEY, ArchSpec, LinearGroup, lean_mlp, spec_for_model
from ascend_quant.arch.attention import install_attention_hook
from ascend_quant.schemes import SCHEMES

# Tokens used for the per-Linear error report (a fixed subsample keeps it cheap).
_ERROR_TOKENS = 256
# SmoothQuant's alpha search compares its candidates on this many tokens (evenly strided),
# ~5% of the calibration time. Its choice depends on the sample: W8A8_DYNAMIC on SmolLM2-135M
# scored +0.75% to +1.17% for different samples of 256 or 512 (recipe.py keeps it for W4A8)
_SEARCH_TOKENS = 256


class CalibrationError(Exception):
    """Calibration cannot go on (NaN activations, a shape the scheme cannot take, ...)."""


class _StopForward(Exception):
    pass


@dataclass
class QuantizedLinear:
    """One Linear's quantized form, enough to write every tensor of its scheme."""
    scheme: str
    q: torch.Tensor                          # int8 [n, k] (int4 values for 4-bit)
    scale: torch.Tensor                      # [n, 1] or [n, k // g] (two-stage: s1 [n, 1])
    bias: torch.Tensor | None
    scale_second: torch.Tensor | None = None  # two-stage int4: s2 [n, k // g]
    input_scale: torch.Tensor | None = None  # static W8A8
    input_offset: torch.Tensor | None = None
    running: tuple[torch.Tensor, torch.Tensor] | None = None  # per-sample (scale, offset) [B, 1, 1]
    row_parallel: bool = False
    error: float = 0.0                       # relative output error on calibration tokens

    def effective_scale(self) -> torch.Tensor:
        if self.scale_second is not None:
            return self.scale_second * self.scale
        return self.scale

    def dequantized(self) -> torch.Tensor:
        return numerics.dequantize(self.q, self.effective_scale())

    def scale_rows(self, factor: torch.Tensor, rows: slice = slice(None)) -> None:
        """Output rows (`rows` of them) divided by `factor` after quantization (smoothing through this Linear)."""
        if rows != slice(None):
            full = torch.ones(self.q.shape[0], dtype=factor.dtype, device=factor.device)
            full[rows] = factor
            factor = full
        self.scale = self.scale / factor.unsqueeze(1)
        if self.bias is not None:
            self.bias = self.bias / factor

    def tensors(self, prefix: str, model_dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, str]]:
        """Checkpoint tensors: name -> (tensor, description type)."""
        s = self.scheme
        n = self.q.shape[0]
        out: dict[str, tuple[torch.Tensor, str]] = {}
        if s == "W8A8":
            deq = numerics.deq_scale(self.input_scale, self.scale)
            out["weight"] = (self.q, s)
            out["input_scale"] = (self.input_scale.float().reshape(1), s)
            out["input_offset"] = (self.input_offset.float().reshape(1), s)
            out["deq_scale"] = (numerics.encode_deq_scale(deq, model_dtype), s)
            out["quant_bias"] = (numerics.quant_bias(self.bias, deq, self.input_offset, self.q), s)
        elif s in ("W8A8_DYNAMIC", "W8A16"):
            out["weight"] = (self.q, s)
            out["weight_scale"] = (self.scale.float(), s)
            out["weight_offset"] = (torch.zeros_like(self.scale, dtype=torch.float32), s)
        elif s == "W4A16":
            out["weight"] = (numerics.pack_int4(self.q), s)
            out["weight_scale"] = (self.scale.float(), s)
            out["weight_offset"] = (torch.zeros_like(self.scale, dtype=torch.float32), s)
        elif s == "W4A8_DYNAMIC":
            chunks = numerics.scale_bias_chunks(self.row_parallel)
            out["weight"] = (numerics.pack_int4(self.q), s)
            out["weight_scale"] = (self.scale.float(), s)
            out["weight_offset"] = (torch.zeros(n, 1), s)
            if self.scale_second is not None:
                out["weight_scale_second"] = (self.scale_second.float(), s)
                out["weight_offset_second"] = (torch.zeros_like(self.scale_second, dtype=torch.int64), s)
                sb_scale = numerics.two_stage_scale(self.scale, self.scale_second)
            else:
                sb_scale = self.scale
            out["scale_bias"] = (numerics.scale_bias(self.q, sb_scale, chunks), s)
        else:
            raise AssertionError(s)
        if self.bias is not None:
            out["bias"] = (self.bias.float(), "FLOAT")
        return {f"{prefix}.{k}": v for k, v in out.items()}


@dataclass
class LayerReport:
    index: int
    seconds: float
    schemes: dict[str, str] = field(default_factory=dict)     # linear -> scheme
    errors: dict[str, float] = field(default_factory=dict)    # linear -> relative output error
    alphas: dict[str, float | None] = field(default_factory=dict)   # smoothed group -> alpha (None: none)


# --------------------------------------------------------------------------- hooks

def _stride(x: torch.Tensor, count: int) -> torch.Tensor:
    """At most `count` rows of x, an even stride through all of them, as a view (count 0:
    all rows)."""
    if not count or x.shape[0] <= count:
        return x
    return x[::-(-x.shape[0] // count)]


def _all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in x: one reduction without a mask tensor (a NaN or Inf anywhere makes
    the sum non-finite; activations are far too small to overflow a float32 sum)."""
    return bool(torch.isfinite(x.sum()))


def _fake_quant_activation(x: torch.Tensor, scheme: str, qlin: QuantizedLinear, in_place: bool = False
                           ) -> torch.Tensor:
    """x as the scheme's Linears compute with it (quantized, dequantized); `in_place`
    (float32 x only) overwrites x with the same values."""
    info = SCHEMES[scheme]
    if info.activation_mode == "dynamic":
        return numerics.fake_quantize_activation_dynamic(x, in_place=in_place)
    if info.activation_mode == "static" and qlin.running is None and in_place:
        scale, offset = qlin.input_scale, qlin.input_offset
        return x.div_(scale).round_().add_(offset).clamp_(numerics.INT8_MIN, numerics.INT8_MAX).sub_(offset).mul_(scale)
    if info.activation_mode == "static" and qlin.running is not None:
        scale, offset = qlin.running            # each sample with the range seen up to it
        return numerics.dequantize(numerics.quantize(x, scale, 8, offset=offset), scale, offset).to(x.dtype)
    if info.activation_mode == "static":
        # msModelSlim's definition (a true division); the NPU's bf16 reciprocal differs by <1 LSB
        q = numerics.quantize(x, qlin.input_scale, 8, offset=qlin.input_offset)
        return numerics.dequantize(q, qlin.input_scale, qlin.input_offset).to(x.dtype)
    return x


class _GroupQuantizer:
    """Quantizes one LinearGroup of a layer the first time its shared input arrives."""

    def __init__(self, layer: torch.nn.Module, group: LinearGroup, prefix: str, recipe: Recipe,
                 results: dict[str, QuantizedLinear], valid: torch.Tensor):
        self.layer, self.group, self.prefix, self.recipe, self.results = layer, group, prefix, recipe, results
        self.valid2d = valid                      # [N, L] bool: real tokens, not padding
        self.valid = valid.reshape(-1)
        self.all_valid = bool(self.valid.all())    # then `flat` below is a view, not a copy
        self.modules = {name: layer.get_submodule(name) for name in group.linears}
        self.schemes = {name: recipe.scheme_for(f"{prefix}.{name}") for name in group.linears}
        self.source: torch.Tensor | None = None     # the input as it arrived
        self.transformed: torch.Tensor | None = None
        self.seen_by_scheme: dict[str, torch.Tensor] = {}
        self.fed: set[torch.nn.Module] = set()     # members whose input has been handed over
        self.alpha: float | None = None            # the smoothing applied (None: none)
        self.smoothed = False
        self.touched: set[str] = set()             # modules (layer-relative) whose weights changed

    def pre_hook(self, module, args):
        x = args[0]
        if module in self.fed or (self.fed and x is not self.source):
            raise AssertionError(f"{self.prefix}: group {self.group.name} saw a second input in one forward")
        if not self.fed:
            self.source = x
            self.transformed = self._quantize(x)
        seen = self._activation_for(module, self.transformed)
        self.fed.add(module)
        if len(self.fed) == len(self.modules):
            # every member has its input: let go of the activations, so that they are freed
            # as soon as the layer's forward drops them (not held to the layer's end)
            self.source = self.transformed = None
            self.seen_by_scheme.clear()
        return (seen,)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[real tokens, k]: a view when there is no padding."""
        flat = x.reshape(-1, x.shape[-1])
        return flat if self.all_valid else flat[self.valid]

    def _activation_for(self, module, x: torch.Tensor) -> torch.Tensor:
        """The input a member sees; members of one scheme share it (and, for static W8A8,
        one range), so it is computed once per scheme."""
        name = next(n for n, m in self.modules.items() if m is module)
        scheme = self.schemes[name]
        if scheme == "FLOAT":
            return x
        if scheme not in self.seen_by_scheme:
            self.seen_by_scheme[scheme] = _fake_quant_activation(x, scheme, self.results[f"{self.prefix}.{name}"])
        return self.seen_by_scheme[scheme]

    def _running_qparams(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """msModelSlim's running observer, vectorized over the batch: sample b is quantized with
        the min/max of samples 0..b (its calibration forwards run one sample at a time)."""
        b = x.shape[0]
        xs = x.reshape(b, -1, x.shape[-1]).float()
        valid = self.valid2d.reshape(b, -1, 1)
        mins = torch.where(valid, xs, torch.inf).amin((1, 2))
        maxs = torch.where(valid, xs, -torch.inf).amax((1, 2))
        scale, offset = numerics.activation_qparams(torch.cummin(mins, 0).values, torch.cummax(maxs, 0).values)
        return scale.reshape(b, 1, 1), offset.reshape(b, 1, 1)

    def _smooths(self, schemes) -> bool:
        """Smoothing helps activation quantization; weight-only groups skip it, and smoothing
        through a Linear (up_proj -> down_proj) is optional."""
        sq, producer = self.recipe.smoothquant, self.group.producer
        if sq is None or producer is None:
            return False
        if not any(SCHEMES[s].activation_bits is not None for s in schemes):
            return False
        return sq.smooth_down or not isinstance(self.layer.get_submodule(producer), torch.nn.Linear)

    def _smoothing(self, flat: torch.Tensor, quantized: dict[str, str]) -> torch.Tensor | None:
        """The group's smoothing factors: the recipe's alpha for this group (`group_alpha`),
        else the best of its `alphas` on a token sample (None: not smoothing is best), else
        its `alpha`. Records the alpha in `self.alpha`."""
        sq = self.recipe.smoothquant
        act_absmax = torch.maximum(flat.amax(0), -flat.amin(0))
        if self.group.name in sq.group_alpha or not sq.alphas:
            self.alpha = sq.group_alpha.get(self.group.name, sq.alpha)
            return smoothing_factors(act_absmax, [m.weight for m in self.modules.values()], self.alpha)
        scheme = next(s for s in quantized.values() if SCHEMES[s].activation_bits is not None)
        info = SCHEMES[scheme]
        gs = self.recipe.group_size if info.weight_bits == 4 else 0

        def quantize_input(x):
            if info.activation_mode == "dynamic":
                return numerics.fake_quantize_activation_dynamic(x, in_place=True)
            scale, offset = numerics.activation_qparams(x.min(), x.max())
            return numerics.dequantize(numerics.quantize(x, scale, 8, offset=offset), scale, offset)

        def quantize_weight(w):
            return numerics.dequantize(*numerics.quantize_weight(w, info.weight_bits, gs))

        weights = [self.modules[n].weight for n in quantized]
        sample = _stride(flat, _SEARCH_TOKENS)
        self.alpha, s = search_alpha(sample, act_absmax, weights, sq.alphas, quantize_input, quantize_weight)
        return None if self.alpha is None else s

    @torch.no_grad()
    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        recipe, group = self.recipe, self.group
        quantized = {n: s for n, s in self.schemes.items() if s != "FLOAT"}
        if not quantized:
            memory.trim()
            return x
        flat = self._tokens(x)
        if not _all_finite(flat):
            raise CalibrationError(f"NaN or Inf in the input of {self.prefix}.{self.group.linears[0]} "
                                   "(check the model's dtype and the calibration data)")
        # The group's input has no other reader (arch.LinearGroup.sole_consumer), so when all members
        # compute with one version of it, smoothing and fake quantization overwrite it in
        # place instead of holding two more copies of the largest activation of the layer.
        in_place = (group.sole_consumer and x.dtype == torch.float32 and len(set(self.schemes.values())) == 1
                    and recipe.activations.observer != "running")
        # 1. SmoothQuant: fold s into the producer, scale the input we hold the same way
        self.smoothed = self._smooths(quantized.values())
        s = self._smoothing(flat, quantized) if self.smoothed else None
        if s is not None:
            producer = self.layer.get_submodule(group.producer)
            rows = group.producer_rows(producer.weight.shape[0])      # all, or gate_up_proj's up half
            apply_smoothing(producer, list(self.modules.values()), s, group.producer_kind, rows)
            self.touched.update([group.producer, *self.modules])
            done = self.results.get(f"{self.prefix}.{group.producer}")
            if done is not None:          # the producer is a Linear quantized earlier in this layer
                done.scale_rows(s, rows)
            x = x.div_(s) if in_place else x / s.to(x.dtype)
            flat = self._tokens(x) if self.all_valid else flat.div_(s.to(flat.dtype))
        # 2. activation range (static W8A8): one for the whole group
        input_scale = input_offset = running = None
        if any(SCHEMES[s].activation_mode == "static" for s in quantized.values()):
            if recipe.activations.observer == "running":
                running = self._running_qparams(x)
                input_scale, input_offset = running[0][-1].reshape(1), running[1][-1].reshape(1)
            elif recipe.activations.observer == "mse":
                importance = sum(self.modules[n].weight.float().pow(2).sum(0) for n in quantized)
                input_scale, input_offset = numerics.activation_qparams(*mse_activation_range(flat, importance))
            else:
                obs = RangeObserver(recipe.activations.percentile if recipe.activations.observer == "percentile" else 100.0)
                obs.update(flat)
                input_scale, input_offset = obs.qparams()
        # 3. weights: GPTQ on the shared Hessian of the (fake-quantized) input, or min-max.
        # Members of one scheme share that input, so their GPTQ runs once on the rows stacked.
        seen_flat: dict[str, torch.Tensor] = {}           # the fake-quantized input, per scheme
        subsample = flat[torch.linspace(0, flat.shape[0] - 1, min(_ERROR_TOKENS, flat.shape[0])).long()]
        sub_seen: dict[str, torch.Tensor] = {}
        plans: dict[str, dict] = {}
        for name, scheme in quantized.items():
            info = SCHEMES[scheme]
            probe = QuantizedLinear(scheme, torch.empty(0), torch.empty(0), None,
                                    input_scale=input_scale, input_offset=input_offset)
            if scheme not in seen_flat:
                # the input the members compute with: kept for the forward (unless msModelSlim's
                # per-sample running ranges apply there), its real tokens feed the Hessian
                sub_seen[scheme] = _fake_quant_activation(subsample, scheme, probe)
                full = _fake_quant_activation(x, scheme, probe, in_place=in_place)
                if running is None:
                    self.seen_by_scheme[scheme] = full
                seen_flat[scheme] = self._tokens(full)
            method = recipe.method_for(f"{self.prefix}.{name}")
            w = self.modules[name].weight.float()
            k = w.shape[1]
            gs = recipe.group_size if info.weight_bits == 4 or (scheme == "W8A16" and recipe.group_size) else 0
            if gs and k % gs:
                raise CalibrationError(
                    f"{self.prefix}.{name}: in-features {k} are not divisible by --group-size {gs}; "
                    f"use a group size that divides {k} (e.g. 64 or 32)")
            s1 = s2 = fixed = None
            if scheme == "W4A8_DYNAMIC" and gs > 0:                     # two-stage int4 scales
                s1 = numerics.absmax_scale(w.abs().amax(-1, keepdim=True), numerics.TWO_STAGE_INT8_BOUND)
                group_scale = mse_weight_scale(w, 4, gs) if method == "gptq" else numerics.weight_scale(w, 4, gs)
                s2 = torch.clamp(torch.round(group_scale / s1), 1.0, 127.0)
                fixed = s1 * s2
            plans[name] = dict(scheme=scheme, method=method, w=w, gs=gs, s1=s1, s2=s2, fixed=fixed)
        quantized_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        batches: dict[tuple, list[str]] = {}
        for name, plan in plans.items():
            if plan["method"] == "gptq":
                batches.setdefault((plan["scheme"], plan["gs"], plan["fixed"] is not None), []).append(name)
            else:
                scale = plan["fixed"] if plan["fixed"] is not None else \
                    numerics.weight_scale(plan["w"], SCHEMES[plan["scheme"]].weight_bits, plan["gs"])
                quantized_weights[name] = (numerics.quantize(plan["w"], scale, SCHEMES[plan["scheme"]].weight_bits), scale)
        for (scheme, gs, has_fixed), names in batches.items():
            g = recipe.gptq
            rows = [plans[n]["w"].shape[0] for n in names]
            fixed = torch.cat([plans[n]["fixed"] for n in names]) if has_fixed else None
            q, scale = gptq_quantize(torch.cat([plans[n]["w"] for n in names]),
                                     hessian(_stride(seen_flat[scheme], g.hessian_tokens and
                                                     max(g.hessian_tokens, 4 * seen_flat[scheme].shape[-1]))),
                                     SCHEMES[scheme].weight_bits, gs, g.damp, g.block_size, g.act_order,
                                     g.mse_scales, scale=fixed)
            quantized_weights.update(zip(names, zip(q.split(rows), scale.split(rows))))
        for name, plan in plans.items():
            scheme, module, w = plan["scheme"], self.modules[name], plan["w"]
            q, scale = quantized_weights[name]
            bias = module.bias.detach().float().clone() if module.bias is not None else None
            qlin = QuantizedLinear(scheme, q, plan["s1"] if plan["s1"] is not None else scale, bias, plan["s2"],
                                   input_scale, input_offset, running=running, row_parallel=group.row_parallel)
            wq = qlin.dequantized()
            ref = subsample @ w.t()          # the error report counts weight and activation rounding
            err = sub_seen[scheme] @ wq.t() - ref
            qlin.error = (err.norm() / ref.norm().clamp(min=1e-12)).item()
            module.weight.data = wq.to(module.weight.dtype)
            self.results[f"{self.prefix}.{name}"] = qlin
        del plans, quantized_weights, seen_flat
        memory.trim()
        return x




class _KVQuantizer:
    def __init__(self, method: str, valid: torch.Tensor):
        self.method, self.valid = method, valid
        self.k_obs, self.v_obs = KVObserver(), KVObserver()
        self.k_scale = self.v_scale = None

    def hook(self, module, key, value):
        if self.k_scale is None:
            self.k_obs.update(key, self.valid)
            self.v_obs.update(value, self.valid)
            self.k_scale, self.v_scale = self.k_obs.scale(self.method), self.v_obs.scale(self.method)
            self.k_obs.release()
            self.v_obs.release()
        return fake_quant_kv(key, self.k_scale), fake_quant_kv(value, self.v_scale)


class _ObserveOnlyKV(_KVQuantizer):
    """K/V observed but passed on unquantized (msModelSlim's calibration pass does this)."""

    def hook(self, module, key, value):
        super().hook(module, key, value)
        return key, value


def _final_pass(layer, attention, x, kwargs, results, prefix, recipe, valid):
    """Run a layer again with every static range final, observing K/V only."""
    handles = []
    for name, qlin in results.items():
        if name.startswith(prefix + "."):
            final = QuantizedLinear(qlin.scheme, qlin.q, qlin.scale, None,
                                    input_scale=qlin.input_scale, input_offset=qlin.input_offset)
            module = layer.get_submodule(name[len(prefix) + 1:])
            handles.append(module.register_forward_pre_hook(
                lambda m, args, final=final: (_fake_quant_activation(args[0], final.scheme, final),)))
    kvq = _ObserveOnlyKV(recipe.kv_cache.method, valid)
    setattr(attention, _KV_HOOK_ATTR, kvq.hook)
    try:
        out = layer(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
        delattr(attention, _KV_HOOK_ATTR)
    return (out[0] if isinstance(out, tuple) else out), kvq


_KV_HOOK_ATTR = "_ascend_quant_kv_hook"


def _dispatch_kv_hook(module, key, value):
    """The model-wide attention hook: call the hook of this attention module, if any."""
    hook = getattr(module, _KV_HOOK_ATTR, None)
    return hook(module, key, value) if hook is not None else None


# ------------------------------------------------------------------------ pipeline

@torch.no_grad()
def capture_layer_inputs(model, spec: ArchSpec, samples: torch.Tensor,
                         position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Run the model up to its first decoder layer: (hidden states [N, L, H], layer kwargs).
    `position_ids` that restart inside a row make transformers mask each sample off from the
    others (samples sharing a row)."""
    layer0 = spec.layers(model)[0]
    captured: dict = {}

    def grab(module, args, kwargs):
        captured["x"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _StopForward

    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(input_ids=samples, position_ids=position_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return captured["x"], captured["kwargs"]


@torch.no_grad()
def quantize_model(model, samples: torch.Tensor, recipe: Recipe, progress=None,
                   valid: torch.Tensor | None = None, release_weights: bool = False,
                   position_ids: torch.Tensor | None = None, stream=None) -> tuple[dict[str, QuantizedLinear], dict[str, tuple[torch.Tensor, torch.Tensor]], list[LayerReport]]:
    """Quantize `model` in place (fake-quant weights, smoothed norms) layer by layer.

    `valid` [N, L] marks real tokens (False: right padding, excluded from every statistic).
    With `release_weights` each quantized Linear's float weight is dropped once its layer is
    done (the int8 copy is all the checkpoint needs): memory falls as calibration proceeds
    instead of holding float and quantized weights side by side. With a `stream`
    (calibration/streaming.py) each layer's float weights are read just before it runs; the
    embeddings and head are dropped once the first layer's input is captured, and every
    float tensor a layer leaves unchanged once the layer is done: they stay on the meta
    device and the writer reads them from the source files (`checkpoint_tensors`).
    `position_ids` restarting inside a row separate samples that share it.
    Returns the quantized Linears by module name, the C8 scales by attention module name
    (k_scale, v_scale) and a report per layer.
    """
    spec = spec_for_model(model)
    install_attention_hook(model, _dispatch_kv_hook)
    x, kwargs = capture_layer_inputs(model, spec, samples, position_ids)
    if stream is not None:       # embeddings and head are not needed again until the checkpoint is written
        stream.release_outer()
    if valid is None:
        valid = torch.ones(samples.shape, dtype=torch.bool)
    valid = valid.to(x.device)
    results: dict[str, QuantizedLinear] = {}
    kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    reports: list[LayerReport] = []
    layers = spec.layers(model)
    for i, layer in enumerate(layers):
        start = time.perf_counter()
        if stream is not None:              # streamed: this layer's float weights arrive now
            stream.load_layer(i)
        prefix = f"{spec.layers_path}.{i}"
        groups = [_GroupQuantizer(layer, g, prefix, recipe, results, valid) for g in spec.groups]
        handles = [m.register_forward_pre_hook(gq.pre_hook) for gq in groups for m in gq.modules.values()]
        kvq = None
        if recipe.kv_cache and spec.missing_modules(layer, [spec.attention]):
            raise CalibrationError(f"{spec.name}: no attention module {spec.attention!r} for the int8 KV cache "
                                   "(see the spec's notes)")
        attention = layer.get_submodule(spec.attention) if recipe.kv_cache else None
        running = recipe.activations.observer == "running"
        if recipe.kv_cache and not running:
            kvq = _KVQuantizer(recipe.kv_cache.method, valid)
            setattr(attention, _KV_HOOK_ATTR, kvq.hook)
        x_in = x
        try:
            with lean_mlp(layer, spec):
                out = layer(x, **kwargs)
        finally:
            for h in handles:
                h.remove()
            if kvq is not None:
                delattr(attention, _KV_HOOK_ATTR)
        x = out[0] if isinstance(out, tuple) else out
        if running and recipe.kv_cache:
            # msModelSlim's dynamic_cache unit: a second pass with the final ranges, observing K/V
            x, kvq = _final_pass(layer, attention, x_in, kwargs, results, prefix, recipe, valid)
        if not _all_finite(x):
            raise CalibrationError(f"NaN or Inf in the output of {prefix} after quantization")
        if kvq is not None:
            kv_scales[prefix] = (kvq.k_scale, kvq.v_scale)
        if release_weights:
            for name in results:
                if name.startswith(prefix + "."):
                    layer.get_submodule(name[len(prefix) + 1:]).weight = torch.nn.Parameter(
                        torch.empty(0), requires_grad=False)
        if stream is not None:               # what the layer left as it was is read again when writing
            touched = set().union(*(gq.touched for gq in groups))
            stream.release([f"{prefix}.{n}" for n, _ in layer.named_parameters()
                            if n.rpartition(".")[0] not in touched and f"{prefix}.{n.rpartition('.')[0]}" not in results])
        memory.trim()                       # this layer's temporaries, back to the system
        report = _layer_report(i, time.perf_counter() - start, groups, results, prefix)
        reports.append(report)
        if progress is not None:
            progress(report)
    return results, kv_scales, reports


def _layer_report(index: int, seconds: float, groups: list[_GroupQuantizer], results: dict[str, QuantizedLinear],
                  prefix: str) -> LayerReport:
    report = LayerReport(index, seconds)
    for gq in groups:
        for name, scheme in gq.schemes.items():
            report.schemes[name] = scheme
            if scheme != "FLOAT":
                report.errors[name] = results[f"{prefix}.{name}"].error
        if gq.smoothed:
            report.alphas[gq.group.name] = gq.alpha
    return report


def checkpoint_tensors(model, results: dict[str, QuantizedLinear],
                       kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]], model_dtype: torch.dtype
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the output checkpoint and its description type. Float tensors still
    on the meta device (released by a streamed calibration, unchanged from the source) come
    out as meta tensors of the output dtype: the writer's `loader` reads them."""
    spec = spec_for_model(model)
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for prefix, qlin in results.items():
        for name, (t, kind) in qlin.tensors(prefix, model_dtype).items():
            tensors[name], types[name] = t, kind
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, param in model.state_dict().items():
        prefix = name.rpartition(".")[0]
        if prefix in results or (tied and name == "lm_head.weight"):
            continue
        dtype = _float_dtype(model_dtype)
        tensors[name] = torch.empty(param.shape, dtype=dtype, device="meta") if param.is_meta else param.detach().to(dtype)
        types[name] = "FLOAT"
    for layer_prefix, (k_scale, v_scale) in kv_scales.items():      # C8 scales sit on the K/V projections
        for proj, scale in zip(spec.kv_projections, (k_scale, v_scale)):
            name = f"{layer_prefix}.{proj}"
            tensors[f"{name}.kv_cache_scale"] = scale.float()
            tensors[f"{name}.kv_cache_offset"] = torch.zeros_like(scale, dtype=torch.float32)
            types[f"{name}.kv_cache_scale"] = types[f"{name}.kv_cache_offset"] = "C8"
    return tensors, types


def _float_dtype(model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if model_dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def matches_any(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def config_with_quant_method(config: dict) -> dict:
    """config.json for the output: msModelSlim drops quantization_config; we add ours so that
    vLLM picks the `ascend` method without --quantization (the writer puts the description in
    it, which vllm-ascend needs)."""
    cfg = json.loads(json.dumps(config))
    cfg["quantization_config"] = {"quant_method": "ascend"}
    return cfg


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------- the job

@dataclass
class CalibrationResult:
    out: Path
    seconds: float
    num_samples: int
    seq_len: int
    reports: list[LayerReport]
    spec: ArchSpec | None = None                  # the architecture spec used (discovered: notes say how)


@dataclass
class LoadedModel:
    tokenizer: object
    model: torch.nn.Module
    source_dtype: torch.dtype
    local: Path                                   # the folder holding config and tokenizer
    stream: object = None                         # a StreamedModel (layers read on demand), or None


def load_model(model_id: str, device: str = "cpu", stream: bool = True) -> LoadedModel:
    """A folder or Hub id as an fp32 model. With `stream` (and safetensors whose names match
    the modules) the decoder layers are read one at a time as calibration reaches them
    (calibration/streaming.py); otherwise the whole model is loaded by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ascend_quant.calibration.streaming import StreamedModel, StreamingUnavailable

    path = Path(model_id)
    if not path.exists() and (model_id.startswith((".", "/", "~")) or model_id.count("/") > 1):
        raise CalibrationError(f"{model_id}: no such model folder")
    where = "folder" if path.exists() else "Hugging Face Hub id (offline or not found?)"
    try:
        local = path if path.exists() else Path(_snapshot_dir(model_id))
        config = AutoConfig.from_pretrained(local)
        tokenizer = AutoTokenizer.from_pretrained(local)
        streamed = None
        if stream:
            try:
                streamed = StreamedModel(local, device)
            except StreamingUnavailable:
                streamed = None
        model = streamed.model if streamed else AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    except OSError as e:
        raise CalibrationError(f"{model_id}: cannot load as a {where}: {str(e).splitlines()[0][:200]}") from None
    except ValueError as e:
        raise CalibrationError(f"{model_id}: {str(e).splitlines()[0][:300]}") from None
    except Exception as e:
        if type(e).__module__.startswith("huggingface_hub"):       # offline, unknown repo, gated, ...
            raise CalibrationError(f"{model_id}: cannot load as a {where}: {type(e).__name__}") from None
        raise
    if device != "cpu" and streamed is None:
        model.to(device)
    source_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(source_dtype, str):
        source_dtype = getattr(torch, source_dtype)
    model.eval()
    return LoadedModel(tokenizer, model, source_dtype, local, streamed)


def _snapshot_dir(model_id: str) -> str:
    from huggingface_hub import snapshot_download
    return snapshot_download(model_id, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "*.safetensors"])


def calibrate(model_id: str, out: str | Path, recipe: Recipe, dataset: str | None = None,
              num_samples: int = 128, seq_len: int = 512, seed: int = 0, device: str = "cpu",
              chat_template: bool = False, packing: bool = True, show_progress: bool = True,
              overwrite: bool = False,
              extra_files: dict[str, str] | None = None) -> CalibrationResult:
    """The whole job: load, sample, quantize layer by layer, write the checkpoint atomically."""
    from ascend_quant.calibration.data import load_texts, tokenize_samples
    from ascend_quant.formats.ascend import write_checkpoint

    out = Path(out)
    if out.exists() and not overwrite:
        raise CalibrationError(f"{out} already exists (choose another -o or remove it)")
    start = time.perf_counter()
    torch.manual_seed(seed)
    loaded = load_model(model_id, device)
    tokenizer, model, source_dtype, local = loaded.tokenizer, loaded.model, loaded.source_dtype, loaded.local
    spec = spec_for_model(model)      # fail early on an unsupported architecture
    texts = load_texts(dataset, "calibration")
    # msModelSlim's per-sample observers (running ranges, last-sample C8) need one sample per row
    per_sample = recipe.activations.observer == "running" or (
        recipe.kv_cache is not None and recipe.kv_cache.method == "msmodelslim")
    samples, valid, position_ids = tokenize_samples(texts, tokenizer, num_samples, seq_len, seed, chat_template,
                                                    packing, share_rows=not per_sample)
    n_samples = int(((position_ids == 0) & valid).sum())
    bar = None
    if show_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(spec.layers(model)), desc="calibrating", unit="layer")

    def progress(report: LayerReport) -> None:
        if bar is not None:
            worst = max(report.errors.values(), default=0.0)
            bar.set_postfix_str(f"layer {report.index} worst rel. error {worst:.4f}")
            bar.update(1)

    try:
        results, kv_scales, reports = quantize_model(model, samples.to(device), recipe, progress, valid,
                                                     release_weights=True, position_ids=position_ids.to(device),
                                                     stream=loaded.stream)
    finally:
        if bar is not None:
            bar.close()
    tensors, types = checkpoint_tensors(model, results, kv_scales, source_dtype)
    config = config_with_quant_method(read_json(local / "config.json"))
    if spec.discovered:               # the checkpoint tools and vLLM read it back (spec_for_config)
        config[SAVED_SPEC_KEY] = spec.to_dict()
    base_model, license_ = source_identity(model_id, local)
    meta = {"tool": "ascend-quant", "base_model": base_model, "license": license_,
            "num_samples": n_samples, "seq_len": int(seq_len),
            "dataset": _dataset_name(dataset), "seed": seed}
    files = {"ascend_quant_recipe.yaml": recipe.to_yaml(),
             "ascend_quant_calibration.json": json.dumps(
                 {**meta, "seconds": round(time.perf_counter() - start, 2), "arch_spec": spec.name,
                  "layers": [{"index": r.index, "seconds": round(r.seconds, 3), "schemes": r.schemes,
                              "errors": r.errors, "smoothquant_alphas": r.alphas} for r in reports]}, indent=2)}
    files.update(extra_files or {})
    group_size = group_size_for(recipe, results)
    files["README.md"] = _card_for(types, group_size, meta, files)
    loader = None
    if loaded.stream is not None:
        def loader(name: str) -> torch.Tensor:
            return loaded.stream.files.read([name], _float_dtype(source_dtype))[name]
    write_checkpoint(out, tensors, types, group_size=group_size, source_dir=local, config=config,
                     metadata=meta, extra_files=files, overwrite=overwrite, loader=loader)
    return CalibrationResult(out, time.perf_counter() - start, n_samples, seq_len, reports, spec)


def _dataset_name(dataset: str | None) -> str:
    """How the card names the data: a Hub dataset by id, a local file by its name only."""
    if not dataset:
        return "built-in wiki text (Wikipedia lead sections, calibration split)"
    return Path(dataset).name if Path(dataset).exists() else dataset


def group_size_for(recipe: Recipe, results: dict[str, QuantizedLinear]) -> int:
    return recipe.group_size if any(SCHEMES[q.scheme].weight_bits == 4 for q in results.values()) else 0


def source_identity(model_id: str, local: Path) -> tuple[str | None, str | None]:
    """(base model id, license) of the source model: a Hub id names itself; a local folder is
    named by its card's `model_name` or config's `_name_or_path` when that looks like a Hub id."""
    license_ = name = None
    card = local / "README.md"
    if card.is_file():
        try:
            from huggingface_hub import ModelCard
            data = ModelCard.load(card).data.to_dict()
            license_, name = data.get("license"), data.get("model_name")
        except Exception:      # a malformed card of the source model is not our error
            pass
    if not Path(model_id).exists():
        return model_id, license_
    cfg_name = read_json(local / "config.json").get("_name_or_path", "")
    if not name and re.fullmatch(r"[\w.-]+/[\w.-]+", cfg_name or "") and not Path(cfg_name).exists():
        name = cfg_name
    return name or local.name, license_


def _card_for(types: dict[str, str], group_size: int, meta: dict, files: dict[str, str]) -> str:
    from ascend_quant.formats.ascend import build_description
    from ascend_quant.hub import render_card

    desc = build_description(types, group_size, meta)
    top = {k: v for k, v in desc.items() if k not in types}
    calib = json.loads(files["ascend_quant_calibration.json"])
    base = str(meta.get("base_model") or "model").rpartition("/")[2]
    return str(render_card(types, top, calib, files["ascend_quant_recipe.yaml"], None,
                           f"{base}-{top['model_quant_type']}"))


def format_reports(reports: list[LayerReport]) -> str:
    """The end-of-run summary: per layer, the schemes and the relative output error per Linear."""
    names = list(reports[0].schemes) if reports else []
    short = [n.rpartition(".")[2] for n in names]
    lines = [f"{'layer':>5}  {'seconds':>7}  " + "  ".join(f"{s:>9}" for s in short)]
    for r in reports:
        cells = []
        for n in names:
            cells.append(f"{'float':>9}" if r.schemes[n] == "FLOAT" else f"{r.errors.get(n, 0.0):>9.4f}")
        lines.append(f"{r.index:>5}  {r.seconds:>7.2f}  " + "  ".join(cells))
    schemes = sorted({s for r in reports for s in r.schemes.values()})
    lines.append(f"(relative output error per Linear on calibration tokens; schemes: {', '.join(schemes)})")
    return "\n".join(lines)
