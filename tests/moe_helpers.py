"""Test helpers for MoE serving: a tiny random Qwen3-MoE or Mixtral, its experts quantized by hand into the
per-expert layout of moe.md §1 (`schemes.checkpoint_entries` on one QuantizedLinear per expert
projection; router, attention and everything else FLOAT), and an independent plain-torch
reference of the quantized experts (moe.md §2's CPU formula) installed into the transformers
model.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ascend_quant import numerics
from ascend_quant.formats.ascend import write_checkpoint
from ascend_quant.schemes import QuantizedLinear, checkpoint_entries, get_scheme
from conftest import add_tiny_tokenizer

NUM_EXPERTS = 4
# family -> (the MoE block's name on disk, gate / up / down names of an expert on disk)
LAYOUTS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
           "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _config(family: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=NUM_EXPERTS,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    if family == "mixtral":
        return MixtralConfig(intermediate_size=64, num_local_experts=NUM_EXPERTS, **common)
    if family == "qwen2_moe":        # layer 0 dense, layer 1 MoE with a gated shared expert
        return Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                              num_experts=NUM_EXPERTS, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[0], **common)
    raise KeyError(family)


def build_tiny_moe(family: str, dst: Path, seed: int = 0, logit_gain: float = 4.0) -> Path:
    """hidden 64, 2 layers, 4 experts of intermediate 64, top-2, saved with save_pretrained (which
    writes per-expert names) and the tiny-qwen2 tokenizer. Weights are random at a scale where
    every Linear matters; router rows are larger so routing is decisive; `logit_gain` scales the
    final norm so greedy choices are decisive."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "experts" in name or name.endswith("proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.12)
        model.model.norm.weight.mul_(logit_gain)
    model.save_pretrained(dst, safe_serialization=True)
    add_tiny_tokenizer(dst)
    return dst


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def quantize_experts(model_dir: Path, out: Path, scheme: str, group_size: int = 0, dense: tuple[str, ...] = ()) -> Path:
    """An Ascend checkpoint of the tiny MoE with every routed expert projection in `scheme`
    (min-max weights, per channel or per `group_size` in-features), and the Linears whose name
    contains one of `dense` (e.g. "shared_expert.") likewise; everything else FLOAT (all of it
    for `scheme` FLOAT)."""
    state = _state(model_dir)
    if not any(EXPERT_KEY.match(k) for k in state):
        raise AssertionError(f"{model_dir}: no per-expert keys (save_pretrained wrote {sorted(state)[:4]} ...)")
    info = get_scheme(scheme)
    tensors: dict[str, torch.Tensor] = {}
    desc: dict[str, str] = {}
    for name, w in state.items():
        m = EXPERT_KEY.match(name)
        linear = info.weight_bits is not None and (
            m is not None or (name.endswith("proj.weight") and any(d in name for d in dense)))
        if not linear:
            tensors[name], desc[name] = w.contiguous(), "FLOAT"
            continue
        prefix = name[: -len(".weight")]
        q, s = numerics.quantize_weight(w.float(), info.weight_bits, group_size)
        ql = QuantizedLinear(info.name, q, s, None, row_parallel=prefix.rsplit(".", 1)[1] in ("down_proj", "w2"))
        for key, (t, qtype) in checkpoint_entries(ql, prefix, torch.float32).items():
            tensors[key], desc[key] = t.contiguous(), qtype
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "ascend"}
    return write_checkpoint(out, tensors, desc, group_size=group_size, source_dir=model_dir, config=config)


# ----------------------------------------------------------------------------- reference

def _int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 [n/2, k] holding two int4 per byte along n (low nibble = even row) -> int values [n, k]."""
    p = packed.to(torch.int16)
    lo = ((p & 0xF) ^ 8) - 8
    hi = (((p >> 4) & 0xF) ^ 8) - 8
    return torch.stack((lo, hi), dim=1).reshape(-1, packed.shape[-1]).float()


def dequantized_expert(ckpt: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The float weight [n, k] of one stored expert projection: integer weights times the scale
    of their channel, or of their group of in-features when the scale is [n, k/g] (int4
    unpacked when the weight has half the scale's rows)."""
    w, s = ckpt[f"{prefix}.weight"], ckpt[f"{prefix}.weight_scale"].float()
    s = s.reshape(s.shape[0], -1)
    values = _int4_rows(w) if w.shape[0] * 2 == s.shape[0] else w.float()
    return values * s.repeat_interleave(values.shape[1] // s.shape[1], dim=1)


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8: s = max|x_t| / 127, round(x / s) in [-128, 127], times s."""
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(x / s), -128, 127) * s


def reference_model(model_dir: Path, ckpt_dir: Path, activations: bool = True, tp: int = 1):
    """The transformers model of `model_dir` whose routed experts compute moe.md §2's CPU
    reference from the checkpoint in `ckpt_dir`: dequantized weights, per-token fake-quantized
    inputs of gate/up and of down (`activations=False`: float inputs, the weight-only schemes),
    the top-k weighted sum. Other Linears quantized in the checkpoint (shared experts) compute
    with their dequantized weight on fake-quantized inputs likewise. Router and the rest stay
    float. `tp`: down's input is split over that many tensor-parallel ranks, each quantizing its
    own slice per token. The checkpoint's float tensors replace the model's (a calibrated
    checkpoint's norms carry its smoothing factors) where the model has the same name; those of
    layers the model does not build (DeepSeek-V3's MTP layer) are left out."""
    from transformers import AutoModelForCausalLM

    ckpt = _state(ckpt_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    block, names = LAYOUTS[model.config.model_type]
    fq = fake_quant_per_token if activations else (lambda a: a)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    built = model.config.num_hidden_layers
    for key, t in ckpt.items():
        layer = re.match(r"^model\.layers\.(\d+)\.", key)
        if t.dtype == torch.int8 or EXPERT_KEY.match(key) or (layer and int(layer.group(1)) >= built):
            continue
        if key in params:           # names the model does not use (Mixtral's block_sparse_moe) keep the source's
            with torch.no_grad():
                params[key].copy_(t)
    for key in ckpt:
        name = key[: -len(".weight")]
        if key.endswith(".weight") and not EXPERT_KEY.match(key) and ckpt[key].dtype == torch.int8:
            linear = modules[name]
            with torch.no_grad():
                linear.weight.copy_(dequantized_expert(ckpt, name))
            linear.register_forward_pre_hook(lambda _m, args: (fq(args[0]),))
    for li, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:                     # a dense layer
            continue
        base = f"model.layers.{li}.{block}.experts"
        weights = [tuple(dequantized_expert(ckpt, f"{base}.{e}.{p}") for p in names)
                   for e in range(experts.num_experts)]

        def forward(self, hidden, top_k_index, top_k_weights, weights=weights):
            out = torch.zeros_like(hidden)
            for t in range(hidden.shape[0]):
                for k in range(top_k_index.shape[1]):
                    gate, up, down = weights[int(top_k_index[t, k])]
                    x = fq(hidden[t:t + 1])
                    a = F.silu(x @ gate.t()) * (x @ up.t())
                    a = torch.cat([fq(part) for part in a.chunk(tp, dim=-1)], dim=-1)
                    out[t] += top_k_weights[t, k] * (a @ down.t())[0]
            return out

        experts.forward = types.MethodType(forward, experts)
    return model


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax of `model`'s logits at each generated position of prompt + tokens: [len(tokens), vocab]."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, len(prompt) - 1:].float(), -1)


def assert_follows(model, prompts, generated, tol: float, label=None, max_tokens: int | None = None) -> None:
    """Each generated token (`generated`: per prompt, (tokens, log-probs) from vLLM) is `model`'s
    greedy choice within `tol` of its best log-prob, with the log-prob vLLM reported within `tol`."""
    for prompt, (tokens, logprobs) in zip(prompts, generated):
        if max_tokens is not None:
            assert len(tokens) == max_tokens
        r = reference_logprobs(model, prompt, tokens)
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            assert r[i, t] >= r[i].max() - tol, (label, prompt, i, t, r[i].argmax().item())
            assert abs(lp - r[i, t].item()) < tol, (label, i, lp, r[i, t].item())


def max_logprob_gap(model, prompts, generated) -> float:
    """The largest difference between vLLM's log-probs and `model`'s on the same tokens."""
    return max(abs(lp - r[i, t].item()) for prompt, (tokens, lps) in zip(prompts, generated)
               for r in [reference_logprobs(model, prompt, tokens)] for i, (t, lp) in enumerate(zip(tokens, lps)))
