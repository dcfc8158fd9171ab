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
lm_head): every runtime serves the calibrated checkpoint unchanged. Rotation needs the
whole float model at once, so the calibration job loads it whole instead of streaming
layers (calibration/job.py).
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


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """The arithmetic runs on the CPU in float64, whatever device the model is on."""
    return t.detach().to("cpu", torch.float64)


def _set(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.device, param.dtype))


def refusal(model: torch.nn.Module, spec: ArchSpec, kind: str = "hadamard", r2: bool = True) -> str | None:
    """Why `rotate_model` would refuse this model (one line), or None; it changes nothing, so a
    recipe whose rotation applies only where it can (`Rotation.where_supported`, the 4-bit
    presets) asks first and calibrates unrotated otherwise."""
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


@torch.no_grad()
def rotate_model(model: torch.nn.Module, spec: ArchSpec, kind: str = "hadamard", r2: bool = True,
                 seed: int = 0) -> dict:
    """Rotate the float model in place (module docstring); returns what was done, for the
    calibration record. Every refusal comes before the first change (`_check`)."""
    rmap = _check(model, spec, kind, r2)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    gen = torch.Generator().manual_seed(seed)
    d = emb.weight.shape[1]
    q = numerics.orthogonal_rotation(d, kind, gen)       # the first draw: `residual_rotation` repeats it
    tied = head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr()
    if tied:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    untie_config(model.config)
    _set(emb.weight, numerics.rotate_input(_cpu(emb.weight), q))
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = None
    readers: dict[str, list[str]] = {}          # norm -> the Linears reading it
    for g in spec.groups:
        if g.producer_kind == "rmsnorm":
            readers.setdefault(g.producer, []).extend(g.linears)
    for i, layer in enumerate(spec.layers(model)):
        for norm_name, linears in readers.items():
            norm = layer.get_submodule(norm_name)
            gain = _cpu(norm.weight)
            for name in linears:
                lin = layer.get_submodule(name)
                _set(lin.weight, numerics.rotate_input(numerics.fold_norm_gain(_cpu(lin.weight), gain), q))
            norm.weight.fill_(1.0)
        for name in rmap.writers:
            lin = layer.get_submodule(name)
            _set(lin.weight, numerics.rotate_output(_cpu(lin.weight), q))
            if lin.bias is not None:
                _set(lin.bias, numerics.rotate_output(_cpu(lin.bias), q))
        if r2:
            v, o = layer.get_submodule(rmap.value), layer.get_submodule(rmap.output)
            head_dim = v.weight.shape[0] // kv_heads
            rs = torch.stack([numerics.orthogonal_rotation(head_dim, kind, gen) for _ in range(kv_heads)])
            _set(v.weight, numerics.rotate_head_rows(_cpu(v.weight), rs))
            if v.bias is not None:
                _set(v.bias, numerics.rotate_head_rows(_cpu(v.bias), rs))
            _set(o.weight, numerics.rotate_head_columns(_cpu(o.weight), rs, heads // kv_heads))
    final = model.get_submodule(rmap.final_norm)
    _set(head.weight, numerics.rotate_input(numerics.fold_norm_gain(_cpu(head.weight), _cpu(final.weight)), q))
    final.weight.fill_(1.0)
    return {"kind": kind, "seed": seed, "hidden_size": d, "r2": bool(r2),
            **({"head_dim": head_dim, "kv_heads": kv_heads} if r2 else {}),
            "untied_embeddings": bool(tied)}


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
