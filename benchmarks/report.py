#!/usr/bin/env python3
"""Write the README's results section from the benchmarks' JSON.

    .venv/bin/python benchmarks/report.py          # rewrites README.md between the markers

Reads benchmarks/results/{calibration,calibration-w8a8d,calibration-gemma,runtime-e2e-compiled-avx2,
runtime-avx2,kv_cache-avx2,runtime-e2e-compiled-amx-stop38,c8_kernel-amx,c8_kernel-amx-before,
kv_cache-amx-avx2-forced,runtime-e2e-compiled-amx-w4a8g64,runtime-e2e-compiled-avx2-forced,
runtime-e2e-compiled-avx2-forced-int8,runtime-avx2-forced,runtime-e2e-compiled-amx,
runtime-e2e-compiled-amx-int8,runtime-amx,runtime,
runtime-e2e-compiled,runtime-e2e,moe_runtime,weight_memory,kv_cache,kv_cache-amx}.*
(whichever exist; quick and ad-hoc runs are ignored) and replaces the text between
`<!-- results:start -->` and `<!-- results:end -->` in README.md. Every number in that section comes from those files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"
LABELS = {"ours": "ascend-quant", "llmcompressor": "llm-compressor", "msmodelslim": "msModelSlim"}
# The real models' float weights are dequantized GGUFs (README "Reference model"): the
# quantization they once had, named beside every 4-bit figure
GGUF_ONCE = {"SmolLM2-135M-Instruct": "Q4_1", "gemma-3-270m": "Q4_K_M"}
sys.path.insert(0, str(HERE))
from calibration import SCHEMES as CAL_SCHEMES  # noqa: E402  (the benchmark's scheme table: standard library only)


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


WINDOWS = "windows (calibrate's default, packed)"


def calibration_section(d: dict, title: str = "Calibration: ascend-quant vs llm-compressor vs msModelSlim",
                        png: str = "calibration") -> list[str]:
    s = d["settings"]
    fl = d["float_ppl"]
    model = Path(s.get("model") or "").name
    gguf = GGUF_ONCE.get(model)
    out = [f"### {title}", "",
           f"`{d['command']}` ({d['created'][:16]}; model `{model}`; {d['data'].get('samples', s.get('samples'))} calibration "
           f"{WINDOWS if d['data'].get('packed') else 'paragraphs'}, "
           f"{d['data'].get('calib_tokens', '?')} tokens; perplexity on {s.get('eval_tokens')} held-out "
           f"tokens at context 512; float perplexity {fl:.4f}; {d['machine'].get('cpus', '?')} CPUs, load "
           f"average at start {d['machine'].get('load_avg_at_start', ['?'])[0]:.1f}).", "",
           "| scheme | tool | threads | wall s | peak RSS MB | checkpoint MB | perplexity | vs float |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["runs"]:
        ppl = r.get("ppl")
        label = d["schemes"].get(r["scheme"], {}).get("title", r["scheme"]) if isinstance(d.get("schemes"), dict) else r["scheme"]
        if gguf and r["scheme"].startswith("w4"):
            label += f", weights 4-bit GGUF ({gguf}) once"
        out.append(f"| {label} | {LABELS.get(r['tool'], r['tool'])} | {r['threads']} | {r['wall_s']:.1f} | "
                   f"{r['peak_rss_mb']:.0f} | {r.get('output_mb') or 0:.0f} | {'' if ppl is None else f'{ppl:.4f}'} | "
                   f"{'' if ppl is None else f'{ppl / fl - 1:+.2%}'} |")
    ratios = []
    ours = {(r["scheme"], r["threads"]): r for r in d["runs"] if r["tool"] == "ours"}
    ppl_by = {(r["tool"], r["scheme"]): r.get("ppl") for r in d["runs"] if r.get("ppl") is not None}
    for r in d["runs"]:
        mine = CAL_SCHEMES.get(r["scheme"], {}).get("ours_row", r["scheme"])   # ours' row it is set against
        o = ours.get((mine, r["threads"]))
        if r["tool"] == "ours" or o is None or not r.get("wall_s"):
            continue
        op, ap = ppl_by.get(("ours", mine)), ppl_by.get((r["tool"], r["scheme"]))
        ratios.append(f"| {r['scheme']} | {LABELS.get(r['tool'], r['tool'])} | {r['threads']} | "
                      f"{o['wall_s'] / r['wall_s']:.2f} | {o['peak_rss_mb'] / r['peak_rss_mb']:.2f} | "
                      f"{'' if not (op and ap) else f'{op / ap:.4f}'} |")
    if ratios:
        out += ["", "Ratios ascend-quant / anchor (below 1: ours is faster / smaller / better):", "",
                "| scheme | anchor | threads | wall time | peak RSS | perplexity |", "|---|---|---:|---:|---:|---:|",
                *ratios]
    if (RESULTS / f"{png}.png").is_file():
        out += ["", f"![{title}](benchmarks/results/{png}.png)"]
    return out


def markdown_file_section(name: str, title: str, note: str = "") -> list[str]:
    """A benchmark's own markdown under a title; `note` (no figures: those come from the file) says
    what the run is and is not evidence of."""
    md = RESULTS / f"{name}.md"
    if not md.is_file() and (RESULTS / f"{name}-quick.md").is_file():
        md, title = RESULTS / f"{name}-quick.md", f"{title} (reduced --quick run)"
    if not md.is_file():
        return []
    body = [line for line in md.read_text().splitlines() if not line.startswith("# ")]
    out = [f"### {title}", "", *([note, ""] if note else []), *body]
    if (RESULTS / f"{name}.png").is_file():
        out += ["", f"![{title}](benchmarks/results/{name}.png)"]
    return out


AVX2_FORCED_SHORT = ("**Not an AVX2 CPU:** our rows run our AVX2 builds (what an AVX2 CPU without VNNI "
                     "selects by default), but torch's own GEMMs still use this CPU's AMX and AVX-512.")
AVX2_FORCED = (f"At commit 5391da2 (the integer GEMV, before its per-group extension). {AVX2_FORCED_SHORT} So the "
               "bf16 and fp32 rows, and the float32 k-chunk GEMMs of prefill and of the `f32` rows, say nothing "
               "about an AVX2 CPU; what the run compares is our two int8 paths of such a CPU side by side: the "
               "integer GEMV (`gemv`, the default there) against the float32 k-chunk GEMMs (`f32`, the previous "
               "default).")


AVX2_REAL_SHORT = ("**An AVX2 CPU** (AMD EPYC, Zen 3: AVX2 and FMA, no AVX-512, no VNNI, no AVX512-BF16): "
                   "torch's bf16 GEMMs have no native bf16 here and run about 10x slower than its fp32 ones, so "
                   "the fp32 columns are the comparison that matters.")
AVX2_REAL = (AVX2_REAL_SHORT + " vLLM's own int8 row is fast at prefill but its oneDNN s8s8 GEMM saturates "
             "without VNNI (wrong results); ours take the integer GEMV, exact.")


def build() -> str:
    lines = ["## Results", "",
             "Generated by `.venv/bin/python benchmarks/report.py` from `benchmarks/results/*.json`; "
             "rerun the benchmarks (commands in each table's caption) and this script to refresh it.", ""]
    cal = _load("calibration")
    if cal:
        lines += calibration_section(cal) + [""]
    w8 = _load("calibration-w8a8d")
    if w8:
        lines += calibration_section(w8, "Calibration: W8A8_DYNAMIC with rotation (stop 24) vs msModelSlim, "
                                     "with and without its QuaRot", "calibration-w8a8d") + [""]
    gemma = _load("calibration-gemma")
    if gemma:
        lines += calibration_section(gemma, "Calibration: Gemma-3-270m (ascend-quant), Intel Xeon with AMX (stop 32)", "calibration-gemma") + [""]
    lines += markdown_file_section("runtime-e2e-compiled-avx2", "vLLM end to end, compiled (vLLM's default mode), "
                                   "AMD EPYC with AVX2, no AVX-512, no VNNI (stop 37)", AVX2_REAL) + [""]
    lines += markdown_file_section("runtime-avx2", "Runtime kernels, AMD EPYC with AVX2 (stop 37)",
                                   "The online rotation column came from a first, uncommitted version of the "
                                   "operator (one chunk of the Paley core at a time); the committed one (a9eb03a) "
                                   "runs four: 778 against 1635 us at 512 tokens, k = 1536, one thread (one-off "
                                   "timing). " + AVX2_REAL_SHORT) + [""]
    lines += markdown_file_section("kv_cache-avx2", "Int8 KV cache in vLLM, AMD EPYC with AVX2 (stop 37)",
                                   AVX2_REAL_SHORT) + [""]
    lines += markdown_file_section("runtime-e2e-compiled-amx-stop38", "vLLM end to end, compiled (vLLM's default "
                                   "mode), Intel Xeon with AMX (stop 38)", "The code at the start of stop 38 on the AMX "
                                   "CPU, with the per-group W4A8 preset grouping and the online rotation's C++ "
                                   "operator (`--online-rotation`) as engines of their own. Its group-64 row ran the "
                                   "int4 form with group scales, replaced in the same stop (next table).") + [""]
    lines += markdown_file_section("runtime-e2e-compiled-amx-w4a8g64", "vLLM end to end, compiled: two-stage "
                                   "W4A8 (group 64) served as int8 per channel, Intel Xeon with AMX (stop 38)",
                                   "After `numerics.two_stage_int8`: the group-64 row ran the int4 form in the "
                                   "table above.") + [""]
    lines += markdown_file_section("c8_kernel-amx", "C8 attention kernel per build, Intel Xeon with AMX (stop 38)",
                                   "After the AVX2 fix (8-float vectors on AVX2). The AVX2 build runs here as it "
                                   "would on an AVX2 CPU (its own instructions only); torch's column uses this "
                                   "CPU's AVX-512.") + [""]
    lines += markdown_file_section("c8_kernel-amx-before", "C8 attention kernel per build, before the AVX2 fix "
                                   "(stop 38)", "The same script on the previous `c8_kernel.c`: 16-float GCC "
                                   "vectors on AVX2, row accumulators spilled to the stack.") + [""]
    lines += markdown_file_section("kv_cache-amx-avx2-forced", "Int8 KV cache in vLLM, our AVX2 C8 build forced on "
                                   "the Intel Xeon with AMX (stop 38)", "**Not an AVX2 CPU:** vLLM's bf16 "
                                   "attention runs its AVX-512 code here; our int8 pages run the AVX2 build.") + [""]
    lines += markdown_file_section("runtime-e2e-compiled-avx2-forced", "vLLM end to end, compiled: the AVX2 builds "
                                   "forced on the Intel Xeon with AMX (stop 29)", AVX2_FORCED) + [""]
    lines += markdown_file_section("runtime-e2e-compiled-avx2-forced-int8", "vLLM end to end, compiled: the int8 "
                                   "rows again, AVX2 builds forced, final dynamic paths (stop 29)",
                                   "At commit f20f1ad; the dynamic int8 paths did not change after it.") + [""]
    lines += markdown_file_section("runtime-avx2-forced", "Runtime kernels, the AVX2 builds forced on the Intel "
                                   "Xeon with AMX (stop 29)", "At commit 9e8e48b; later commits moved no "
                                   "arithmetic of these paths. " + AVX2_FORCED_SHORT) + [""]
    lines += markdown_file_section("runtime-e2e-compiled-amx", "vLLM end to end, compiled (vLLM's default mode), "
                                   "Intel Xeon with AMX (stop 26)") + [""]
    lines += markdown_file_section("runtime-e2e-compiled-amx-int8", "vLLM end to end, compiled: the int8 "
                                   "engines again, 4 rounds, Intel Xeon with AMX (stop 26)") + [""]
    lines += markdown_file_section("runtime-amx", "Runtime kernels, Intel Xeon with AMX (stop 26)") + [""]
    lines += markdown_file_section("runtime", "Runtime kernels (CPU)") + [""]
    lines += markdown_file_section("runtime-e2e-compiled", "vLLM end to end, compiled (vLLM's default mode), "
                                   "AMD EPYC (stop 23)") + [""]
    lines += markdown_file_section("runtime-e2e", "vLLM end to end, enforce_eager: tokens/s and weight memory per scheme") + [""]
    lines += markdown_file_section("moe_runtime", "MoE in vLLM: quantized experts vs bf16 (re-cut SmolLM2-135M)") + [""]
    lines += markdown_file_section("weight_memory", "Weight memory of quantized Linears in vLLM") + [""]
    lines += markdown_file_section("kv_cache", "Int8 KV cache in vLLM (CPU)") + [""]
    lines += markdown_file_section("kv_cache-amx", "Int8 KV cache in vLLM, Intel Xeon with AMX (stop 30)") + [""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        text = text.rstrip() + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{build()}{END}{tail}")
    print(f"updated {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
