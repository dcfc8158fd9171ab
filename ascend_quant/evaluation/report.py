"""Float vs quantized: perplexity on held-out text and per-decoder-layer hidden-state error."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ascend_quant.evaluation.perplexity import perplexity

RESULTS_FILE = "eval_results.json"


class EvalError(Exception):
    """The models cannot be evaluated (missing folder, mismatched vocabularies, ...)."""


@dataclass
class EvalResult:
    float_model: str
    quantized: str
    dataset: str
    tokens: int
    seq_len: int
    float_ppl: float
    quantized_ppl: float
    seconds: float
    layer_errors: list[float] = field(default_factory=list)   # relative hidden-state error after each layer
    vllm_ppl: float | None = None   # the quantized checkpoint served by vLLM (`eval --vllm`)

    @property
    def delta(self) -> float:
        return self.quantized_ppl / self.float_ppl - 1.0

    def as_dict(self) -> dict:
        d = {**asdict(self), "delta": self.delta}
        if self.vllm_ppl is None:
            del d["vllm_ppl"]
        else:
            d["vllm_vs_simulation"] = self.vllm_ppl / self.quantized_ppl - 1.0
        return d

    def save(self, folder: str | os.PathLike) -> None:
        path = Path(folder) / RESULTS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        os.replace(tmp, path)


def _layer_outputs(model, windows: torch.Tensor, spec) -> list[torch.Tensor]:
    """Hidden states after every decoder layer for one batch."""
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(
        lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach()))
        for layer in spec.layers(model)]
    try:
        with torch.inference_mode():
            model(input_ids=windows, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return outs


def _rotation_of(quantized: str) -> torch.Tensor | None:
    """The R1 rotation a checkpoint was calibrated with (its calibration record), or None."""
    from ascend_quant.calibration.rotation import residual_rotation
    from ascend_quant.hub import CALIBRATION_NAME
    path = Path(quantized) / CALIBRATION_NAME
    try:
        record = json.loads(path.read_text()).get("rotation") if path.is_file() else None
    except (OSError, ValueError):
        return None
    return residual_rotation(record) if isinstance(record, dict) else None


def evaluate(float_model: str, quantized: str, dataset: str | None = None, tokens: int = 16384,
             seq_len: int = 512, with_vllm: bool = False) -> EvalResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_quant.arch import spec_for_config
    from ascend_quant.calibration.data import eval_windows, load_texts
    from ascend_quant.formats.ascend import CheckpointError
    from ascend_quant.runtime.reference_model import load_reference_model

    start = time.perf_counter()
    if not Path(float_model).exists():
        raise EvalError(f"{float_model}: no such model folder")
    try:
        qmodel = load_reference_model(quantized, torch.float32, kv_cache=True)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    tokenizer = AutoTokenizer.from_pretrained(float_model)
    fmodel = AutoModelForCausalLM.from_pretrained(float_model, dtype=torch.float32).eval()
    if fmodel.config.vocab_size != qmodel.config.vocab_size:
        raise EvalError(f"{quantized} (vocab {qmodel.config.vocab_size}) is not a quantization of {float_model} "
                        f"(vocab {fmodel.config.vocab_size})")
    windows = eval_windows(load_texts(dataset, "eval"), tokenizer, tokens, seq_len)
    fppl = perplexity(fmodel, windows)
    qppl = perplexity(qmodel, windows)
    probe = windows[:1]
    # the checkpoint's spec (a discovered one is saved in its config.json) for both models
    spec = spec_for_config(qmodel.config.to_dict())
    ref, got = _layer_outputs(fmodel, probe, spec), _layer_outputs(qmodel, probe, spec)
    q = _rotation_of(quantized)
    if q is not None:       # a rotated checkpoint's residual stream is the float one times Q
        ref = [(r.double() @ q).float() for r in ref]
    errors = [((g - r).norm() / r.norm().clamp(min=1e-12)).item() for r, g in zip(ref, got)]
    vppl = None
    if with_vllm:           # the same windows through vLLM with our `ascend` method, fp32 like the simulation
        from ascend_quant.evaluation.vllm_perplexity import vllm_perplexity
        del fmodel, qmodel
        vppl = vllm_perplexity(quantized, windows, quantization="ascend", dtype="float32")
    return EvalResult(float_model, quantized, dataset or "wiki (built-in, held-out split)",
                      int(windows.numel()), seq_len, fppl, qppl, time.perf_counter() - start, errors, vppl)


def format_result(r: EvalResult) -> str:
    lines = [f"perplexity on {r.tokens} tokens of {r.dataset} (context {r.seq_len}):",
             f"  float      {r.float_ppl:.4f}",
             f"  quantized  {r.quantized_ppl:.4f}  ({r.delta:+.2%})",
             *([f"  vLLM       {r.vllm_ppl:.4f}  ({r.vllm_ppl / r.quantized_ppl - 1:+.2%} vs the simulation above)"]
               if r.vllm_ppl is not None else []),
             "relative hidden-state error after each layer (first window):"]
    row = [f"{i}:{e:.4f}" for i, e in enumerate(r.layer_errors)]
    for i in range(0, len(row), 8):
        lines.append("  " + "  ".join(row[i:i + 8]))
    lines.append(f"({r.seconds:.1f} s)")
    return "\n".join(lines)
