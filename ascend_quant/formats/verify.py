"""Check a checkpoint folder against what vllm-ascend (and our runtime) need to load it.

Each problem is one line naming the file and the tensor or key. Checks that need
config.json are skipped, with a note, where the folder has none (msModelSlim's v0 outputs).
Headers are checked first (names, dtypes, shapes), then the values of every tensor that can
hold a bad one (`formats.checks`: scales, offsets, float tensors), read one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ascend_quant import numerics
from ascend_quant.formats.ascend import (Checkpoint, CheckpointError, TensorInfo, kv_geometry, read_checkpoint,
                                         text_config)
from ascend_quant.formats.checks import checkpoint_value_problems
from ascend_quant.arch import spec_for_config
from ascend_quant.schemes import C8, FLOAT, INPUT_ROTATION, KV_SUFFIXES, SCHEMES, is_kv, is_linear


@dataclass
class Report:
    path: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "problems": self.problems, "notes": self.notes}



def verify(path: str | Path) -> Report:
    """Run every check on a folder; never raises for a bad folder (problems are reported)."""
    report = Report(str(path))
    try:
        ckpt = read_checkpoint(path)
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    _check_files(ckpt, report)
    _check_index(ckpt, report)
    report.problems.extend(structure_problems(ckpt))
    for prefix in ckpt.modules():
        _check_deq_dtype(ckpt, prefix, report)
    _check_layers_complete(ckpt, report)
    _check_moe(ckpt, report)
    _check_fused(ckpt, report)
    report.problems.extend(checkpoint_value_problems(ckpt))
    _value_notes(ckpt, report)
    _check_input_rotations(ckpt, report)
    gap = spec_for_config(ckpt.config).vllm_ascend_gap
    if gap:
        report.notes.append(gap)
    return report


def structure_problems(ckpt: Checkpoint) -> list[str]:
    """What code reading the tensors by name relies on: every tensor described and present,
    each quantized Linear with the tensors, dtypes and shapes of its scheme, C8 scales where
    they belong. `convert` runs it before computing with a layer's tensors."""
    report = Report(str(ckpt.path))
    _check_keys(ckpt, report)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}       # module -> suffix -> stored shape
    for name, info in ckpt.infos.items():
        module, _, suffix = name.rpartition(".")
        shapes.setdefault(module, {})[suffix] = tuple(info.shape)
    for prefix, mod in ckpt.modules().items():
        if is_linear(mod.weight_scheme):
            _check_linear(ckpt, prefix, mod.weight_scheme, shapes.get(prefix, {}), report)
    _check_kv(ckpt, report)
    return report.problems


def _rel(ckpt: Checkpoint, name: str) -> str:
    file = ckpt.tensor_files.get(name)
    return file.name if file else ckpt.description_file.name


def _check_files(ckpt: Checkpoint, report: Report) -> None:
    weights = set(ckpt.weight_files)
    for f in sorted(ckpt.path.glob("*.safetensors")):
        if f not in weights:
            report.problems.append(
                f"{f.name}: stray safetensors file beside the quantized weights (vLLM loads every "
                "*.safetensors in the folder; remove it)")
    q = (ckpt.config or {}).get("quantization_config")
    if q is not None and not (isinstance(q, dict) and q.get("quant_method") == "ascend"):
        report.problems.append(f"config.json: quantization_config is {str(q)[:80]!r}; vLLM takes it for the "
                               "quantization method (write {\"quant_method\": \"ascend\"} or remove it)")
    elif q is not None:
        # vllm-ascend takes this dict as the whole description and then never reads the file
        inside = {k: v for k, v in q.items() if "." in k}
        if inside != dict(ckpt.description):
            what = "holds no tensor keys" if not inside else "disagrees with the description file"
            report.problems.append(
                f"config.json: quantization_config {what}; vllm-ascend reads it instead of "
                f"{ckpt.description_file.name} (run `ascend-quant convert` or remove quantization_config)")
    if not (ckpt.path / "config.json").is_file():
        report.notes.append("no config.json: dtype and shape-vs-config checks skipped "
                            "(convert with --config-from MODEL to serve it)")
    if ckpt.layout == "mindie":
        report.notes.append(f"{ckpt.description_file.name}: MindIE-style name; vllm-ascend looks for "
                            "quant_model_description.json (run `ascend-quant convert`)")
    if ckpt.layout == "v0":
        report.notes.append("v0 weight file names (quant_model_weight_<type>.safetensors): vLLM loads "
                            "them, but `ascend-quant convert` writes the v1 names")


def _check_index(ckpt: Checkpoint, report: Report) -> None:
    """The shard index agrees with the shards' headers: vLLM loads only the files it names,
    and other tools look tensors up in it."""
    if ckpt.index_file is None:
        return
    index = ckpt.index_file.name
    for name, shard in ckpt.weight_map.items():
        holder = ckpt.tensor_files.get(name)
        if holder is None:
            report.problems.append(f"{index}: weight_map lists {name!r} (in {shard}), which no shard holds")
        elif holder.name != shard:
            report.problems.append(f"{index}: weight_map puts {name!r} in {shard}, but {holder.name} holds it")
    for name, file in ckpt.tensor_files.items():
        if name not in ckpt.weight_map:
            report.problems.append(f"{index}: {name!r} (in {file.name}) is missing from weight_map")


def _check_keys(ckpt: Checkpoint, report: Report) -> None:
    desc = ckpt.description
    for name in ckpt.infos:
        if name not in desc:
            report.problems.append(f"{ckpt.description_file.name}: no entry for tensor {name!r} "
                                   f"(in {_rel(ckpt, name)}); vllm-ascend raises KeyError at load")
    for name, qtype in desc.items():
        if qtype not in SCHEMES:
            report.problems.append(f"{ckpt.description_file.name}: {name!r} has unknown quant type {qtype!r}")
        if name not in ckpt.infos:
            report.problems.append(f"{ckpt.description_file.name}: {name!r} is described but no weight file "
                                   "holds it")
    quantized_weights = [n for n, t in desc.items() if n.endswith(".weight") and is_linear(t)]
    if ckpt.meta.get("model_quant_type") is None and quantized_weights:
        report.problems.append(f"{ckpt.description_file.name}: no top-level 'model_quant_type'")


def _info(ckpt: Checkpoint, name: str) -> TensorInfo | None:
    return ckpt.infos.get(name)


def _check_linear(ckpt: Checkpoint, prefix: str, scheme_name: str, shapes: dict[str, tuple[int, ...]],
                  report: Report) -> None:
    """The tensors, dtypes and shapes the scheme's `tensor_specs` asks for, and its value rules
    (`shapes`: suffix -> stored shape of the module's tensors)."""
    scheme = SCHEMES[scheme_name]
    weight = _info(ckpt, f"{prefix}.weight")
    if weight is None:
        return  # reported by _check_keys
    fname = _rel(ckpt, f"{prefix}.weight")
    # Out/in features of the float weight, from the packed weight.
    if len(weight.shape) != 2:
        report.problems.append(f"{fname}: {prefix}.weight of {scheme_name} must be 2-D, is {list(weight.shape)}")
        return
    scale_info = _info(ckpt, f"{prefix}.weight_scale")
    n, k = _out_features(weight, scale_info, scheme.packed), weight.shape[1]
    if scheme.packed and (n % 2 or tuple(weight.shape) != (n // 2, k)):
        report.problems.append(f"{fname}: {prefix}.weight holds packed int4 {list(weight.shape)}, but weight_scale "
                               f"says {n} out-features, so it must be [{n // 2}, {k}] (two int4 per byte along n)")
    group_size, two_stage = scheme.layout_of(shapes, ckpt.group_size)
    if two_stage and ckpt.group_size and group_size != ckpt.group_size:
        group_size = ckpt.group_size if k % ckpt.group_size == 0 else -1
    if group_size < 0:
        report.problems.append(f"{ckpt.description_file.name}: the group size of {prefix} (description "
                               f"group_size {ckpt.group_size}) does not divide its in-features {k}")
        return
    row_parallel = spec_for_config(ckpt.config).is_row_parallel(prefix)
    for suffix, spec in scheme.tensor_specs(n, k, group_size, two_stage=two_stage, row_parallel=row_parallel).items():
        name = f"{prefix}.{suffix}"
        info = _info(ckpt, name)
        if info is None:
            report.problems.append(f"{fname}: {scheme_name} layer {prefix} has no {suffix!r} tensor")
            continue
        typed = ckpt.description.get(name)
        if typed is not None and typed != scheme_name:
            report.problems.append(f"{ckpt.description_file.name}: {name!r} is typed {typed!r}, but its layer is "
                                   f"{scheme_name} (every tensor of a quantized Linear has the weight's type)")
        if info.dtype not in spec.accepted:
            want = " or ".join(str(d).replace("torch.", "") for d in spec.accepted)
            report.problems.append(f"{_rel(ckpt, name)}: {name} is {str(info.dtype).replace('torch.', '')}, "
                                   f"{scheme_name} needs {want}")
        if suffix == "weight" and scheme.packed:
            continue                        # checked above, in one line
        ok = _numel(info.shape) == 1 if spec.param == "per_shard" else tuple(info.shape) == spec.shape
        if not ok:
            report.problems.append(f"{_rel(ckpt, name)}: {name} has shape {list(info.shape)}, "
                                   f"expected {list(spec.shape)}")
    read = lambda name: ckpt.tensor(name) if name in ckpt.infos else None  # noqa: E731
    for problem in scheme.value_problems(prefix, read):
        report.problems.append(f"{_rel(ckpt, prefix + '.weight')}: {problem}")


def _value_notes(ckpt: Checkpoint, report: Report) -> None:
    """Each scheme's notes on valid Linears not served everywhere (e.g. W4A16 zero points), once each."""
    read = lambda name: ckpt.tensor(name) if name in ckpt.infos else None  # noqa: E731
    for prefix, mod in ckpt.modules().items():
        if is_linear(mod.weight_scheme):
            for note in SCHEMES[mod.weight_scheme].value_notes(prefix, read):
                if note not in report.notes:
                    report.notes.append(note)


def _check_input_rotations(ckpt: Checkpoint, report: Report) -> None:
    """Online input rotations (`input_rotation` signs beside a Linear's weight): float32 [k], k
    the weight's in-features (their values: formats.checks); and the note that only our runtime
    serves them."""
    names = [n for n in ckpt.infos if n.rpartition(".")[2] == INPUT_ROTATION]
    for name in names:
        prefix = name.rpartition(".")[0]
        info, weight = ckpt.infos[name], _info(ckpt, f"{prefix}.weight")
        where = _rel(ckpt, name)
        if weight is None or len(weight.shape) != 2:
            report.problems.append(f"{where}: {name} rotates the input of {prefix}, which has no 2-D weight")
            continue
        k = weight.shape[1]
        if info.dtype != torch.float32 or tuple(info.shape) != (k,):
            report.problems.append(f"{where}: {name} must be float32 [{k}] (the in-features of {prefix}), is "
                                   f"{str(info.dtype).replace('torch.', '')} {list(info.shape)}")
    if names:
        report.notes.append(f"online input rotation on {len(names)} Linear(s) ({INPUT_ROTATION}, e.g. "
                            f"{names[0].rpartition('.')[0]}): served by ascend-quant's runtime at tensor-parallel "
                            "size 1; vllm-ascend has no parameter for it and fails at load")


def _out_features(weight: TensorInfo, scale: TensorInfo | None, packed: bool) -> int:
    """n of a Linear: rows of its int8 weight; for packed int4, rows of weight_scale (one per
    output channel, unpacked), so that a packed weight of the wrong shape is the one named."""
    if not packed:
        return weight.shape[0]
    return scale.shape[0] if scale is not None and scale.shape else weight.shape[0] * 2


def _check_deq_dtype(ckpt: Checkpoint, prefix: str, report: Report) -> None:
    name = f"{prefix}.deq_scale"
    info = _info(ckpt, name)
    dtype = ckpt.model_dtype
    if info is None or dtype is None:
        return
    want = numerics.deq_scale_dtype_for(dtype)
    if info.dtype != want:
        report.problems.append(
            f"{_rel(ckpt, name)}: {name} is {str(info.dtype).replace('torch.', '')} but config.json dtype is "
            f"{str(dtype).replace('torch.', '')}, which needs {str(want).replace('torch.', '')} "
            "(re-encode with `ascend-quant convert --dtype`)")


def _nonzero(t: torch.Tensor) -> bool:
    """Any finite nonzero value (NaN and Inf are the value checks' to report, in their own line)."""
    return bool(torch.any((t != 0) & t.isfinite()))


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _check_layers_complete(ckpt: Checkpoint, report: Report) -> None:
    """Every decoder layer has the same Linear `.weight` keys as the others of its kind (dense,
    MoE) (a missing one is a KeyError)."""
    spec = spec_for_config(ckpt.config)
    by_layer: dict[int, set[tuple[str, str]]] = {}     # layer -> (text before, after the layer index)
    for name in ckpt.description:
        split = spec.split_layer(name)
        if split and name.endswith(".weight"):
            by_layer.setdefault(split[1], set()).add((split[0], split[2]))
    n_layers = (ckpt.config or {}).get("num_hidden_layers")
    if not isinstance(n_layers, int):
        n_layers = max(by_layer) + 1 if by_layer else 0
    # layers stored after the model's own (MTP) have keys of their own: not compared
    by_layer = {i: keys for i, keys in by_layer.items() if i < n_layers}
    union = set().union(*by_layer.values()) if by_layer else set()
    kind = {i: ckpt.config is not None and spec.is_moe_layer(i, ckpt.config) for i in by_layer}
    unions = {k: set().union(*(by_layer[i] for i in by_layer if kind[i] == k)) for k in set(kind.values())}
    for i in sorted(i for i in by_layer if i < n_layers):
        for before, after in sorted(unions[kind[i]] - by_layer[i]):
            key = spec.join_layer(before, i, after)
            report.problems.append(f"{ckpt.description_file.name}: layer {i} has no key {key!r} "
                                   "(every Linear needs a .weight entry)")
    present = sum(1 for i in by_layer if i < n_layers)
    if union and present < n_layers:      # whole layers without keys: one line, however many
        first = [i for i in range(present + 3) if i not in by_layer][:3]
        report.problems.append(f"{ckpt.description_file.name}: no keys for {n_layers - present} of {n_layers} "
                               f"layers (first: {', '.join(map(str, first))}); every Linear needs a .weight entry")


def moe_report(ckpt: Checkpoint) -> Report:
    """The MoE checks alone (`_check_moe`: problems and notes); `convert` runs them on the
    checkpoint it is about to write."""
    report = Report(str(ckpt.path))
    _check_moe(ckpt, report)
    return report


def _check_moe(ckpt: Checkpoint, report: Report) -> None:
    """MoE layers (by config.json): every routed expert has every Linear and the same tensors
    as the others, one scheme for all of a layer's experts, one vllm-ascend 0.23 serves
    (notes for ours-only schemes and unmapped families), the router (with its other tensors,
    DeepSeek-V3's e_score_correction_bias) and shared-expert gate present as FLOAT."""
    spec = spec_for_config(ckpt.config)
    moe = spec.moe
    if moe is None or ckpt.config is None:
        return
    desc, modules, dname = ckpt.description, ckpt.modules(), ckpt.description_file.name
    splits = [spec.split_layer(n) for n in desc]
    before = next((sp[0] for sp in splits if sp), spec.layers_path)
    n_layers = text_config(ckpt.config).get("num_hidden_layers", 0)
    num = moe.num_experts(ckpt.config)
    layer_schemes: set[str] = set()
    for i in range(n_layers if isinstance(n_layers, int) else 0):
        if not spec.is_moe_layer(i, ckpt.config):
            continue
        name = lambda rel: spec.to_disk(spec.join_layer(before, i, rel))  # noqa: E731
        if not any(n.startswith(name(moe.experts_path) + ".") for n in desc):
            continue            # a layer without keys at all: _check_layers_complete says so
        schemes: dict[str, str] = {}
        for role in range(3):
            prefixes = [name(moe.expert_linear(e, role)) for e in range(num)]
            suffixes = {p: modules[p].suffixes if p in modules else set() for p in prefixes}
            union = set().union(*suffixes.values())
            if not union:
                report.problems.append(f"{dname}: MoE layer {i} has no {prefixes[0]}.weight (nor any other expert's "
                                       f"{moe.linears[role]}; expert Linears are named {', '.join(moe.linears)})")
            for p in prefixes:
                for suffix in sorted(union - set(suffixes[p])):
                    report.problems.append(f"{dname}: MoE layer {i} has no {p}.{suffix} (every one of its "
                                           f"{num} experts needs every tensor the others have)")
                if p in modules and modules[p].weight_scheme is not None:
                    schemes[p] = modules[p].weight_scheme
        distinct = sorted(set(schemes.values()))
        if len(distinct) > 1:
            shown = ", ".join(f"{next(p for p, s in schemes.items() if s == d)}={d}" for d in distinct)
            report.problems.append(f"{dname}: the experts of MoE layer {i} mix schemes ({shown}); vLLM holds "
                                   "a layer's experts in one tensor per name and vllm-ascend reads expert 0's type")
        elif distinct:
            layer_schemes.add(distinct[0])
            _check_expert_scheme(ckpt, i, distinct[0], name(moe.expert_linear(0, 0)), report)
        keys = [f"{name(rel)}.weight" for rel in (moe.router_path, *moe.float_modules)]
        for key in keys + [f"{name(moe.router_path)}.{t}" for t in moe.router_tensors]:
            if key not in desc:
                report.problems.append(f"{dname}: MoE layer {i} has no {key!r} (kept FLOAT; vLLM needs the key)")
            elif desc[key] != FLOAT.name:
                report.problems.append(f"{dname}: {key!r} is {desc[key]}; the router and shared-expert gate "
                                       f"stay {FLOAT.name} (vLLM builds them unquantized)")
    for i in range(n_layers if isinstance(n_layers, int) else 0):
        for rel in spec.float_linears:
            key = f"{spec.to_disk(spec.join_layer(before, i, rel))}.weight"
            if key in desc and desc[key] != FLOAT.name:
                report.problems.append(f"{dname}: {key!r} is {desc[key]}; it must stay {FLOAT.name} "
                                       "(vllm-ascend's MLA splits it and asserts it is unquantized)")
    if layer_schemes - {FLOAT.name} and not moe.vllm_ascend_maps:
        report.notes.append(f"config.json model_type {ckpt.config.get('model_type')!r}: vllm-ascend 0.23 has no "
                            "`experts` mapping for it and would fail to load the experts (KeyError); vLLM "
                            "with our plugin loads it")


def _check_expert_scheme(ckpt: Checkpoint, layer: int, scheme_name: str, first: str, report: Report) -> None:
    """What vllm-ascend 0.23 does with a layer's expert scheme (property rules, no names):
    per-token dynamic int activations with per-channel weights load; static ranges raise
    NotImplementedError; weight-only experts of this format it does not load."""
    scheme = SCHEMES.get(scheme_name)
    if scheme is None or not scheme.linear:
        return
    dname = ckpt.description_file.name
    if scheme.activation_mode == "static":
        report.problems.append(f"{dname}: MoE layer {layer} experts are {scheme_name} (static activation "
                               "ranges): vllm-ascend 0.23 raises NotImplementedError and our runtime has no "
                               "static-range experts; calibrate them W8A8_DYNAMIC or W4A8_DYNAMIC")
    elif scheme.activation_mode == "none":
        report.notes.append(f"MoE layer {layer} experts are {scheme_name}: served by our runtime only "
                            "(vllm-ascend 0.23 loads W8A8_DYNAMIC / W4A8_DYNAMIC per-channel experts)")
    else:
        shapes = {n[len(first) + 1:]: tuple(info.shape) for n, info in ckpt.infos.items()
                  if n.startswith(first + ".")}
        if scheme.layout_of(shapes, ckpt.group_size)[1]:
            report.notes.append(f"MoE layer {layer} experts are per-group {scheme_name}: vllm-ascend 0.23 loads "
                                "them, later versions serve per-channel experts only")


def _check_fused(ckpt: Checkpoint, report: Report) -> None:
    modules = ckpt.modules()
    spec = spec_for_config(ckpt.config)
    seen: set[str] = set()
    for prefix in modules:
        group = spec.fused_siblings(prefix)
        if not group or group[0] in seen:
            continue
        seen.add(group[0])
        present = [p for p in group if p in modules]
        if len(present) < 2:
            continue
        schemes = {p: modules[p].weight_scheme for p in present}
        if len(set(schemes.values())) > 1:
            detail = ", ".join(f"{p.rpartition('.')[2]}={s}" for p, s in schemes.items())
            report.problems.append(f"{ckpt.description_file.name}: fused layers disagree in scheme ({detail}); "
                                   "vLLM loads them as one parameter")
            continue
        scheme = SCHEMES.get(next(iter(schemes.values())))
        if scheme is None or not scheme.linear:
            continue
        per_shard = [suffix for suffix, spec in scheme.tensor_specs(1, 1).items() if spec.param == "per_shard"]
        for suffix in per_shard:
            names = [f"{p}.{suffix}" for p in present
                     if f"{p}.{suffix}" in ckpt.infos and _numel(ckpt.infos[f"{p}.{suffix}"].shape) == 1]
            if len(names) < 2:
                continue
            values = [ckpt.tensor(n).float().reshape(-1) for n in names]
            if any(not torch.equal(values[0], v) for v in values[1:]):
                shown = ", ".join(f"{n.rpartition('.')[0].rpartition('.')[2]}={v.item():.6g}"
                                  for n, v in zip(names, values))
                report.problems.append(f"{_rel(ckpt, names[0])}: fused layers have different {suffix} ({shown}); "
                                       "vllm-ascend keeps only one, calibrate them on the shared input")


def _check_kv(ckpt: Checkpoint, report: Report) -> None:
    kv_names = [n for n, t in ckpt.description.items() if is_kv(t)]
    if not kv_names:
        return
    if ckpt.meta.get("kv_cache_type") != C8.name:
        report.problems.append(f"{ckpt.description_file.name}: {C8.name} tensors present but top-level "
                               f"'kv_cache_type' is not '{C8.name}'")
    spec = spec_for_config(ckpt.config)
    geometry = kv_geometry(ckpt.config)
    width = geometry[0] * geometry[1] if geometry else None
    for name in kv_names:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in KV_SUFFIXES or not spec.is_kv_projection(prefix):
            report.problems.append(f"{ckpt.description_file.name}: {name!r} is typed C8 but is not a "
                                   f"{'/'.join(spec.kv_projections)} kv_cache_scale or kv_cache_offset")
            continue
        info = _info(ckpt, name)
        if info is None:
            continue
        if info.dtype != torch.float32 or len(info.shape) != 1 or (width and info.shape[0] != width):
            want = f"[{width}]" if width else "[num_kv_heads * head_dim]"
            report.problems.append(f"{_rel(ckpt, name)}: {name} is {str(info.dtype).replace('torch.', '')} "
                                   f"{list(info.shape)}, C8 needs float32 {want}")
        elif suffix == "kv_cache_offset" and _nonzero(ckpt.tensor(name)):
            report.problems.append(f"{_rel(ckpt, name)}: {name} is not zero; the NPU decode path is "
                                   "symmetric only")
    layers = {spec.layer_prefix(n.rpartition(".")[0]) for n in kv_names} - {None}
    for layer in sorted(layers):
        for proj in spec.kv_projections:
            if f"{layer}.{proj}.kv_cache_scale" not in ckpt.description:
                report.problems.append(f"{ckpt.description_file.name}: {layer} has C8 tensors but no "
                                       f"{proj}.kv_cache_scale")
