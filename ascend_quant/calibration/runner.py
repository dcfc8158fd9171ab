"""The runner: capture the first layer's inputs, then calibrate the decoder layer by layer.

For each decoder layer: run it once on the calibration inputs with hooks in place. When a
group of Linears that share an input (q/k/v, o, gate/up, down) is reached, its hook holds
that input for every calibration token and runs the group step there (group.py):
SmoothQuant or AWQ factors (folded here into the producing norm or Linear), the activation
observer (static W8A8: one range for the whole group), GPTQ with the group's shared Hessian
or min-max rounding; then the Linears continue with fake-quantized weights and activations.
The attention hook sees post-RoPE K/V, chooses the C8 scales and fake-quantizes them. So
every observation is made on the smoothed, already-quantized-upstream activations, in a
single forward per layer, and the layer's output (what the next layer is calibrated on) is
the quantized one.

MoE layers run with per-expert Linears (arch/moe.py): each expert's groups are calibrated on
the tokens the router sends it (or, with `moe.tokens: all`, on every token), an expert with
fewer than `moe.min_tokens` real tokens (or none) gets min-max weights and is named in the
report, and a layer's experts take one scheme with per-token (or no) activation quantization.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from dataclasses import dataclass, field, replace

import torch

from ascend_quant import memory
from ascend_quant.arch import (ArchSpec, GatedMLP, LinearExperts, LinearGroup, experts_of, lean_mlp, replace_experts,
                               spec_for_model)
from ascend_quant.arch.attention import install_attention_hook
from ascend_quant.arch.spec import norm_eps
from ascend_quant.calibration import CalibrationError
from ascend_quant.calibration.group import (choose_awq, choose_smoothing, error_sample, fake_quantized_inputs,
                                            gate_up_row_weights, hessian_sample, hessian_sample_weights,
                                            observe_activations,
                                            output_norm_weights, quantize_linears, smooths, weigh)
from ascend_quant.calibration.kv import KVObserver, fake_quant_kv
from ascend_quant.calibration import blocktune, online_rotation
from ascend_quant.calibration.recipe import Recipe
from ascend_quant.calibration.smoothquant import apply_smoothing
from ascend_quant.schemes import SCHEMES, QuantizedLinear, is_float


class _StopForward(Exception):
    pass


@dataclass
class LayerReport:
    """What calibrating one decoder layer did: its time, each Linear's scheme and error, each
    smoothed group's alpha, each AWQ-searched group's alpha, each clip-searched Linear's mean ratio."""
    index: int
    seconds: float
    schemes: dict[str, str] = field(default_factory=dict)     # linear -> scheme
    errors: dict[str, float] = field(default_factory=dict)    # linear -> relative output error
    alphas: dict[str, float | None] = field(default_factory=dict)   # smoothed group -> alpha (None: none)
    awq_alphas: dict[str, float | str | None] = field(default_factory=dict)  # AWQ group -> alpha, "duo ALPHA" or None
    clip_ratios: dict[str, float] = field(default_factory=dict)     # linear -> mean AWQ clip ratio
    expert_tokens: dict[str, int] = field(default_factory=dict)     # MoE: expert -> real routed tokens
    fallbacks: dict[str, int] = field(default_factory=dict)         # experts given min-max weights -> tokens
    # smoothed or AWQ-scaled dense group -> its factor s (input channels), for the quality
    # budget's mixed-model simulation (calibration/budget.py); not written to the report
    factors: dict[str, torch.Tensor] = field(default_factory=dict)
    tune: blocktune.TuneResult | None = None          # the recipe's tune: what block tuning did


# --------------------------------------------------------------------------- hooks

def _all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in x: one reduction without a mask tensor (a NaN or Inf anywhere makes
    the sum non-finite; activations are far too small to overflow a float32 sum)."""
    return bool(torch.isfinite(x.sum()))


class _GroupHook:
    """The forward pre-hook on one LinearGroup's members: the first time the group's shared
    input arrives it runs the group step on it (group.py), folds the smoothing into the
    model and sets the fake-quantized weights; each member then gets the input it computes with."""

    def __init__(self, layer: torch.nn.Module, group: LinearGroup, prefix: str, recipe: Recipe,
                 results: dict[str, QuantizedLinear], valid: torch.Tensor, experts: LinearExperts | None = None,
                 float_input: torch.Tensor | None = None, mlp: GatedMLP | None = None):
        self.layer, self.group, self.prefix, self.recipe, self.results = layer, group, prefix, recipe, results
        self.mlp = mlp                            # the layer's gated MLP (gptq.gate_up_clusters), if any
        self.float_input = float_input            # the float model's input at GPTQ's tokens (gptq.float_target)
        self.experts = experts                    # a routed expert's group: its layer's experts
        self.valid2d = valid                      # [N, L] bool: real tokens, not padding
        self.valid = valid.reshape(-1)
        self.all_valid = bool(self.valid.all())    # then `flat` below is a view, not a copy
        self.modules = {name: layer.get_submodule(name) for name in group.linears}
        self.schemes = {name: recipe.scheme_for(f"{prefix}.{name}", group.name) for name in group.linears}
        self.source: torch.Tensor | None = None     # the input as it arrived
        self.transformed: torch.Tensor | None = None
        self.seen_by_scheme: dict[str, torch.Tensor] = {}
        self.fed: set[torch.nn.Module] = set()     # members whose input has been handed over
        self.alpha: float | str | None = None      # the smoothing applied (None: none; "duo A": AWQ's two-sided)
        self.smoothed = False
        self.awq = False                           # scaled by AWQ's search (alpha: its choice)
        self.factor: torch.Tensor | None = None    # the s folded into the producer (None: none)
        self.touched: set[str] = set()             # modules (layer-relative) whose weights changed
        self.tokens: int | None = None             # an expert's real tokens (None: never reached)
        self.fallback = False                      # an expert given min-max weights (too few tokens)

    def pre_hook(self, module, args):
        x = args[0]
        if module in self.fed or (self.fed and x is not self.source):
            raise AssertionError(f"{self.prefix}: group {self.group.name} saw a second input in one forward")
        if not self.fed:
            self.source = x
            if self.experts is not None:
                self._expert_tokens(x)
            self.transformed = self._quantize(x)
        seen = self._activation_for(module, self.transformed)
        self.fed.add(module)
        if len(self.fed) == len(self.modules):
            # every member has its input: let go of the activations, so that they are freed
            # as soon as the layer's forward drops them (not held to the layer's end)
            self.source = self.transformed = None
            self.seen_by_scheme.clear()
        return (seen,)

    def _expert_tokens(self, x: torch.Tensor) -> None:
        """An expert's input [t, k]: which of its tokens are real, and whether they are enough."""
        valid = self.experts.routed_valid
        self.valid = torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if valid is None else valid
        self.all_valid = bool(self.valid.all())
        self.tokens = int(self.valid.sum())
        self.fallback = self.tokens < max(self.recipe.moe.min_tokens, 1) and \
            not all(is_float(s) for s in self.schemes.values())

    def quantize_unreached(self) -> None:
        """An expert the router sent no token: min-max weights from nothing but the weights."""
        weight = next(iter(self.modules.values())).weight
        self.valid = torch.ones(0, dtype=torch.bool)
        self.all_valid, self.tokens = True, 0
        self.fallback = not all(is_float(s) for s in self.schemes.values())
        self._quantize(torch.empty(0, weight.shape[1], dtype=weight.dtype))
        self.fed.update(self.modules.values())

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[real tokens, k]: a view when there is no padding."""
        flat = x.reshape(-1, x.shape[-1])
        return flat if self.all_valid else flat[self.valid]

    def _activation_for(self, module, x: torch.Tensor) -> torch.Tensor:
        """The input a member sees; members of one scheme share it (and, for static W8A8,
        one range), so it is computed once per scheme."""
        name = next(n for n, m in self.modules.items() if m is module)
        scheme = self.schemes[name]
        if is_float(scheme):
            return x
        if scheme not in self.seen_by_scheme:
            self.seen_by_scheme[scheme] = SCHEMES[scheme].fake_quant_input(x, self.results[f"{self.prefix}.{name}"])
        return self.seen_by_scheme[scheme]

    def _gate_up_rows(self, flat: torch.Tensor, weights: dict[str, torch.Tensor], quantized: dict[str, str],
                      recipe: Recipe) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """`gptq.gate_up_clusters`: the row clusters and their token weights at GPTQ's tokens
        (group.gate_up_row_weights) when this group is the layer's gated MLP's gate and up, both
        rounded by GPTQ; else None."""
        mlp, clusters = self.mlp, recipe.gptq.gate_up_clusters
        if not clusters or mlp is None or sorted(quantized) != sorted((mlp.gate, mlp.up)) or \
                any(recipe.method_for(f"{self.prefix}.{n}") != "gptq" for n in quantized):
            return None
        labels, token_weights = gate_up_row_weights(hessian_sample(flat, recipe), weights[mlp.gate], weights[mlp.up],
                                                    mlp.activation_fn(), clusters)
        n_gate = weights[mlp.gate].shape[0]
        return {mlp.gate: labels[:n_gate], mlp.up: labels[n_gate:]}, token_weights

    @torch.no_grad()
    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Run the group step on the group's input x [B, L, k]; returns x as the members
        receive it (smoothed; fake-quantized too where all of them share one version)."""
        recipe, group = self.recipe, self.group
        quantized = {n: s for n, s in self.schemes.items() if not is_float(s)}
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
        weights = {name: m.weight for name, m in self.modules.items()}
        # 1. SmoothQuant: fold s into the producer, scale the input we hold the same way
        producer = self.layer.get_submodule(group.producer) if group.producer is not None else None
        if producer is not None and any(hasattr(m, online_rotation.Q_ATTR) for m in self.modules.values()):
            producer = None     # an online rotation sits between the producer and this input
        self.awq = producer is not None and not self.fallback and recipe.awq is not None and bool(recipe.awq.alphas)
        self.smoothed = producer is not None and not self.fallback and not self.awq and \
            smooths(recipe, quantized.values(), isinstance(producer, torch.nn.Linear))
        s = None
        expert = self.experts is not None
        group_size = 0 if expert and _activations_quantized(quantized) else None      # per-channel experts
        if expert and not recipe.weights.symmetric:
            # zero points are for dense Linears: vllm-ascend's W4A16 experts have no weight_offset
            recipe = replace(recipe, weights=replace(recipe.weights, symmetric=True))
        # a post-norm reads the member's output: each token's error counts as the norm passes it on
        token_weights = None
        if group.output_norm is not None and recipe.weights.post_norm and not expert and \
                all(SCHEMES[q].activation_mode != "static" for q in quantized.values()):
            member = next(iter(self.modules.values()))
            norm = self.layer.get_submodule(group.output_norm)
            token_weights = output_norm_weights(flat, member.weight, member.bias, norm_eps(norm))
        if self.awq:
            self.alpha, s = choose_awq(flat, weights, quantized, recipe, self.prefix, group_size, token_weights)
        elif self.smoothed:
            self.alpha, s = choose_smoothing(flat, weights, quantized, recipe, group.name)
        if s is not None:
            self.factor = s.detach().clone()
            rows = group.producer_rows(producer.weight.shape[0])      # all, or gate_up_proj's up half
            apply_smoothing(producer, list(self.modules.values()), s, group.producer_kind, rows)
            self.touched.update([group.producer, *self.modules])
            done = self.results.get(f"{self.prefix}.{group.producer}")
            if done is not None:          # the producer is a Linear quantized earlier in this layer
                done.scale_rows(s, rows)
            x = x.div_(s) if in_place else x / s.to(x.dtype)
            flat = self._tokens(x) if self.all_valid else flat.div_(s.to(flat.dtype))
        # 2. activation range (static W8A8): one for the whole group
        qparams = observe_activations(x, flat, self.valid2d, weights, quantized, recipe)
        # gptq.float_target: the float model's input and this one, before the activation quantizer
        float_target = None
        if self.float_input is not None:
            fit_weights = hessian_sample_weights(token_weights, flat.shape[-1], recipe)
            float_target = (weigh(self.float_input if s is None else self.float_input / s, fit_weights),
                            weigh(hessian_sample(flat, recipe).float().clone(), fit_weights))
            self.float_input = None
        # gptq.gate_up_clusters (not with the float target, whose fit is to the shared Hessian)
        gate_up = None if expert or float_target is not None else self._gate_up_rows(flat, weights, quantized, recipe)
        # 3. the input each scheme's members compute with: kept for the forward (unless
        # msModelSlim's per-sample running ranges apply there), its real tokens feed GPTQ
        subsample = error_sample(flat)
        inputs, sub_inputs = fake_quantized_inputs(x, subsample, quantized, qparams, in_place)
        if qparams.running is None:
            self.seen_by_scheme.update(inputs)
        seen = {scheme: self._tokens(t) for scheme, t in inputs.items()}
        del inputs
        # 4. the weights: GPTQ on the group's shared Hessian, or min-max
        biases = {name: m.bias for name, m in self.modules.items()}
        linears = quantize_linears(weights, biases, quantized, seen, subsample, sub_inputs, qparams,
                                   group.row_parallel, recipe, self.prefix,
                                   method="minmax" if self.fallback else None, group_size=group_size,
                                   float_target=float_target, token_weights=token_weights, gate_up=gate_up)
        del float_target
        for name, qlin in linears.items():
            module = self.modules[name]
            module.weight.data = qlin.dequantized().to(module.weight.dtype)
            self.results[f"{self.prefix}.{name}"] = qlin
        del seen, linears
        memory.trim()
        return x


def _activations_quantized(quantized: dict[str, str]) -> bool:
    return any(SCHEMES[s].activation_bits is not None for s in quantized.values())


def expert_scheme(spec: ArchSpec, groups: tuple[LinearGroup, ...], prefix: str, recipe: Recipe) -> str:
    """The one scheme of a MoE layer's routed experts; a CalibrationError if the recipe mixes
    schemes across them (vLLM and vllm-ascend hold a layer's experts in one tensor per
    name) or gives them static activation ranges (vllm-ascend has no static-W8A8 experts; the
    experts take per-token dynamic activations, W4A8 per-channel, or weight-only schemes)."""
    schemes = {f"{prefix}.{n}": recipe.scheme_for(f"{prefix}.{n}", g.name) for g in groups if g.expert is not None
               for n in g.linears}
    distinct = sorted(set(schemes.values()))
    static = next((d for d in distinct if SCHEMES[d].activation_mode == "static"), None)
    if static is not None:
        raise CalibrationError(f"{prefix}: MoE experts cannot be {static} (static activation ranges); use "
                               f"w8a8-dynamic, w4a8, w8a16 or w4a16 for them, e.g. an override "
                               f"{{match: '*.{spec.moe.experts_path}.*', scheme: w8a8-dynamic}}")
    if len(distinct) > 1:
        shown = ", ".join(f"{next(n for n, s in schemes.items() if s == d)}={d}" for d in distinct)
        raise CalibrationError(f"{prefix}: the experts of one MoE layer take one scheme, the recipe gives "
                               f"{shown} (overrides, ignore and float_groups must cover every expert Linear "
                               "of the layer alike)")
    return distinct[0]


_KV_HOOK_ATTR = "_ascend_quant_kv_hook"


def _dispatch_kv_hook(module, key, value):
    """The model-wide attention hook: call the hook of this attention module, if any."""
    hook = getattr(module, _KV_HOOK_ATTR, None)
    return hook(module, key, value) if hook is not None else None


class _KVQuantizer:
    """One attention module's C8 hook: chooses the K/V scales on the first post-RoPE K/V it
    sees and fake-quantizes them."""

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


@contextlib.contextmanager
def _kv_hooked(attention, kvq: _KVQuantizer | None):
    """`kvq`'s hook on `attention` for the block's forwards (nothing where kvq is None)."""
    if kvq is None:
        yield
        return
    setattr(attention, _KV_HOOK_ATTR, kvq.hook)
    try:
        yield
    finally:
        delattr(attention, _KV_HOOK_ATTR)


def _hidden_states(out):
    """A decoder layer's output hidden states (some families return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def _final_pass(layer, attention, x, kwargs, results, prefix, recipe, valid):
    """Run a layer again with every static range final, observing K/V only."""
    handles = []
    for name, qlin in results.items():
        if name.startswith(prefix + "."):
            final = QuantizedLinear(qlin.scheme, qlin.q, qlin.scale, None,
                                    input_scale=qlin.input_scale, input_offset=qlin.input_offset)
            module = layer.get_submodule(name[len(prefix) + 1:])
            handles.append(module.register_forward_pre_hook(
                lambda m, args, final=final: (SCHEMES[final.scheme].fake_quant_input(args[0], final),)))
    kvq = _ObserveOnlyKV(recipe.kv_cache.method, valid)
    try:
        with _kv_hooked(attention, kvq):
            out = layer(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return _hidden_states(out), kvq


# ---------------------------------------------------------------------- the layers

def _float_copy(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of `layer` as it is now (before calibration touches it: float) without the
    calibration's hooks."""
    ref = copy.deepcopy(layer)
    for m in ref.modules():          # a deep copy carries the layer's hooks along: not on the float copy
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    for m in online_rotation.rotated_modules(ref):       # but an online input rotation is the model's
        online_rotation.attach(m)
    return ref


@torch.no_grad()
def _tuned_pass(layer, spec: ArchSpec, attention, x: torch.Tensor, kwargs: dict, recipe: Recipe,
                valid: torch.Tensor) -> tuple[torch.Tensor, _KVQuantizer | None]:
    """The layer once more after block tuning moved its codes: its output, and with C8 the K/V
    scales of the tuned K/V."""
    kvq = _KVQuantizer(recipe.kv_cache.method, valid) if attention is not None else None
    with _kv_hooked(attention, kvq), lean_mlp(layer, spec):
        out = layer(x, **kwargs)
    return _hidden_states(out), kvq


@torch.no_grad()
def _float_forward(layer, spec: ArchSpec, groups: tuple[LinearGroup, ...], x: torch.Tensor, kwargs: dict,
                   valid: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`gptq.float_target`: a float copy of `layer` (taken before calibration touches it) on the
    float model's hidden states x. Returns its output (the next layer's float input) and, per
    dense group (by its first member), the group's input at GPTQ's Hessian tokens. Routed
    experts get none: their tokens differ between the float and the quantized model."""
    ref = _float_copy(layer)
    mask = valid.reshape(-1)
    all_valid = bool(mask.all())
    captured: dict[str, torch.Tensor] = {}

    def grab(name):
        def hook(module, args):
            if name not in captured:
                flat = args[0].reshape(-1, args[0].shape[-1])
                captured[name] = hessian_sample(flat if all_valid else flat[mask], recipe).float().clone()
        return hook

    handles = [ref.get_submodule(g.linears[0]).register_forward_pre_hook(grab(g.linears[0]))
               for g in groups if g.expert is None]
    try:
        with lean_mlp(ref, spec):
            out = ref(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return _hidden_states(out), captured


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
                   position_ids: torch.Tensor | None = None, stream=None,
                   spill=None) -> tuple[dict[str, QuantizedLinear], dict[str, tuple[torch.Tensor, torch.Tensor]], list[LayerReport]]:
    """Quantize `model` in place (fake-quant weights, smoothed norms) layer by layer.

    `valid` [N, L] marks real tokens (False: right padding, excluded from every statistic).
    With `release_weights` each quantized Linear's float weight is dropped once its layer is
    done (the int8 copy is all the checkpoint needs): memory falls as calibration proceeds
    instead of holding float and quantized weights side by side. With a `stream`
    (calibration/streaming.py) each layer's float weights are read just before it runs; the
    embeddings and head are dropped once the first layer's input is captured, and every
    float tensor a layer leaves unchanged once the layer is done: they stay on the meta
    device and the writer reads them from the source files (`checkpoint_tensors`).
    `position_ids` restarting inside a row separate samples that share it. A `spill`
    callable is handed each finished layer's quantized Linears (module name -> QuantizedLinear),
    which are then left out of the results: calibration.job writes them to disk there, so
    the int8 weights of the finished layers are not all held until the checkpoint is written.
    Returns the quantized Linears by module name (those not spilled), the C8 scales by
    attention module name (k_scale, v_scale) and a report per layer.
    """
    spec = spec_for_model(model)
    if recipe.kv_cache and not spec.kv_projections:
        raise CalibrationError(f"{spec.name}: no int8 KV cache (C8) for this attention (its cache holds no "
                               "per-head K/V, e.g. MLA); drop kv_cache from the recipe")
    replace_experts(model, spec)            # MoE: per-expert Linears (a no-op when streamed)
    install_attention_hook(model, _dispatch_kv_hook)
    if stream is not None:       # the embedding rows of the calibration tokens, not the whole matrix
        stream.load_embedding_rows(samples)
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
    # gptq.float_target: the float model's hidden states, run alongside through float copies;
    # the Hessian and the fit then take gptq.float_target_tokens tokens
    x_float = x.clone() if recipe.gptq.float_target and recipe.activations.observer != "running" else None
    if x_float is not None:
        recipe = replace(recipe, gptq=replace(recipe.gptq, hessian_tokens=recipe.gptq.float_target_tokens))
    # tune with the float model's hidden states as the target, where gptq.float_target does not run them
    # (not with the running observer, which no layer is tuned under)
    x_tune = x.clone() if recipe.tune is not None and recipe.tune.target == "float" and x_float is None \
        and recipe.activations.observer != "running" else None
    rotations = torch.Generator().manual_seed(recipe.online_rotation.seed) if recipe.online_rotation else None
    for i, layer in enumerate(layers):
        start = time.perf_counter()
        if stream is not None:              # streamed: this layer's float weights arrive now
            stream.load_layer(i)
        rotated = [online_rotation.rotate_layer(layer, spec, rotations)] if rotations is not None else []
        prefix = f"{spec.layers_path}.{i}"
        layer_groups = spec.layer_groups(i, model.config)
        experts = experts_of(layer, spec)
        if experts is not None:
            expert_scheme(spec, layer_groups, prefix, recipe)
            experts.token_mask, experts.counts = valid.reshape(-1), {}
            experts.all_tokens = recipe.moe.tokens == "all"
        running = recipe.activations.observer == "running"
        # tune: the float layer's output is the target (with the float target, the float model's)
        tune = recipe.tune is not None and experts is None and not running
        reference = _float_copy(layer) if x_float is None and (tune or x_tune is not None) else None
        float_inputs: dict[str, torch.Tensor] = {}
        if x_float is not None:
            x_float, float_inputs = _float_forward(layer, spec, layer_groups, x_float, kwargs, valid, recipe)
        groups = [_GroupHook(layer, g, prefix, recipe, results, valid, experts if g.expert is not None else None,
                             float_inputs.pop(g.linears[0], None), spec.mlp)        # none for routed experts
                  for g in layer_groups]
        del float_inputs
        handles = [m.register_forward_pre_hook(gq.pre_hook) for gq in groups for m in gq.modules.values()]
        if recipe.kv_cache and spec.missing_modules(layer, [spec.attention]):
            raise CalibrationError(f"{spec.name}: no attention module {spec.attention!r} for the int8 KV cache "
                                   "(see the spec's notes)")
        attention = layer.get_submodule(spec.attention) if recipe.kv_cache else None
        kvq = _KVQuantizer(recipe.kv_cache.method, valid) if recipe.kv_cache and not running else None
        x_in = x
        try:
            with _kv_hooked(attention, kvq), lean_mlp(layer, spec):
                out = layer(x, **kwargs)
        finally:
            for h in handles:
                h.remove()
            if experts is not None:
                experts.token_mask, experts.all_tokens = None, False
        x = _hidden_states(out)
        for gq in groups:                   # experts the router sent no token
            if gq.experts is not None and not gq.fed:
                gq.quantize_unreached()
        if running and recipe.kv_cache:
            # msModelSlim's dynamic_cache unit: a second pass with the final ranges, observing K/V
            x, kvq = _final_pass(layer, attention, x_in, kwargs, results, prefix, recipe, valid)
        tuned = None
        if x_tune is not None:               # the float model's hidden states, one layer on
            x_tune = blocktune.layer_outputs(reference, x_tune, kwargs)
        if tune:
            if x_float is not None:
                target = x_float
            elif x_tune is not None:
                target = x_tune
            else:
                target = blocktune.layer_outputs(reference, x_in, kwargs)
            tuned = blocktune.tune_layer(layer, prefix, results, x_in, target, kwargs, valid, recipe.tune, seed=i)
            del target
            if tuned is not None and tuned.kept:
                x, kvq = _tuned_pass(layer, spec, attention, x_in, kwargs, recipe, valid)
        del reference
        for name in results:
            if name.startswith(prefix + "."):
                results[name].unrounded = None
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
            touched = set().union(*(gq.touched for gq in groups), rotated)
            stream.release([f"{prefix}.{n}" for n, _ in layer.named_parameters()
                            if n.rpartition(".")[0] not in touched and f"{prefix}.{n.rpartition('.')[0]}" not in results])
        memory.trim()                       # this layer's temporaries, back to the system
        report = _layer_report(i, time.perf_counter() - start, groups, results, prefix, experts, spec)
        report.tune = tuned
        reports.append(report)
        if spill is not None:                # the layer is final: its quantized Linears leave memory
            spill({n: results.pop(n) for n in [n for n in results if n.startswith(prefix + ".")]})
            memory.trim()
        if progress is not None:
            progress(report)
    return results, kv_scales, reports


def _layer_report(index: int, seconds: float, groups: list[_GroupHook], results: dict[str, QuantizedLinear],
                  prefix: str, experts: LinearExperts | None = None, spec: ArchSpec | None = None) -> LayerReport:
    report = LayerReport(index, seconds)
    dense = {g.name for g in spec.groups} if spec is not None else set()
    for gq in groups:
        for name, scheme in gq.schemes.items():
            report.schemes[name] = scheme
            if not is_float(scheme):
                report.errors[name] = results[f"{prefix}.{name}"].error
                if results[f"{prefix}.{name}"].clip_ratio is not None:
                    report.clip_ratios[name] = round(results[f"{prefix}.{name}"].clip_ratio, 4)
        if gq.smoothed or gq.awq:
            # a MoE layer's shared-expert and expert groups are named by where they sit
            moe_group = experts is not None and (gq.group.expert is not None or gq.group.name in dense
                                                 and gq.group.linears[0].startswith(spec.moe.block + "."))
            key = f"{gq.group.linears[0].rpartition('.')[0]}.{gq.group.name}" if moe_group else gq.group.name
            (report.awq_alphas if gq.awq else report.alphas)[key] = gq.alpha
        if gq.factor is not None and experts is None:
            report.factors[gq.group.name] = gq.factor
    if experts is not None:
        base = spec.moe.experts_path
        report.expert_tokens = {f"{base}.{e}": n for e, n in sorted(experts.counts.items())}
        for gq in groups:
            if gq.experts is not None and gq.fallback:
                report.fallbacks[f"{base}.{gq.group.expert}"] = gq.tokens or 0
    return report


def format_reports(reports: list[LayerReport]) -> str:
    """The end-of-run summary: per layer, the schemes and the relative output error per Linear."""
    columns: dict[str, None] = {}          # Linear names, experts collapsed to `experts.*.<name>`
    for r in reports:
        columns.update(dict.fromkeys(_collapsed(n) for n in r.schemes))
    names = list(columns)
    leaves = [n.rpartition(".")[2] for n in names]
    # the last name, or the last two where two columns share it (a shared expert's gate_proj)
    short = ["e*." + leaf if "*" in n else ".".join(n.split(".")[-2:]) if leaves.count(leaf) > 1 else leaf
             for n, leaf in zip(names, leaves)]
    widths = [max(9, len(s)) for s in short]
    tuned = any(r.tune is not None for r in reports)
    lines = [f"{'layer':>5}  {'seconds':>7}  " + "  ".join(f"{s:>{w}}" for s, w in zip(short, widths))
             + ("  tune" if tuned else "")]
    for r in reports:
        cells = []
        for n, w in zip(names, widths):
            members = [m for m in r.schemes if _collapsed(m) == n]
            if not members:
                cells.append(f"{'-':>{w}}")
            elif all(is_float(r.schemes[m]) for m in members):
                cells.append(f"{'float':>{w}}")
            else:                            # experts: the worst one
                cells.append(f"{max(r.errors.get(m, 0.0) for m in members):>{w}.4f}")
        if tuned:
            t = r.tune
            cells.append("    -" if t is None else f"{t.after / max(t.before, 1e-30):5.2f}" + ("" if t.kept else "*"))
        lines.append(f"{r.index:>5}  {r.seconds:>7.2f}  " + "  ".join(cells))
    schemes = sorted({s for r in reports for s in r.schemes.values()})
    lines.append(f"(relative output error per Linear on calibration tokens, experts: the worst; "
                 f"schemes: {', '.join(schemes)})")
    if tuned:
        lines.append("(tune: the layer's output error after block tuning over before, on calibration samples; "
                     "* not kept: the rounding's codes stay; the per-Linear errors are from before tuning)")
    for r in reports:
        if r.fallbacks:
            shown = ", ".join(f"{e} ({n} tokens)" for e, n in r.fallbacks.items())
            lines.append(f"layer {r.index}: min-max fallback for {shown}")
    return "\n".join(lines)


def _collapsed(name: str) -> str:
    """`mlp.experts.*.down_proj` for `mlp.experts.3.down_proj` (a report column for all
    experts; inside a layer only an expert's index is a number)."""
    return re.sub(r"\.\d+\.", ".*.", name)
