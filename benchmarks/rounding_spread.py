"""How much of a weight-only int8 perplexity change is the luck of the rounding.

Per-channel symmetric int8 (W8A16's grid: `numerics.weight_scale` and
`numerics.fake_quantize_weight`) is applied in the float model to one Linear role at a time
(q_proj, k_proj, ..., down_proj of every decoder layer, then all of them), and the perplexity of
the selection part of the calibration text (`choose_preset.split_texts`; the eval split is never
read) is compared with float's. Besides round-to-nearest (RTN), each role gets `--draws`
perturbations with RTN's error magnitudes and random signs: every weight moves by
+-|RTN(w) - w|, each sign a coin flip. (Uniform noise of the step's size is not the same:
weights dequantized from a GGUF file sit on a coarser grid, and many of them round with a
small or no error.) The spread of the draws is the spread of outcomes that errors of RTN's
size can land in. Where it is as wide as a target, the increase is mostly the first-order
term g . dW (g: the loss gradient at the float weights, which is not zero where the float
model is not at a minimum of the loss on this text; both reference models were 4-bit GGUF
once), and a smaller weight error alone (GPTQ's) does not decide it.

    python benchmarks/rounding_spread.py --model $(ascend-quant fetch gemma-3-270m) --threads 2
    -> benchmarks/results/rounding_spread-<model folder name>.{json,md}
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the reference model)")
    ap.add_argument("--select-tokens", type=int, default=8192, help="selection tokens scored")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--draws", type=int, default=3, help="random perturbations per role")
    ap.add_argument("--roles", default=None, help="comma list of Linear names (default: every one in the layers)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="results stem (default: benchmarks/results/rounding_spread-MODEL)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_quant import assets, numerics
    from ascend_quant.arch import spec_for_model
    from ascend_quant.calibration.data import eval_windows, load_texts
    from ascend_quant.evaluation.perplexity import perplexity
    from choose_preset import split_texts
    from runtime import cpu_description

    if args.model and not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"error: {args.model}: no model folder (config.json) there")
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else assets.reference_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _, select = split_texts(load_texts(None, "calibration"))
    windows = eval_windows(select, tokenizer, args.select_tokens, args.seq_len)

    layers = spec_for_model(model).layers(model)
    linears = {f"{i}.{name}": m for i, layer in enumerate(layers)
               for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    names = list(dict.fromkeys(k.rsplit(".", 1)[1] for k in linears))
    roles = args.roles.split(",") if args.roles else names
    unknown = [r for r in roles if r not in names]
    if unknown:
        raise SystemExit(f"error: no Linear named {', '.join(unknown)} in the layers (they have {', '.join(names)})")
    original = {k: m.weight.detach().clone() for k, m in linears.items()}
    rounded = {k: numerics.fake_quantize_weight(w, numerics.weight_scale(w, 8), 8)     # per channel
               for k, w in original.items()}

    def score(weights: dict[str, torch.Tensor]) -> float:
        for k, m in linears.items():
            m.weight.data = weights.get(k, original[k])
        return perplexity(model, windows)

    def members(role: str) -> list[str]:
        return [k for k in linears if role == "all" or k.rsplit(".", 1)[1] == role]

    start = time.perf_counter()
    float_ppl = score({})
    print(f"float perplexity {float_ppl:.4f} on {windows.numel()} selection tokens", flush=True)
    rows = []
    for role in [*roles, "all"]:
        keys = members(role)
        rtn = score({k: rounded[k] for k in keys})
        row = {"role": role, "linears": len(keys), "rtn_pct": 100 * (rtn / float_ppl - 1), "draws_pct": []}
        for draw in range(args.draws):
            g = torch.Generator().manual_seed(draw)
            noisy = {}
            for k in keys:
                error = (rounded[k] - original[k]).abs()
                sign = torch.randint(0, 2, error.shape, generator=g).float() * 2 - 1
                noisy[k] = original[k] + sign * error
            row["draws_pct"].append(100 * (score(noisy) / float_ppl - 1))
        rows.append(row)
        draws = " ".join(f"{d:+.3f}%" for d in row["draws_pct"])
        print(f"{role:<12} RTN {row['rtn_pct']:+.3f}%  draws {draws}", flush=True)

    out = Path(args.out) if args.out else Path("benchmarks/results") / f"rounding_spread-{model_dir.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": model_dir.name, "select_tokens": int(windows.numel()), "float_ppl": float_ppl,
            "threads": args.threads, "cpu": cpu_description(),
            "seconds": round(time.perf_counter() - start, 1), "date": datetime.now(timezone.utc).isoformat()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Rounding spread, {model_dir.name} ({meta['select_tokens']} selection tokens, float {float_ppl:.4f})",
             "", f"| role | Linears | int8 RTN | {args.draws} draws: RTN's errors, random signs |", "|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['role']} | {r['linears']} | {r['rtn_pct']:+.3f}% | "
                     + ", ".join(f"{d:+.3f}%" for d in r["draws_pct"]) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json, {out}.md")


if __name__ == "__main__":
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
