#!/usr/bin/env python3
"""Weight memory of quantized Linears as our CPU kernels hold them in vLLM, against bf16.

    .venv/bin/python benchmarks/weight_memory.py CKPT [CKPT ...]

For every quantized Linear of each checkpoint, the bytes of every tensor the CPU backend keeps
after loading (`PreparedLinear.build`, which vLLM's `process_weights_after_loading` calls; the
loaded parameters are dropped after it), against `n * k * 2` bytes of the bf16 weight.
Writes benchmarks/results/weight_memory.{json,md}.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from ascend_quant.formats.ascend import read_checkpoint
from ascend_quant.runtime.kernels.cpu import CpuBackend
from ascend_quant.schemes import LINEAR_SCHEMES, PreparedLinear

RESULTS = Path(__file__).resolve().parent / "results"


def _tensor_bytes(obj, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.numel() == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_tensor_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    return 0


def measure(path: str) -> dict:
    ckpt = read_checkpoint(path)
    backend = CpuBackend()
    held = bf16 = 0
    per_scheme: dict[str, list[int]] = {}
    for prefix, mod in ckpt.modules().items():
        scheme = mod.weight_scheme
        if scheme not in LINEAR_SCHEMES:
            continue
        t = ckpt.tensors([f"{prefix}.{s}" for s in sorted(mod.schemes[scheme])])
        t = {name.rpartition(".")[2]: v for name, v in t.items()}
        ql = PreparedLinear.build(scheme, t, backend=backend, dtype=torch.bfloat16)
        b = _tensor_bytes(ql, set())
        f = ql.n * ql.k * 2
        held += b
        bf16 += f
        acc = per_scheme.setdefault(scheme, [0, 0])
        acc[0] += b
        acc[1] += f
    return {"checkpoint": Path(path).name, "quantized_linear_bytes": held, "bf16_bytes": bf16,
            "ratio": held / bf16 if bf16 else None,
            "per_scheme": {s: {"bytes": v[0], "bf16_bytes": v[1], "ratio": v[0] / v[1]} for s, v in per_scheme.items()}}


def main(paths: list[str]) -> int:
    rows = [measure(p) for p in paths]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_memory.json").write_text(json.dumps({"command": "benchmarks/weight_memory.py " + " ".join(
        Path(p).name for p in paths), "rows": rows}, indent=2))
    lines = ["| checkpoint | scheme | held by the CPU kernels | bf16 weights | ratio |", "|---|---|---:|---:|---:|"]
    for r in rows:
        for s, v in r["per_scheme"].items():
            lines.append(f"| {r['checkpoint']} | {s} | {v['bytes'] / 2**20:.1f} MiB | {v['bf16_bytes'] / 2**20:.1f} MiB | "
                         f"{v['ratio']:.3f}x |")
    (RESULTS / "weight_memory.md").write_text("# Weight memory of quantized Linears in vLLM (CPU kernels)\n\n"
                                              + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
