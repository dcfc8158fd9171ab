"""Phi-3 and GLM-4-0414: Linears fused on disk (qkv_proj, gate_up_proj) on tiny random models.

Smoothing through each spec's producers leaves the logits unchanged (down_proj's fold divides
only the up half of gate_up_proj), every scheme calibrates and verifies under the fused
names, and vLLM serves one W8A8 checkpoint with the int8 KV cache (C8) per family with the
reference model's greedy tokens and log-probs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from ascend_quant.arch import spec_for_model  # noqa: E402
from ascend_quant.calibration import job, recipe as recipes  # noqa: E402
from ascend_quant.calibration.smoothquant import apply_smoothing  # noqa: E402
from ascend_quant.formats.ascend import read_checkpoint  # noqa: E402
from ascend_quant.formats.inspect import format_summary, summarize  # noqa: E402
from ascend_quant.formats.verify import verify  # noqa: E402
from conftest import FIXTURES, fixture_dir  # noqa: E402

FAMILIES = ("phi3", "glm4")
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=512, max_position_embeddings=256, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _config(family: str):
    if family == "phi3":
        from transformers import Phi3Config
        return Phi3Config(**COMMON)
    from transformers import Glm4Config
    return Glm4Config(**COMMON, head_dim=32, partial_rotary_factor=0.5, attention_bias=True)


def _model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    with torch.no_grad():     # non-trivial norms and biases, so a wrong fold shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(30.0)    # decisive greedy choices (see runtime_helpers)
    return model


def save_tiny(family: str, d: Path) -> Path:
    """The tiny model of the family saved with the tiny-qwen2 tokenizer (also used by
    tests/test_vllm_ascend_layout.py)."""
    _model(family).save_pretrained(d)
    for f in fixture_dir("tiny-qwen2-fp32").iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {family: save_tiny(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def calib_jsonl():
    return str(FIXTURES / "calib.jsonl")


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_names_the_fused_linears(family):
    model = _model(family)
    spec = spec_for_model(model)
    assert spec.name == family
    assert "mlp.gate_up_proj" in spec.linear_names()
    assert ("self_attn.qkv_proj" in spec.linear_names()) == (family == "phi3")


@pytest.mark.parametrize("family", FAMILIES)
def test_output_norms_read_their_groups_output(family):
    """GLM-4's sandwich norms as the spec names them (Phi-3 has none): the norm's input is the
    group's Linear's output in a forward of the model."""
    from test_families import _check_output_norms
    model = _model(family)
    _check_output_norms(model, spec_for_model(model), torch.randint(3, 512, (1, 12)))


@pytest.mark.parametrize("family", FAMILIES)
def test_smoothing_through_every_producer_keeps_the_logits(family):
    model = _model(family)
    spec = spec_for_model(model)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        g = torch.Generator().manual_seed(2)
        for layer in spec.layers(model):
            for group in spec.groups:
                if group.producer is None:
                    continue
                producer = layer.get_submodule(group.producer)
                consumers = [layer.get_submodule(n) for n in group.linears]
                s = torch.exp(0.5 * torch.randn(consumers[0].in_features, generator=g))
                rows = group.producer_rows(producer.weight.shape[0]) \
                    if isinstance(producer, torch.nn.Linear) else slice(None)
                apply_smoothing(producer, consumers, s, rows=rows)
        got = model(ids).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, rel


def test_folding_into_all_of_gate_up_would_be_wrong():
    """The check above can fail: dividing gate's rows too changes the output."""
    model = _model("phi3")
    spec = spec_for_model(model)
    ids = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        layer = spec.layers(model)[0]
        apply_smoothing(layer.mlp.gate_up_proj, [layer.mlp.down_proj], torch.full((128,), 2.0),
                        rows=slice(0, 128))     # the gate half: wrong
        assert ((model(ids).logits - ref).norm() / ref.norm()).item() > 1e-3


SCHEMES = [("w8a8", None), ("w8a8-dynamic", None), ("w8a16", None), ("w4a16", 32), ("w4a8", 32)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme,group", SCHEMES, ids=[s for s, _ in SCHEMES])
def test_calibrate_every_scheme_verifies(tmp_path, tiny_dirs, calib_jsonl, family, scheme, group):
    from ascend_quant.runtime.reference_model import load_reference_model
    from transformers import AutoModelForCausalLM

    rec = recipes.preset(scheme, group)
    out = tmp_path / "out"
    job.calibrate(str(tiny_dirs[family]), out, rec, calib_jsonl, num_samples=8, seq_len=64,
                  show_progress=False)
    report = verify(out)
    assert report.ok, report.problems
    ckpt = read_checkpoint(out)
    want = recipes.normalize_scheme(scheme)
    assert ckpt.description["model.layers.1.mlp.gate_up_proj.weight"] == want
    assert "model.layers.1.mlp.up_proj.weight" not in ckpt.description
    qkv = "self_attn.qkv_proj" if family == "phi3" else "self_attn.k_proj"
    assert ckpt.description[f"model.layers.0.{qkv}.weight"] == want
    assert format_summary(summarize(ckpt))      # inspect reads the fused layout
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()(ids).logits
    got = load_reference_model(out)(ids).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < (0.25 if "4" in scheme else 0.08), rel


# served with the int8 KV cache (C8) on every layer: Phi-3 W8A8 static, GLM-4 W8A8_DYNAMIC
SERVED = {"phi3": "w8a8", "glm4": "w8a8-dynamic"}


@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_serves_w8a8_with_the_int8_kv_cache_like_the_reference(tmp_path, tiny_dirs, calib_jsonl, family):
    """One engine per family: the C8 scales of Phi-3's fused qkv_proj are written under the
    attention's `k_proj` / `v_proj` names (as vllm-ascend maps them, arch/phi3.py), verify
    accepts them, and vLLM's int8 paged cache gives the greedy tokens and log-probs of the
    reference forward with the same scales simulated.

    Static int8 activations and an int8 cache turn float differences in the last bit (vLLM's
    float ops and our C8 kernel against the reference's torch ones) into a whole step of one
    int8 value now and then, which later steps carry on. So one prompt may drift past
    LOGPROB_TOL once such a step has happened, within 10x; the others stay within it. Seen on an
    AMX Xeon, glm4: two prompts equal to 1e-5, the third exact for three steps, then off by
    0.0016-0.013 (the torch C8 path, ASCEND_QUANT_NATIVE=0, stayed within 2e-3 there)."""
    from test_vllm_runtime import LOGPROB_TOL, PROMPTS, reference_logprobs, run_engine

    from ascend_quant.runtime.reference_model import load_reference_model

    rec = recipes.preset(SERVED[family])
    rec.kv_cache = recipes.KVCache(method="absmax")
    out = tmp_path / "out"
    job.calibrate(str(tiny_dirs[family]), out, rec, calib_jsonl, num_samples=8, seq_len=64,
                  show_progress=False)
    report = verify(out)
    assert report.ok, report.problems
    ckpt = read_checkpoint(out)
    assert ckpt.meta.get("kv_cache_type") == "C8"
    width = COMMON["num_key_value_heads"] * (32 if family == "glm4" else COMMON["hidden_size"] // 2)
    for i in range(COMMON["num_hidden_layers"]):
        for p in ("k_proj", "v_proj"):
            assert ckpt.description[f"model.layers.{i}.self_attn.{p}.kv_cache_scale"] == "C8"
            assert ckpt.tensor(f"model.layers.{i}.self_attn.{p}.kv_cache_scale").shape == (width,)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():       # the scales bite: the simulated int8 cache moves the logits
        c8 = load_reference_model(out, torch.float32, kv_cache=True)(ids).logits
        plain = load_reference_model(out, torch.float32)(ids).logits
    assert (c8 - plain).abs().max() > 1e-4
    within = 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, run_engine(out)):
        ref = reference_logprobs(out, prompt, tokens)
        for i, t in enumerate(tokens):          # vLLM's greedy choice is the reference's (up to a tie)
            assert ref[i, t] >= ref[i].max() - LOGPROB_TOL, (family, prompt, i, t, ref[i].argmax().item())
        off = max(abs(lp - ref[i, t].item()) for i, (t, lp) in enumerate(zip(tokens, logprobs)))
        assert off < 10 * LOGPROB_TOL, (family, prompt, off)
        within += off < LOGPROB_TOL
    assert within >= len(PROMPTS) - 1, (family, within)


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_smooths_down_through_the_up_half(tmp_path, tiny_dirs, calib_jsonl, family):
    """down_proj smoothed (alpha forced): its factor lands in gate_up's up rows of the
    quantized Linear, and the checkpoint still tracks the float model."""
    from ascend_quant.runtime.reference_model import load_reference_model
    from transformers import AutoModelForCausalLM

    rec = recipes.preset("w8a8-dynamic")
    rec.smoothquant = recipes.SmoothQuant(alpha=0.5, smooth_down=True, alphas=[], group_alpha={"down": 0.9})
    rec.awq = None                        # the preset's AWQ would replace SmoothQuant on these unrotated models
    rec.ignore = ["lm_head"]
    out = tmp_path / "out"
    result = job.calibrate(str(tiny_dirs[family]), out, rec, calib_jsonl, num_samples=8, seq_len=64,
                           show_progress=False)
    assert all(r.alphas.get("down") == 0.9 for r in result.reports)
    assert verify(out).ok
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32).eval()(ids).logits
    got = load_reference_model(out)(ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 0.08


# ------------------------------------------------------------------ convert

def _mixed_recipe():
    """W8A8 static + C8, layer 1's attention W4A16 and MLP W4A8 (group 32): four schemes in one run."""
    rec = recipes.preset("w8a8")
    rec.group_size = 32
    rec.kv_cache = recipes.KVCache(method="absmax")
    rec.overrides = [recipes.Override("model.layers.1.self_attn.*", "w4a16"),
                     recipes.Override("model.layers.1.mlp.*", "w4a8")]
    return rec


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_the_fused_layout_both_ways(tmp_path, tiny_dirs, calib_jsonl, family):
    """Our fused checkpoint -> v1 for bf16 serving (deq_scale re-encoded) and -> compressed-tensors
    (C8 dropped: per-channel has no equivalent) and back: the fused names stay, every quantized
    Linear dequantizes bit for bit as before, and both Ascend outputs verify."""
    from test_convert import _assert_same_dequantized, _check_with_compressed_tensors_library

    from ascend_quant.formats.convert import convert, detect_layout
    src = tmp_path / "src"
    job.calibrate(str(tiny_dirs[family]), src, _mixed_recipe(), calib_jsonl, num_samples=4, seq_len=32,
                       show_progress=False)
    a = read_checkpoint(src)
    fused = ["model.layers.0.mlp.gate_up_proj.weight"] + (["model.layers.1.self_attn.qkv_proj.weight"]
                                                         if family == "phi3" else [])
    assert {a.description[k] for k in fused} <= {"W8A8", "W4A16"}
    bf16 = convert(src, tmp_path / "bf16", dtype="bf16")
    assert verify(bf16.out).ok and any("re-encoded" in n for n in bf16.notes)
    b = read_checkpoint(bf16.out)
    assert b.description == a.description
    _assert_same_dequantized(src, bf16.out)
    ct = convert(src, tmp_path / "ct", to="compressed-tensors", drop_kv_cache=True)
    assert detect_layout(ct.out) == "compressed-tensors"
    _assert_same_dequantized(src, ct.out)
    _check_with_compressed_tensors_library(ct.out)
    back = convert(ct.out, tmp_path / "back")
    report = verify(back.out)
    assert report.ok, report.problems
    _assert_same_dequantized(src, back.out)
    c = read_checkpoint(back.out)
    assert all(k in c.description for k in fused) and "model.layers.0.mlp.up_proj.weight" not in c.description
    assert {k: v for k, v in a.description.items() if "kv_cache" not in k} == c.description


@pytest.mark.parametrize("family", FAMILIES)
def test_library_compressed_tensors_of_a_fused_family_converts(tmp_path, tiny_dirs, family):
    """A compressed-tensors checkpoint the library writes for the fused names (targets qkv_proj /
    gate_up_proj) with an int8 per-tensor KV cache -> Ascend: C8 under the attention's k_proj /
    v_proj names, the ints and scales carried over, and back to the same file."""
    from safetensors.torch import load_file
    from test_convert import build_ct_model

    from ascend_quant import numerics
    from ascend_quant.formats import compressed_tensors as ctf
    from ascend_quant.formats.convert import convert, dequantized_weights
    attn = "qkv|o" if family == "phi3" else "q|k|v|o"
    int8 = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
    int4 = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    token = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    groups = {
        "group_0": {"targets": [rf"re:model\.layers\.0\.self_attn\.({attn})_proj$"], "weights": int8,
                    "input_activations": dict(num_bits=8, type="int", symmetric=False, strategy="tensor",
                                              dynamic=False)},
        "group_1": {"targets": [r"re:model\.layers\.0\.mlp\.(gate_up|down)_proj$"], "weights": int8,
                    "input_activations": token},
        "group_2": {"targets": [rf"re:model\.layers\.1\.self_attn\.({attn})_proj$"], "weights": int4},
        "group_3": {"targets": [r"re:model\.layers\.1\.mlp\.(gate_up|down)_proj$"], "weights": int4,
                    "input_activations": token},
    }
    kv = dict(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
    ct_dir = build_ct_model(tiny_dirs[family], tmp_path / "ct", groups, kv, {"k_scale": 0.05, "v_scale": 0.01})
    asc = convert(ct_dir, tmp_path / "asc")
    report = verify(asc.out)
    assert report.ok, report.problems
    ckpt = read_checkpoint(asc.out)
    qkv = "self_attn.qkv_proj" if family == "phi3" else "self_attn.q_proj"
    assert ckpt.modules()[f"model.layers.0.{qkv}"].weight_scheme == "W8A8"
    assert ckpt.modules()["model.layers.0.mlp.gate_up_proj"].weight_scheme == "W8A8_DYNAMIC"
    assert ckpt.modules()[f"model.layers.1.{qkv}"].weight_scheme == "W4A16"
    assert ckpt.modules()["model.layers.1.mlp.gate_up_proj"].weight_scheme == "W4A8_DYNAMIC"
    dst, src = ckpt.tensors(), ctf.read_compressed_tensors(ct_dir).tensors()
    width = COMMON["num_key_value_heads"] * (32 if family == "glm4" else COMMON["hidden_size"] // 2)
    for i in range(2):
        assert torch.equal(dst[f"model.layers.{i}.self_attn.k_proj.kv_cache_scale"], torch.full((width,), 0.05))
        assert torch.equal(dst[f"model.layers.{i}.self_attn.v_proj.kv_cache_scale"], torch.full((width,), 0.01))
    before, after = dequantized_weights(ct_dir), dequantized_weights(asc.out)
    for prefix, w in before.items():
        if ckpt.modules()[prefix].weight_scheme == "W8A8":     # no weight scale kept: deq_scale from the source's
            deq = numerics.deq_scale(src[prefix + ".input_scale"], src[prefix + ".weight_scale"])
            assert torch.equal(dst[prefix + ".weight"], src[prefix + ".weight"])
            assert torch.equal(numerics.decode_deq_scale(dst[prefix + ".deq_scale"]), deq)
        else:
            assert torch.equal(after[prefix], w), prefix
    back = convert(asc.out, tmp_path / "back", to="compressed-tensors")
    a, b = load_file(ct_dir / "model.safetensors"), load_file(back.out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        if k.endswith(".weight_scale") and ".layers.0.self_attn." in k:    # recovered: the same deq_scale bits
            p = k.rpartition(".")[0]
            assert torch.equal(numerics.deq_scale(a[p + ".input_scale"], a[k]),
                               numerics.deq_scale(b[p + ".input_scale"], b[k]))
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
