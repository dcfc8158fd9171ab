"""int8 GEMM vs float matmul on the CPU at the reference model's prefill and decode shapes.

SmolLM2-135M (hidden 576, intermediate 1536, 9 heads, 3 KV heads, head_dim 64): the Linears
are qkv [576 -> 960], o [576 -> 576], gate_up [576 -> 3072], down [1536 -> 576]. For each
shape and token count it times, side by side in one run: fp32 and bf16 `x @ w^T`, the bare
`torch._int_mm`, the exact int8 GEMM of the cpu backend (float32 GEMMs over k-chunks of
1024), and the whole W8A8_DYNAMIC and W8A8 static Linears of `runtime.kernels` (cpu
backend: quantize + int8 GEMM + epilogue, bf16 activations). Ratios against bf16 are what to quote;
absolute times drift between runs on a shared machine.

    python benchmarks/runtime.py --threads 1 --out benchmarks/results/runtime
    -> runtime.json, runtime.md (and runtime.png when matplotlib is importable)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ascend_quant import numerics
from ascend_quant.runtime.kernels.cpu import CpuBackend, cpu_has_vnni, vllm_cpu_ops
from ascend_quant.runtime.kernels.reference import exact_int8_matmul
from ascend_quant.runtime.qlinear import QuantLinear

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576)}
TOKENS = {"decode": 1, "decode_batch8": 8, "prefill": 512}


def timeit(fn, min_time: float = 0.3, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` batches of at least `min_time` seconds."""
    fn()
    n, t = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - start
        if t >= min_time / repeats:
            break
        n *= 2
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n)
    return statistics.median(samples)


def bench_shape(k: int, n: int, m: int, backend: CpuBackend) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    w_bf16, x_bf16 = w.to(torch.bfloat16), x.to(torch.bfloat16)
    w_q, s_w = numerics.quantize_weight(w, 8)
    x_q, _ = numerics.quantize_activation_dynamic(x)
    w_f32_t = w_q.float().t().contiguous()
    dyn = QuantLinear.build("W8A8_DYNAMIC", {"weight": w_q, "weight_scale": s_w}, backend=backend)
    s_x, o_x = numerics.activation_qparams(x.min(), x.max())
    deq = numerics.deq_scale(s_x, s_w)
    static = QuantLinear.build("W8A8", {"weight": w_q, "input_scale": s_x, "input_offset": o_x, "deq_scale": deq,
                                        "quant_bias": numerics.quant_bias(None, deq, o_x, w_q)}, backend=backend)
    out = {
        "fp32_matmul": timeit(lambda: x @ w.t()),
        "bf16_matmul": timeit(lambda: x_bf16 @ w_bf16.t()),
        "int8_gemm_f32_exact": timeit(lambda: exact_int8_matmul(x_q, w_f32_t=w_f32_t)),
        "int_mm": timeit(lambda: torch._int_mm(x_q, w_q.t())),
        "w8a8_dynamic_linear_bf16": timeit(lambda: dyn(x_bf16)),
        "w8a8_static_linear_bf16": timeit(lambda: static(x_bf16)),
    }
    return out


def markdown(result: dict) -> str:
    lines = [f"# int8 GEMM vs float matmul (CPU, {result['threads']} thread(s))", "",
             f"{result['machine']}; torch {result['torch']}; VNNI: {result['vnni']}; "
             f"oneDNN int8 path: {result['onednn']}", "",
             "Median time per call in microseconds; `x bf16` = speed-up over the bf16 matmul.", "",
             "| phase | layer | m x k x n | fp32 | bf16 | _int_mm | int8 GEMM, exact f32 | W8A8_DYNAMIC linear | W8A8 static linear |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        t = row["seconds"]
        bf = t["bf16_matmul"]

        def cell(key):
            return f"{t[key] * 1e6:.1f} ({bf / t[key]:.2f}x)"
        lines.append(f"| {row['phase']} | {row['layer']} | {row['m']}x{row['k']}x{row['n']} | "
                     f"{t['fp32_matmul'] * 1e6:.1f} | {bf * 1e6:.1f} | {cell('int_mm')} | {cell('int8_gemm_f32_exact')} | "
                     f"{cell('w8a8_dynamic_linear_bf16')} | {cell('w8a8_static_linear_bf16')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = ["fp32_matmul", "int_mm", "int8_gemm_f32_exact", "w8a8_dynamic_linear_bf16", "w8a8_static_linear_bf16"]
    labels = [f"{r['phase']}\n{r['layer']}" for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ratios = [r["seconds"]["bf16_matmul"] / r["seconds"][key] for r in result["rows"]]
        ax.bar([j + i * width for j in range(len(labels))], ratios, width, label=key)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("speed-up over bf16 matmul")
    ax.set_title(f"CPU, {result['threads']} thread(s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned; default 1)")
    ap.add_argument("--out", default="benchmarks/results/runtime", help="output path without extension")
    ap.add_argument("--phases", default=",".join(TOKENS), help=f"comma list of {', '.join(TOKENS)}")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    backend = CpuBackend()
    result = {"threads": args.threads, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "vnni": cpu_has_vnni(), "cpu_gemm": backend.gemm, "onednn": "used" if backend.use_onednn else
              ("not used: no VNNI (oneDNN s8s8 saturates int16 pair sums on AVX2)" if vllm_cpu_ops() else
               "not used: vLLM CPU ops absent"), "rows": []}
    for phase in args.phases.split(","):
        m = TOKENS[phase]
        for layer, (k, n) in SHAPES.items():
            seconds = bench_shape(k, n, m, backend)
            result["rows"].append({"phase": phase, "layer": layer, "m": m, "k": k, "n": n, "seconds": seconds})
            print(f"{phase:14s} {layer:13s} " + " ".join(f"{key}={v * 1e6:.1f}us" for key, v in seconds.items()),
                  file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    made_plot = plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}"
          + (f", {out.with_suffix('.png')}" if made_plot else " (no plot: matplotlib not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
