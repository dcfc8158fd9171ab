"""Test helpers for the runtime tests: tiny quantized checkpoints made with ascend_quant.numerics
and formats.ascend.write_checkpoint from msModelSlim's tiny-qwen2 (not the calibrator: static
W8A8 ranges come from plain forward hooks over calib.jsonl)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ascend_quant import numerics
from ascend_quant.formats.ascend import write_checkpoint
from ascend_quant.arch import DEFAULT as LLAMA_SPEC
from ascend_quant.schemes import QuantizedLinear, checkpoint_entries, get_scheme
from conftest import FIXTURES, fixture_dir

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def sharpened_tiny_model(dst: Path, logit_gain: float = 30.0) -> Path:
    """tiny-qwen2-fp32 with lm_head scaled so greedy decoding has clear winners (the random-init
    model's next-token distribution is nearly flat, where argmax is decided by rounding)."""
    src = fixture_dir("tiny-qwen2-fp32")
    shutil.copytree(src, dst)
    for f in dst.rglob("*"):
        f.chmod(0o644)
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] * logit_gain
    save_file(state, str(dst / "model.safetensors"))
    return dst


def calibration_texts(n: int = 4) -> list[str]:
    lines = (FIXTURES / "calib.jsonl").read_text().splitlines()
    return [json.loads(l)["inputs_pretokenized"] for l in lines[:n]]


def activation_ranges(model_dir: Path, texts: list[str]) -> dict[str, tuple[float, float]]:
    """min/max of every Linear's input over `texts` (forward hooks on the float model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ranges: dict[str, list[float]] = {}

    def hook(name):
        def fn(_mod, inputs, _out):
            x = inputs[0].detach()
            lo, hi = ranges.setdefault(name, [float("inf"), float("-inf")])
            ranges[name] = [min(lo, x.min().item()), max(hi, x.max().item())]
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for text in texts:
            model(**tok(text, return_tensors="pt"))
    for h in handles:
        h.remove()
    return {k: (v[0], v[1]) for k, v in ranges.items()}


def quantize_tiny(model_dir: Path, out: Path, schemes: dict[str, str], *, group_size: int = 32,
                  norm_bias: tuple[str, ...] = (), deq_dtype: torch.dtype = torch.float32,
                  config_dtype: str | None = None) -> Path:
    """Write an Ascend checkpoint of the tiny model. `schemes` maps 'layers.<i>.<self_attn|mlp>'
    to a scheme (W4A8_GROUP = two-stage per-group W4A8_DYNAMIC); `norm_bias` names norms
    ('layers.0.input_layernorm') given a smoothing-style bias (folded out of nothing: the
    checkpoint simply means norm(x) + b)."""
    state = load_file(model_dir / "model.safetensors")
    ranges = activation_ranges(model_dir, calibration_texts()) if "W8A8" in schemes.values() else {}
    tensors: dict[str, torch.Tensor] = {}
    desc: dict[str, str] = {}
    g = torch.Generator().manual_seed(1)

    def put(name, t, qtype):
        tensors[name] = t.contiguous()
        desc[name] = qtype

    done = set()
    for block, scheme in schemes.items():
        for lin in LINEARS:
            if not lin.startswith(block.split(".")[-1]):
                continue
            p = f"model.{block.rsplit('.', 1)[0]}.{lin}"
            done.add(p)
            w, bias = state[f"{p}.weight"], state.get(f"{p}.bias")
            if scheme == "FLOAT":
                put(f"{p}.weight", w, "FLOAT")
                if bias is not None:
                    put(f"{p}.bias", bias, "FLOAT")
                continue
            row_parallel = LLAMA_SPEC.is_row_parallel(p)
            if scheme == "W8A8":
                w_q, s_w = numerics.quantize_weight(w, 8)
                s_x, o_x = numerics.activation_qparams(*ranges[p])
                ql = QuantizedLinear(scheme, w_q, s_w, bias, input_scale=s_x, input_offset=o_x)
            elif scheme == "W4A8_GROUP":           # the scheme's two-stage per-group form
                w4, s1, s2 = numerics.two_stage_int4(w, group_size)
                ql = QuantizedLinear("W4A8_DYNAMIC", w4, s1, bias, s2, row_parallel=row_parallel)
            else:
                info = get_scheme(scheme)
                w_q, s = numerics.quantize_weight(w, info.weight_bits, group_size if info.weight_granularity == "group"
                                                  else 0)
                ql = QuantizedLinear(scheme, w_q, s, bias, row_parallel=row_parallel)
            for name, (t, qtype) in checkpoint_entries(ql, p, deq_dtype).items():
                put(name, t, qtype)
    for name, t in state.items():
        if name not in tensors and name.rpartition(".")[0] not in done:
            put(name, t, "FLOAT")
    for norm in norm_bias:
        n = state[f"model.{norm}.weight"].shape[0]
        put(f"model.{norm}.bias", torch.randn(n, generator=g) * 0.3, "FLOAT")
    config = json.loads((model_dir / "config.json").read_text())
    if config_dtype:
        config["dtype"] = config_dtype
    config["quantization_config"] = {"quant_method": "ascend"}
    return write_checkpoint(out, tensors, desc, group_size=group_size, source_dir=model_dir, config=config)
