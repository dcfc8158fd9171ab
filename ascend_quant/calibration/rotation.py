"""Rotations folded offline into the float model before calibration (QuaRot / SpinQuant R1, R2).

R1: one orthogonal Q [d, d] on the residual stream. The stream x becomes x·Q everywhere:
the embeddings E -> E·Q; every norm on the residual first has its gain folded into the
Linears it feeds (W -> W·diag(g), gain -> 1), since x̂·Q is the norm of x·Q only without a
per-channel gain; those Linears read x̂·Q and take W -> W·Q; the Linears that add into the
residual (o_proj, down_proj) take W -> Qᵀ·W and b -> Qᵀ·b; the final norm folds into
lm_head, which takes W -> W·Q. Tied embeddings are untied first (lm_head gets its own copy,
the output config says `tie_word_embeddings: false`). The logits are unchanged in exact
arithmetic; the weights' outliers are spread over all channels, which is what helps 4-bit.

R2: per layer, one orthogonal R_j [head_dim, head_dim] per KV head: v_proj's rows of head j
(and its bias) -> R_jᵀ·(rows), o_proj's columns of every query head that reads KV head j
-> (columns)·R_j (GQA: query head i reads KV head i // (heads / kv_heads)). Attention mixes
tokens, not channels, so the rotation passes through it.

Q is a randomized Hadamard D·H / sqrt(d) (`numerics.orthogonal_rotation`, D random ±1) with
H a true Hadamard matrix of order 2^a·c (Sylvester doubling of a Paley matrix of order c):
SmolLM2-135M's d = 576 = 16·36 uses the Paley II matrix of order 36 (q = 17), head_dim 64
a Sylvester one. A size with no such construction is refused; `kind: random` uses a
Haar-random orthogonal matrix instead (any size, also exact, but it spreads outliers less
evenly than a Hadamard).

Whether a family allows it is a fact of its spec (`ArchSpec.rotation`, `post_norms`;
arch/): post-norms on o_proj / down_proj outputs (Gemma, GLM-4), (1+w) or biased norms,
MoE routers or an undeclared (discovered) layout are refused with one message.

The result is an ordinary float model (all-ones norms, rotated weights, an untied
lm_head): every runtime serves the calibrated checkpoint unchanged. Each rotated tensor is a
function of a few unrotated ones (a Linear and the norm it reads, the head and the final
norm; `RotationPlan`), so a streamed calibration rotates each layer as it reads it
(calibration/streaming.py) and the whole float model is never needed at once.
"""

from __future__ import annotations

import torch

from ascend_quant import numerics
from ascend_quant.arch import ArchSpec
from ascend_quant.arch.spec import ResidualRotation
from ascend_quant.calibration import CalibrationError


def rotation_map(spec: ArchSpec) -> ResidualRotation:
    """The spec's rotation map, or a CalibrationError saying why this family takes none."""
    why = None
    if spec.post_norms:
        why = (f"post-norms ({', '.join(spec.post_norms)}) normalise Linear outputs before the residual add, "
               "so a rotation of the residual stream is not an equivalence")
    elif spec.rotation is None:
        why = ("its MoE router reads the residual stream and the map covers dense layers only" if spec.moe else
               "a discovered spec declares no rotation map" if spec.discovered else
               "its spec (ascend_quant/arch/) declares no rotation map")
    else:
        bad = [g.producer for g in spec.groups if g.producer_kind not in (None, "rmsnorm", "linear_rows")]
        if bad:
            why = f"{', '.join(bad)} are not plain x̂·w norms (R1 folds only those)"
    if why:
        raise CalibrationError(f"{spec.name}: no offline rotation: {why}; calibrate without rotation")
    return spec.rotation


def _set(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.device, param.dtype))


def refusal(model: torch.nn.Module, spec: ArchSpec, kind: str = "hadamard", r2: bool = True) -> str | None:
    """Why `rotate_model` would refuse this model (one line), or None; it changes nothing, so a
    recipe whose rotation applies only where it can (`Rotation.where_supported`, the
    W8A8_DYNAMIC preset) asks first and calibrates unrotated otherwise."""
    try:
        _check(model, spec, kind, r2)
    except CalibrationError as e:
        return str(e)
    return None


def _check(model: torch.nn.Module, spec: ArchSpec, kind: str, r2: bool) -> ResidualRotation:
    """Every refusal of `rotate_model`, before it changes anything."""
    rmap = rotation_map(spec)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is None or head is None:
        raise CalibrationError(f"{spec.name}: no offline rotation: the model has no separate embeddings and head")
    d = emb.weight.shape[1]
    try:
        numerics.orthogonal_rotation(d, kind, torch.Generator().manual_seed(0))
    except ValueError as e:
        raise CalibrationError(f"rotation of hidden size {d}: {e}") from None
    norms = {g.producer for g in spec.groups if g.producer_kind == "rmsnorm"}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dims = set()
    for i, layer in enumerate(spec.layers(model)):
        for norm_name in sorted(norms):
            if getattr(layer.get_submodule(norm_name), "bias", None) is not None:
                raise CalibrationError(f"{spec.name}: no offline rotation: layer {i} {norm_name} has a bias")
        if r2:
            v, o = layer.get_submodule(rmap.value), layer.get_submodule(rmap.output)
            head_dim = v.weight.shape[0] // kv_heads
            if v.weight.shape[0] != kv_heads * head_dim or o.weight.shape[1] != heads * head_dim \
                    or heads % kv_heads:
                raise CalibrationError(f"{spec.name}: no R2 rotation: layer {i} {rmap.value} has "
                                       f"{v.weight.shape[0]} rows and {rmap.output} {o.weight.shape[1]} "
                                       f"columns for {heads} heads / {kv_heads} KV heads")
            head_dims.add(head_dim)
    for head_dim in sorted(head_dims):          # one trial draw per size, not per layer
        try:
            numerics.orthogonal_rotation(head_dim, kind, torch.Generator().manual_seed(0))
        except ValueError as e:
            raise CalibrationError(f"R2 rotation of head_dim {head_dim}: {e}") from None
    return rmap


class RotationPlan:
    """One rotation of one model, drawn once: Q, then each layer's R2 matrices (the order the
    generator has always been drawn in, so a record's seed redraws Q), and the rule that
    rotates a tensor by its state-dict name. The whole-model rotation (`rotate_model`) and the
    streamed one (calibration/streaming.py, which rotates each tensor as it is read) share
    it, so both give the same checkpoint. Every refusal comes first (`_check`)."""

    def __init__(self, model: torch.nn.Module, spec: ArchSpec, kind: str = "hadamard", r2: bool = True,
                 seed: int = 0):
        self.rmap = rmap = _check(model, spec, kind, r2)
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        names = {id(m): n for n, m in model.named_modules()}
        self.embedding, self.head = f"{names[id(emb)]}.weight", f"{names[id(head)]}.weight"
        self.final_norm = f"{rmap.final_norm}.weight"
        self.layers = spec.layers_path + "."
        self.tied = head.weight is emb.weight
        gen = torch.Generator().manual_seed(seed)
        d = emb.weight.shape[1]
        self.q = numerics.orthogonal_rotation(d, kind, gen)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.group = heads // kv_heads
        self.norm_of: dict[str, str] = {}          # a Linear reading a norm -> that norm
        for g in spec.groups:
            if g.producer_kind == "rmsnorm":
                self.norm_of.update(dict.fromkeys(g.linears, g.producer))
        self.r2: list[torch.Tensor] = []           # per layer, [kv_heads, head_dim, head_dim]
        head_dim = None
        if r2:
            for layer in spec.layers(model):
                head_dim = layer.get_submodule(rmap.value).weight.shape[0] // kv_heads
                self.r2.append(torch.stack([numerics.orthogonal_rotation(head_dim, kind, gen)
                                            for _ in range(kv_heads)]))
        self.record = {"kind": kind, "seed": seed, "hidden_size": d, "r2": bool(r2),
                       **({"head_dim": head_dim, "kv_heads": kv_heads} if r2 else {}),
                       "untied_embeddings": bool(self.tied)}

    def _in_layer(self, name: str) -> tuple[int, str, str] | None:
        """(layer index, module, attribute) of a decoder layer's tensor name, else None."""
        if not name.startswith(self.layers):
            return None
        index, _, rel = name[len(self.layers):].partition(".")
        module, _, attr = rel.rpartition(".")
        return int(index), module, attr

    def inputs(self, name: str) -> list[str] | None:
        """The tensors (state-dict names, unrotated) the rotated `name` is computed from, or
        None when the rotation leaves it as it is."""
        if name == self.head:
            return [name, self.final_norm]
        if name in (self.embedding, self.final_norm):
            return [name]
        where = self._in_layer(name)
        if where is None:
            return None
        i, module, attr = where
        rmap = self.rmap
        if attr == "weight" and module in self.norm_of:           # reads x̂·g: the gain folds in
            return [name, f"{self.layers}{i}.{self.norm_of[module]}.weight"]
        if attr == "weight" and module in self.norm_of.values():
            return [name]
        if module in rmap.writers or (self.r2 and module == rmap.value) or (self.r2 and module == rmap.output
                                                                            and attr == "weight"):
            return [name]
        return None

    def rotated(self, name: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """`name` rotated, float32, from the unrotated `values` of `inputs(name)`. Each step
        runs in float64 on blocks of rows (or columns, for Qᵀ·W) and is stored in float32,
        so a tensor's temporaries stay a fraction of its own size."""
        t = values[name].detach().to("cpu", torch.float32)
        q = self.q
        if name in (self.embedding, self.head):
            gain = values[self.final_norm].to("cpu", torch.float64) if name == self.head else None
            return _by_rows(t, lambda w, _: numerics.rotate_input(
                w if gain is None else numerics.fold_norm_gain(w, gain), q))
        if name == self.final_norm:
            return torch.ones(t.shape, dtype=torch.float32)
        i, module, attr = self._in_layer(name)
        rmap = self.rmap
        if module in self.norm_of.values() and attr == "weight":
            return torch.ones(t.shape, dtype=torch.float32)
        if module in self.norm_of and attr == "weight":
            gain = values[f"{self.layers}{i}.{self.norm_of[module]}.weight"].to("cpu", torch.float64)
            t = _by_rows(t, lambda w, _: numerics.rotate_input(numerics.fold_norm_gain(w, gain), q))
        if module in rmap.writers:
            t = _by_columns(t, lambda w: numerics.rotate_output(w, q)) if t.dim() == 2 else \
                numerics.rotate_output(t.double(), q).float()
        if self.r2 and module == rmap.value:
            rs = self.r2[i]
            d = rs.shape[1]
            t = _by_rows(t, lambda w, start: numerics.rotate_head_rows(
                w, rs[start // d:(start + w.shape[0]) // d]), align=d)
        if self.r2 and module == rmap.output and attr == "weight":
            t = _by_rows(t, lambda w, _: numerics.rotate_head_columns(w, self.r2[i], self.group))
        return t


def _by_rows(t: torch.Tensor, rule, align: int = 1, elements: int = 1 << 18) -> torch.Tensor:
    """A rule that treats rows independently (`rule(block, first_row)`, float64 block in, float64
    out), applied to blocks of about `elements` entries whose row counts are multiples of
    `align`; float32 result. A vocabulary-sized matrix is never held in float64 whole."""
    if t.dim() == 1:
        return rule(t.double(), 0).float()
    rows = max(align, (elements // max(1, t.shape[1])) // align * align)
    out = torch.empty(t.shape, dtype=torch.float32)
    for start in range(0, t.shape[0], rows):
        out[start:start + rows] = rule(t[start:start + rows].double(), start).float()
    return out


def _by_columns(t: torch.Tensor, rule, elements: int = 1 << 18) -> torch.Tensor:
    """`_by_rows` for a rule that treats columns independently (Qᵀ·W)."""
    cols = max(1, elements // max(1, t.shape[0]))
    out = torch.empty(t.shape, dtype=torch.float32)
    for start in range(0, t.shape[1], cols):
        out[:, start:start + cols] = rule(t[:, start:start + cols].double()).float()
    return out


@torch.no_grad()
def rotate_model(model: torch.nn.Module, spec: ArchSpec, kind: str = "hadamard", r2: bool = True,
                 seed: int = 0) -> dict:
    """Rotate the float model in place (module docstring); returns what was done, for the
    calibration record. Every refusal comes before the first change (`_check`)."""
    plan = RotationPlan(model, spec, kind, r2, seed)
    params = dict(model.named_parameters(remove_duplicate=False))      # the head's name too, if tied

    def rotate(names: list[str]) -> None:       # all from the unrotated values, then set
        names = [n for n in names if plan.inputs(n) is not None]
        new = {n: plan.rotated(n, {m: params[m].detach() for m in plan.inputs(n)}) for n in names}
        for n, value in new.items():
            if n == plan.head and plan.tied:      # the head gets a weight of its own
                model.get_output_embeddings().weight = torch.nn.Parameter(
                    value.to(params[n].device, params[n].dtype), requires_grad=False)
            else:
                _set(params[n], value)

    rotate([plan.embedding, plan.head, plan.final_norm])
    untie_config(model.config)
    for i in range(len(spec.layers(model))):
        rotate([n for n in params if n.startswith(f"{plan.layers}{i}.")])
    return plan.record


def residual_rotation(record: dict) -> torch.Tensor:
    """The R1 matrix Q [d, d] (float64) that `rotate_model` used, drawn again from its record
    (`rotation` in ascend_quant_calibration.json): the first draw of a generator seeded with
    the record's seed. The rotated model's residual stream is the float one times Q."""
    return numerics.orthogonal_rotation(record["hidden_size"], record["kind"],
                                        torch.Generator().manual_seed(record["seed"]))


def untie_config(config) -> None:
    """`tie_word_embeddings = False` on a transformers config object or a config.json dict
    (and its text config, where it has one)."""
    if isinstance(config, dict):
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
        return
    config.tie_word_embeddings = False
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        text.tie_word_embeddings = False
