"""Model families beyond the Llama layout, on tiny random models built here: Gemma-2 and
Gemma-3 text. Each family: its spec, the float equivalence of every smoothing fold, every
scheme calibrated and verified, the reference model reproducing the float model, and (Gemma-3)
vLLM serving the calibrated checkpoint with the reference's greedy tokens.

The norms get random gains (a fresh Gemma norm has w = 0, where the wrong fold w / s and the
right one (1 + w) / s - 1 differ only by a constant), so a wrong fold or norm mapping fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ascend_quant.arch import lean_mlp, spec_for_model
from ascend_quant.arch.attention import install_attention_hook
from ascend_quant.calibration import job, recipe as recipes
from ascend_quant.calibration.smoothquant import apply_smoothing
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from conftest import FIXTURES, add_tiny_tokenizer

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, sliding_window=8, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, query_pre_attn_scalar=32)


def _config(family: str):
    from transformers import Gemma2Config, Gemma3TextConfig
    if family == "gemma2":      # layer 0 sliding, 1 full; softcap small enough to bite on these logits
        return Gemma2Config(num_hidden_layers=2, attn_logit_softcapping=1.0, final_logit_softcapping=30.0, **COMMON)
    return Gemma3TextConfig(num_hidden_layers=3, rope_local_base_freq=10000.0,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"], **COMMON)


def build_tiny(family: str, dst: Path, seed: int = 0, logit_gain: float = 1.0) -> Path:
    """A random tiny model of the family saved with the tiny-qwen2 tokenizer. Norm gains are
    random around 0 (all four per layer, q/k norms and the final norm); `logit_gain`
    multiplies the final norm's 1 + w (sharper next-token distributions)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
        model.model.norm.weight.copy_((1 + model.model.norm.weight) * logit_gain - 1)
    model.save_pretrained(dst, safe_serialization=True)
    add_tiny_tokenizer(dst)
    return dst


def _float_model(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


IDS = torch.tensor([[1, 17, 250, 33, 400, 5, 77, 140, 3, 99, 31, 8, 300, 301, 40, 41, 42, 7, 12, 500]])
FAMILIES = ("gemma2", "gemma3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def calib_jsonl():
    return str(FIXTURES / "calib.jsonl")


# ------------------------------------------------------------------------ spec

@pytest.mark.parametrize("family", FAMILIES)
def test_gemma_spec_groups_and_no_norm_bias(family, tiny):
    """Gate/up read pre_feedforward_layernorm, o_proj has no producer, the norms are (1+w)
    ones that never take a bias, and lean_mlp leaves the GELU MLP as it is."""
    model = _float_model(tiny[family])
    spec = spec_for_model(model)
    assert spec.name == "gemma"
    by_name = {g.name: g for g in spec.groups}
    assert (by_name["qkv"].producer, by_name["qkv"].producer_kind) == ("input_layernorm", "rmsnorm_offset")
    assert (by_name["gate_up"].producer, by_name["gate_up"].producer_kind) == ("pre_feedforward_layernorm",
                                                                                "rmsnorm_offset")
    assert by_name["o"].producer is None and by_name["down"].producer == "mlp.up_proj"
    assert spec.norm_consumers() == {}
    assert spec.fused_siblings("model.layers.1.mlp.up_proj") == ("model.layers.1.mlp.gate_proj",
                                                                  "model.layers.1.mlp.up_proj")
    layer = model.model.layers[0]
    with lean_mlp(layer, spec):
        assert "forward" not in vars(layer.mlp)           # GELU MLP: not rewritten


def test_gemma3_multimodal_wrapper_finds_its_decoder():
    """`gemma3` (Gemma3ForConditionalGeneration) uses the same spec under its wrapper's path."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = {k: COMMON[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim")}
    config = Gemma3Config(text_config=dict(num_hidden_layers=2, **text), mm_tokens_per_image=4,
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14))
    model = Gemma3ForConditionalGeneration(config)
    spec = spec_for_model(model)
    assert spec.name == "gemma3" and len(spec.layers(model)) == 2
    assert spec.groups == spec_for_model(_float_model_of(_config("gemma3"))).groups


def _float_model_of(config):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(config)


# ------------------------------------------------------------------------ fold equivalence

def _smooth_randomly(model, seed: int = 0, kind_override: str | None = None) -> None:
    """Every smoothing group of every layer folded with a random positive s (no quantization)."""
    spec = spec_for_model(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in spec.layers(model):
            for group in spec.groups:
                if group.producer is None:
                    continue
                consumers = [layer.get_submodule(n) for n in group.linears]
                s = torch.exp(torch.randn(consumers[0].in_features, generator=g) * 0.5)
                kind = kind_override if kind_override and group.producer_kind == "rmsnorm_offset" else group.producer_kind
                apply_smoothing(layer.get_submodule(group.producer), consumers, s, kind)


@pytest.mark.parametrize("family", FAMILIES)
def test_offset_norm_fold_leaves_logits_unchanged(family, tiny):
    """w' = (1 + w) / s - 1 with the consumers' columns times s: logits equal to fp32 noise
    (relative error <= 1e-5); the plain-norm fold w / s on the same norms does not."""
    model = _float_model(tiny[family])
    with torch.no_grad():
        want = model(IDS).logits
        _smooth_randomly(model)
        got = model(IDS).logits
        wrong = _float_model(tiny[family])
        _smooth_randomly(wrong, kind_override="rmsnorm")
        bad = wrong(IDS).logits
    rel = lambda a: ((a - want).norm() / want.norm()).item()   # noqa: E731
    assert rel(got) <= 1e-5, rel(got)
    assert rel(bad) > 1e-2, rel(bad)


def test_offset_fold_formula():
    from ascend_quant import numerics
    w, s = torch.tensor([0.0, 0.5, -0.2]), torch.tensor([2.0, 0.5, 4.0])
    assert torch.allclose(numerics.smoothed_norm_gain(w, s, offset=True), torch.tensor([-0.5, 2.0, -0.8]))
    assert torch.allclose(numerics.smoothed_norm_gain(w, s), w / s)


# ------------------------------------------------------------------------ softcap in the attention hook

def test_gemma2_attention_hook_keeps_the_softcap(tiny):
    """The calibrator's attention hook runs Gemma-2's own eager attention (logit softcap
    applied) even on an sdpa model; Llama's eager function or sdpa would drop it."""
    eager = _float_model(tiny["gemma2"], attn_implementation="eager")
    sdpa = _float_model(tiny["gemma2"], attn_implementation="sdpa")
    with torch.no_grad():
        want = eager(IDS).logits
        no_cap = sdpa(IDS).logits
        install_attention_hook(sdpa, lambda module, k, v: None)
        got = sdpa(IDS).logits
    assert (no_cap - want).abs().max() > 1e-2          # the softcap matters on this model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gemma2_c8_calibration_matches_eager_attention(tmp_path, tiny, calib_jsonl):
    """C8 on Gemma-2: the reference forward with the int8 KV cache follows the model's own
    softcapped eager attention within the KV rounding error, far closer than the uncapped one."""
    rec = recipes.preset("float")                      # weights float, KV cache int8
    out = tmp_path / "c8"
    job.calibrate(str(tiny["gemma2"]), out, rec, calib_jsonl, num_samples=8, seq_len=64, show_progress=False)
    assert verify(out).ok
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    assert "model.layers.0.self_attn.k_proj.kv_cache_scale" in tensors
    with torch.no_grad():
        want = _float_model(tiny["gemma2"], attn_implementation="eager")(IDS).logits
        no_cap = _float_model(tiny["gemma2"], attn_implementation="sdpa")(IDS).logits
        got = load_reference_model(out, kv_cache=True)(IDS).logits
    err, uncapped = (got - want).abs().max().item(), (no_cap - want).abs().max().item()
    assert err < 0.2 * uncapped, (err, uncapped)


# ------------------------------------------------------------------------ post-norm weighting

@pytest.mark.parametrize("family", FAMILIES)
def test_output_norms_read_their_groups_output(family, tiny):
    """Gemma's post norms as the spec names them: post_attention_layernorm reads o_proj's
    output, post_feedforward_layernorm down_proj's. A norm named on a group of several
    Linears, or not among the spec's post_norms, is refused."""
    from ascend_quant.arch.spec import ArchSpec, LinearGroup
    model = _float_model(tiny[family])
    _check_output_norms(model, spec_for_model(model), IDS)
    with pytest.raises(ValueError, match="one Linear"):
        LinearGroup("qkv", ("q", "k"), output_norm="n")
    with pytest.raises(ValueError, match="not in post_norms"):
        ArchSpec("x", ("x",), (LinearGroup("o", ("o",), output_norm="n"),))


def _check_output_norms(model, spec, ids):
    """Each group's `output_norm` reads that group's Linear's output (hooks in a forward of the
    real model), and every norm in spec.post_norms is named by a group."""
    layer = spec.layers(model)[0]
    outputs, norm_inputs = {}, {}
    handles = [layer.get_submodule(g.linears[0]).register_forward_hook(
        lambda m, a, o, n=g.name: outputs.__setitem__(n, o)) for g in spec.groups]
    handles += [layer.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: norm_inputs.__setitem__(n, a[0])) for n in spec.post_norms]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    named = {g.output_norm: g.name for g in spec.groups if g.output_norm is not None}
    assert sorted(named) == sorted(spec.post_norms)
    for norm, group in named.items():
        assert norm_inputs[norm] is outputs[group] or torch.equal(norm_inputs[norm], outputs[group])


def test_post_norm_token_weights_follow_the_norm(tiny):
    """`output_norm_weights` against the post-norm itself: for each token, how much a small
    change of o_proj's output (orthogonal to it) moves the output of the model's own
    post_attention_layernorm (its gain set to 1), by finite differences in float64. Up to one
    constant, the two agree token by token, also for tokens whose output is 100x smaller."""
    from ascend_quant.calibration.group import output_norm_weights
    from ascend_quant.arch.spec import norm_eps
    model = _float_model(tiny["gemma3"])
    spec = spec_for_model(model)
    o = next(g for g in spec.groups if g.name == "o")
    layer = model.model.layers[0]
    norm = layer.get_submodule(o.output_norm)
    linear = layer.get_submodule(o.linears[0])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, linear.in_features, generator=g)
    x[::4] *= 0.01                                   # some tokens with a tiny output
    got = output_norm_weights(x, linear.weight, linear.bias, norm_eps(norm))
    oracle = norm.double()
    with torch.no_grad():
        oracle.weight.zero_()                        # Gemma's (1 + w) gain: 1
        y = x.double() @ linear.weight.double().t()
        u = torch.randn(y.shape, generator=g, dtype=torch.float64)
        u -= (u * y).sum(-1, keepdim=True) / (y * y).sum(-1, keepdim=True) * y
        u /= u.norm(dim=-1, keepdim=True)
        step = 1e-4 * y.norm(dim=-1, keepdim=True)
        moved = (oracle(y + step * u) - oracle(y)).norm(dim=-1) / step.squeeze(-1)
    ratio = got.double() / moved
    assert (ratio / ratio.mean() - 1).abs().max() < 1e-3, ratio
    assert moved.max() / moved.min() > 50             # the weights really differ


def test_post_norm_weighting_lowers_the_error_the_norm_passes_on():
    """GPTQ on one Linear whose output a post-norm reads, for tokens whose outputs differ 30x in
    size and whose inputs are correlated differently: with the tokens weighted
    (`token_weights`), the error after the norm (torch's RMSNorm) is lower than with every
    token alike; the unnormalised error, which the large outputs dominate, goes the other way."""
    from ascend_quant.calibration import group
    from ascend_quant.calibration.group import output_norm_weights, quantize_linears
    from ascend_quant.calibration.group import ActivationQParams
    g = torch.Generator().manual_seed(0)
    k, n, t = 64, 48, 2048
    w = torch.randn(n, k, generator=g) * 0.1
    # two kinds of tokens with different correlations; the first kind's outputs are 30x smaller
    x = torch.cat([torch.randn(t // 2, k, generator=g) @ torch.randn(k, k, generator=g) / 30,
                   torch.randn(t // 2, k, generator=g) @ torch.randn(k, k, generator=g)]) * 0.3
    rec = recipes.Recipe("W4A16", method="gptq", group_size=32)
    tw = output_norm_weights(x, w, None, 1e-6)
    norm = torch.nn.RMSNorm(n, eps=1e-6, elementwise_affine=False)
    errors = {}
    for label, weights in (("equal", None), ("weighted", tw)):
        q = quantize_linears({"m": w}, {"m": None}, {"m": "W4A16"}, {"W4A16": x}, x[:8], {"W4A16": x[:8]},
                             ActivationQParams(), True, rec, "layer", token_weights=weights)["m"]
        wq = q.dequantized()
        errors[label] = ((norm(x @ wq.t()) - norm(x @ w.t())).norm().item(), (x @ (wq - w).t()).norm().item())
    assert errors["weighted"][0] < 0.9 * errors["equal"][0], errors
    assert errors["weighted"][1] > errors["equal"][1], errors
    assert group.sample(x, 0, tw).shape == x.shape


def test_weighted_activation_mean_counts_each_token_by_its_weight():
    """AWQ's per-channel mean |x| with token weights, over chunks, against the mean written out."""
    from ascend_quant.calibration.awq import activation_mean
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 16, generator=g), torch.rand(300, generator=g)
    torch.testing.assert_close(activation_mean(x, w, chunk=64), (x.abs() * w[:, None]).sum(0) / 300)
    torch.testing.assert_close(activation_mean(x), x.abs().mean(0))


def test_post_norm_groups_get_token_weights(tmp_path, tiny, calib_jsonl, monkeypatch):
    """The runner weighs tokens for the groups a post-norm reads (o_proj, down_proj), for no
    other group, not with `weights: {post_norm: false}` and not for static W8A8 (one range for
    all tokens does not commute with scaling them)."""
    from ascend_quant.calibration import runner
    seen = {}
    real = runner.quantize_linears

    def spy(weights, *args, token_weights=None, **kwargs):
        seen.setdefault(next(iter(weights)), []).append(token_weights)
        return real(weights, *args, token_weights=token_weights, **kwargs)
    monkeypatch.setattr(runner, "quantize_linears", spy)

    def weighted(rec):
        seen.clear()
        job.calibrate(str(tiny["gemma3"]), tmp_path / f"out{len(list(tmp_path.iterdir()))}", rec, calib_jsonl,
                      num_samples=4, seq_len=32, show_progress=False)
        return sorted(name for name, tws in seen.items() if any(tw is not None for tw in tws))

    rec = recipes.preset("w4a16", 32)
    assert weighted(rec) == ["mlp.down_proj", "self_attn.o_proj"]
    tws = [tw for name in ("self_attn.o_proj", "mlp.down_proj") for tw in seen[name]]
    assert len(tws) == 3 * 2 and all(tw is not None and torch.isfinite(tw).all() and tw.min() > 0 for tw in tws)
    rec.weights.post_norm = False
    assert weighted(rec) == []
    assert weighted(recipes.preset("w8a8")) == []


# ------------------------------------------------------------------------ every scheme

SCHEMES = ("w8a8", "w8a8-dynamic", "w8a16", "w4a16", "w4a8")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_calibrates_verifies_and_tracks_float(family, scheme, tmp_path, tiny, calib_jsonl):
    """Each scheme on each family: verify ok, no norm bias anywhere, the smoothed (1+w) norms
    written, and the reference forward close to the float model."""
    rec = recipes.preset(scheme, 32 if scheme in ("w4a16", "w4a8") else None)
    out = tmp_path / scheme
    job.calibrate(str(tiny[family]), out, rec, calib_jsonl, num_samples=8, seq_len=64, show_progress=False)
    report = verify(out)
    assert report.ok, report.problems
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert not [k for k in desc if k.endswith("norm.bias")]
    with torch.no_grad():
        want = _float_model(tiny[family], attn_implementation="eager")(IDS).logits
        got = load_reference_model(out)(IDS).logits
    rel = ((got - want).norm() / want.norm()).item()
    # measured: 8-bit 0.015-0.06, 4-bit 0.19-0.39 (random weights, 3 layers; w4a8's smoothing
    # does not raise the error over w4a16's, so the fold written is the right one)
    assert rel < (0.5 if scheme in ("w4a16", "w4a8") else 0.1), rel


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_model_reproduces_float_without_quantization(family, tmp_path, tiny, calib_jsonl):
    """Every Linear left in float: the reference model is the float model (embedding scale,
    (1+w) norms, tied head, softcaps), to fp32 noise."""
    rec = recipes.Recipe("FLOAT", method="minmax")
    out = tmp_path / "float"
    job.calibrate(str(tiny[family]), out, rec, calib_jsonl, num_samples=4, seq_len=32, show_progress=False)
    assert verify(out).ok
    with torch.no_grad():
        want = _float_model(tiny[family], attn_implementation="eager")(IDS).logits
        got = load_reference_model(out)(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ vLLM

@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_serves_calibrated_gemma_like_the_reference(family, tmp_path, calib_jsonl):
    """A calibrated Gemma (W8A8_DYNAMIC, layer 1 W8A16, the last layer's MLP W4A16, int8 KV cache
    on every layer) in vLLM: greedy tokens and log-probs of the reference forward (C8 simulated),
    past the sliding window (8) and, for Gemma-2, with the attention logit softcap, both in our
    int8 paged attention (no norm bias: vLLM's GemmaRMSNorm has none).
    One engine per family."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from test_vllm_runtime import LOGPROB_TOL, assert_matches_reference, run_engine

    src = build_tiny(family, tmp_path / "sharp", logit_gain=8.0)
    last = _config(family).num_hidden_layers - 1
    rec = recipes.preset("w8a8-dynamic")
    rec.group_size = 32
    rec.overrides = [recipes.Override("model.layers.1.*", "w8a16"),
                     recipes.Override(f"model.layers.{last}.mlp.*", "w4a16")]
    rec.kv_cache = recipes.KVCache(method="absmax")     # int8 pages on sliding and full layers
    out = tmp_path / "mixed"
    job.calibrate(str(src), out, rec, calib_jsonl, num_samples=8, seq_len=64, show_progress=False)
    assert verify(out).ok
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert {desc["model.layers.0.mlp.up_proj.weight"], desc["model.layers.1.self_attn.q_proj.weight"],
            desc[f"model.layers.{last}.mlp.down_proj.weight"]} == {"W8A8_DYNAMIC", "W8A16", "W4A16"}
    assert all(desc.get(f"model.layers.{i}.self_attn.k_proj.kv_cache_scale") == "C8" for i in range(last + 1))
    decisive = []
    for ref in assert_matches_reference(out, run_engine(out), flips=1):
        top2 = ref.topk(2, -1).values
        decisive += ((top2[:, 0] - top2[:, 1]) > 10 * LOGPROB_TOL).tolist()
    assert sum(decisive) > 0.5 * len(decisive)          # the comparison is not decided by ties


@pytest.mark.vllm
def test_vllm_config_maps_gemma_fused_names_and_refuses_a_norm_bias(tmp_path, tiny, calib_jsonl):
    """No engine: the `ascend` config finds q/k/v behind qkv_proj and gate/up behind
    gate_up_proj of a Gemma checkpoint, places no norm bias, and refuses one a tool added."""
    from ascend_quant.runtime.vllm.config import AscendQuantConfig
    out = tmp_path / "ckpt"
    job.calibrate(str(tiny["gemma3"]), out, recipes.preset("w8a16"), calib_jsonl, num_samples=4, seq_len=32,
                  show_progress=False)
    config = AscendQuantConfig()
    config.maybe_update_config(str(out))
    assert config.shard_prefixes("model.layers.0.mlp.gate_up_proj") == ["model.layers.0.mlp.gate_proj",
                                                                        "model.layers.0.mlp.up_proj"]
    assert config.shard_prefixes("model.layers.2.self_attn.qkv_proj") == [
        f"model.layers.2.self_attn.{p}_proj" for p in "qkv"]
    assert config.norm_bias_key("model.layers.0.mlp.gate_up_proj") is None
    bad = AscendQuantConfig(dict(config.description, **{"model.layers.0.pre_feedforward_layernorm.bias": "FLOAT"}),
                            dict(config.meta))
    bad.spec, bad.description_file = config.spec, config.description_file
    with pytest.raises(ValueError, match="pre_feedforward_layernorm"):
        bad.validate()
