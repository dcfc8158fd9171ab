"""DeepSeek-V2 / V3 with the low-rank query (`q_lora_rank` set: q_a_proj -> q_a_layernorm ->
q_b_proj) on tiny random models built here: the spec is chosen from the config, every
smoothing fold of the spec is a float equivalence, W8A8_DYNAMIC and W4A8 calibrate and verify
with kv_b_proj, the router and its `e_score_correction_bias` FLOAT, the reference model tracks
the float model, and the MTP layer a V3 checkpoint stores after the model's own layers
(`model.layers.{num_hidden_layers}`, which transformers does not build) is copied FLOAT.

Routers, their correction biases and the norm gains are random (fresh ones are zero or one:
routing would tie and a fold into a norm of ones would hide a wrong factor).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ascend_quant.arch import replace_experts, spec_for_config, spec_for_model
from ascend_quant.calibration import CalibrationError, job, recipe as recipes
from ascend_quant.calibration.smoothquant import apply_smoothing
from ascend_quant.formats.ascend import read_checkpoint
from ascend_quant.formats.inspect import format_summary, summarize
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from ascend_quant.schemes import FLOAT, get_scheme
from conftest import FIXTURES, add_tiny_tokenizer

E, INTER, LAYERS = 4, 64, 2
IDS = torch.tensor([[1, 17, 250, 33, 400, 5, 77, 140, 3, 99, 31, 8, 300, 301, 40, 41, 42, 7, 12, 500]])
# what a DeepSeek-V3 MTP layer holds besides a decoder layer's modules (its README_WEIGHTS)
MTP_EXTRA = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "shared_head.head.weight")


def _config(model_type: str = "deepseek_v3", q_lora_rank: int | None = 32):
    from transformers import DeepseekV2Config, DeepseekV3Config
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=INTER,
                  num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                  n_routed_experts=E, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=q_lora_rank,
                  qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1,
                  first_k_dense_replace=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if model_type == "deepseek_v2":
        return DeepseekV2Config(topk_method="greedy", **common)
    return DeepseekV3Config(num_nextn_predict_layers=1, **common)


def _random_model(model_type: str = "deepseek_v3", q_lora_rank: int | None = 32, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(model_type, q_lora_rank), dtype=torch.float32).eval()
    return randomize(model, seed)


def randomize(model, seed: int):
    """Random weights at a scale where every Linear matters, random norm gains, router rows and
    correction bias (fresh ones are ones / zero: routing would tie)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):                 # the router
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
            elif "proj" in name or "experts" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def build_tiny(dst: Path, model=None, mtp: bool = True, dtype: torch.dtype = torch.float32) -> Path:
    """save_pretrained, then (`mtp`) the safetensors extended by an MTP layer at index
    num_hidden_layers: layer 1's tensors scaled by 1.5 under the new index, plus the MTP-only
    ones (random). `dtype` bfloat16: every tensor bf16 but e_score_correction_bias, float32 as
    in DeepSeek-V3's own files."""
    model = model if model is not None else _random_model()
    model.save_pretrained(dst)
    f = dst / "model.safetensors"
    state = load_file(f)
    if mtp:
        g = torch.Generator().manual_seed(7)
        hidden = model.config.hidden_size
        for name, t in list(state.items()):
            if name.startswith("model.layers.1."):
                state[name.replace("model.layers.1.", f"model.layers.{LAYERS}.")] = t * 1.5
        for leaf in MTP_EXTRA:
            shape = {"eh_proj.weight": (hidden, 2 * hidden), "embed_tokens.weight": (512, hidden),
                     "shared_head.head.weight": (512, hidden)}.get(leaf, (hidden,))
            state[f"model.layers.{LAYERS}.{leaf}"] = torch.randn(shape, generator=g)
    if dtype != torch.float32:
        state = {n: t if n.endswith("e_score_correction_bias") else t.to(dtype) for n, t in state.items()}
        config = json.loads((dst / "config.json").read_text())
        config["dtype"] = str(dtype).replace("torch.", "")
        (dst / "config.json").write_text(json.dumps(config))
    save_file(state, str(f), metadata={"format": "pt"})
    add_tiny_tokenizer(dst)
    return dst


def _float_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _source(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _stored(out: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(out.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def _desc(out: Path) -> dict:
    return json.loads((out / "quant_model_description.json").read_text())


def _calibrate(src, out, rec, **kw):
    kw = {"num_samples": 8, "seq_len": 64, **kw}
    return job.calibrate(str(src), out, rec, str(FIXTURES / "calib.jsonl"), show_progress=False, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("deepseek") / "v3")


# ----------------------------------------------------------------- the spec

@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_the_spec_follows_q_lora_rank(model_type, q_lora_rank):
    """The attention group the spec names is the one transformers builds for this config, for
    the model and for its config.json alike: q_a_proj (and q_b_proj behind q_a_layernorm)
    with q_lora_rank set, q_proj without; vLLM fuses q_a_proj with kv_a_proj_with_mqa only
    in the first case."""
    model = _random_model(model_type, q_lora_rank)
    spec = spec_for_model(model)                 # raises if a named module is missing
    assert spec_for_config(model.config.to_dict()) == spec
    attn = model.model.layers[0].self_attn
    groups = {g.name: g for g in spec.groups}
    qkv = groups["qkv"]
    assert qkv.producer == "input_layernorm"
    assert "self_attn.kv_a_proj_with_mqa" in qkv.linears
    if q_lora_rank is not None:
        assert attn.q_proj is None and qkv.linears[0] == "self_attn.q_a_proj"
        assert qkv.vllm_fused == "fused_qkv_a_proj"
        assert groups["q_b"].linears == ("self_attn.q_b_proj",)
        assert groups["q_b"].producer == "self_attn.q_a_layernorm"
    else:
        assert attn.q_a_proj is None and qkv.linears[0] == "self_attn.q_proj"
        assert qkv.vllm_fused is None and "q_b" not in groups
    assert spec.float_linears == ("self_attn.kv_b_proj",)
    has_bias = hasattr(model.model.layers[1].mlp.gate, "e_score_correction_bias")
    assert ("e_score_correction_bias" in spec.moe.router_tensors) == has_bias


# ----------------------------------------------------------------- smoothing is an equivalence

def _fold(model, groups_of_layer, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    spec = spec_for_model(model)
    for i, layer in enumerate(spec.layers(model)):
        for group in groups_of_layer(i):
            if group.producer is None:
                continue
            producer = layer.get_submodule(group.producer)
            consumers = [layer.get_submodule(n) for n in group.linears]
            s = torch.exp(0.5 * torch.randn(consumers[0].in_features, generator=g))
            apply_smoothing(producer, consumers, s, group.producer_kind)


def test_every_fold_of_the_q_lora_spec_keeps_the_logits():
    """Random positive factors folded into every group's producer of every layer (the norms,
    q_a_layernorm, each expert's, the shared experts' and the dense MLP's up_proj), nothing
    quantized: the logits stay within fp32 noise (<= 1e-5 relative). Folding input_layernorm
    into q_a_proj alone (its other reader kv_a_proj_with_mqa left out) does not."""
    model = _random_model()
    spec = spec_for_model(model)
    with torch.no_grad():
        want = model(IDS).logits
        replace_experts(model, spec)
        _fold(model, lambda i: spec.layer_groups(i, model.config))
        got = model(IDS).logits
        wrong = _random_model()
        qkv = next(g for g in spec.groups if g.name == "qkv")
        partial = type(qkv)(qkv.name, qkv.linears[:1], qkv.producer, qkv.producer_kind)
        _fold(wrong, lambda i: (partial,))
        bad = wrong(IDS).logits
    rel = lambda a: ((a - want).norm() / want.norm()).item()   # noqa: E731
    assert rel(got) <= 1e-5, rel(got)
    assert rel(bad) > 1e-3, rel(bad)


# ----------------------------------------------------------------- calibration

@pytest.mark.parametrize("scheme", ["w8a8-dynamic", "w4a8"])
def test_v3_calibrates_verifies_and_tracks_float(scheme, tmp_path, tiny):
    """Both expert schemes: the MLA Linears (q_a_proj, kv_a_proj_with_mqa, q_b_proj, o_proj),
    the dense first layer, the shared and routed experts take the scheme; kv_b_proj, the
    router and its e_score_correction_bias (the source's values) stay FLOAT; the MTP layer's
    tensors are the source's, FLOAT; verify is clean, inspect names the MoE and MTP layers,
    the config hints name the schemes, and the reference model is close to the float model."""
    rec = recipes.preset(scheme, 32 if scheme == "w4a8" else None)
    out = tmp_path / scheme
    _calibrate(tiny, out, rec)
    report = verify(out)
    assert report.ok, report.problems
    s = get_scheme(scheme)
    desc, stored, source = _desc(out), _stored(out), _source(tiny)
    for i in range(LAYERS):
        for leaf in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj"):
            assert desc[f"model.layers.{i}.self_attn.{leaf}.weight"] == s.name, leaf
        assert desc[f"model.layers.{i}.self_attn.kv_b_proj.weight"] == FLOAT.name
        assert desc[f"model.layers.{i}.self_attn.q_a_layernorm.weight"] == FLOAT.name
    assert desc["model.layers.0.mlp.down_proj.weight"] == s.name                 # the dense first layer
    assert desc["model.layers.1.mlp.shared_experts.down_proj.weight"] == s.name
    for e in range(E):
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            assert desc[f"model.layers.1.mlp.experts.{e}.{leaf}.weight"] == s.name
    assert desc["model.layers.1.mlp.gate.weight"] == FLOAT.name
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert desc[bias] == FLOAT.name and torch.equal(stored[bias], source[bias])
    mtp = [n for n in source if n.startswith(f"model.layers.{LAYERS}.")]
    assert len(mtp) > len(MTP_EXTRA)
    for name in mtp:
        assert desc[name] == FLOAT.name, name
        assert torch.equal(stored[name], source[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["moe_quantize"] == config["quantize"] == config["mla_quantize"] == s.name.lower()
    summary = summarize(read_checkpoint(out))
    layers = {m["layer"]: m for m in summary["moe_layers"]}
    assert sorted(layers) == [1, LAYERS]
    assert layers[1]["scheme"] == s.name and layers[1]["router_float"] and not layers[1]["mtp"]
    assert layers[LAYERS]["scheme"] == FLOAT.name and layers[LAYERS]["mtp"]
    assert f"MoE layer 1: {E} experts {s.name}, router FLOAT" in format_summary(summary)
    # MLA caches one latent + RoPE key per token and layer, not K and V per head
    cached = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * config["num_hidden_layers"]
    fsize = {"bfloat16": 2, "float16": 2, "float32": 4}[summary["float_dtype"]]
    assert summary["kv_cache_tokens_per_gib"]["float"] == (1 << 30) // (cached * fsize)
    with torch.no_grad():
        want = _float_model(tiny)(IDS).logits
        got = load_reference_model(out)(IDS).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (0.5 if s.weight_bits == 4 else 0.1), rel


def test_float_checkpoint_reference_is_the_float_model(tmp_path, tiny):
    """Everything FLOAT, MTP layer included: verify is clean and the reference model (which
    leaves the MTP layer out) reproduces the float model to fp32 noise."""
    out = tmp_path / "float"
    _calibrate(tiny, out, recipes.Recipe(FLOAT.name, method="minmax"), num_samples=4, seq_len=32)
    assert verify(out).ok
    with torch.no_grad():
        want = _float_model(tiny)(IDS).logits
        got = load_reference_model(out)(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_source_keeps_the_float32_router_bias_and_the_mtp_layer_as_stored(tmp_path):
    """A bf16 checkpoint with DeepSeek-V3's float32 e_score_correction_bias: the bias is written
    float32 with its exact values (bf16 would round them), the MTP layer bf16 as stored."""
    src = build_tiny(tmp_path / "src", dtype=torch.bfloat16)
    out = tmp_path / "out"
    _calibrate(src, out, recipes.preset("w8a8-dynamic"), num_samples=4, seq_len=32)
    assert verify(out).ok
    stored, source = _stored(out), _source(src)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert source[bias].dtype == stored[bias].dtype == torch.float32
    assert not torch.equal(source[bias].bfloat16().float(), source[bias])       # bf16 would change it
    assert torch.equal(stored[bias], source[bias])
    mtp = [n for n in source if n.startswith(f"model.layers.{LAYERS}.")]
    for name in mtp:
        assert stored[name].dtype == source[name].dtype and torch.equal(stored[name], source[name]), name
    assert stored["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16


def test_verify_wants_the_router_bias(tmp_path, tiny):
    """vLLM builds e_score_correction_bias as a parameter of the router: a checkpoint without
    it is a verify problem naming it."""
    out = tmp_path / "ckpt"
    _calibrate(tiny, out, recipes.Recipe(FLOAT.name, method="minmax"), num_samples=4, seq_len=32)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    f = next(out.glob("*.safetensors"))
    with safe_open(str(f), "pt") as handle:
        meta = handle.metadata()
    tensors = load_file(f)
    tensors.pop(name)
    save_file(tensors, str(f), metadata=meta)
    desc = _desc(out)
    desc.pop(name)
    (out / "quant_model_description.json").write_text(json.dumps(desc))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "ascend", **desc}
    (out / "config.json").write_text(json.dumps(config))
    problems = verify(out).problems
    assert any(name in p and "MoE layer 1" in p for p in problems), problems


def test_a_quantized_mtp_tensor_is_refused_before_calibrating(tmp_path):
    """DeepSeek-V3's own files are FP8: an MTP tensor copied FLOAT would carry wrong values,
    so the job stops at once, in one line naming the tensor."""
    src = build_tiny(tmp_path / "src")
    state = _source(src)
    name = f"model.layers.{LAYERS}.eh_proj.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CalibrationError, match=rf"{name}: stored as F8_E4M3 .*dequantize"):
        _calibrate(src, tmp_path / "out", recipes.preset("w8a8-dynamic"), num_samples=4, seq_len=32)
    assert not (tmp_path / "out").exists()


def test_a_config_without_q_lora_rank_gets_the_spec_transformers_built(tmp_path):
    """transformers reads a config.json without q_lora_rank as its default (set: the q-LoRA
    layout); the output's config.json states the value, so the checkpoint tools pick the
    spec calibration used rather than the q_proj one an absent key would suggest."""
    from transformers import DeepseekV3Config
    default = DeepseekV3Config().q_lora_rank
    src = build_tiny(tmp_path / "src", _random_model(q_lora_rank=default), mtp=False)
    config = json.loads((src / "config.json").read_text())
    del config["q_lora_rank"]
    (src / "config.json").write_text(json.dumps(config))
    assert default is not None and spec_for_config(config).variant == ("q_lora_rank", False)
    out = tmp_path / "out"
    _calibrate(src, out, recipes.Recipe(FLOAT.name, method="minmax"), num_samples=4, seq_len=32)
    written = json.loads((out / "config.json").read_text())
    assert written["q_lora_rank"] == default
    assert spec_for_config(written).variant == ("q_lora_rank", True)
    assert verify(out).ok
