"""Architecture discovery: an ArchSpec for a decoder without an explicit one, found by probing.

    spec = discover(model)        # the float model with its weights; spec.notes is the report

Decoder layer 0 stands for every layer: it runs on a few random tokens (inputs captured from
the model's own forward) with hooks on all its modules, and the spec is read off what the
hooks see, never off class or module names:

* group: Linears that receive the identical input tensor (same storage, shape and stride);
* producer: the module whose output that tensor is; its kind from a per-channel fit of the
  output against the normalised input: x̂ · w `rmsnorm`, x̂ · (1 + w) `rmsnorm_offset`,
  x̂ · w + b with its own bias `layernorm`; anything else gets no producer;
* Linear producer: scaling a Linear's output channels (or one chunk of them) scales a group's
  input channels exactly (down_proj reads up_proj, or the up half of a fused gate_up); the map
  through the attention (v -> o) is reported and not folded (the spec has no GQA channel map);
* K / V: the Linears whose scaling changes the key / value the attention function receives;
* row_parallel: the groups whose input stops moving with the layer input once every Linear's
  output is held fixed (it is reached only through the layer's Linears);
* output_norm: an RMS norm (the producer fit above) whose input is a one-Linear group's output,
  a post-norm before the residual add (Gemma, GLM-4): calibration weighs that group's tokens by
  it, and the spec's `post_norms` rule out an offline rotation.

Every fold is checked before use: a random s = exp(N(0, 0.5)) folded with calibration's own
`apply_smoothing` must leave the layer output within `TOLERANCE`, else the group gets no
producer (no smoothing; rounding and GPTQ still run). `sole_consumer` is checked as
calibration uses it: the input overwritten in place once the group has it must not change the
output. vLLM names cannot be probed: `vllm_fused` comes from the vLLM model class's
`packed_modules_mapping` when vLLM has one; `vllm_attention` and `mlp` keep their defaults.
The probe runs in the model's dtype: call it on the fp32 model calibration loads.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ascend_quant.arch.spec import ArchSpec, LinearGroup, UnsupportedModelError, norm_eps

PROBE_TOKENS = 16
TOLERANCE = 1e-5          # relative change of the layer output a fold may cause (fp32)
_FIT_TOLERANCE = 1e-4     # relative residual of the norm fit and the channel-ratio fit


class _Stop(Exception):
    pass


def find_layers(model: torch.nn.Module) -> str:
    """The path of the decoder-layer ModuleList: the longest list of one block class named in
    `_no_split_modules`, else the longest list of identical blocks holding a Linear."""
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)
             and len({type(b) for b in m}) == 1]
    named = [(n, m) for n, m in lists if type(m[0]).__name__ in wanted]
    found = named or [(n, m) for n, m in lists if any(isinstance(x, torch.nn.Linear) for x in m[0].modules())]
    if not found:
        raise UnsupportedModelError("no decoder-layer list found")
    return max(found, key=lambda c: len(c[1]))[0]


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _tensors(*items) -> list[torch.Tensor]:
    out = []
    for x in items:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            out += _tensors(*x)
        elif isinstance(x, dict):
            out += _tensors(*x.values())
    return out


class _Probe:
    """Layer 0 with its captured inputs; `run` calls it with temporary hooks."""

    def __init__(self, model, layer: torch.nn.Module, seed: int = 0):
        self.layer = layer
        self.modules = {n: m for n, m in layer.named_modules() if n}
        self.linears = {n: m for n, m in self.modules.items() if isinstance(m, torch.nn.Linear)}
        if not self.linears:
            raise UnsupportedModelError("its decoder layer has no torch Linear")
        self.gen = torch.Generator().manual_seed(seed)
        embeddings = model.get_input_embeddings().weight
        self.device = embeddings.device
        ids = torch.randint(0, embeddings.shape[0], (1, PROBE_TOKENS), generator=self.gen)
        got = {}

        def grab(module, args, kwargs):
            got["args"], got["kwargs"] = args, kwargs
            raise _Stop

        h = layer.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            model(input_ids=ids.to(self.device), use_cache=False)
        except _Stop:
            pass
        finally:
            h.remove()
        if not got:
            raise UnsupportedModelError("the probe forward never reached decoder layer 0")
        self.args, self.kwargs = got["args"], got["kwargs"]
        self.kv: list[tuple[str, torch.Tensor, torch.Tensor]] = []     # (attention module, key, value)

    def scales(self, n: int) -> torch.Tensor:
        """n random positive factors exp(N(0, 0.5)) on the model's device."""
        return torch.exp(torch.randn(n, generator=self.gen) * 0.5).to(self.device)

    def run(self, pre: dict | None = None, post: dict | None = None, perturb_input: torch.Tensor | None = None):
        """The layer output with forward pre-hooks `pre` / hooks `post` ({module name: fn})."""
        handles = [self.modules[n].register_forward_pre_hook(f) for n, f in (pre or {}).items()]
        handles += [self.modules[n].register_forward_hook(f) for n, f in (post or {}).items()]
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in self.args]
        kwargs = dict(self.kwargs)
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = kwargs["hidden_states"].clone()
        self.last_input = x = args[0] if args else kwargs["hidden_states"]
        if perturb_input is not None:
            x.mul_(perturb_input)
        self.kv.clear()
        try:
            with torch.no_grad():
                out = self.layer(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        return (out[0] if isinstance(out, tuple) else out).detach().clone()

    def trace(self):
        """(order, inputs, outputs) per module name: what one plain forward shows the hooks."""
        order, inputs, outputs = {}, {}, {}

        def pre(name):
            def f(m, args, kwargs):
                if name not in order:
                    order[name] = len(order)
                    inputs[name] = _tensors(args, kwargs)
            return f

        def post(name):
            def f(m, args, kwargs, out):
                outputs.setdefault(name, _tensors(out))
            return f

        handles = [m.register_forward_pre_hook(pre(n), with_kwargs=True) for n, m in self.modules.items()]
        handles += [m.register_forward_hook(post(n), with_kwargs=True) for n, m in self.modules.items()]
        try:
            self.run()
        finally:
            for h in handles:
                h.remove()
        return order, inputs, outputs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _norm_kind(module, x: torch.Tensor, y: torch.Tensor) -> tuple[str | None, str]:
    """Fit y = a ⊙ x̂ + c per channel, x̂ = x / rms(x) or its mean-centred form; (kind or None, why)."""
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    k = y.shape[-1]
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.shape[0] != k or x.shape[-1] != k:
        return None, "not a norm with a per-channel gain"
    eps = norm_eps(module)
    x, y, w = x.double().reshape(-1, k), y.double().reshape(-1, k), w.detach().double()
    b = b.detach().double() if isinstance(b, torch.Tensor) else torch.zeros_like(w)
    atol = 1e-4 * y.abs().max().item()
    for centred in (False, True):
        z = x - x.mean(-1, keepdim=True) if centred else x
        xhat = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
        xm, ym = xhat.mean(0), y.mean(0)
        a = ((xhat - xm) * (y - ym)).sum(0) / (xhat - xm).pow(2).sum(0)
        c = ym - a * xm
        if _rel(a * xhat + c, y) > _FIT_TOLERANCE:
            continue
        plain = not centred and torch.allclose(c, torch.zeros_like(c), atol=atol)
        if plain and torch.allclose(a, w, rtol=1e-3, atol=1e-5):
            return "rmsnorm", "y = x̂ · w"
        if plain and torch.allclose(a, 1 + w, rtol=1e-3, atol=1e-5):
            return "rmsnorm_offset", "y = x̂ · (1 + w)"
        if torch.allclose(a, w, rtol=1e-3, atol=1e-5) and torch.allclose(c, b, rtol=1e-3, atol=atol):
            return "layernorm", f"y = x̂ · w + b, x̂ {'mean-centred' if centred else 'RMS'}"
        return None, "a norm whose gain or shift is not its weight / bias"
    return None, "output is not a per-channel affine map of the normalised input"


def _channel_map(x: torch.Tensor, x2: torch.Tensor, c: torch.Tensor) -> bool:
    """Every channel of x2 is its channel of x times one of the factors c (e.g. a GQA repeat)."""
    k = x.shape[-1]
    x, x2 = x.reshape(-1, k).double(), x2.reshape(-1, k).double()
    r = (x * x2).sum(0) / x.pow(2).sum(0).clamp(min=1e-30)
    if _rel(x * r, x2) > _FIT_TOLERANCE:
        return False
    return bool(((r.unsqueeze(1) - c.to(r).unsqueeze(0)).abs().amin(1) <= 1e-6 * r.abs()).all())


def _vllm_packed(model) -> tuple[str | None, dict[str, list[str]]]:
    """(vLLM class name, its `packed_modules_mapping`) for the model's architecture; (None, {})
    without vLLM or a vLLM class for it."""
    try:
        from vllm.model_executor.models import ModelRegistry
    except Exception:
        return None, {}
    for arch in getattr(model.config, "architectures", None) or [type(model).__name__]:
        try:
            cls = ModelRegistry._try_load_model_cls(arch)
        except Exception:
            cls = None
        if cls is not None:
            return arch, {k: list(v) for k, v in (getattr(cls, "packed_modules_mapping", None) or {}).items()}
    return None, {}


@torch.no_grad()
def discover(model: torch.nn.Module) -> ArchSpec:
    """Probe decoder layer 0 of a float `model` and return the spec; `notes` is the report."""
    from ascend_quant.arch.attention import install_attention_hook

    path = find_layers(model)
    layers = model.get_submodule(path)
    layer = layers[0]
    if any(p.is_meta for p in layer.parameters()):
        raise UnsupportedModelError("it needs the weights (layer 0 is on the meta device)")
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    probe = _Probe(model, layer)
    names = {m: n for n, m in probe.modules.items()}
    _, previous = install_attention_hook(
        model, lambda m, k, v: probe.kv.append((names[m], k.clone(), v.clone())) if m in names else None)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    try:
        found = _Findings(probe, state)
        dtype = str(probe.last_input.dtype).removeprefix("torch.")
        found.report.insert(0, f"layers: {path} ({len(layers)} x {type(layer).__name__}); layer 0 probed on "
                               f"{PROBE_TOKENS} random tokens in {dtype}")
        kv = found.kv_projections()
        vllm_class, packed = _vllm_packed(model)
        groups = found.groups(packed)
    finally:
        model.set_attn_implementation(previous)
        layer.load_state_dict(state)
    report = found.report
    report.append("row-parallel: " + (", ".join(g.name for g in groups if g.row_parallel) or "none")
                  + " (inputs reached only through the layer's Linears)")
    fused = ", ".join(f"{g.vllm_fused} ({', '.join(g.linears)})" for g in groups if g.vllm_fused) or "none"
    report.append(f"vLLM fused names from {vllm_class}.packed_modules_mapping: {fused}" if vllm_class
                  else "vLLM fused names: vLLM has no class for this architecture: none")
    return ArchSpec(name=model_type, model_types=(model_type,), groups=tuple(groups),
                    layers_path=path, kv_projections=kv, notes=tuple(report), discovered=True,
                    post_norms=tuple(g.output_norm for g in groups if g.output_norm is not None))


class _Findings:
    """What the probes of one layer show; each step is one method."""

    def __init__(self, probe: _Probe, state: dict):
        self.probe, self.state, self.report = probe, state, []
        self.base = probe.run()
        self.base_kv = list(probe.kv)
        self.attention = self.base_kv[0][0] if self.base_kv else None
        self.order, self.inputs, self.outputs = probe.trace()
        self.layer_input = _key(probe.last_input)
        # Linears fed the identical tensor, in execution order
        self.by_key: dict[tuple, list[str]] = {}
        self.feeds: dict[tuple, torch.Tensor] = {}
        for n in sorted((n for n in probe.linears if n in self.order), key=self.order.get):
            x = self.inputs[n][0]
            self.by_key.setdefault(_key(x), []).append(n)
            self.feeds[_key(x)] = x
        self._perturb_linears()
        self._row_parallel()

    def _capture_inputs(self) -> tuple[dict, dict]:
        seen = {}
        return seen, {members[0]: _capture(seen, key) for key, members in self.by_key.items()}

    def _perturb_linears(self) -> None:
        """Scale each Linear's output channels (all, then each chunk of a group's width alone:
        scaling a fused gate_up's gate half too would hide the up half's map) and see which
        group inputs follow exactly, and whether the attention's key or value changes."""
        self.kv_role: dict[str, set[str]] = {}
        self.linear_producer: dict[tuple, tuple[str, tuple[int, int] | None]] = {}
        self.mapped: dict[tuple, str] = {}
        widths = {x.shape[-1] for x in self.feeds.values()}
        for lin in sorted((n for n in self.probe.linears if n in self.order), key=self.order.get):
            n_out = self.probe.linears[lin].out_features
            parts = [(0, 1)] + [(i, n_out // k) for k in sorted(widths) if k < n_out and n_out % k == 0
                                and n_out // k <= 4 for i in range(n_out // k)]
            for i, count in parts:
                rows = slice(i * n_out // count, (i + 1) * n_out // count)
                c = torch.ones(n_out, device=self.probe.device)
                c[rows] = self.probe.scales(n_out // count)
                seen, pre = self._capture_inputs()
                self.probe.run(pre, {lin: lambda m, a, out, c=c: out * c.to(out)})
                if count == 1:
                    self.kv_role[lin] = {r for (_, k0, v0), (_, k1, v1) in zip(self.base_kv, self.probe.kv)
                                         for r, a, b in (("k", k0, k1), ("v", v0, v1)) if not torch.equal(a, b)}
                through_v = "v" in self.kv_role[lin]
                for key, members in self.by_key.items():
                    if lin in members or self.order[lin] > self.order[members[0]] or key not in seen:
                        continue
                    x, x2 = self.feeds[key], seen[key]
                    if not through_v and key not in self.linear_producer and x.shape[-1] == n_out // count \
                            and _rel(x2.double(), (x * c[rows].to(x)).double()) <= _FIT_TOLERANCE:
                        self.linear_producer[key] = (lin, None if count == 1 else (i, count))
                    elif count == 1 and through_v and _channel_map(x, x2, c):
                        self.mapped[key] = lin

    def _row_parallel(self) -> None:
        """Row-parallel groups: with every Linear's output fixed, their input no longer moves
        with the layer input (it is reached only through the layer's Linears)."""
        fixed = {n: (lambda y: lambda m, a, out: y.clone())(self.outputs[n][0])
                 for n in self.probe.linears if n in self.order}
        seen, pre = self._capture_inputs()
        width = self.probe.last_input.shape[-1]
        self.probe.run(pre, fixed, perturb_input=self.probe.scales(width).to(self.probe.last_input))
        self.row_parallel = {key for key in self.by_key if key in seen and torch.equal(seen[key], self.feeds[key])}

    def kv_projections(self) -> tuple[str, str]:
        """The Linears that change only the key / only the value the attention function receives."""
        ks = [n for n, r in self.kv_role.items() if r == {"k"}]
        vs = [n for n, r in self.kv_role.items() if r == {"v"}]
        default = ArchSpec.__dataclass_fields__["kv_projections"].default
        if len(ks) == 1 and len(vs) == 1:
            self.report.append(f"K / V (post-RoPE, seen by {self.attention}'s attention function): {ks[0]}, {vs[0]}")
            return ks[0], vs[0]
        if self.attention is None:
            self.report.append("K / V: the attention function was not seen (no AttentionInterface): C8 unavailable")
            return default
        kv = tuple(f"{self.attention}.{p.rpartition('.')[2]}" for p in default)
        fused = [n for n, r in self.kv_role.items() if r == {"k", "v"}]
        self.report.append(f"K / V: from {', '.join(fused) or 'no single Linear'} (fused): C8 scales named "
                           f"{kv[0]} / {kv[1]} by convention")
        return kv

    def groups(self, packed: dict[str, list[str]]) -> list[LinearGroup]:
        out = []
        for key, members in self.by_key.items():
            role = _role(members, self.attention, key in self.row_parallel)
            taken = sum(g.name == role or g.name.startswith(role + "_") for g in out)
            group = self._group(f"{role}_{taken + 1}" if taken else role, key, members)
            fused, on_disk = _vllm_names(members, packed)
            out.append(replace(group, row_parallel=key in self.row_parallel, vllm_fused=fused, on_disk=on_disk,
                               output_norm=self._output_norm(group.name, members)))
        return out

    def _output_norm(self, role: str, members: list[str]) -> str | None:
        """The RMS norm that reads a one-Linear group's output, if any (a post-norm before the
        residual add: Gemma, GLM-4); calibration then weighs each token's error by 1 / RMS of
        that output (`LinearGroup.output_norm`). Several Linears, or a norm that reads a view
        (a per-head q/k norm): None."""
        if len(members) != 1 or not self.outputs.get(members[0]):
            return None
        out = _key(self.outputs[members[0]][0])
        for name in sorted(self.inputs, key=self.order.get):
            module = self.probe.modules[name]
            if isinstance(module, torch.nn.Linear) or not self.inputs[name] or not self.outputs.get(name) \
                    or _key(self.inputs[name][0]) != out:
                continue
            kind, why = _norm_kind(module, self.inputs[name][0], self.outputs[name][0])
            if kind in ("rmsnorm", "rmsnorm_offset"):
                self.report.append(f"{role}: {members[0]}'s output is read by {name} ({why}): a post-norm "
                                   "(tokens weighed by 1 / RMS of the output; no offline rotation)")
                return name
            if kind is not None:
                self.report.append(f"{role}: {members[0]}'s output is read by {name} ({why}): not an RMS "
                                   "norm, tokens weighed alike")
        return None

    def _group(self, role: str, key: tuple, members: list[str]) -> LinearGroup:
        """The group with its producer (kept only if its fold checks) and sole_consumer; reported."""
        lines, said = self.report, ", ".join(members)
        producer = kind = chunk = None
        made = [n for n in self.outputs if self.outputs[n][:1] and _key(self.outputs[n][0]) == key
                and not isinstance(self.probe.modules[n], torch.nn.Linear)]
        if made:
            producer = max(made, key=lambda n: n.count("."))       # the innermost module
            x_in = self.inputs[producer][0] if self.inputs[producer] else None
            kind, why = _norm_kind(self.probe.modules[producer], x_in, self.feeds[key]) if x_in is not None \
                else (None, "it has no input tensor")
            if kind is None:
                lines.append(f"{role}: {said} read {producer} ({why})")
                producer = None
        elif key in self.linear_producer:
            producer, chunk = self.linear_producer[key]
            kind, why = "linear_rows", "rows" if chunk is None else f"rows chunk {chunk[0]} of {chunk[1]}"
        elif key in self.mapped:
            lines.append(f"{role}: {said}: input channels follow {self.mapped[key]}'s through the attention: "
                         "no v -> o fold (the spec has no GQA channel map; explicit specs leave o unsmoothed too)")
        elif key == self.layer_input:
            lines.append(f"{role}: {said} read the layer input (the residual stream): no producer")
        else:
            lines.append(f"{role}: {said}: no module produced its input (a functional result): no producer")
        if producer is not None:
            group = LinearGroup(role, tuple(members), producer, kind, producer_chunk=chunk)
            err = _fold_error(self.probe, self.state, group, self.base)
            if err <= TOLERANCE:
                lines.append(f"{role}: {said} <- {producer} ({kind}: {why}); fold checked, layer output "
                             f"changed {err:.1e}")
            else:
                lines.append(f"{role}: {said} <- {producer}: the fold changed the layer output by {err:.1e} "
                             f"(> {TOLERANCE:g}; another reader of its output?): no smoothing")
                producer = kind = chunk = None
        others = [n for n in self.inputs if n not in members and not any(m.startswith(n + ".") for m in members)
                  and any(_key(t) == key for t in self.inputs[n])]
        sole = not others and _in_place_safe(self.probe, members, self.base)
        if others:
            lines.append(f"{role}: its input is also read by {', '.join(others)} (not a sole consumer)")
        elif not sole:
            lines.append(f"{role}: its input overwritten in place changed the layer output: read elsewhere too "
                         "(not a sole consumer)")
        return LinearGroup(role, tuple(members), producer, kind, sole_consumer=sole, producer_chunk=chunk)


def _capture(store: dict, key):
    """A pre-hook keeping a copy of the input it sees first under `key`."""
    def hook(module, args):
        store.setdefault(key, args[0].clone())
    return hook


def _role(members: list[str], attention: str | None, row_parallel: bool) -> str:
    """The recipe's group names (`smoothquant.group_alpha`): qkv / o inside the attention
    module (the one whose attention function ran), gate_up / down outside it."""
    inside = attention is not None and all(m.startswith(attention + ".") for m in members)
    return ("o" if inside else "down") if row_parallel else ("qkv" if inside else "gate_up")


def _in_place_safe(probe: _Probe, members: list[str], base: torch.Tensor) -> bool:
    """The group's input overwritten in place once its first member has it (as calibration
    does for a sole consumer), its members fed the original: the layer output must not change."""
    kept = {}

    def first(m, a):
        x = a[0]
        kept["x"], kept["id"] = x.clone(), id(x)
        try:
            x.mul_(probe.scales(x.shape[-1]).to(x))
        except RuntimeError:         # an expanded or otherwise shared view: not private
            kept["fail"] = True
        return (kept["x"],)

    def later(m, a):
        return (kept["x"],) if id(a[0]) == kept.get("id") else None

    out = probe.run({members[0]: first, **{n: later for n in members[1:]}})
    return "fail" not in kept and _rel(out, base) <= TOLERANCE


def _fold_error(probe: _Probe, state: dict, group: LinearGroup, base: torch.Tensor) -> float:
    """Relative change of the layer output after a random fold through `group`'s producer, with
    calibration's own fold (`apply_smoothing`); the layer's weights are restored from `state`."""
    from ascend_quant.calibration.smoothquant import apply_smoothing

    layer = probe.layer
    producer = layer.get_submodule(group.producer)
    consumers = [layer.get_submodule(n) for n in group.linears]
    s = probe.scales(consumers[0].in_features)
    try:
        apply_smoothing(producer, consumers, s, group.producer_kind, group.producer_rows(producer.weight.shape[0]))
        out = probe.run()
    except (RuntimeError, ValueError):
        return math.inf
    finally:
        layer.load_state_dict(state)
    return _rel(out, base)


def _vllm_names(members: list[str], packed: dict[str, list[str]]) -> tuple[str | None, tuple[str, ...]]:
    """(vllm_fused, on_disk) from vLLM's packed mapping: members q/k/v_proj listed under
    `qkv_proj`, or one member named like the key (fused on disk; its parts if vLLM names them)."""
    parents = {m.rpartition(".")[0] for m in members}
    leaves = [m.rpartition(".")[2] for m in members]
    for fused, parts in packed.items():
        if len(parents) == 1 and leaves == parts and len(parts) > 1:
            return fused, ()
        if leaves == [fused]:
            return fused, tuple(parts) if parts != [fused] else ()
    return None, ()
