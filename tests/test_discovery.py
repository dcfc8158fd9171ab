"""Architecture discovery (arch/discovery.py) on tiny random models built here.

Discovery must reproduce every explicit spec from probing alone; a fold that a hidden
functional reader of the norm output breaks is caught by the equivalence check and that group
goes unsmoothed; and a family without an explicit spec (Granite) calibrates, verifies, keeps
its discovered spec in the checkpoint and serves in vLLM like the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch

from ascend_quant.arch import SAVED_SPEC_KEY, SPECS, ArchSpec, UnsupportedModelError, spec_for_config, spec_for_model
from ascend_quant.arch.discovery import TOLERANCE, discover
from ascend_quant.calibration import recipe as recipes
from ascend_quant.calibration.job import calibrate
from ascend_quant.calibration.runner import quantize_model
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from conftest import FIXTURES, fixture_dir

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=512, max_position_embeddings=256, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def _config(model_type: str):
    import transformers as t
    if model_type in ("gemma2", "gemma3_text"):
        cls = t.Gemma2Config if model_type == "gemma2" else t.Gemma3TextConfig
        return cls(**SMALL, head_dim=32, sliding_window=8, query_pre_attn_scalar=32)
    if model_type == "glm4":
        return t.Glm4Config(**SMALL, head_dim=32, partial_rotary_factor=0.5, attention_bias=True)
    if model_type == "granite":      # multipliers on embeddings, attention, residual and logits
        return t.GraniteConfig(**SMALL, embedding_multiplier=2.0, attention_multiplier=0.2,
                               residual_multiplier=0.5, logits_scaling=0.5, tie_word_embeddings=False)
    return t.AutoConfig.for_model(model_type, **SMALL)


def _model(model_type: str, seed: int = 0):
    """Random norm gains around 1 and around 0 alike (so w and 1 + w differ), small random biases."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(p + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


# compared: everything a probe can know. Not compared: `on_disk` (Phi-3's vLLM mapping
# `qkv_proj: [qkv_proj]` does not name the parts), `vllm_attention` (a vLLM module name, left
# at its default), `mlp` (only lean_mlp's memory saving reads it), `name` / `model_types` / `notes`.
GROUP_FIELDS = ("name", "linears", "producer", "producer_kind", "sole_consumer", "producer_chunk",
                "row_parallel", "vllm_fused", "output_norm")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "glm4"])
def test_discovery_reproduces_the_explicit_spec(model_type):
    model = _model(model_type)
    (want,) = SPECS[model_type]
    got = discover(model)
    assert got.discovered and got.layers_path == want.layers_path
    assert got.kv_projections == want.kv_projections
    assert [tuple(getattr(g, f) for f in GROUP_FIELDS) for g in got.groups] == \
        [tuple(getattr(g, f) for f in GROUP_FIELDS) for g in want.groups], "\n".join(got.notes)
    assert got.post_norms == want.post_norms
    assert ArchSpec.from_dict(json.loads(json.dumps(got.to_dict()))) == got


def test_wrong_norm_kind_would_be_caught_by_the_fold_check():
    """The classification is not the only guard: Gemma's (1+w) norm folded as a plain norm
    changes the layer output far beyond the tolerance the discovered fold keeps."""
    from ascend_quant.arch.discovery import _fold_error, _Probe
    model = _model("gemma3_text")
    layer = model.model.layers[0]
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    probe = _Probe(model, layer)
    base = probe.run()
    group = SPECS["gemma3_text"][0].groups[0]
    assert _fold_error(probe, state, group, base) <= TOLERANCE
    wrong = type(group)(group.name, group.linears, group.producer, "rmsnorm")
    assert _fold_error(probe, state, wrong, base) > 1e-3


def _tapped(model):
    """Every MLP also adds 0.5 x its input (the post-attention norm's output) to its output:
    a functional reader of the norm that no module hook sees."""
    for layer in model.model.layers:
        mlp = layer.mlp
        plain = type(mlp).forward
        mlp.forward = types.MethodType(lambda self, x, plain=plain: plain(self, x) + 0.5 * x, mlp)
    model.config.model_type = "tapped_llama"          # no explicit spec: discovery runs
    return model


def test_hidden_reader_fails_the_fold_and_the_group_is_not_smoothed():
    model = _tapped(_model("llama"))
    spec = spec_for_model(model)
    gate_up = next(g for g in spec.groups if "mlp.up_proj" in g.linears)
    assert gate_up.producer is None and not gate_up.sole_consumer
    assert any("no smoothing" in n and "post_attention_layernorm" in n for n in spec.notes), spec.notes
    qkv = spec.groups[0]
    assert qkv.producer == "input_layernorm"          # the other folds stay
    ids = torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    _, _, reports = quantize_model(model, ids, recipes.preset("w8a8-dynamic"))
    # unrotated, the preset scales with AWQ's search (SmoothQuant's alphas where rotated)
    assert all(set(r.alphas) | set(r.awq_alphas) == {"qkv", "down"} for r in reports), \
        [(r.alphas, r.awq_alphas) for r in reports]
    with torch.no_grad():
        got = model(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.1


def test_discovered_post_norms_weigh_the_tokens(monkeypatch):
    """A Gemma-3 layout under a model type with no spec: discovery finds the norms on o_proj's
    and down_proj's outputs, so calibration weighs those two groups' tokens (the explicit
    Gemma spec's `output_norm`), by the 1 / RMS the norm really divides by, and no other group."""
    from ascend_quant.calibration import runner
    model = _model("gemma3_text")
    model.config.model_type = "unlisted_gemma3"        # no explicit spec: discovery runs
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    want = {}                                          # each post-norm's input, as the model computes it

    def grab(i):
        def f(m, args):
            want.setdefault(i, args[0].reshape(-1, args[0].shape[-1]).double())
        return f
    layer0 = model.model.layers[0]
    handles = [layer0.post_attention_layernorm.register_forward_pre_hook(grab("o")),
               layer0.post_feedforward_layernorm.register_forward_pre_hook(grab("down"))]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    seen = {}                                          # per member name: layer 0's (the first) weights
    real = runner.quantize_linears

    def spy(weights, *args, token_weights=None, **kwargs):
        seen.setdefault(next(iter(weights)), token_weights)
        return real(weights, *args, token_weights=token_weights, **kwargs)
    monkeypatch.setattr(runner, "quantize_linears", spy)
    quantize_model(model, ids, recipes.preset("w4a16", 32))
    spec = spec_for_model(model)
    assert spec.discovered and spec.post_norms == ("post_attention_layernorm", "post_feedforward_layernorm")
    weighted = sorted(name for name, tw in seen.items() if tw is not None)
    assert weighted == ["mlp.down_proj", "self_attn.o_proj"], weighted
    for group, name in (("o", "self_attn.o_proj"), ("down", "mlp.down_proj")):
        rms = want[group].pow(2).mean(-1).add(model.config.rms_norm_eps).sqrt()
        expect = 1 / rms
        expect = expect / expect.pow(2).mean().sqrt()
        got = seen[name].double()
        # the runner's weights come from the group's input after the Linears before it were
        # rounded to 4 bits, the float model's from its own: close, and far from equal weights
        assert ((got - expect).abs() / expect).max() < 0.1
        assert ((1 - expect).abs() / expect).max() > 0.3      # equal weights would not pass


def test_no_decoder_layers_is_one_clear_error():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4))
    model.config = types.SimpleNamespace(model_type="toy")
    with pytest.raises(UnsupportedModelError, match="no decoder-layer list"):
        spec_for_model(model)


# ------------------------------------------------------------------------ families without a spec

def test_layernorm_folds_are_found_and_keep_the_logits():
    """StableLM's LayerNorms (mean subtracted, with bias) are `layernorm` producers; folding a
    random s into every discovered producer leaves the logits unchanged to fp32 noise."""
    from ascend_quant.calibration.smoothquant import apply_smoothing
    model = _model("stablelm")
    spec = spec_for_model(model)
    kinds = {g.name: g.producer_kind for g in spec.groups}
    assert kinds == {"qkv": "layernorm", "o": None, "gate_up": "layernorm", "down": "linear_rows"}, spec.notes
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        want = model(ids).logits
        for layer in spec.layers(model):
            for group in spec.groups:
                if group.producer:
                    consumers = [layer.get_submodule(n) for n in group.linears]
                    s = torch.exp(torch.randn(consumers[0].in_features, generator=g) * 0.5)
                    apply_smoothing(layer.get_submodule(group.producer), consumers, s, group.producer_kind)
        got = model(ids).logits
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def _saved(model_type: str, root):
    d = root / model_type
    model = _model(model_type)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)       # decisive greedy choices (see runtime_helpers)
    model.save_pretrained(d)
    for f in fixture_dir("tiny-qwen2-fp32").iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, d / f.name)
    return d


@pytest.mark.parametrize("model_type", ["stablelm", "olmo2"])
def test_family_without_spec_calibrates_and_tracks_float(model_type, tmp_path):
    """StableLM (LayerNorm folds) and OLMo-2 (q/k/v and gate/up read the residual stream: no
    producer, not sole consumers) calibrate W8A8_DYNAMIC with their discovered specs; the
    scaled groups are exactly those with a producer; verify ok; reference close to float."""
    from transformers import AutoModelForCausalLM
    src = _saved(model_type, tmp_path)
    out = tmp_path / "w8a8"
    calibrate(str(src), out, recipes.preset("w8a8-dynamic"), str(FIXTURES / "calib.jsonl"),
                       num_samples=8, seq_len=64, show_progress=False)
    assert verify(out).ok
    spec = spec_for_config(json.loads((out / "config.json").read_text()))
    calib = json.loads((out / "ascend_quant_calibration.json").read_text())
    # discovered specs take no rotation, so the preset scales with AWQ's search
    assert all(set(layer["awq_alphas"]) == {g.name for g in spec.groups if g.producer} and not layer["smoothquant_alphas"]
               for layer in calib["layers"])
    ids = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
        got = load_reference_model(out)(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.1, rel


# ------------------------------------------------------------------------ Granite, served by vLLM

@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return _saved("granite", tmp_path_factory.mktemp("granite"))


@pytest.fixture(scope="module")
def granite_w8a8(granite, tmp_path_factory):
    assert "granite" not in SPECS
    out = tmp_path_factory.mktemp("granite_q") / "w8a8"
    rec = recipes.preset("w8a8-dynamic")
    rec.kv_cache = recipes.KVCache(method="absmax")
    calibrate(str(granite), out, rec, str(FIXTURES / "calib.jsonl"), num_samples=8, seq_len=64,
                       show_progress=False)
    return out


def test_granite_calibrates_with_discovery_verifies_and_tracks_float(granite, granite_w8a8):
    from transformers import AutoModelForCausalLM
    report = verify(granite_w8a8)
    assert report.ok, report.problems
    config = json.loads((granite_w8a8 / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.discovered and spec == ArchSpec.from_dict(config[SAVED_SPEC_KEY])
    assert [g.producer for g in spec.groups] == ["input_layernorm", None, "post_attention_layernorm", "mlp.up_proj"]
    calib = json.loads((granite_w8a8 / "ascend_quant_calibration.json").read_text())
    assert calib["arch_spec"] == spec.name
    desc = json.loads((granite_w8a8 / "quant_model_description.json").read_text())
    assert desc["model.layers.1.self_attn.k_proj.kv_cache_scale"] == "C8"
    ids = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(granite, dtype=torch.float32).eval()(ids).logits
        got = load_reference_model(granite_w8a8, kv_cache=True)(ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.1, rel


def test_streamed_model_discovers_on_layer_zero_alone(granite):
    """Layer streaming keeps working without an explicit spec: discovery reads the embeddings
    and layer 0 only, gives the spec of the whole loaded model, and leaves the layers on meta."""
    from transformers import AutoModelForCausalLM

    from ascend_quant.calibration.streaming import StreamedModel
    streamed = StreamedModel(granite)
    layers = streamed.spec.layers(streamed.model)
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    whole = discover(AutoModelForCausalLM.from_pretrained(granite, dtype=torch.float32).eval())
    assert streamed.spec.groups == whole.groups and streamed.spec.kv_projections == whole.kv_projections


def test_unreadable_saved_spec_is_one_line(granite_w8a8, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(granite_w8a8, bad)
    config = json.loads((bad / "config.json").read_text())
    del config[SAVED_SPEC_KEY]["groups"][0]["linears"]
    (bad / "config.json").write_text(json.dumps(config))
    report = verify(bad)
    assert not report.ok and any("saved architecture spec is not readable" in p for p in report.problems), \
        report.problems


@pytest.mark.vllm
def test_vllm_serves_discovered_granite_like_the_reference(granite_w8a8):
    """vLLM with our plugin on the discovered family: greedy tokens and log-probs of the
    reference forward (C8 simulated), the plugin reading the spec saved in config.json."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from test_vllm_runtime import assert_matches_reference, run_engine

    from ascend_quant.runtime.vllm.config import AscendQuantConfig
    config = AscendQuantConfig()
    config.maybe_update_config(str(granite_w8a8))
    assert config.spec.discovered and len(config.c8_layers()) == 2

    assert_matches_reference(granite_w8a8, run_engine(granite_w8a8), "granite")
