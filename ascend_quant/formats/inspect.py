"""Summarise a checkpoint: per module, its scheme, bits and bytes, and the size against float;
per MoE layer, its experts, their scheme and whether the router is FLOAT."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ascend_quant.arch import spec_for_config
from ascend_quant.formats.ascend import Checkpoint, kv_geometry, text_config
from ascend_quant.schemes import FLOAT, KV_SUFFIXES, SCHEMES, is_kv


@dataclass
class ModuleRow:
    module: str
    scheme: str
    weight_bits: int | None
    activation: str          # "int8 static", "int8 dynamic", "float"
    shape: list[int]         # float weight [n, k] (unpacked)
    bytes: int               # stored bytes of all the module's tensors
    float_bytes: int         # bytes of the same module in the float dtype


def summarize(ckpt: Checkpoint, float_dtype: torch.dtype | None = None) -> dict:
    """Rows per module and totals. `float_dtype` (default: config dtype, else bf16) prices
    what the float model would take."""
    dtype = float_dtype or ckpt.model_dtype or torch.bfloat16
    fsize = torch.empty((), dtype=dtype).element_size()
    rows: list[ModuleRow] = []
    for prefix, mod in ckpt.modules().items():
        names = [f"{prefix}.{s}" for s in sorted(mod.suffixes) if f"{prefix}.{s}" in ckpt.infos]
        stored = sum(ckpt.infos[n].nbytes for n in names)
        scheme = mod.weight_scheme or next(iter(mod.schemes))
        info = SCHEMES.get(scheme)
        weight = ckpt.infos.get(f"{prefix}.weight")
        shape = list(weight.shape) if weight else []
        if info and info.packed and shape:
            shape[0] *= 2
        if info is not None and info.weight_bits is not None:
            # float model: the weight in the float dtype plus its float bias; no quant tensors
            float_bytes = math.prod(shape) * fsize if shape else 0
            if f"{prefix}.bias" in ckpt.infos:
                float_bytes += ckpt.infos[f"{prefix}.bias"].nbytes
            kv = [n for n in names if n.rpartition(".")[2] in KV_SUFFIXES]
            stored_cmp = stored - sum(ckpt.infos[n].nbytes for n in kv)
        else:
            numel = sum(ckpt.infos[n].nbytes // ckpt.infos[n].dtype.itemsize for n in names
                        if n.rpartition(".")[2] not in KV_SUFFIXES)
            float_bytes = numel * fsize
            stored_cmp = stored
        if info is None or info.activation_bits is None or info.kv_cache:
            act = "float"
        else:
            act = f"int{info.activation_bits} {info.activation_mode}"
        rows.append(ModuleRow(prefix, scheme, info.weight_bits if info else None, act, shape,
                              stored_cmp, float_bytes))
    total = sum(r.bytes for r in rows)
    total_float = sum(r.float_bytes for r in rows)
    quantized = [r for r in rows if r.weight_bits is not None]
    return {
        "path": str(ckpt.path),
        "layout": ckpt.layout,
        "model_quant_type": ckpt.meta.get("model_quant_type"),
        "group_size": ckpt.group_size,
        "kv_cache": "int8 (C8)" if ckpt.kv_cache_int8 else "model dtype",
        "kv_cache_tokens_per_gib": kv_tokens_per_gib(ckpt, fsize),
        "float_dtype": str(dtype).replace("torch.", ""),
        "modules": [asdict(r) for r in rows],
        "moe_layers": moe_layers(ckpt),
        "totals": {
            "bytes": total,
            "float_bytes": total_float,
            "ratio": total / total_float if total_float else None,
            "quantized_linears": len(quantized),
            "quantized_linear_bytes": sum(r.bytes for r in quantized),
            "quantized_linear_float_bytes": sum(r.float_bytes for r in quantized),
        },
    }


def moe_layers(ckpt: Checkpoint) -> list[dict]:
    """Per MoE layer found in the checkpoint: its index, how many experts it holds, their
    scheme(s), whether the router is stored FLOAT and whether the layer is one stored after the
    model's own (MTP) (by the family's spec; [] for dense)."""
    spec = spec_for_config(ckpt.config)
    if spec.moe is None:
        return []
    modules = ckpt.modules()
    by_layer: dict[int, dict] = {}
    for prefix, mod in modules.items():
        rel = spec.relative(prefix)
        if rel is None:
            continue
        rel = spec.moe.from_disk_relative(rel)
        e = spec.moe.expert_of(rel)
        if e is None:
            continue
        i = spec.layer_index(prefix)
        entry = by_layer.setdefault(i, {"layer": i, "experts": set(), "schemes": set()})
        entry["experts"].add(e)
        if mod.weight_scheme:
            entry["schemes"].add(mod.weight_scheme)
        before = spec.split_layer(prefix)[0]
        entry["router"] = spec.to_disk(spec.join_layer(before, i, spec.moe.router_path))
    out = []
    for i in sorted(by_layer):
        entry = by_layer[i]
        schemes = sorted(entry["schemes"])
        router = ckpt.description.get(entry["router"] + ".weight")
        out.append({"layer": i, "experts": len(entry["experts"]), "scheme": schemes[0] if len(schemes) == 1 else schemes,
                    "router_float": router == FLOAT.name,
                    "mtp": spec.is_extra_layer(entry["router"], ckpt.config or {})})
    return out


def kv_tokens_per_gib(ckpt: Checkpoint, fsize: int) -> dict | None:
    """Tokens of KV cache per GiB (K + V of every layer, MLA's latent; block rounding ignored): as stored by
    this checkpoint (int8 on C8 layers) and in the float dtype. None without a usable config."""
    layers, geometry = text_config(ckpt.config).get("num_hidden_layers"), kv_geometry(ckpt.config)
    if not isinstance(layers, int) or layers <= 0 or geometry is None:
        return None
    kv_heads, head_dim = geometry
    spec = spec_for_config(ckpt.config)
    c8 = sum(1 for k, v in ckpt.description.items()
             if is_kv(v) and spec.kv_cache_parent(k) is not None)
    c8 = min(c8, layers)
    per_layer = spec.kv_values_per_token(ckpt.config, kv_heads, head_dim)
    if per_layer is None:
        return None
    stored = per_layer * (c8 * 1 + (layers - c8) * fsize)
    return {"stored": (1 << 30) // stored, "float": (1 << 30) // (per_layer * layers * fsize), "c8_layers": c8}


def format_summary(summary: dict) -> str:
    """The human table of `summarize`."""
    lines = []
    width = max([len(m["module"]) for m in summary["modules"]] + [6])
    head = f"{'module':<{width}}  {'scheme':<13} {'w bits':>6}  {'activations':<13} {'shape':<12} {'bytes':>12} {'float bytes':>12}"
    lines.append(head)
    lines.append("-" * len(head))
    for m in summary["modules"]:
        shape = "x".join(str(d) for d in m["shape"]) if m["shape"] else "-"
        bits = str(m["weight_bits"]) if m["weight_bits"] else "-"
        lines.append(f"{m['module']:<{width}}  {m['scheme']:<13} {bits:>6}  {m['activation']:<13} {shape:<12} "
                     f"{m['bytes']:>12,} {m['float_bytes']:>12,}")
    t = summary["totals"]
    lines.append("-" * len(head))
    lines.append(f"layout {summary['layout']}, model_quant_type {summary['model_quant_type']}, "
                 f"group_size {summary['group_size']}, KV cache {summary['kv_cache']}")
    kv = summary.get("kv_cache_tokens_per_gib")
    if kv:
        lines.append(f"KV cache: {kv['stored']:,} tokens per GiB ({kv['float']:,} in {summary['float_dtype']}; "
                     f"{kv['c8_layers']} int8 layers)")
    for m in summary.get("moe_layers", []):
        scheme = m["scheme"] if isinstance(m["scheme"], str) else "mixed " + "/".join(m["scheme"])
        router = "router FLOAT" if m["router_float"] else "router NOT FLOAT"
        mtp = " (MTP, after the model's layers)" if m.get("mtp") else ""
        lines.append(f"MoE layer {m['layer']}{mtp}: {m['experts']} experts {scheme}, {router}")
    ql, qf = t["quantized_linear_bytes"], t["quantized_linear_float_bytes"]
    if qf:
        lines.append(f"quantized Linears: {t['quantized_linears']}, {ql:,} bytes vs {qf:,} in "
                     f"{summary['float_dtype']} ({ql / qf:.3f}x)")
    lines.append(f"total: {t['bytes']:,} bytes vs {t['float_bytes']:,} in {summary['float_dtype']} "
                 f"({t['ratio']:.3f}x)" if t["ratio"] else f"total: {t['bytes']:,} bytes")
    return "\n".join(lines)
