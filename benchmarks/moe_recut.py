"""A real-weight MoE whose function equals a dense model, and its quantization quality.

SmolLM2-135M (Llama layout) re-cut into a Mixtral: each MLP's intermediate channels are split
into E experts, the router is zero (every token reaches all E experts with weight 1/E after
top-E renormalisation) and each expert's down projection is scaled by E, so the sum of the
experts is the dense MLP. The float logits are checked against the dense model's; then the
dense model and the MoE are calibrated with the same preset and scored on the same held-out
tokens (exact reference arithmetic).

    python benchmarks/moe_recut.py --out /tmp/recut --experts 4 --schemes w8a8-dynamic w4a8
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def recut(dense_dir: Path, out: Path, experts: int) -> Path:
    """Save the Mixtral re-cut of the dense Llama model in `dense_dir` to `out`."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    c = dense.config
    inter = c.intermediate_size
    if inter % experts:
        raise SystemExit(f"intermediate size {inter} does not split into {experts} experts")
    config = MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=inter // experts,
                           num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                           max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                           rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
                           num_local_experts=experts, num_experts_per_tok=experts, sliding_window=None,
                           bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, _ = moe.load_state_dict(state, strict=False)
    with torch.no_grad():
        for i, layer in enumerate(dense.model.layers):
            target = moe.model.layers[i].mlp
            gate, up, down = (getattr(layer.mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj"))
            part = inter // experts
            for e in range(experts):
                rows = slice(e * part, (e + 1) * part)
                target.experts.gate_up_proj[e].copy_(torch.cat([gate[rows], up[rows]]))
                target.experts.down_proj[e].copy_(down[:, rows] * experts)
            target.gate.weight.zero_()
    moe.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (dense_dir / f).is_file():
            shutil.copy(dense_dir / f, out / f)
    return out


def main() -> None:
    from ascend_quant.assets import reference_model_dir
    from ascend_quant.calibration import job, recipe as recipes
    from ascend_quant.evaluation.report import evaluate
    from ascend_quant.formats.verify import verify

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="dense Llama-layout model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--schemes", nargs="+", default=["w8a8-dynamic"])
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    dense_dir = Path(args.model or reference_model_dir())
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    moe_dir = root / f"moe{args.experts}"
    if not moe_dir.exists():
        recut(dense_dir, moe_dir, args.experts)
    ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()(ids).logits
    results = {"float_max_abs_logit_diff": (a - b).abs().max().item(), "experts": args.experts, "runs": []}
    print(f"float logits, re-cut vs dense: max |diff| {results['float_max_abs_logit_diff']:.3g}")
    for scheme in args.schemes:
        for name, src in (("dense", dense_dir), (f"moe{args.experts}", moe_dir)):
            out = root / f"{name}-{scheme}"
            start = time.perf_counter()
            if not out.exists():
                job.calibrate(str(src), out, recipes.preset(scheme), None, num_samples=args.num_samples,
                              show_progress=False)
            seconds = time.perf_counter() - start
            report = verify(out)
            r = evaluate(str(src), str(out), None, args.tokens, 512)
            row = {"model": name, "scheme": scheme, "float_ppl": r.float_ppl, "quantized_ppl": r.quantized_ppl,
                   "delta": r.delta, "verify_ok": report.ok, "calibration_seconds": round(seconds, 1)}
            results["runs"].append(row)
            print(json.dumps(row))
    (root / "moe_recut_results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
