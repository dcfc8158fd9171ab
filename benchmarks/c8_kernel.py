"""The C8 paged-attention kernel alone (`native/c8_kernel.c`), per build, on serving shapes.

One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64) over int8 pages
of 128 tokens, bf16 queries and output, the scales folded as in serving:
  * decode: 32 sequences, one query each, 540 tokens of context (kv_cache.py's 512-token prompts);
  * prefill: 4 sequences of 512 tokens, causal.
Columns: the -march=native build (what this CPU runs by default), the AVX2 build (what an AVX2
CPU runs; `ASCEND_QUANT_CPU_ISA=avx2` selects it in serving), and `attention_torch` (our batched
torch path: gathered pages, scaled_dot_product_attention) as the anchor on the same pages.

    python benchmarks/c8_kernel.py --threads 2 --out benchmarks/results/c8_kernel
    -> c8_kernel.json, c8_kernel.md, c8_kernel.png

Fastest of 5 repeats of 5 calls each; compare within one run, by the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ascend_quant import native
from ascend_quant.runtime.paged import c8

CASES = {"decode 32 x 540": ((540,) * 32, (1,) * 32), "prefill 4 x 512": ((512,) * 4, (512,) * 4)}
H, HKV, D, BS = 9, 3, 64, 128


def pages(ctx, qlen, seed=0):
    """Random K/V written into shuffled int8 pages through c8.write, and bf16 queries."""
    g = torch.Generator().manual_seed(seed)
    nblk = [(c + BS - 1) // BS for c in ctx]
    perm = torch.randperm(sum(nblk) + 1, generator=g)
    bt = torch.zeros(len(ctx), max(nblk), dtype=torch.int32)
    slots, used = [], 0
    for r, (c, n) in enumerate(zip(ctx, nblk)):
        bt[r, :n] = perm[used:used + n].int()
        used += n
        slots += [int(bt[r, p // BS]) * BS + p % BS for p in range(c)]
    cache = torch.zeros(sum(nblk) + 1, HKV, BS, 2 * D, dtype=torch.int8)
    ks, vs = torch.rand(HKV * D, generator=g) * 0.02 + 0.005, torch.rand(HKV * D, generator=g) * 0.02 + 0.01
    key = (torch.randn(len(slots), HKV, D, generator=g) * 2).to(torch.bfloat16)
    value = torch.randn(len(slots), HKV, D, generator=g).to(torch.bfloat16)
    c8.write(cache, key, value, torch.tensor(slots), ks, vs)
    qsl = torch.tensor([0] + torch.tensor(qlen).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), H, D, generator=g).to(torch.bfloat16)
    return (q, cache, ks, vs, qsl, torch.tensor(ctx, dtype=torch.int32), bt, D ** -0.5)


def timeit(fn, repeats=5, inner=5) -> float:
    fn(), fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def run(threads: int) -> dict:
    torch.set_num_threads(threads)
    builds = {"native": native.C8.load(), "avx2": native.C8_AVX2.load()}
    rows = []
    for name, (ctx, qlen) in CASES.items():
        args = pages(ctx, qlen)
        out = torch.empty(sum(qlen), H, D, dtype=torch.bfloat16)
        us = {b: timeit(lambda lib=lib: c8.attention_native(*args, out=out, lib=lib)) * 1e6
              for b, lib in builds.items() if lib is not None}
        us["torch"] = timeit(lambda: c8.attention(*args, impl="torch", out=out)) * 1e6
        rows.append({"case": name, "us": us})
    return {"threads": threads, "rows": rows}


def markdown(res: dict, command: str, cpu: str) -> str:
    lines = ["# C8 paged attention kernel per build (one layer, SmolLM2-135M's heads, 128-token int8 pages)", "",
             f"`{command}` on {cpu}, {res['threads']} thread(s), {res['created']}. Microseconds per call, fastest "
             "of 5 x 5; ratios against our torch path on the same pages.", "",
             "| case | -march=native build | AVX2 build | torch (SDPA on gathered pages) | native vs torch | AVX2 vs torch |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        u = {"native": float("nan"), "avx2": float("nan"), **r["us"]}    # a build that did not compile: nan
        lines.append(f"| {r['case']} | {u['native']:.0f} | {u['avx2']:.0f} | {u['torch']:.0f} | "
                     f"{u['torch'] / u['native']:.2f}x | {u['torch'] / u['avx2']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> bool:
    from runtime import pyplot       # benchmarks/ is on sys.path when run as a script
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    keys = ["native", "avx2", "torch"]
    for i, k in enumerate(keys):
        ax.bar([j + i * 0.27 for j in range(len(res["rows"]))], [r["us"].get(k, 0) for r in res["rows"]], 0.27, label=k)
    ax.set_xticks([j + 0.27 for j in range(len(res["rows"]))], [r["case"] for r in res["rows"]])
    ax.set_ylabel("microseconds per layer")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/c8_kernel", help="output path without extension")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from runtime import cpu_description as cpu_name   # benchmarks/ is on sys.path when run as a script

    res = run(args.threads)
    res["created"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "benchmarks/c8_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(res, command, cpu_name())
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res.update(command=command, cpu=cpu_name(), python=platform.python_version(), torch=torch.__version__)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    plot(res, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
