"""Mixture-of-Experts calibration on tiny random Qwen3-MoE (layer 0 dense), Mixtral,
Qwen2-MoE (shared expert) and DeepSeek-V2-Lite-style (MLA, first layer dense, shared
experts) models built here: the per-expert replacement computes the fused
model's logits, streaming reads per-expert and fused-on-disk files alike, every expert
scheme calibrates, verifies and tracks the float model through the reference model, experts
the router never picks fall back and are named, and verify catches broken expert layouts.

Routers get large random weights (a fresh router is zero: every expert ties) so that the
routing is sharp and differs per token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_quant.arch import LinearExperts, replace_experts, spec_for_config, spec_for_model
from ascend_quant.calibration import CalibrationError, job, recipe as recipes
from ascend_quant.calibration.streaming import StreamedModel
from ascend_quant.formats.ascend import read_checkpoint
from ascend_quant.formats.inspect import format_summary, summarize
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from ascend_quant.schemes import FLOAT, SCHEMES, get_scheme
from conftest import FIXTURES, add_tiny_tokenizer

COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=256, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
E, INTER = 4, 64
FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2")
IDS = torch.tensor([[1, 17, 250, 33, 400, 5, 77, 140, 3, 99, 31, 8, 300, 301, 40, 41, 42, 7, 12, 500]])


def _config(family: str):
    from transformers import DeepseekV2Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    if family == "deepseek_v2":     # V2-Lite layout (q_proj, no q LoRA); vLLM's MLA would need 512 + 64
        return DeepseekV2Config(n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=INTER,
                                intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
                                kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                topk_method="greedy", n_group=1, topk_group=1,
                                **{**COMMON, "num_key_value_heads": 2})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=INTER, intermediate_size=128,
                              mlp_only_layers=[0], norm_topk_prob=True, **COMMON)
    if family == "mixtral":
        return MixtralConfig(num_local_experts=E, num_experts_per_tok=2, intermediate_size=INTER, **COMMON)
    return Qwen2MoeConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=INTER, intermediate_size=128,
                          shared_expert_intermediate_size=96, **COMMON)


def _random_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):                 # the router
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "proj" in name or "experts" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    return model


def build_tiny(family: str, dst: Path, model=None, fused_on_disk: bool = False) -> Path:
    model = model if model is not None else _random_model(family)
    model.save_pretrained(dst, save_original_format=not fused_on_disk)
    add_tiny_tokenizer(dst)
    return dst


def _float_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: build_tiny(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def calib_jsonl():
    return str(FIXTURES / "calib.jsonl")


def _calibrate(src, out, rec, calib, **kw):
    kw = {"num_samples": 8, "seq_len": 64, **kw}
    return job.calibrate(str(src), out, rec, calib, show_progress=False, **kw)


def _desc(out: Path) -> dict:
    return json.loads((out / "quant_model_description.json").read_text())


# ----------------------------------------------------------------- the replacement

@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_linears_compute_the_fused_models_logits(family, tiny):
    """Swapping the fused experts (grouped_mm) for per-expert Linears leaves the logits as
    they are, and the state-dict names are the checkpoint's per-expert ones."""
    model = _float_model(tiny[family])
    spec = spec_for_model(model)
    with torch.no_grad():
        want = model(IDS).logits
        replace_experts(model, spec)
        got = model(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    moe_layers = [i for i in range(2) if spec.is_moe_layer(i, model.config)]
    assert moe_layers == ([1] if family in ("qwen3_moe", "deepseek_v2") else [0, 1])
    layer = spec.layers(model)[moe_layers[0]]
    assert isinstance(layer.get_submodule(spec.moe.experts_path), LinearExperts)
    names = {spec.to_disk(n) for n in model.state_dict()}
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    leaves = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(E):
        for leaf in leaves:
            assert f"model.layers.1.{block}.experts.{e}.{leaf}.weight" in names
    assert f"model.layers.1.{block}.gate.weight" in names


def test_streaming_reads_fused_on_disk_experts_like_per_expert_files(tmp_path, calib_jsonl):
    """The same model saved per expert and fused on disk (`experts.gate_up_proj`): streamed,
    each expert's Linears hold its slice, and both calibrate to the same checkpoint."""
    model = _random_model("qwen3_moe")
    per_expert = build_tiny("qwen3_moe", tmp_path / "per_expert", model)
    fused = build_tiny("qwen3_moe", tmp_path / "fused", model, fused_on_disk=True)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(fused / "model.safetensors")
    streamed = StreamedModel(fused)
    streamed.load_layer(1)
    experts = streamed.model.model.layers[1].mlp.experts
    fused_gu = model.model.layers[1].mlp.experts.gate_up_proj
    for e in range(E):
        assert torch.equal(experts[e].gate_proj.weight, fused_gu[e, :INTER])
        assert torch.equal(experts[e].up_proj.weight, fused_gu[e, INTER:])
        assert torch.equal(experts[e].down_proj.weight, model.model.layers[1].mlp.experts.down_proj[e])
    rec = recipes.preset("w8a8-dynamic")
    a, b = tmp_path / "a", tmp_path / "b"
    _calibrate(per_expert, a, rec, calib_jsonl)
    _calibrate(fused, b, rec, calib_jsonl)
    da, db = _desc(a), _desc(b)
    da.pop("metadata"), db.pop("metadata")          # the source folder's name
    assert da == db
    ta, tb = load_file(next(a.glob("*.safetensors"))), load_file(next(b.glob("*.safetensors")))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


# ----------------------------------------------------------------- every scheme

CASES = [("qwen3_moe", s) for s in ("w8a8-dynamic", "w4a8", "w8a16", "w4a16")] + \
        [(f, s) for f in ("mixtral", "qwen2_moe", "deepseek_v2") for s in ("w8a8-dynamic", "w4a8")]


@pytest.mark.parametrize("family,scheme", CASES)
def test_every_expert_scheme_calibrates_verifies_and_tracks_float(family, scheme, tmp_path, tiny, calib_jsonl):
    """Each expert scheme: every expert of every MoE layer has its scheme's tensors (W4A8
    per-channel, down's scale_bias in row-parallel chunks; weight-only ones per-group
    like the dense Linears), router and shared-expert gate
    FLOAT, the config hints, verify clean with the notes it owes, and the reference model
    close to the float model."""
    rec = recipes.preset(scheme, 32 if scheme in ("w4a16", "w4a8") else None)
    out = tmp_path / scheme
    _calibrate(tiny[family], out, rec, calib_jsonl)
    report = verify(out)
    assert report.ok, report.problems
    s = get_scheme(scheme)
    gs = 0 if s.activation_bits is not None else s.group_size_for(rec.group_size)
    desc, ckpt = _desc(out), read_checkpoint(out)
    spec = spec_for_config(ckpt.config)
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    leaves = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(E):
        for role, leaf in enumerate(leaves):
            prefix = f"model.layers.1.{block}.experts.{e}.{leaf}"
            n, k = (INTER, 64) if role < 2 else (64, INTER)
            specs = s.tensor_specs(n, k, gs, row_parallel=role == 2)
            assert spec.is_row_parallel(prefix) == (role == 2)
            for suffix, t in specs.items():
                assert desc[f"{prefix}.{suffix}"] == s.name
                assert tuple(ckpt.infos[f"{prefix}.{suffix}"].shape) == t.shape, (prefix, suffix)
            assert f"{prefix}.weight_scale_second" not in desc         # per-channel experts
    assert desc[f"model.layers.1.{block}.gate.weight"] == FLOAT.name
    if family == "qwen2_moe":
        assert desc["model.layers.1.mlp.shared_expert_gate.weight"] == FLOAT.name
        assert desc["model.layers.1.mlp.shared_expert.down_proj.weight"] == s.name
    config = json.loads((out / "config.json").read_text())
    assert config["moe_quantize"] == s.name.lower() and config["quantize"] == s.name.lower()
    if family == "deepseek_v2":
        assert desc["model.layers.1.mlp.shared_experts.down_proj.weight"] == s.name
        assert desc["model.layers.0.mlp.down_proj.weight"] == s.name                # the dense first layer
        for i in range(2):
            assert desc[f"model.layers.{i}.self_attn.kv_b_proj.weight"] == FLOAT.name
            assert desc[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] == s.name
        assert config["mla_quantize"] == s.name.lower()
    else:
        assert "mla_quantize" not in config
    notes = " ".join(report.notes)
    assert ("our runtime only" in notes) == (s.activation_bits is None)
    assert ("no `experts` mapping" in notes) == (family in ("mixtral", "qwen2_moe"))
    with torch.no_grad():
        want = _float_model(tiny[family])(IDS).logits
        got = load_reference_model(out)(IDS).logits
    rel = ((got - want).norm() / want.norm()).item()
    # measured: 8-bit 0.015-0.07, 4-bit 0.3-0.42 (random weights, 2 layers)
    assert rel < (0.5 if s.weight_bits == 4 else 0.1), rel
    if scheme == "w4a8":       # MoE models keep W4A8's SmoothQuant search (awq.moe: false)
        layers = json.loads((out / "ascend_quant_calibration.json").read_text())["layers"]
        assert any(layer["smoothquant_alphas"] for layer in layers)
        assert not any(layer.get("awq_alphas") for layer in layers)


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral", "deepseek_v2"))
def test_reference_model_of_a_float_moe_checkpoint_is_the_float_model(family, tmp_path, tiny, calib_jsonl):
    """Everything FLOAT: the reference model (per-expert Linears, router, Mixtral's renamed
    block) reproduces the float model to fp32 noise."""
    out = tmp_path / "float"
    _calibrate(tiny[family], out, recipes.Recipe(FLOAT.name, method="minmax"), calib_jsonl, num_samples=4,
               seq_len=32)
    assert verify(out).ok
    with torch.no_grad():
        want = _float_model(tiny[family])(IDS).logits
        got = load_reference_model(out)(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- fallbacks

def _model_with_a_dead_expert(dead: int = 3):
    """Qwen3-MoE whose layer-1 router never picks expert `dead`: hidden channel 0 is made
    large and positive for every token (the embeddings), the router's row `dead` weighs it
    strongly negative and the other rows not at all (they route on the other channels)."""
    model = _random_model("qwen3_moe")
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(5)))
        emb[:, 0] = 5.0
        router = model.model.layers[1].mlp.gate.weight
        router[:, 0] = 0.0
        router[dead, 0] = -50.0
    return model


def test_an_expert_the_router_never_picks_falls_back_and_is_named(tmp_path, calib_jsonl):
    """Routed calibration: the unpicked expert gets min-max weights (still complete on disk),
    the report and the calibration record name it with its 0 tokens; with `moe.tokens: all`
    it is calibrated on every token and nothing falls back."""
    src = build_tiny("qwen3_moe", tmp_path / "src", _model_with_a_dead_expert())
    rec = recipes.preset("w8a8-dynamic")
    out = tmp_path / "routed"
    result = _calibrate(src, out, rec, calib_jsonl)
    layer1 = result.reports[1]
    assert layer1.expert_tokens["mlp.experts.3"] == 0
    assert all(n > 0 for e, n in layer1.expert_tokens.items() if e != "mlp.experts.3")
    assert layer1.fallbacks == {"mlp.experts.3": 0}
    assert result.reports[0].fallbacks == {}                       # the dense layer
    record = json.loads((out / "ascend_quant_calibration.json").read_text())
    assert record["layers"][1]["expert_fallbacks"] == {"mlp.experts.3": 0}
    from ascend_quant.calibration.runner import format_reports
    assert "min-max fallback for mlp.experts.3 (0 tokens)" in format_reports(result.reports)
    assert verify(out).ok
    # the dead expert's weights are the min-max rounding of its float weights
    w = _float_model(src).model.layers[1].mlp.experts.gate_up_proj[3, :INTER]
    stored = load_file(next(out.glob("*.safetensors")))
    q = stored["model.layers.1.mlp.experts.3.gate_proj.weight"].float()
    scale = stored["model.layers.1.mlp.experts.3.gate_proj.weight_scale"].float()
    torch.testing.assert_close(scale.reshape(-1), w.abs().amax(1) / 127, rtol=1e-6, atol=0)
    assert torch.equal(q, torch.round(w / scale).clamp(-128, 127))

    rec_all = recipes.preset("w8a8-dynamic")
    rec_all.moe.tokens = "all"
    result = _calibrate(src, tmp_path / "all", rec_all, calib_jsonl)
    assert result.reports[1].fallbacks == {}
    assert result.reports[1].expert_tokens["mlp.experts.3"] == 0    # still never routed
    assert verify(tmp_path / "all").ok


def test_experts_below_min_tokens_fall_back(tmp_path, tiny, calib_jsonl):
    rec = recipes.preset("w8a8-dynamic")
    rec.moe.min_tokens = 10 ** 6
    result = _calibrate(tiny["mixtral"], tmp_path / "out", rec, calib_jsonl)
    for r in result.reports:
        assert sorted(r.fallbacks) == [f"mlp.experts.{e}" for e in range(E)]
        assert r.fallbacks == r.expert_tokens


def test_a_recipe_mixing_expert_schemes_or_static_experts_is_refused(tmp_path, tiny, calib_jsonl):
    rec = recipes.preset("w8a8-dynamic")
    rec.overrides = [recipes.Override("model.layers.1.mlp.experts.0.*", scheme="w8a16")]
    with pytest.raises(CalibrationError, match="experts of one MoE layer take one scheme"):
        _calibrate(tiny["qwen3_moe"], tmp_path / "mixed", rec, calib_jsonl)
    with pytest.raises(CalibrationError, match="static activation ranges"):
        _calibrate(tiny["qwen3_moe"], tmp_path / "static", recipes.preset("w8a8"), calib_jsonl)
    # per layer is fine: layer 1's experts all W8A16, the other Linears W8A8 (static); the
    # W8A8 preset's float_groups [down] would keep the experts' down FLOAT (mixed): cleared
    rec = recipes.preset("w8a8")
    rec.float_groups = []
    rec.overrides = [recipes.Override("*.mlp.experts.*", scheme="w8a16")]
    out = tmp_path / "per_layer"
    _calibrate(tiny["qwen3_moe"], out, rec, calib_jsonl)
    assert verify(out).ok


def test_mla_refuses_the_int8_kv_cache_and_verify_keeps_kv_b_proj_float(tmp_path, tiny, calib_jsonl):
    """MLA caches compressed KV, not per-head K/V: a C8 recipe is refused in one line; a
    quantized kv_b_proj (vllm-ascend asserts it is unquantized) is a verify problem."""
    rec = recipes.preset("w8a8-dynamic")
    rec.kv_cache = recipes.KVCache()
    with pytest.raises(CalibrationError, match="no int8 KV cache"):
        _calibrate(tiny["deepseek_v2"], tmp_path / "c8", rec, calib_jsonl)
    out = tmp_path / "ok"
    _calibrate(tiny["deepseek_v2"], out, recipes.preset("w8a8-dynamic"), calib_jsonl, num_samples=4, seq_len=32)
    assert verify(out).ok
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    other = next(s for s in SCHEMES.values() if s.linear and s.weight_bits == 8 and s.activation_bits is None)
    _edit(out, desc_edit=lambda desc: desc.update({name: other.name}))
    assert any(name in p and "must stay FLOAT" in p for p in verify(out).problems)


# ----------------------------------------------------------------- verify, inspect

@pytest.fixture(scope="module")
def calibrated(tiny, calib_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ckpt") / "w8a8d"
    _calibrate(tiny["qwen3_moe"], out, recipes.preset("w8a8-dynamic"), calib_jsonl)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, tensors_edit=None, desc_edit=None) -> None:
    """Change the weights file and the description (and config.json's copy of it) alike."""
    f = next(folder.glob("*.safetensors"))
    if tensors_edit:
        tensors = load_file(f)
        tensors_edit(tensors)
        save_file(tensors, str(f))
    if desc_edit:
        d = _desc(folder)
        desc_edit(d)
        (folder / "quant_model_description.json").write_text(json.dumps(d))
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "ascend", **d}
        (folder / "config.json").write_text(json.dumps(config))


def test_verify_catches_a_missing_expert_tensor(calibrated, tmp_path):
    d = _copy(calibrated, tmp_path / "c")
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    _edit(d, lambda t: t.pop(name), lambda desc: desc.pop(name))
    report = verify(d)
    hits = [p for p in report.problems if name in p and "MoE layer 1" in p]
    assert hits, report.problems


def test_verify_catches_mixed_expert_schemes_and_a_quantized_or_missing_router(calibrated, tmp_path):
    d = _copy(calibrated, tmp_path / "mixed")
    other = next(s for s in SCHEMES.values() if s.linear and s.weight_bits == 8 and s.activation_bits is None)
    # W8A16 has the tensors of W8A8_DYNAMIC: only the type of expert 1 changes
    _edit(d, desc_edit=lambda desc: desc.update(
        {k: other.name for k in desc if k.startswith("model.layers.1.mlp.experts.1.")}))
    report = verify(d)
    assert any("mix schemes" in p and other.name in p for p in report.problems), report.problems
    d = _copy(calibrated, tmp_path / "router")
    router = "model.layers.1.mlp.gate.weight"
    _edit(d, lambda t: t.pop(router), lambda desc: desc.pop(router))
    assert any(router in p and "MoE layer 1" in p for p in verify(d).problems)


def test_inspect_summarises_moe_layers(calibrated):
    summary = summarize(read_checkpoint(calibrated))
    layers = {m["layer"]: m for m in summary["moe_layers"]}
    assert list(layers) == [1]
    assert layers[1]["experts"] == E and layers[1]["scheme"] == "W8A8_DYNAMIC" and layers[1]["router_float"]
    text = format_summary(summary)
    assert "MoE layer 1: 4 experts W8A8_DYNAMIC, router FLOAT" in text


@pytest.mark.vllm
@pytest.mark.parametrize("family,scheme", [("qwen3_moe", "w8a8-dynamic"), ("mixtral", "w4a8"), ("qwen2_moe", "w8a8-dynamic")])
def test_a_calibrated_moe_checkpoint_serves_in_vllm_like_the_reference(family, scheme, tmp_path, tiny, calib_jsonl):
    """The two halves together: what our calibrator writes for experts (per-expert names,
    router FLOAT, shared expert) is what our vLLM experts method loads, and vLLM's greedy
    tokens and log-probs are those of the reference model on the same checkpoint."""
    from test_vllm_runtime import assert_matches_reference, run_engine

    out = tmp_path / "out"
    _calibrate(tiny[family], out, recipes.preset(scheme, 0 if scheme == "w4a8" else None), calib_jsonl)
    assert verify(out).ok
    assert_matches_reference(out, run_engine(out), family)


def test_zero_points_are_for_dense_linears_only(tmp_path, tiny, calib_jsonl):
    """W4A16 with `weights: {symmetric: false}`: the attention Linears get zero points, the
    routed experts stay symmetric (all-zero weight_offset: vllm-ascend's W4A16 MoE layout)."""
    rec = recipes.preset("w4a16", 32)
    rec.weights = recipes.Weights(symmetric=False)
    out = tmp_path / "asym"
    _calibrate(tiny["qwen3_moe"], out, rec, calib_jsonl)
    assert verify(out).ok
    ckpt = read_checkpoint(out)
    assert ckpt.tensor("model.layers.1.self_attn.q_proj.weight_offset").any()
    experts = [n for n in ckpt.infos if ".experts." in n and n.endswith("weight_offset")]
    assert experts and not any(ckpt.tensor(n).any() for n in experts)
