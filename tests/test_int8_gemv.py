"""The CPU backend's integer GEMV for int8 activations (`native/wq_gemv.c`: wq_int8_gemv, through
the C++ operator `ascend_quant_cpu::int8_gemv_linear` or ctypes; `ASCEND_QUANT_CPU_GEMM=gemv`, the
default on CPUs without VNNI), on every GEMV build this CPU runs (AVX2 forced on wider CPUs).

The oracle is written out here: the integer product as an int64 matmul, the epilogue
`(((acc + quant_bias) * scale) * s_t) + bias` in float32 in that order, cast last, and numerics'
per-token quantizer (the kernel quantizes with its own C code). VPMADDUBSW's pair sums cannot
saturate with the operands the kernel chooses, so every comparison is bit for bit; weights
holding -128 (which VPSIGNB cannot negate) must stay off this path."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ascend_quant import numerics
from ascend_quant.runtime.kernels import cpu
from ascend_quant.runtime.kernels.cpu import GEMM_ENV, CpuBackend
from ascend_quant.runtime.kernels.reference import ReferenceBackend
from ascend_quant.schemes import PreparedLinear
from conftest import (assert_int8_epilogues, assert_quantized_inside, int8_oracle, int8_scheme_tensors,
                      rounding_boundaries)

ISAS = list(cpu.ISAS[cpu.ISAS.index(cpu.cpu_isa()):-1])        # this CPU's widest down to avx2
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=[(isa, via) for isa in ISAS for via in ("op", "ctypes")], ids="-".join)
def gemv(request, monkeypatch):
    isa, via = request.param
    monkeypatch.setenv(cpu.ISA_ENV, isa)
    monkeypatch.setenv(cpu.OP_ENV, "1" if via == "op" else "0")
    b = CpuBackend(gemm="gemv")
    assert b.gemm == "gemv" and b.gemv_lib is not None, "the GEMV kernel did not build (a C compiler is needed)"
    assert (b.int8_gemv_op is not None) == (via == "op"), cpu.native.WQ_OP.error
    return b


# k = 77: a padded 32-block; k = 4000: beyond every float path's exact range; m: register
# tiles of 1 to 8 tokens, several tiles, a prefill-sized call; n = 38: not a multiple of 4 channels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [77, 4000])
def test_int8_activations_are_exact(gemv, bits, k):
    """Full-range weights (int8 -128..127, int4 -8..7) and activations (int4 weights: x_q
    -128..127; int8: -127..127, what the dynamic quantizer gives; -128 with int8 weights is the
    next test's): the integer products exactly, then the epilogue with and without per-token
    scales, quant_bias and bias."""
    g = torch.Generator().manual_seed(k + bits)
    n, (lo, hi) = 38, (-128, 127) if bits == 8 else (-8, 7)
    w = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    w[0], w[1] = lo, hi
    x_lo = -127 if bits == 8 else -128
    x_all = torch.randint(x_lo, 128, (300, k), generator=g, dtype=torch.int8)
    x_all[0], x_all[1] = x_lo, 127
    ones = gemv.prepare_int8(w, torch.ones(n), bits=bits)
    assert ones.gemv is not None and ones.weight_t is None and ones.bits == bits
    scale = torch.rand(n, generator=g) * 0.01
    prep = gemv.prepare_int8(w, scale, bits=bits)
    for m in (1, 2, 3, 4, 5, 9, 17, cpu.GEMV_MAX_M, 300):   # 300: the float32 GEMMs of prefill
        x_q = x_all[:m]
        assert torch.equal(gemv.int8_matmul(x_q, ones).double(), (x_q.double() @ w.double().t()))
        assert_int8_epilogues(lambda x, **kw: gemv.int8_matmul(x, prep, **kw), x_q, w, scale, g)


@pytest.mark.parametrize("m", [1, 3, 9])
def test_an_activation_of_minus_128(gemv, m):
    """VPSIGNB cannot negate -128. int8 weights: |w| against x_q with w's sign (form 1) unless the
    call's x_q holds a -128, then |x_q| against w with x_q's sign (form 2) unless the weights hold
    a -128 too: that call is declined (status 3, y untouched) and the backend answers it exactly
    with the float32 GEMMs. int4 per channel (weight + 8 against x_q) takes everything. Static
    W8A8 hands in such activations; GPTQ writes such weights."""
    g = torch.Generator().manual_seed(m)
    n, k = 20, 77
    x_plain = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    x_min = x_plain.clone()
    x_min[m - 1, 7] = -128
    w_plain = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_min = w_plain.clone()
    w_min[0, 3] = -128
    w4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    cases = [(w_min, x_plain, 8, 0), (w_plain, x_min, 8, 0), (w_min, x_min, 8, 3), (w4, x_min, 4, 0)]
    for w, x_q, bits, want_status in cases:
        prep = gemv.prepare_int8(w, torch.ones(n), bits=bits)
        assert prep.gemv is not None and prep.gemv.full_range == bool((w == -128).any())
        exact = x_q.double() @ w.double().t()
        assert torch.equal(gemv.int8_matmul(x_q, prep).double(), exact)
        y = torch.full((m, n), 7.0)
        status = ctypes.c_int(0)
        q = prep.gemv
        gemv.gemv_lib.wq_int8_gemv(x_q.data_ptr(), 2, m, k, k, None, q.q.data_ptr(), bits, q.full_range, n, 1, q.gp,
                                   prep.scale.data_ptr(), None, None, y.data_ptr(), 0, n, 1, ctypes.byref(status))
        assert status.value == want_status, (bits, want_status)
        assert torch.equal(y, torch.full((m, n), 7.0)) if want_status else torch.equal(y.double(), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_inside_the_call(gemv, dtype, bits):
    """Float activations quantized per token inside the call: numerics' quantizer bit for bit
    (rows on x / s_t rounding boundaries, an all-zero row), then the exact product and epilogue;
    3-D input keeps its leading shape."""
    x = rounding_boundaries(40, 1).to(dtype)
    x[3] = 0
    n, k = 70, x.shape[1]
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) if bits == 8 else \
        torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    assert_quantized_inside(gemv, x, w, bits, g)


def test_two_threads_give_one_threads_result(gemv):
    g = torch.Generator().manual_seed(11)
    m, n, k = 40, 1030, 576       # the kernel (at most GEMV_MAX_M tokens), its OpenMP loop
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    prep = gemv.prepare_int8(w, scale)
    torch.set_num_threads(1)
    one = gemv.int8_matmul_dynamic(x, prep)
    torch.set_num_threads(2)
    two = gemv.int8_matmul_dynamic(x, prep)
    x_q, s_t = numerics.quantize_activation_dynamic(x)
    assert torch.equal(one, int8_oracle(x_q, w, scale, s_t=s_t, out_dtype=torch.bfloat16))
    assert torch.equal(two, one)


@pytest.mark.parametrize("scheme", ["W8A8_DYNAMIC", "W4A8_DYNAMIC", "W8A8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_schemes_equal_the_reference_and_trace(gemv, scheme, dtype):
    """The three int8-activation schemes on the integer GEMV equal the reference backend bit for
    bit. With the operators all three are traceable (the dynamic ones: one operator per Linear,
    the quantizer inside; static W8A8: the `quant_static` operator, then the GEMV's): a fullgraph
    dynamic torch.compile gives the eager outputs for 1 to 70 tokens. Nothing through ctypes is."""
    g = torch.Generator().manual_seed(len(scheme))
    n, k = 40, 754
    t = int8_scheme_tensors(scheme, g, n, k)
    pl = PreparedLinear.build(scheme, t, backend=gemv, dtype=dtype)
    ref = PreparedLinear.build(scheme, t, backend=ReferenceBackend(), dtype=dtype)
    gemv.finalize_linear(pl, dtype, scheme != "W8A8")
    assert pl.prepared.gemv is not None
    traced = gemv.int8_gemv_op is not None and (scheme != "W8A8" or gemv.static_ops is not None)
    assert gemv.traceable(pl) == traced
    bias = None if scheme == "W8A8" else torch.randn(n, generator=g).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: pl(x, bias), fullgraph=True, dynamic=True) if traced else None
    for m in (1, 7, 33, 70):
        x = rounding_boundaries(m, seed=m)[:, :k].to(dtype)
        eager = pl(x, bias)
        assert torch.equal(eager, ref(x, bias)), (m, scheme)
        if traced:
            assert torch.equal(compiled(x), eager), (m, scheme)


def test_gemm_switch(monkeypatch):
    """`gemv` is the default int8 GEMM where neither AMX-INT8 nor VNNI runs; forced, it runs on any
    CPU with a GEMV build; with the GEMV off it is refused in one line when forced, and the
    default falls back to the float32 GEMMs."""
    monkeypatch.delenv(GEMM_ENV, raising=False)
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu, "cpu_has_vnni", lambda: False)
    monkeypatch.setattr(cpu, "cpu_has_amx_int8", lambda: False)
    assert cpu.default_gemm() == "gemv" and CpuBackend().gemm == "gemv"
    monkeypatch.setenv(cpu.ISA_ENV, "off")
    assert cpu.default_gemm() == "f32" and CpuBackend().gemm == "f32"
    with pytest.raises(ValueError, match="ASCEND_QUANT_CPU_GEMM=gemv needs the GEMV library"):
        CpuBackend(gemm="gemv")


@pytest.mark.parametrize("k", [256, 200])
def test_per_group_sums_are_exact(gemv, k):
    """Two-stage per-group W4A8's weights (int4 in groups of 64; k = 200 in groups of 8, each
    padded to 32 in the layout) with power-of-two group scales: the int32 sum of each group
    times its scale, summed in float32, is exact here, so the kernel equals an int64 oracle bit for
    bit, 1 to 9 tokens, a -128 among the activations included."""
    g = torch.Generator().manual_seed(k)
    n, gs = 38, 8 if k == 200 else 64
    w4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    w4[0] = -8
    scale = 2.0 ** torch.randint(-1, 3, (n, k // gs), generator=g).float()
    prep = gemv.prepare_weight_only(w4, scale, None, 4)
    assert prep.gemv is not None and prep.gemv.scale.shape == (n, k // gs)
    x_q = torch.randint(-127, 128, (10, k), generator=g, dtype=torch.int8)
    x_q[0] = -127
    x_q[9, 3] = -128        # rows 5-9: |x_q| against the weight with x_q's sign (form 2)
    want = x_q.double() @ (w4.double() * scale.double().repeat_interleave(gs, 1)).t()
    for rows in (slice(0, 1), slice(0, 2), slice(0, 3), slice(0, 5), slice(0, 9), slice(5, 10)):
        if gemv.int8_gemv_op is not None:
            got = gemv.int8_gemv_op(x_q[rows], None, prep.gemv.q, prep.gemv.scale, None, None,
                                    cpu.ISAS.index(gemv.isa), 4, False, cpu.GEMV_MAX_M, torch.float32)
        else:
            got = gemv._int8_gemv(x_q[rows], prep.gemv, prep.gemv.scale, None, None, None, torch.float32)
        assert torch.equal(got.double(), want[rows]), rows
