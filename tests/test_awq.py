"""AWQ-style weight rounding and asymmetric W4A16, on tensors and tiny models built here.

Losses and quantizers the checks compare against are written out again below in plain torch
(int4 per-group rounding, `mean|x|^alpha`), not taken from the code under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ascend_quant import numerics
from ascend_quant.arch import spec_for_model
from ascend_quant.calibration import job, recipe as recipes
from ascend_quant.calibration.awq import search_clip, search_scales
from ascend_quant.calibration.gptq import gptq_quantize, hessian
from ascend_quant.calibration.smoothquant import apply_smoothing
from ascend_quant.formats.verify import verify
from ascend_quant.runtime.reference_model import load_reference_model
from ascend_quant.schemes import W4A16
from conftest import FIXTURES, fixture_dir
from format_oracle import TOLERANCE, load_oracle_model
from test_families import build_tiny

G = 32


def _inputs(k: int, tokens: int = 512, seed: int = 0) -> torch.Tensor:
    """Correlated activations with a few channels far larger than the rest (as in LLMs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)
    x[:, :3] *= 25
    return x


def _int4_sym(w: torch.Tensor, ratio=1.0) -> torch.Tensor:
    """Symmetric int4 per group of G, written out: round(w / s) clamped to [-8, 7], s = max|w| / 7."""
    n, k = w.shape
    wg = w.reshape(n, k // G, G)
    s = (wg.abs().amax(-1, keepdim=True) * ratio / 7).clamp(min=1e-12)
    return (torch.clamp(torch.round(wg / s), -8, 7) * s).reshape(n, k)


def _output_error(x, w, wq, s=None) -> float:
    s = torch.ones(x.shape[1]) if s is None else s
    return ((x / s) @ wq.t() - x @ w.t()).square().sum().item()


# ------------------------------------------------------------------ the searches

def test_awq_scale_search_is_never_worse_than_no_scaling():
    """The search returns its best candidate on its loss, with alpha 0 (no scaling) among them;
    on activations with outlier channels scaling wins clearly."""
    x = _inputs(128)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0]
    alpha, s = search_scales(x, x.abs().mean(0), [w], alphas, lambda t: t, lambda t, _s: _int4_sym(t))
    none = _output_error(x, w, _int4_sym(w))
    chosen = _output_error(x, w, _int4_sym(w * s), s)
    assert chosen <= none
    mean = x.abs().mean(0)
    for a in alphas:                       # each candidate's factor, written out: mean|x|^a
        c = mean.pow(a)
        assert chosen <= _output_error(x, w, _int4_sym(w * c), c) * (1 + 1e-4), a
    assert alpha is not None and chosen < 0.9 * none


def test_awq_duo_candidates_are_the_two_sided_factors_and_never_lose():
    """With `duo` the search also tries s = mean|x|^a / mean(|w| / its group's max)^(1 - a),
    written out here per group of G: its choice is the best of all those candidates and of the
    one-sided ones, so never worse than the search without them."""
    x = _inputs(128, seed=4)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    w[:, 5] *= 6                            # a column that already uses its groups' range
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0]
    q = lambda t, _s: _int4_sym(t)          # noqa: E731
    one, s1 = search_scales(x, x.abs().mean(0), [w], alphas, lambda t: t, q)
    two, s2 = search_scales(x, x.abs().mean(0), [w], alphas, lambda t: t, q, duo=True, group_size=G)
    wg = w.abs().reshape(96, -1, G)
    w_mean = (wg / wg.amax(-1, keepdim=True)).reshape(96, 128).mean(0)
    cands = {a: x.abs().mean(0).pow(a) for a in alphas}
    cands.update({f"duo {a}": x.abs().mean(0).pow(a) / w_mean.pow(1 - a) for a in alphas if a < 1})
    errs = {a: _output_error(x, w, _int4_sym(w * c), c) for a, c in cands.items()}
    chosen = _output_error(x, w, _int4_sym(w * s2), s2)
    assert chosen <= min(errs.values()) * (1 + 1e-4)
    assert chosen <= _output_error(x, w, _int4_sym(w * s1), s1) * (1 + 1e-6)
    if isinstance(two, str):                # a two-sided winner: its factor up to a common scale
        ratio = s2 / cands[two]
        assert torch.allclose(ratio, ratio.mean().expand_as(ratio), rtol=1e-4)


def test_awq_scale_search_keeps_no_scaling_when_it_is_best():
    """With evenly sized activations and a quantizer that scaling cannot help (identity),
    no scaling (alpha None, s all ones) is kept: it is tried first and wins ties."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    alpha, s = search_scales(x, x.abs().mean(0), [w], [0.5, 1.0], lambda t: t,
                             lambda t, _s: torch.round(t * 8) / 8)
    if alpha is None:
        assert torch.equal(s, torch.ones(64))
    # whichever won, it is the best on the loss written out here
    cand = {None: torch.ones(64), **{a: x.abs().mean(0).pow(a) for a in (0.5, 1.0)}}
    errs = {a: _output_error(x, w, torch.round(w * c * 8) / 8, c) for a, c in cand.items()}
    assert errs[alpha] <= min(errs.values()) * (1 + 1e-4)


def test_clip_search_never_worse_than_min_max_per_group():
    """Per row and group the chosen ratio's output error (sum over tokens of that group's part
    of the product, squared) is at most min-max's, and the total is lower on outlier inputs."""
    x = _inputs(128, seed=4)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    w[:, 7] *= 6                                   # a weight outlier per row: clipping pays
    ratios = [1.0 - 0.3 * i / 12 for i in range(13)]
    scale, offset, ratio = search_clip(w, x, lambda t, r: numerics.weight_qparams(t, 4, G, True, r), 4, G, ratios)
    assert offset is None and ratio.shape == (64, 128 // G)
    assert all(min(abs(r - c) for c in ratios) < 1e-6 for r in ratio.unique().tolist())
    wq = (torch.clamp(torch.round(w / scale.repeat_interleave(G, 1)), -8, 7) * scale.repeat_interleave(G, 1))
    base = _int4_sym(w)

    def per_group(wd):
        e = (w - wd).reshape(64, 128 // G, G)
        xg = x.reshape(-1, 128 // G, G)
        return torch.einsum("tgi,ngi->tng", xg, e).square().sum(0)          # [n, groups]

    assert bool((per_group(wq) <= per_group(base) * (1 + 1e-5) + 1e-9).all())
    assert per_group(wq).sum() < 0.95 * per_group(base).sum()
    assert (ratio < 1).any() and (ratio >= 0.7 - 1e-6).all()


def test_gptq_with_zero_points_beats_asymmetric_rounding():
    """GPTQ on the asymmetric grid (given scales and zero points) lowers the layer's output error
    against plain asymmetric rounding with the same scales, and its integers stay in int4."""
    x = _inputs(128, tokens=1024, seed=6)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)) * 0.05 + 0.02
    scale, offset = numerics.weight_qparams(w, 4, G, symmetric=False)
    q, s = gptq_quantize(w, hessian(x), 4, G, scale=scale, offset=offset)
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and torch.equal(s, scale)
    per = lambda t: t.repeat_interleave(G, 1)                                 # noqa: E731
    deq = (q.float() - per(offset)) * per(scale)
    rtn = (torch.clamp(torch.round(w / per(scale)) + per(offset), -8, 7) - per(offset)) * per(scale)
    assert _output_error(x, w, deq) < 0.8 * _output_error(x, w, rtn)



def test_awq_final_scoring_reuses_one_hessian_per_group():
    """`choose_awq` (score: final, weight-only) rounds every candidate with D H D, D = diag(1/s),
    instead of the Hessian of x / s formed again: the same GPTQ codes (but for float ties)."""
    from ascend_quant.calibration.group import _plan, _round
    x = _inputs(128, tokens=1024, seed=8)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(9)) * 0.05
    s = torch.rand(128, generator=torch.Generator().manual_seed(10)) + 0.5
    recipe = recipes.preset("w4a16", G)
    xs = x / s
    plans = {"m": _plan("m", "W4A16", w * s, recipe, "layer", None, G, xs)}
    direct = _round(plans, {"W4A16": xs}, recipe)["m"]
    d = (1.0 / s).double()
    reused = _round(plans, {"W4A16": xs}, recipe, {"W4A16": hessian(x) * d[:, None] * d[None, :]})["m"]
    torch.testing.assert_close(reused[1], direct[1])
    assert (reused[0] != direct[0]).float().mean() < 1e-3

# ------------------------------------------------------------- asymmetric W4A16

def test_asymmetric_int4_qparams_and_pack_round_trip():
    """Zero points are integers in [-8, 7], each group's min and max are on the grid within half a
    step, every weight within half a step; W4A16 packs and unpacks q, scale and offset unchanged."""
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(8)) * 0.1 + 0.03
    scale, offset = numerics.weight_qparams(w, 4, G, symmetric=False)
    assert torch.equal(offset, offset.round()) and int(offset.min()) >= -8 and int(offset.max()) <= 7
    per = lambda t: t.repeat_interleave(G, 1)                                 # noqa: E731
    q = numerics.quantize(w, scale, 4, offset)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    deq = (q.float() - per(offset)) * per(scale)
    assert bool(((deq - w).abs() <= per(scale) / 2 + 1e-6).all())
    wg = w.reshape(16, -1, G)
    # 15 steps span the group's range (widened to 0): the asymmetric step is about half the symmetric one
    assert torch.allclose(scale * 15, wg.amax(-1).clamp(min=0) - wg.amin(-1).clamp(max=0), rtol=1e-6)
    ql = W4A16.from_scale(q, scale)
    ql.offset = offset
    back = W4A16.unpack(W4A16.pack(ql, torch.bfloat16))
    assert torch.equal(back.q, q) and torch.equal(back.scale, scale) and torch.equal(back.offset, offset)
    torch.testing.assert_close(back.dequantized(), deq, rtol=0, atol=0)


@pytest.mark.parametrize("text,match", [
    ("scheme: w8a16\nweights: {symmetric: false}\n", "zero points"),
    ("scheme: w4a16\nawq: {alphas: [1.5]}\n", "awq alphas"),
    ("scheme: w4a16\nawq: {clip_min: 0}\n", "clip_min"),
    ("scheme: w4a16\nawq: {grid: 3}\n", "unknown key"),
    ("scheme: w4a16\nawq: {score: gptq}\n", "awq.score"),
    ("scheme: w4a16\ngptq: {float_target_tokens: -1}\n", "float_target_tokens"),
    ("scheme: w4a16\ngptq: {hessian_tokens: many}\n", "hessian_tokens"),
])
def test_awq_and_weights_recipe_errors(tmp_path, text, match):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(recipes.RecipeError, match=match):
        recipes.load_recipe(path)


# -------------------------------------------------------------------- the fold

def _tiny_llama(dst):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(dst, safe_serialization=True)
    return dst


IDS = torch.tensor([[1, 17, 250, 33, 400, 5, 77, 140, 3, 99, 31, 8, 300, 301, 40, 41, 42, 7, 12, 500]])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_awq_fold_keeps_float_logits(tmp_path, family):
    """AWQ factors (alpha 0.5 from each group's own inputs) folded into every producer (RMSNorm,
    Gemma's (1 + w) norm, up_proj rows) leave the float model's logits unchanged (fp32)."""
    path = _tiny_llama(tmp_path / family) if family == "llama" else build_tiny(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(IDS).logits
    spec = spec_for_model(model)
    folded = 0
    for i, layer in enumerate(spec.layers(model)):
        for group in spec.layer_groups(i, model.config):
            if group.producer is None:
                continue
            seen = {}
            first = layer.get_submodule(group.linears[0])
            h = first.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].detach().clone()))
            with torch.no_grad():
                model(IDS)
            h.remove()
            s = numerics.awq_factors(seen["x"].reshape(-1, seen["x"].shape[-1]).abs().mean(0), 0.5)
            assert s.std() > 0.05                           # a real rescaling, not ones
            producer = layer.get_submodule(group.producer)
            apply_smoothing(producer, [layer.get_submodule(n) for n in group.linears], s, group.producer_kind,
                            group.producer_rows(producer.weight.shape[0]))
            folded += 1
    assert folded >= 3 * len(spec.layers(model))
    with torch.no_grad():
        got = model(IDS).logits
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-5


# --------------------------------------------------------------- the whole job

def test_calibrate_awq_asymmetric_w4a16_verifies_and_serves(tmp_path):
    """A tiny calibration with AWQ scaling (scored with the final rounding), clip search, GPTQ and
    zero points: verify accepts the checkpoint and notes where it is served, the zero points are
    stored, the report records the searches, and the reference model (reference and CPU kernels)
    computes what the format oracle computes from the dequantized weights."""
    out = tmp_path / "out"
    rec_path = tmp_path / "r.yaml"
    rec_path.write_text("scheme: w4a16\ngroup_size: 32\nmethod: gptq\n"
                        "awq: {alphas: [0.0, 0.5, 1.0], score: final}\nweights: {symmetric: false}\n")
    rec = recipes.load_recipe(rec_path)
    tiny = fixture_dir("tiny-qwen2-fp32")
    job.calibrate(str(tiny), out, rec, str(FIXTURES / "calib.jsonl"), num_samples=8, seq_len=64,
                  show_progress=False)
    report = verify(out)
    assert report.ok, report.problems
    assert any("zero points" in n and "MoE experts only" in n for n in report.notes), report.notes
    from safetensors.torch import load_file
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    offset = tensors["model.layers.0.mlp.up_proj.weight_offset"]
    assert offset.shape == tensors["model.layers.0.mlp.up_proj.weight_scale"].shape and bool((offset != 0).any())
    layers = json.loads((out / "ascend_quant_calibration.json").read_text())["layers"]
    assert set(layers[0]["awq_alphas"]) == {"qkv", "gate_up", "down"}
    assert all(0.7 - 1e-6 <= r <= 1.0 for r in layers[0]["clip_ratios"].values())
    assert "awq" in (out / "ascend_quant_recipe.yaml").read_text()
    with torch.no_grad():
        oracle = torch.log_softmax(load_oracle_model(out)(IDS[:, :16]).logits[0], -1)
        plain = torch.log_softmax(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()(
            IDS[:, :16]).logits[0], -1)
        assert (oracle - plain).abs().max() > TOLERANCE               # the oracle is not the float model
        # ... but close to it: zero points of the wrong sign or scales off by a step would not be
        assert ((oracle.exp() - plain.exp()).abs().sum(-1).max()) < 0.25
        for backend in ("reference", "cpu"):
            got = torch.log_softmax(load_reference_model(out, backend=backend)(IDS[:, :16]).logits[0], -1)
            assert (got - oracle).abs().max() <= TOLERANCE, backend


@pytest.mark.parametrize("scheme,extra", [("w4a8", ""), ("w4a16", "weights: {symmetric: false}\n")])
def test_awq_on_moe_experts_calibrates_and_verifies(tmp_path, scheme, extra):
    """MoE experts take AWQ too (down_proj through up_proj's rows; W4A8 experts per channel):
    the checkpoint verifies and stays close to the float model."""
    from moe_helpers import build_tiny_moe
    model_dir = build_tiny_moe("qwen3_moe", tmp_path / "moe")
    path = tmp_path / "r.yaml"
    path.write_text(f"scheme: {scheme}\ngroup_size: 32\nawq: {{alphas: [0.0, 0.5]}}\n{extra}")
    out = tmp_path / "out"
    job.calibrate(str(model_dir), out, recipes.load_recipe(path), str(FIXTURES / "calib.jsonl"), num_samples=8,
                  seq_len=64, show_progress=False)
    report = verify(out)
    assert report.ok, report.problems
    layers = json.loads((out / "ascend_quant_calibration.json").read_text())["layers"]
    assert any(k.startswith("mlp.experts.") for k in layers[1]["awq_alphas"]), layers[1]["awq_alphas"]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(IDS).logits
        got = load_reference_model(out)(IDS).logits
    # a loose sanity bound (4-bit, group 32, random weights): W4A8 measured 0.52, W4A16 0.50
    assert ((got - want).norm() / want.norm()).item() < 0.7
