"""The format oracle is not vacuous: it reads the int4 packing as msModelSlim wrote it, it is not
the float model, and a small error in any one scale tensor moves it beyond the tolerance the vLLM
test holds the runtime to. No vLLM needed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import fixture_dir
from format_oracle import TOLERANCE, load_oracle_model, read_checkpoint, unpack_int4

TOKENS = torch.tensor([list(range(1, 24))])


def greedy_logprobs(model, tokens=TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax [positions, vocab], the argmax token at each position) under teacher forcing."""
    with torch.no_grad():
        lp = torch.log_softmax(model(tokens).logits[0].float(), -1)
    return lp, lp.argmax(-1, keepdim=True)


@pytest.mark.parametrize("name", ["v1_w8a16_w4a8", "v0_w4a8"])
def test_int4_reading_reproduces_msmodelslim_scale_bias(name):
    """scale_bias = 8 * sum_k w4[n, k] * scale over 1 or 16 chunks of k (section 2), computed by
    msModelSlim itself: an independent check of the nibble order and sign the oracle reads, per
    channel (v1) and two-stage per group with bf16-rounded scales (v0)."""
    tensors, _ = read_checkpoint(fixture_dir(name))
    prefixes = [k[: -len(".scale_bias")] for k in tensors if k.endswith(".scale_bias")]
    assert prefixes
    for p in prefixes:
        w4 = unpack_int4(tensors[f"{p}.weight"]).float()
        scale = tensors[f"{p}.weight_scale"].float()
        if f"{p}.weight_scale_second" in tensors:
            s2 = tensors[f"{p}.weight_scale_second"].bfloat16().float()
            scale = (s2 * scale.bfloat16().float()).repeat_interleave(w4.shape[1] // s2.shape[1], dim=1)
        scale = scale.expand_as(w4)
        stored = tensors[f"{p}.scale_bias"]
        ours = 8 * (w4 * scale).reshape(w4.shape[0], stored.shape[1], -1).sum(-1)
        torch.testing.assert_close(ours, stored, rtol=0, atol=1e-5, msg=p)


@pytest.mark.parametrize("name", ["v1_w8a8_static_c8", "v1_w8a8_dyn", "v1_w8a16_w4a8"])
def test_oracle_is_not_the_float_model(name):
    """A runtime that ignored quantization altogether would fail the vLLM test."""
    oracle, top = greedy_logprobs(load_oracle_model(fixture_dir(name)))
    float_model = AutoModelForCausalLM.from_pretrained(str(fixture_dir("tiny-qwen2-fp32")), dtype=torch.float32)
    plain, _ = greedy_logprobs(float_model.eval())
    assert (oracle.gather(1, top) - plain.gather(1, top)).abs().max() > TOLERANCE


# (fixture, tensor, how it is spoilt): one per scheme of the vLLM test's msModelSlim checkpoints
SPOILT = [
    ("v1_w8a8_static_c8", "model.layers.1.mlp.down_proj.input_scale", 1.05),
    ("v1_w8a8_static_c8", "model.layers.0.self_attn.k_proj.kv_cache_scale", 1.05),
    ("v1_w8a8_static_c8", "model.layers.1.self_attn.v_proj.kv_cache_scale", 1.05),
    ("v1_w8a8_dyn", "model.layers.0.mlp.down_proj.weight_scale", 1.05),
    ("v1_w8a8_dyn", "model.layers.1.post_attention_layernorm.bias", 0.05),   # msModelSlim's are 0: add
    ("v1_w8a16_w4a8", "model.layers.0.self_attn.o_proj.weight_scale", 1.05),
    ("v1_w8a16_w4a8", "model.layers.1.mlp.down_proj.weight_scale", 1.05),
]


@pytest.mark.parametrize("name, key, change", SPOILT, ids=[k for _, k, _ in SPOILT])
def test_one_spoilt_tensor_moves_the_oracle_beyond_tolerance(name, key, change, golden_copy):
    """A 5% error in one scale tensor (or a norm bias appearing) changes the log-probs of the
    oracle's greedy tokens by more than TOLERANCE, so the vLLM test would see such a misreading."""
    before, top = greedy_logprobs(load_oracle_model(fixture_dir(name)))
    folder = golden_copy(name)
    files = [f for f in folder.glob("*.safetensors") if key in load_file(f)]
    assert len(files) == 1
    state = load_file(files[0])
    state[key] = state[key] + change if key.endswith(".bias") else state[key] * change
    save_file(state, str(files[0]))
    after, _ = greedy_logprobs(load_oracle_model(folder))
    assert (after.gather(1, top) - before.gather(1, top)).abs().max() > TOLERANCE
