"""Int8 (C8) KV cache vs upstream bf16 CPU attention inside vLLM, on the reference model.

Side by side in one run, same threads, same KV budget, bf16 model weights in both engines:
  * bf16: the float reference model (SmolLM2-135M) with vLLM's own CPU attention (bf16 pages);
  * int8: a C8 checkpoint of it (float weights + kv_cache_scale; `ascend-quant calibrate
    --scheme float --kv-cache int8`), served by ascend-quant's C8 attention (int8 pages).
For each: vLLM's KV cache size (tokens, tokens per GiB), prefill and decode throughput at
1 / 8 / 32 concurrent sequences (fresh random prompts, prefix caching off), and a long workload
with more concurrent sequences than the bf16 cache holds (preemptions, wall time).

    OMP_NUM_THREADS=2 python benchmarks/kv_cache.py --c8 DIR --out benchmarks/results/kv_cache
    -> kv_cache.json, kv_cache.md     (--quick: shorter prompts, fewer tokens)

Ratios int8/bf16 are what to quote; absolute numbers drift on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--c8", help="C8 checkpoint folder (made with ascend-quant calibrate if missing)",
                    default=str(Path.home() / ".cache" / "ascend-quant" / "SmolLM2-135M-c8"))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE for the size comparison")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--long-seqs", type=int, default=16, help="sequences in the over-subscribed workload")
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--long-gen", type=int, default=64)
    ap.add_argument("--long-fit", type=float, default=0.5, help="fraction of the long workload the bf16 cache holds")
    ap.add_argument("--rounds", type=int, default=1,
                    help="throughput rounds per engine, interleaved (bf16, int8, bf16, ...); the fastest counts")
    ap.add_argument("--quick", action="store_true", help="prompt 128, gen 32, long workload 8 x (128 + 32)")
    ap.add_argument("--out", default="benchmarks/results/kv_cache")
    a = ap.parse_args()
    if a.quick:
        a.prompt_len, a.gen, a.long_seqs, a.long_prompt, a.long_gen = 128, 32, 8, 128, 32
    return a


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None:      # before torch/vLLM load: pin threads, in-process engine
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def ensure_c8(path: Path, model_dir: Path) -> Path:
    if (path / "quant_model_description.json").exists():
        return path
    print(f"calibrating C8 scales into {path} ...", flush=True)
    subprocess.run([sys.executable, "-m", "ascend_quant.cli.main", "calibrate", "-o", str(path), "--scheme", "float",
                    "--kv-cache", "int8", "--num-samples", "32"], check=True)
    return path


def make_llm(path: Path, quantization: str | None, kv_bytes: int, max_num_seqs: int, max_len: int):
    from vllm import LLM

    # one prefill step for a whole throughput batch, so the decode inter-token latencies that
    # follow are pure decode steps
    batched = max(2048, max_len, max(ARGS.concurrency) * ARGS.prompt_len)
    return LLM(str(path), quantization=quantization, dtype="bfloat16", enforce_eager=True, seed=0,
               max_model_len=max_len, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes,
               enable_prefix_caching=False, disable_log_stats=False, max_num_batched_tokens=batched)


def prompts(n: int, length: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(100, 40000, (length,), generator=g).tolist()} for _ in range(n)]


def preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def run_throughput(llm, args, seed0: int) -> dict:
    from vllm import SamplingParams

    res = {}
    llm.generate(prompts(2, 32, seed0 - 1), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    for c in args.concurrency:
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        full = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts(c, args.prompt_len, seed0 + c), one, use_tqdm=False)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate(prompts(c, args.prompt_len, seed0 + 1000 + c), full, use_tqdm=False)
        t_full = time.perf_counter() - t
        # decode: per-request inter-token latency from the engine's timestamps (first -> last token);
        # c sequences advance one token per step, so throughput = c / median ITL
        itl = sorted((o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1)
                     for o in outs if o.metrics is not None and len(o.outputs[0].token_ids) > 1)
        if itl:
            decode = c / itl[len(itl) // 2]
        else:           # no engine timestamps: the difference of two runs (noisier)
            decode = c * (args.gen - 1) / max(t_full - t_prefill, 1e-9)
        res[c] = {"prefill_tok_s": c * args.prompt_len / t_prefill, "decode_tok_s": decode,
                  "median_itl_ms": 1e3 * itl[len(itl) // 2] if itl else None,
                  "prefill_s": t_prefill, "total_s": t_full}
        print(f"  c={c}: prefill {res[c]['prefill_tok_s']:.0f} tok/s, decode {res[c]['decode_tok_s']:.1f} tok/s",
              flush=True)
    return res


def run_long(llm, args, seed: int) -> dict:
    from vllm import SamplingParams

    before = preemptions(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts(args.long_seqs, args.long_prompt, seed),
                        SamplingParams(max_tokens=args.long_gen, temperature=0.0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == args.long_gen for o in outs)
    return {"preemptions": preemptions(llm) - before, "wall_s": wall,
            "tok_s": args.long_seqs * args.long_gen / wall}


def engine_kv(llm) -> dict:
    cc = llm.llm_engine.vllm_config.cache_config
    return {"num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size, "tokens": cc.num_gpu_blocks * cc.block_size}


def main() -> None:
    import torch

    from ascend_quant.assets import reference_model_dir
    from ascend_quant.evaluation.vllm_engine import release, shutdown

    args = ARGS
    torch.set_num_threads(args.threads)
    model = Path(reference_model_dir())
    c8 = ensure_c8(Path(args.c8), model)
    gib = 1 << 30
    max_len = max(args.prompt_len + args.gen, args.long_prompt + args.long_gen) + 16
    engines = {"bf16": (model, None), "int8": (c8, "ascend")}
    root = str(Path(__file__).resolve().parent.parent)
    from runtime import cpu_description

    results: dict = {"config": {k: v for k, v in vars(args).items()}, "machine": cpu_description(),
                     "command": " ".join(["benchmarks/kv_cache.py", *sys.argv[1:]]).replace(root, "."),
                     "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "load_avg_at_start": list(os.getloadavg()), "torch_threads": args.threads, "engines": {}}
    # rounds interleaved, so that a busy spell on the machine hits both engines; per concurrency
    # the fastest prefill and decode of the rounds count (every round is kept in the JSON)
    for rnd in range(args.rounds):
        for name, (path, quant) in engines.items():
            print(f"[{name}] round {rnd + 1}: {path}", flush=True)
            t = time.perf_counter()
            llm = make_llm(path, quant, args.kv_gib * gib, max(args.concurrency), max_len)
            e = results["engines"].setdefault(name, {"init_s": time.perf_counter() - t, "kv": engine_kv(llm),
                                                     "rounds": []})
            e["kv"]["tokens_per_gib"] = e["kv"]["tokens"] / args.kv_gib
            print(f"  KV cache: {e['kv']['tokens']} tokens in {args.kv_gib} GiB", flush=True)
            e["rounds"].append(run_throughput(llm, args, seed0=10))
            shutdown(llm)
            del llm
            release()
    for e in results["engines"].values():
        e["throughput"] = {c: {k: (max if k.endswith("tok_s") else min)(r[c][k] for r in e["rounds"])
                               for k in ("prefill_tok_s", "decode_tok_s")} for c in args.concurrency}
    # size the budget in whole blocks: bf16 holds `long_fit` of the blocks the workload wants at once
    bkv = results["engines"]["bf16"]["kv"]
    bytes_per_block_bf16 = args.kv_gib * gib / bkv["num_blocks"]
    long_len = args.long_prompt + args.long_gen + 16
    blocks_per_seq = -(-long_len // bkv["block_size"])
    blocks_wanted = args.long_seqs * blocks_per_seq
    # at least one whole sequence of the engine's max_model_len fits, or vLLM refuses to start
    # (it did with --long-prompt 128 next to the default 512-token throughput prompts)
    long_blocks = max(blocks_per_seq + 1, round(args.long_fit * blocks_wanted))
    long_bytes = int(long_blocks * bytes_per_block_bf16)
    results["long"] = {"kv_bytes": long_bytes}
    for name, (path, quant) in engines.items():
        llm = make_llm(path, quant, long_bytes, args.long_seqs, long_len)
        r = run_long(llm, args, seed=99)
        r["kv_tokens"] = engine_kv(llm)["tokens"]
        shutdown(llm)
        del llm
        release()
        results["long"][name] = r
        print(f"[{name}] long workload: {r['preemptions']} preemptions, {r['wall_s']:.1f} s", flush=True)
    b, i = results["engines"]["bf16"], results["engines"]["int8"]
    results["ratios"] = {
        "kv_tokens": i["kv"]["tokens"] / b["kv"]["tokens"],
        **{f"prefill_c{c}": i["throughput"][c]["prefill_tok_s"] / b["throughput"][c]["prefill_tok_s"]
           for c in args.concurrency},
        **{f"decode_c{c}": i["throughput"][c]["decode_tok_s"] / b["throughput"][c]["decode_tok_s"]
           for c in args.concurrency},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(results, args))
    print(markdown(results, args))
    made = plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}"
          + (f", {out.with_suffix('.png')}" if made else " (no plot: matplotlib not installed)"))


def plot(r: dict, path: Path) -> bool:
    """Prefill and decode tok/s per concurrency, vLLM's bf16 pages beside our int8 ones, each
    int8 bar labelled with its ratio; False where matplotlib is not installed."""
    from runtime import pyplot       # benchmarks/ is on sys.path when run as a script
    plt = pyplot()
    if plt is None:
        return False
    # keyed by the concurrency: ints in this process, strings once read back from the JSON
    b, i = ({str(c): v for c, v in r["engines"][e]["throughput"].items()} for e in ("bf16", "int8"))
    conc = [str(c) for c in r["config"]["concurrency"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_tok_s", "decode tok/s")):
        xs = range(len(conc))
        ax.bar([x - 0.2 for x in xs], [b[c][key] for c in conc], 0.4, color="#7f7f7f", label="bf16 pages (vLLM)")
        bars = ax.bar([x + 0.2 for x in xs], [i[c][key] for c in conc], 0.4, color="#1f77b4", label="int8 pages (C8)")
        for bar, c in zip(bars, conc):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{i[c][key] / b[c][key]:.2f}x",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [f"{c} seq" for c in conc])
        ax.set_ylabel(title)
        ax.set_ylim(0, max(max(b[c][key], i[c][key]) for c in conc) * 1.25)     # room for the labels
    axes[0].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"int8 KV cache vs bf16, {r['config']['threads']} thread(s), {r['config']['prompt_len']}-token "
                 f"prompts, {r['ratios']['kv_tokens']:.2f}x the cached tokens: {r.get('machine', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(r: dict, args) -> str:
    b, i = r["engines"]["bf16"], r["engines"]["int8"]
    lines = [f"# Int8 (C8) KV cache vs bf16 CPU attention (vLLM, SmolLM2-135M, bf16 weights, {args.threads} threads)",
             "", f"`{r['command']}` ({r['created']}, {r['machine']}, load average {r['load_avg_at_start'][0]:.2f} at "
             f"start). Prompt {args.prompt_len} tokens, {args.gen} generated; KV budget {args.kv_gib} GiB; "
             f"{args.rounds} round(s) per engine, interleaved, the fastest counts.", "",
             "| | bf16 (upstream) | int8 (C8) | ratio |", "|---|---|---|---|",
             f"| KV cache tokens | {b['kv']['tokens']:,} | {i['kv']['tokens']:,} | {r['ratios']['kv_tokens']:.2f} |",
             f"| tokens per GiB | {b['kv']['tokens_per_gib']:,.0f} | {i['kv']['tokens_per_gib']:,.0f} | |"]
    for c in args.concurrency:
        for kind in ("prefill", "decode"):
            x, y = b["throughput"][c][f"{kind}_tok_s"], i["throughput"][c][f"{kind}_tok_s"]
            lines.append(f"| {kind} tok/s, {c} seqs | {x:.1f} | {y:.1f} | {y / x:.2f} |")
    lg = r["long"]
    lines += ["", f"Over-subscribed: {args.long_seqs} sequences x ({args.long_prompt} + {args.long_gen}) tokens, "
              f"KV budget {lg['kv_bytes'] / 2**20:.1f} MiB (bf16 holds ~{args.long_fit:.0%})", "",
              "| | bf16 | int8 |", "|---|---|---|",
              f"| KV tokens | {lg['bf16']['kv_tokens']:,} | {lg['int8']['kv_tokens']:,} |",
              f"| preemptions | {lg['bf16']['preemptions']} | {lg['int8']['preemptions']} |",
              f"| wall s | {lg['bf16']['wall_s']:.1f} | {lg['int8']['wall_s']:.1f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
