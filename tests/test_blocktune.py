"""Block tuning (recipe `tune`, calibration/blocktune.py): GPTQ's unrounded values, the tuned
weight's formula and gradient, and tuning through real calibrations of tiny models (Qwen2, and
the Gemma families with their post-norms and sliding-window layers)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
import torch
import yaml

from ascend_quant import numerics
from ascend_quant.calibration import job, recipe as recipes, runner
from ascend_quant.calibration.data import load_texts, tokenize_samples
from ascend_quant.calibration.gptq import gptq_quantize, hessian
from ascend_quant.calibration.recipe import RecipeError, load_recipe
from ascend_quant.cli.main import cli
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from conftest import FIXTURES, fixture_dir
from test_families import build_tiny

TUNE = {"iters": 30, "batch": 4, "lr": 0.005}


def _recipe(scheme: str = "w4a16", group: int | None = 32, tune: dict | None = TUNE) -> recipes.Recipe:
    """The scheme's preset with min-max rounding (AutoRound's start) and `tune`."""
    rec = recipes.preset(scheme, group)
    rec.method = "minmax"
    rec.gptq.float_target = False        # as `calibrate` resolves it on these unrotated models
    rec.tune = recipes.Tune(**tune) if tune is not None else None
    return rec


@pytest.fixture(scope="module")
def calib_jsonl():
    return str(FIXTURES / "calib.jsonl")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("blocktune")
    return {"qwen2": fixture_dir("tiny-qwen2-fp32"), "gemma2": build_tiny("gemma2", root / "gemma2"),
            "gemma3": build_tiny("gemma3", root / "gemma3")}


def _inputs(k: int, tokens: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)
    x[:, :3] *= 10
    return x


# ------------------------------------------------------------------ GPTQ's unrounded values

@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_gptq_unrounded_values_round_to_its_codes(zero_points, native):
    """Every code is the round-and-clamp of its unrounded value, unclamped values lie within
    half a step of their code, and the first column (which no update reached, act-order off) is
    w / s (+ zero point) by the quantizer's own definition, computed here by hand."""
    torch.manual_seed(0)
    n, k, gs = 24, 96, 32
    w = torch.randn(n, k)
    x = _inputs(k)
    scale, offset = numerics.weight_qparams(w, 4, gs, symmetric=not zero_points)
    values = torch.full((n, k), float("nan"))
    q, s = gptq_quantize(w, hessian(x), 4, gs, act_order=False, scale=scale, offset=offset,
                         unrounded=values, native_sweep=native)
    assert torch.isfinite(values).all()
    assert torch.equal(torch.clamp(torch.round(values), -8, 7).to(torch.int8), q)
    inside = (values > -8.5) & (values < 7.5)
    assert ((values - q.float()).abs()[inside] <= 0.5 + 1e-5).all()
    first = w[:, 0] / scale[:, 0] + (offset[:, 0] if zero_points else 0.0)
    torch.testing.assert_close(values[:, 0], first, rtol=1e-5, atol=1e-5)


def test_gptq_unrounded_values_agree_between_the_native_and_python_sweeps():
    torch.manual_seed(1)
    w, x = torch.randn(16, 64), _inputs(64, seed=1)
    out = [torch.empty(16, 64), torch.empty(16, 64)]
    for native, values in zip((True, False), out):
        gptq_quantize(w, hessian(x), 4, 32, act_order=True, unrounded=values, native_sweep=native)
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the tuned weight

def test_tuned_weight_is_the_dequantized_codes_with_a_straight_through_gradient():
    """At zero shift and gain: exactly the dequantized codes. A shift past a half moves a code
    by one step. The gradient of sum(r * W) is r * scale * (1 + gain) for the shift where the
    code is not clamped (0 where it is) and sum over the group of r * (code - offset) * scale
    for the gain: written out here, not taken from the code under test."""
    torch.manual_seed(2)
    n, k, gs = 4, 64, 32
    w = torch.randn(n, k)
    scale, offset = numerics.weight_qparams(w, 4, gs, symmetric=False)
    values = numerics.unrounded_codes(w, scale, offset)
    q = numerics.quantize(w, scale, 4, offset)
    shift = torch.zeros(n, k, requires_grad=True)
    gain = torch.zeros(n, k // gs, requires_grad=True)
    got = numerics.tuned_weight(values, shift, scale, gain, offset, 4)
    assert torch.equal(got, numerics.dequantize(q, scale, offset))
    r = torch.randn(n, k)
    (got * r).sum().backward()
    codes = torch.round(values)
    clamped = (codes < -8) | (codes > 7)
    s_full, o_full = numerics.expand_groups(scale, k), numerics.expand_groups(offset, k)
    torch.testing.assert_close(shift.grad, torch.where(clamped, 0.0, r * s_full))
    want_gain = (r * (q.float() - o_full) * s_full).reshape(n, k // gs, gs).sum(-1)
    torch.testing.assert_close(gain.grad, want_gain)
    with torch.no_grad():
        moved = numerics.tuned_weight(values, torch.full((n, k), 0.5) * torch.sign(values - codes + 1e-9),
                                      scale, torch.zeros_like(gain), offset, 4)
    step = ((moved - numerics.dequantize(q, scale, offset)) / s_full).round()
    assert set(step.unique().tolist()) <= {-1.0, 0.0, 1.0} and step.abs().sum() > 0


# ------------------------------------------------------------------ through calibration

def _samples(path, calib_jsonl, count=16, seq_len=64):
    from transformers import AutoTokenizer
    return tokenize_samples(load_texts(calib_jsonl), AutoTokenizer.from_pretrained(path), count, seq_len)


def _layer0_error(model, float_model, ids) -> float:
    """The first decoder layer's output error on `ids` (its input is the embedding in both)."""
    outs = {}
    for tag, m in (("q", model), ("f", float_model)):
        layer = m.model.layers[0]
        h = layer.register_forward_hook(lambda mod, a, o, tag=tag: outs.__setitem__(tag, o[0] if isinstance(o, tuple) else o))
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)
        h.remove()
    return (outs["q"] - outs["f"]).pow(2).mean().item()


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_tuning_lowers_the_layer_error_on_unseen_samples(models, calib_jsonl, family):
    """W4A16 g32, min-max rounding with and without `tune`: every layer's error on the calibration samples falls
    (the kept rule), and layer 0's output error on samples no calibration saw (its input is the
    embedding in both runs) is lower with tuning."""
    from transformers import AutoModelForCausalLM
    path = models[family]
    fit = _samples(path, calib_jsonl, seq_len=32)
    unseen = _samples(path, calib_jsonl, count=32, seq_len=32).ids[16:]     # packed windows: the same first 16
    float_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    errors, reports = {}, {}
    for tuned in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rec = _recipe(tune=TUNE if tuned else None)
        _, _, reports[tuned] = runner.quantize_model(model, fit.ids, rec, valid=fit.valid)
        errors[tuned] = _layer0_error(model, float_model, unseen)
    assert all(r.tune is None for r in reports[False])
    assert all(r.tune is not None and r.tune.kept and r.tune.after < r.tune.before and r.tune.moved > 0
               for r in reports[True]), [r.tune for r in reports[True]]
    assert errors[True] < 0.9 * errors[False], errors


def test_a_tuning_that_raises_the_error_is_dropped(models, calib_jsonl):
    """A step size far too large makes every code jump together: the tuned layer is worse on the
    calibration samples, so the rounding's codes and scales stay, bit for bit."""
    from transformers import AutoModelForCausalLM
    path = models["qwen2"]
    fit = _samples(path, calib_jsonl, count=8)
    results = {}
    for tune in (None, {"iters": 4, "batch": 2, "lr": 0.5, "max_gain": 0.9}):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rec = _recipe(tune=tune)
        results[tune is None], _, reports = runner.quantize_model(model, fit.ids, rec, valid=fit.valid)
    assert all(r.tune is not None and not r.tune.kept and r.tune.moved == 0 for r in reports)
    for name, ql in results[True].items():
        assert torch.equal(ql.q, results[False][name].q) and torch.equal(ql.scale, results[False][name].scale)
        assert results[False][name].unrounded is None


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3"])
def test_tuned_checkpoint_verifies_and_tracks_float_closer(tmp_path, models, calib_jsonl, family):
    """Through the CLI with a recipe: the report shows the tuning, the checkpoint verifies and
    records the recipe, and the reference model's logits on tokens no calibration saw are closer
    to the float model's than without tuning (min-max rounding, the same command otherwise)."""
    from transformers import AutoModelForCausalLM
    path = models[family]
    unseen = _samples(path, calib_jsonl, count=32, seq_len=32).ids[16:]     # the calibration takes the first 16
    rels = {}
    for tuned in (False, True):
        recipe = tmp_path / f"r{tuned}.yaml"
        recipe.write_text(yaml.safe_dump({"scheme": "w4a16", "group_size": 32, "method": "minmax",
                                          **({"tune": TUNE} if tuned else {})}))
        out = tmp_path / f"out{tuned}"
        result = CliRunner().invoke(cli, ["calibrate", str(path), "-o", str(out), "--recipe", str(recipe), "--dataset", calib_jsonl,
                      "--num-samples", "16", "--seq-len", "32"])
        assert result.exit_code == 0, result.output
        assert ("(tune: " in result.output) == tuned
        report = verify(out)
        assert report.ok, report.problems
        saved = yaml.safe_load((out / "ascend_quant_recipe.yaml").read_text())
        assert (saved["tune"] is not None) == tuned
        layers = json.loads((out / "ascend_quant_calibration.json").read_text())["layers"]
        assert all(("tune" in layer) == tuned for layer in layers)
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()(unseen).logits
            got = load_reference_model(out)(unseen).logits
        rels[tuned] = ((got - want).norm() / want.norm()).item()
    assert rels[True] < 0.95 * rels[False], rels     # measured 0.80x-0.87x


def test_tuned_c8_scales_come_from_the_tuned_layer(tmp_path, models, calib_jsonl):
    """W8A16 + C8: layer 0 gets the same input with and without tuning, so its K/V scales can
    differ only if they were chosen again on the tuned layer's K/V; the checkpoint verifies."""
    from transformers import AutoModelForCausalLM
    path = models["qwen2"]
    fit = _samples(path, calib_jsonl)
    scales = {}
    for tuned in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rec = _recipe("w8a16", None, TUNE if tuned else None)
        rec.kv_cache = recipes.KVCache()
        _, kv, reports = runner.quantize_model(model, fit.ids, rec, valid=fit.valid)
        scales[tuned] = kv[next(iter(kv))]
    assert reports[0].tune.kept and reports[0].tune.moved > 0
    assert not all(torch.equal(a, b) for a, b in zip(scales[False], scales[True]))
    rec.kv_cache, out = recipes.KVCache(), tmp_path / "c8"
    job.calibrate(str(path), out, rec, calib_jsonl, num_samples=16, seq_len=64, show_progress=False)
    report = verify(out)
    assert report.ok, report.problems


def test_moe_layers_are_left_to_their_rounding(tmp_path, calib_jsonl):
    """Qwen2-MoE with layer 0 dense and layer 1 MoE: the dense layer is tuned, the MoE layer is
    not (no float copy of its experts), and the W4A16 checkpoint (symmetric experts) verifies."""
    from moe_helpers import build_tiny_moe
    path = build_tiny_moe("qwen2_moe", tmp_path / "moe")
    out = tmp_path / "out"
    result = job.calibrate(str(path), out, _recipe(), calib_jsonl, num_samples=16, seq_len=32, show_progress=False)
    assert result.reports[0].tune is not None and result.reports[0].tune.kept
    assert result.reports[1].tune is None
    report = verify(out)
    assert report.ok, report.problems


@pytest.mark.parametrize("target", ["own", "float"])
def test_the_target_is_the_float_layer_on_the_chosen_input(models, calib_jsonl, monkeypatch, target):
    """own: a float copy of each layer on the input the quantized layers before it give; float:
    the float model's own hidden states. Checked against an untouched float model's layer
    outputs, hooked (layer 0 gets the embedding either way; past it only `float` matches)."""
    from transformers import AutoModelForCausalLM
    from ascend_quant.calibration import blocktune
    path = models["qwen2"]
    fit = _samples(path, calib_jsonl, count=4)
    float_outputs = []
    float_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer in float_model.model.layers:
        layer.register_forward_hook(lambda m, a, o: float_outputs.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        float_model(input_ids=fit.ids, use_cache=False)
    seen = []
    real = blocktune.tune_layer
    monkeypatch.setattr(blocktune, "tune_layer", lambda layer, prefix, results, x, target, *a, **k:
                        seen.append(target.clone()) or real(layer, prefix, results, x, target, *a, **k))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rec = _recipe(tune={"iters": 2, "batch": 2, "target": target})
    runner.quantize_model(model, fit.ids, rec, valid=fit.valid)
    assert len(seen) == len(float_outputs) >= 2
    torch.testing.assert_close(seen[0], float_outputs[0], rtol=1e-4, atol=1e-4)
    later = [torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(seen[1:], float_outputs[1:])]
    assert all(later) if target == "float" else not any(later)


@pytest.mark.parametrize("bad", [{"iters": 0}, {"batch": -1}, {"lr": 0}, {"max_gain": 1.5}, {"iters": True},
                                 {"steps": 3}, {"target": "fp32"}])
def test_bad_tune_keys_are_refused(tmp_path, bad):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"scheme": "w4a16", "tune": bad}))
    with pytest.raises(RecipeError, match="tune"):
        load_recipe(path)
