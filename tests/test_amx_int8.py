"""The CPU backend's AMX-INT8 Linear (`native/wq_gemv.c`: wq_int8_linear, through the C++ operator
`ascend_quant_cpu::int8_linear`; `ASCEND_QUANT_CPU_GEMM=amx`, the default on AMX-INT8 CPUs).

The oracle here is written out in this file: the integer product as an int64 matmul, the
epilogue `(((acc + quant_bias) * scale) * s_t) + bias` in float32 in that order, cast last, and
the per-token quantizer of `numerics` (the kernel quantizes with its own C code). TDPBSSD's
int32 sums are exact, so every comparison is bit for bit.

On CPUs without AMX-INT8 the path must be refused when forced and never chosen by default; the
kernel tests then check exactly that, since the instructions cannot run there."""

from __future__ import annotations

import pytest
import torch

from ascend_quant import numerics
from ascend_quant.runtime.kernels import cpu
from ascend_quant.runtime.kernels.cpu import GEMM_ENV, AmxInt8Weight, CpuBackend
from ascend_quant.runtime.kernels.reference import ReferenceBackend
from ascend_quant.schemes import PreparedLinear
from conftest import (assert_int8_epilogues, assert_quantized_inside, int8_oracle, int8_scheme_tensors,
                      rounding_boundaries)

HAS_AMX = cpu.cpu_has_amx_int8() and cpu.cpu_isa() == "amx"


@pytest.fixture
def amx(monkeypatch):
    """A cpu backend on the AMX-INT8 GEMM; on CPUs without it, the check that it is refused."""
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    monkeypatch.delenv(cpu.OP_ENV, raising=False)
    if not HAS_AMX:
        with pytest.raises(ValueError, match="ASCEND_QUANT_CPU_GEMM=amx needs a CPU with AMX-INT8"):
            CpuBackend(gemm="amx")
        assert cpu.default_gemm() != "amx"
        return None
    b = CpuBackend(gemm="amx")
    assert b.int8_op is not None, cpu.native.WQ_OP.error
    return b


def test_layout_round_trips():
    g = torch.Generator().manual_seed(0)
    for n, k in [(1, 1), (38, 77), (64, 128), (33, 200)]:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        a = AmxInt8Weight.build(q)
        assert a.wp.numel() == -(-n // 32) * 32 * -(-k // 64) * 64
        assert torch.equal(a.values(), q)
        # the first B tile: row r, column j holds in-features 4r..4r+3 of channel j
        padded = torch.zeros(32, 64, dtype=torch.int8)
        padded[:min(n, 32), :min(k, 64)] = q[:32, :64]
        assert torch.equal(a.wp[:1024].view(16, 16, 4), padded[:16].view(16, 16, 4).permute(1, 0, 2))


# n = 38 / 1030: not a multiple of the 32-channel blocks; k = 77: padded to 128; k = 4000:
# beyond every float path's exact range; m = 17, 33, 70: partial tiles of 16 tokens
@pytest.mark.parametrize("n,k", [(38, 77), (64, 576), (100, 4000)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 70])
def test_int8_activations_are_exact(amx, n, k, m):
    """Full-range int8 operands (-128 included): the integer products exactly, then the
    epilogue with and without per-token scales, quant_bias (static W8A8) and bias."""
    if amx is None:
        return
    g = torch.Generator().manual_seed(n * m + k)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = -128
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    x_q[0] = -128
    prep = amx.prepare_int8(w, torch.ones(n))
    assert prep.amx is not None and prep.weight_t is None
    assert torch.equal(amx.int8_matmul(x_q, prep).double(), (x_q.double() @ w.double().t()))
    scale = torch.rand(n, generator=g) * 0.01
    prep = amx.prepare_int8(w, scale)
    assert_int8_epilogues(lambda x, **kw: amx.int8_matmul(x, prep, **kw), x_q, w, scale, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_tail", [0, 5])
def test_quantized_inside_the_call(amx, dtype, k_tail):
    """Float activations quantized per token inside the operator: numerics' quantizer bit for bit
    (rows on x / s_t rounding boundaries, an all-zero row), then the exact product and epilogue;
    3-D input keeps its leading shape."""
    if amx is None:
        return
    x = rounding_boundaries(40, 1)
    x = torch.cat([x, x[:, 1:1 + k_tail]], 1).to(dtype)
    x[3] = 0
    n, k = 70, x.shape[1]
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    assert_quantized_inside(amx, x, w, 8, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_batches_and_two_threads(amx, dtype):
    """A prefill-sized call: several spans of tokens, outputs of more than 4 MiB (streamed
    around the cache), n not a multiple of 32; two threads give one thread's result."""
    if amx is None:
        return
    g = torch.Generator().manual_seed(11)
    m, n, k = 1100, 1030, 576
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    prep = amx.prepare_int8(w, scale)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx.int8_matmul_dynamic(x, prep)
        torch.set_num_threads(2)
        two = amx.int8_matmul_dynamic(x, prep)
    finally:
        torch.set_num_threads(before)
    x_q, s_t = numerics.quantize_activation_dynamic(x)
    assert torch.equal(one, int8_oracle(x_q, w, scale, s_t=s_t, out_dtype=dtype)) and torch.equal(two, one)


@pytest.mark.parametrize("scheme", ["W8A8_DYNAMIC", "W4A8_DYNAMIC", "W8A8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_schemes_equal_the_reference_and_trace(amx, scheme, dtype):
    """The three int8-activation schemes on the AMX GEMM equal the reference backend bit for bit.
    The dynamic ones are traceable (one operator per Linear, the quantizer inside): a fullgraph
    dynamic torch.compile gives the eager outputs for 1 to 70 tokens. Static W8A8 is not (its
    quantizer's multiply-add would be fused by inductor), so it stays one opaque op in vLLM."""
    if amx is None:
        return
    g = torch.Generator().manual_seed(len(scheme))
    n, k = 40, 754
    t = int8_scheme_tensors(scheme, g, n, k)
    pl = PreparedLinear.build(scheme, t, backend=amx, dtype=dtype)
    ref = PreparedLinear.build(scheme, t, backend=ReferenceBackend(), dtype=dtype)
    amx.finalize_linear(pl, dtype, scheme != "W8A8")
    assert pl.prepared.amx is not None and amx.traceable(pl) == (scheme != "W8A8")
    bias = None if scheme == "W8A8" else torch.randn(n, generator=g).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: pl(x, bias), fullgraph=True, dynamic=True)
    for m in (1, 7, 33, 70):
        x = rounding_boundaries(m, seed=m)[:, :k].to(dtype)
        eager = pl(x, bias)
        assert torch.equal(eager, ref(x, bias)), (m, scheme)
        if scheme != "W8A8":
            assert torch.equal(compiled(x), eager), (m, scheme)


def test_gemm_switch(monkeypatch):
    """`ASCEND_QUANT_CPU_GEMM=amx` is the default where AMX-INT8 runs and the amx GEMV build is
    selected; forcing a narrower GEMV build, or a CPU without AMX-INT8, leaves the previous
    default, and forcing amx there is refused in one line."""
    monkeypatch.delenv(GEMM_ENV, raising=False)
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    if HAS_AMX:
        assert cpu.default_gemm() == "amx" and CpuBackend().gemm == "amx"
        monkeypatch.setenv(cpu.ISA_ENV, "avx512bf16")
        assert cpu.default_gemm() != "amx"
        with pytest.raises(ValueError, match="needs a CPU with AMX-INT8, the amx GEMV build"):
            CpuBackend(gemm="amx")
        monkeypatch.delenv(cpu.ISA_ENV)
        monkeypatch.setenv(cpu.OP_ENV, "0")         # no C++ operator: the next path, not an error
        assert CpuBackend().gemm != "amx"
        monkeypatch.delenv(cpu.OP_ENV)
    monkeypatch.setattr(cpu, "cpu_has_amx_int8", lambda: False)
    assert cpu.default_gemm() != "amx"
    with pytest.raises(ValueError, match="needs a CPU with AMX-INT8"):
        CpuBackend(gemm="amx")
