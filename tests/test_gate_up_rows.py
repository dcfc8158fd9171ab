"""GPTQ for a gated MLP's product (`gptq.gate_up_clusters`): gate's and up's rows weighted by
how their error reaches act(gate) * up, clustered, one Hessian per cluster.

The oracles below take the activation from torch.nn.functional and its slope by central
differences in float64, not from the code under test.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers.activations import ACT2FN

from ascend_quant import numerics
from ascend_quant.calibration import group, job, recipe as recipes
from ascend_quant.calibration.gptq import gptq_quantize, hessian
from ascend_quant.calibration.recipe import GPTQ
from ascend_quant.formats.verify import verify
from conftest import FIXTURES, fixture_dir

ORACLE_ACT = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _oracle_sensitivities(x, wg, wu, name):
    """(d product / d g)^2 and (d product / d u)^2 per token and row, by central differences."""
    act = ORACLE_ACT[name]
    g, u = x.double() @ wg.double().t(), x.double() @ wu.double().t()
    h = 1e-5
    dg = (act(g + h) * u - act(g - h) * u) / (2 * h)
    du = (act(g) * (u + h) - act(g) * (u - h)) / (2 * h)
    return dg.square(), du.square()


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_sensitivities_are_the_products_slopes(name):
    g = torch.Generator().manual_seed(0)
    x, wg, wu = torch.randn(300, 24, generator=g), torch.randn(10, 24, generator=g), torch.randn(10, 24, generator=g)
    got_g, got_u = group.gate_up_sensitivities(x, wg, wu, ACT2FN[name])
    want_g, want_u = _oracle_sensitivities(x, wg, wu, name)
    torch.testing.assert_close(got_g.double(), want_g, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got_u.double(), want_u, rtol=1e-3, atol=1e-4)


def test_row_weights_are_each_clusters_mean(monkeypatch):
    """Over several token chunks: each cluster's token weights are the mean over its rows of
    (1 - floor) * p / mean(p) + floor, p a row's sensitivity (the oracle's); gate's rows first."""
    monkeypatch.setattr(group, "ROW_CHUNK", 64)
    g = torch.Generator().manual_seed(1)
    x, wg, wu = torch.randn(500, 16, generator=g), torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
    labels, weights = group.gate_up_row_weights(x, wg, wu, ACT2FN["silu"], 3)
    assert labels.shape == (24,) and weights.shape == (3, 500) and set(labels.tolist()) == {0, 1, 2}
    p = torch.cat(_oracle_sensitivities(x, wg, wu, "silu"), 1).t()          # [rows, tokens]
    f = group.ROW_WEIGHT_FLOOR
    p = (1 - f) * p / p.mean(1, keepdim=True) + f
    for c in range(3):
        torch.testing.assert_close(weights[c].double(), p[labels == c].mean(0), rtol=2e-3, atol=1e-3)


def test_clusters_with_equal_weights_are_plain_gptq():
    """Clusters whose token weights are all alike round each row as one GPTQ on all rows would
    (fixed scales and zero points follow their rows)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(400, 64, generator=g), torch.randn(20, 64, generator=g)
    scale, offset = numerics.weight_scale(w, 4, 32), torch.randint(-2, 3, (20, 2), generator=g).float()
    plain_q, plain_s = gptq_quantize(w, hessian(x), 4, 32, 0.01, 128, True, True, scale=scale, offset=offset)
    labels = torch.randint(0, 3, (20,), generator=g)
    q, s = group._gptq_by_cluster(w, labels, torch.ones(3, 400), x, 4, 32, GPTQ(), scale, offset)
    assert torch.equal(s, plain_s)
    assert (q != plain_q).float().mean() < 0.002


def _two_kinds_of_tokens(t, seed):
    """Even tokens vary along features 2-32 and switch on gate rows 0-15, odd ones along 33-63
    and rows 16-31: each row's error counts on one kind of token only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=g) * 0.3
    even = torch.arange(t) % 2 == 0
    x[even, 0], x[~even, 1] = 2.0, 2.0
    x[even, 2:33] += 2.0 * torch.randn(int(even.sum()), 31, generator=g)
    x[~even, 33:] += 2.0 * torch.randn(int((~even).sum()), 31, generator=g)
    return x


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh"])
def test_clusters_lower_the_products_error(name):
    """3-bit g32 GPTQ per row cluster beats one shared Hessian on the gated product's error,
    on tokens the calibration did not see."""
    g = torch.Generator().manual_seed(0)
    wg, wu = 0.1 * torch.randn(32, 64, generator=g), 0.3 * torch.randn(32, 64, generator=g)
    wg[:16, :2], wg[16:, :2] = torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])
    x, held_out = _two_kinds_of_tokens(4096, 1), _two_kinds_of_tokens(4096, 2)
    act = ORACLE_ACT[name]

    def error(w):
        ref = act(held_out @ wg.t()) * (held_out @ wu.t())
        got = act(held_out @ w[:32].t()) * (held_out @ w[32:].t())
        return ((got - ref).square().sum() / ref.square().sum()).item()

    w = torch.cat([wg, wu])
    shared = numerics.dequantize(*gptq_quantize(w, hessian(x), 3, 32, 0.01, 128, True, True))
    labels, weights = group.gate_up_row_weights(x, wg, wu, ACT2FN[name], 4)
    assert len(set(labels[:16].tolist()) & set(labels[16:32].tolist())) == 0   # the two kinds apart
    clustered = numerics.dequantize(*group._gptq_by_cluster(w, labels, weights, x, 3, 32, GPTQ(), None, None))
    assert error(clustered) < 0.95 * error(shared)


@pytest.mark.parametrize("text", ["gptq: {gate_up_clusters: -1}\n", "gptq: {gate_up_clusters: true}\n",
                                  "gptq: {gate_up_clusters: 2.5}\n"])
def test_gate_up_clusters_recipe_errors(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text("scheme: w4a16\n" + text)
    with pytest.raises(recipes.RecipeError, match="gate_up_clusters"):
        recipes.load_recipe(path)


def test_calibration_rounds_gate_and_up_per_cluster(tmp_path, monkeypatch):
    """In a real calibration only each layer's gate_proj + up_proj batch goes through the
    clusters (all of their rows, gate's first); the checkpoint verifies."""
    calls = []
    real = group._gptq_by_cluster

    def spy(w, labels, *args):
        calls.append((w.shape[0], int(labels.max()) + 1))
        return real(w, labels, *args)

    monkeypatch.setattr(group, "_gptq_by_cluster", spy)
    rec_path = tmp_path / "r.yaml"
    rec_path.write_text("scheme: w4a16\ngroup_size: 32\nmethod: gptq\ngptq: {gate_up_clusters: 3}\n")
    tiny = fixture_dir("tiny-qwen2-fp32")
    out = tmp_path / "out"
    job.calibrate(str(tiny), out, recipes.load_recipe(rec_path), str(FIXTURES / "calib.jsonl"), num_samples=8,
                  seq_len=64, show_progress=False)
    import json
    config = json.loads((tiny / "config.json").read_text())
    assert calls == [(2 * config["intermediate_size"], 3)] * config["num_hidden_layers"]
    assert verify(out).ok
    # where the float target applies, GPTQ keeps the shared Hessian its fit was solved for
    calls.clear()
    rec_path.write_text("scheme: w4a16\ngroup_size: 32\nmethod: gptq\n"
                        "gptq: {gate_up_clusters: 3, float_target: true}\n")
    job.calibrate(str(tiny), tmp_path / "out2", recipes.load_recipe(rec_path), str(FIXTURES / "calib.jsonl"),
                  num_samples=8, seq_len=64, show_progress=False)
    assert calls == []
