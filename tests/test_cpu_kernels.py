"""The CPU backend's C GEMV (`native/wq_gemv.c`) against the reference backend, on every
instruction set this CPU runs (the narrower builds forced through `ASCEND_QUANT_CPU_ISA`),
for token counts on both sides of `GEMV_MAX_M`.

Comparisons: int8 activations x int4 weights accumulate exactly, so W4A8 per-channel equals
the reference bit for bit (same float32 epilogue in the same order) and the bare integer
products equal an int64 matmul. The weight-only and two-stage per-group paths sum float
products in another order than the reference's GEMM: they agree within 1e-5 of the output's
magnitude (float32 output), or one bfloat16 rounding (bfloat16 output)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ascend_quant import numerics
from ascend_quant.runtime.kernels import cpu
from ascend_quant.runtime.kernels.cpu import GEMV_MAX_M, ISA_ENV, CpuBackend, cpu_isa
from ascend_quant.runtime.kernels.reference import ReferenceBackend
from ascend_quant.schemes import PreparedLinear
from conftest import int8_oracle, rounding_boundaries

REF = ReferenceBackend()
pytestmark = pytest.mark.usefixtures("one_thread")
ISAS = list(cpu.ISAS[cpu.ISAS.index(cpu_isa()):-1])        # this CPU's widest down to avx2
# register tiles 1-8, two tiles, the GEMM path (float32 activations; bfloat16 on the avx512bf16 and amx
# builds: their panel paths from 10 tokens on, tiles of 6 with tails of 4 and 1)
TOKENS = (1, 3, 5, 9, GEMV_MAX_M, GEMV_MAX_M + 3)


@pytest.fixture(params=[(isa, via) for isa in ISAS for via in ("op", "ctypes")], ids="-".join)
def backend(request, monkeypatch):
    """A cpu backend on one GEMV build, its weight-only Linears called through the C++ operator
    (`ascend_quant_cpu::wq_linear`, the default) or from Python through ctypes (OP_ENV=0)."""
    isa, via = request.param
    monkeypatch.setenv(ISA_ENV, isa)
    monkeypatch.setenv(cpu.OP_ENV, "1" if via == "op" else "0")
    b = CpuBackend(gemm="f32")
    assert b.gemv_lib is not None, "the GEMV kernel did not build (a C compiler is needed for these tests)"
    b.gemv_lib.wq_isa.restype = ctypes.c_int
    assert b.gemv_lib.wq_isa() == {"amx": 1024, "avx512bf16": 516, "avx512": 512, "avx2": 2}[isa]
    assert (b.wq_op is not None) == (via == "op"), cpu.native.WQ_OP.error
    return b


def test_threads_split_the_output_channels(backend):
    """A shape large enough for the OpenMP loop, on two threads, equals one thread's result."""
    g = torch.Generator().manual_seed(2)
    w_int, scale = numerics.quantize_weight(torch.randn(1030, 576, generator=g), 4, 64)
    prep = backend.prepare_weight_only(w_int, scale, None, 4, torch.float32)
    x = torch.randn(3, 576, generator=g)
    one = backend.weight_only_matmul(x, prep)
    torch.set_num_threads(2)
    assert torch.equal(backend.weight_only_matmul(x, prep), one)


def test_this_cpu_has_a_gemv_path():
    assert ISAS, f"no AVX2/AVX-512 on this CPU ({cpu_isa()}): the GEMV kernel cannot be tested here"


def _close(got, want, out_dtype):
    scale = want.abs().max().item() + 1e-6
    tol = 1e-5 if out_dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


# n = 38: not a multiple of the 4-channel row blocks; k = 77: not a multiple of any vector
# width (padded to 96); group 24: padded to 32 inside every group
@pytest.mark.parametrize("bits,n,k,group", [(8, 38, 77, 0), (8, 64, 160, 32), (8, 38, 72, 24),
                                            (4, 38, 78, 0), (4, 64, 256, 64), (4, 38, 72, 24),
                                            (8, 20, 2100, 0), (4, 20, 2304, 384)])   # k-chunks past 1024
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_gemv(backend, bits, n, k, group, asym, dtype):
    g = torch.Generator().manual_seed(bits * 1000 + k)
    w_int, scale = numerics.quantize_weight(torch.randn(n, k, generator=g) * 0.05, bits, group)
    offset = torch.randint(-3, 4, scale.shape, generator=g).float() if asym else None
    bias = torch.randn(n, generator=g)
    prep = backend.prepare_weight_only(w_int, scale, offset, bits, dtype)
    assert prep.gemv is not None and prep.weight_t is None        # only the integers are held
    ref = REF.prepare_weight_only(w_int, scale, offset, bits)
    for m in TOKENS:
        x = (torch.randn(m, k, generator=g) * 2).to(dtype)
        for b in (None, bias):
            got = backend.weight_only_matmul(x, prep, bias=b)
            assert got.dtype == dtype and got.shape == (m, n)
            _close(got, REF.weight_only_matmul(x, ref, bias=b), dtype)
    x3 = torch.randn(2, 3, k, generator=g).to(dtype)              # leading dims kept
    _close(backend.weight_only_matmul(x3, prep), REF.weight_only_matmul(x3, ref), dtype)


@pytest.mark.parametrize("bits,group,asym", [(8, 0, False), (4, 64, True)])
def test_bf16_prefill_spans(backend, bits, group, asym):
    """Prefill-sized bfloat16 batches, which the avx512bf16 and amx builds run on bfloat16
    panels (the others on float32 GEMMs): k large enough for several spans of tokens, a token
    tail (301 = 50 x 6 + 1) and a channel tail (70 = 2 x 32 + 6); two threads equal one."""
    g = torch.Generator().manual_seed(bits + group)
    n, k, m = 70, 2112, 301
    w_int, scale = numerics.quantize_weight(torch.randn(n, k, generator=g) * 0.05, bits, group)
    offset = torch.randint(-3, 4, scale.shape, generator=g).float() if asym else None
    bias = torch.randn(n, generator=g)
    prep = backend.prepare_weight_only(w_int, scale, offset, bits, torch.bfloat16)
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    want = REF.weight_only_matmul(x, REF.prepare_weight_only(w_int, scale, offset, bits), bias=bias)
    one = backend.weight_only_matmul(x, prep, bias=bias)
    _close(one, want, torch.bfloat16)
    torch.set_num_threads(2)
    assert torch.equal(backend.weight_only_matmul(x, prep, bias=bias), one)


def test_static_quantizer_is_numerics_bit_for_bit(backend):
    """Static W8A8's activation quantizer in C on each build (`wq_quant_static`): numerics'
    formula (1/s and the offset rounded to bf16, the product and the sum each rounded to float32,
    half to even, clamped to [-128, 127]) on inputs that land on every .5 boundary and one ulp
    either side, past both ends of the range, float32 and bfloat16, rows of 841 (a tail)."""
    s, o = torch.tensor([0.0371]), torch.tensor([-3.0])
    inv, off = numerics.static_activation_params(s, o)
    mid = ((torch.arange(-140, 140).float() + 0.5) - off) / inv
    x = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), torch.tensor([0.0])])
    x = torch.cat([x, x.flip(0) * 0.7]).reshape(2, -1)
    for xs in (x, x.to(torch.bfloat16), x.reshape(2, 1, -1)):
        got = backend.quantize_static(xs, s, o)
        assert got.dtype == torch.int8 and got.shape == xs.shape
        assert torch.equal(got, numerics.quantize_activation_static(xs, s, o))


@pytest.mark.parametrize("terms", ["qbias", "qbias+bias", "pertoken+bias", "none"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_epilogue_is_the_oracle_bit_for_bit(backend, terms, out_dtype):
    """The int8 GEMM's float32 epilogue in C on each build (`wq_int8_epilogue`, after the exact
    int32 sums of the float32 k-chunks here): ((acc + quant_bias) * scale) * s_t + bias in that
    order, cast last, equal to the written-out oracle; n = 37 (a tail on every vector width)."""
    g = torch.Generator().manual_seed(len(terms))
    n, k, m = 37, 300, 70
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 1e-3
    args = dict(qbias=torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=torch.int32) if "qbias" in terms else None,
                s_t=torch.rand(m, 1, generator=g) if "pertoken" in terms else None,
                bias=torch.randn(n, generator=g) if "bias" in terms else None)
    got = backend.int8_matmul(x_q, backend.prepare_int8(w, scale), quant_bias=args["qbias"],
                              pertoken_scale=args["s_t"], bias=args["bias"], out_dtype=out_dtype)
    assert torch.equal(got, int8_oracle(x_q, w, scale, out_dtype=out_dtype, **args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_outputs(backend, dtype):
    """Outputs of 4 MiB and more, which the amx build writes around the cache (streaming
    stores of whole lines), with a channel tail (n % 32) and a token tail (m % 32), equal the
    reference within the same tolerance as small ones."""
    g = torch.Generator().manual_seed(11)
    n, k = 2056, 64
    m = (5 << 20) // (n * (4 if dtype == torch.float32 else 2)) | 1
    w_int, scale = numerics.quantize_weight(torch.randn(n, k, generator=g) * 0.05, 8, 0)
    prep = backend.prepare_weight_only(w_int, scale, None, 8, dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    _close(backend.weight_only_matmul(x, prep, bias=bias),
           REF.weight_only_matmul(x, REF.prepare_weight_only(w_int, scale, None, 8), bias=bias), dtype)


@pytest.mark.parametrize("k", [77, 4000])
def test_w4a8_per_channel_is_exact(backend, k):
    """Full-range int8 activations times int4 weights (extremes included), k beyond the
    reference's 1024-chunks: the integer products are exact, the epilogue is the reference's."""
    g = torch.Generator().manual_seed(k)
    n = 38
    w4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    w4[0] = -8
    x_q = torch.randint(-128, 128, (GEMV_MAX_M + 2, k), generator=g, dtype=torch.int8)
    x_q[0] = -128
    ones = backend.prepare_int8(w4, torch.ones(n), bits=4)
    assert ones.gemv is not None
    for m in TOKENS:
        got = backend.int8_matmul(x_q[:m], ones)
        assert torch.equal(got.double(), (x_q[:m].double() @ w4.double().t()))   # below 2^24: exact in float32
    scale = torch.rand(n, generator=g) * 0.01
    s_t = torch.rand(x_q.shape[0], 1, generator=g)
    bias = torch.randn(n, generator=g)
    prep, ref = backend.prepare_int8(w4, scale, bits=4), REF.prepare_int8(w4, scale)
    for m in TOKENS:
        for out_dtype in (torch.float32, torch.bfloat16):
            args = dict(pertoken_scale=s_t[:m], bias=bias, out_dtype=out_dtype)
            got = backend.int8_matmul(x_q[:m], prep, **args)
            want = REF.int8_matmul(x_q[:m], ref, **args)
            assert got.dtype == out_dtype and torch.equal(got, want)


@pytest.mark.parametrize("form", ["int4", "int8"])
def test_two_stage_w4a8_per_group(backend, form, monkeypatch):
    """Two-stage per-group W4A8: int8 activations times the dequantized int4 weight, the
    per-token scale after. int4 (kept packed, group scales): within a group each vector lane
    sums integer products exactly; the group scale multiplies the lane sums once, so only the
    float sums across groups round. int8 (the default): w4 * s2 held as one int8 weight per
    channel, the int8 path of W8A8_DYNAMIC (exact integer sums, one float epilogue)."""
    monkeypatch.setenv(cpu.TWO_STAGE_ENV, form)
    g = torch.Generator().manual_seed(5)
    n, k = 38, 256
    w = torch.randn(n, k, generator=g) * 0.05
    w4, s1, s2 = numerics.two_stage_int4(w, 64)
    t = dict(weight=numerics.pack_int4(w4),
             weight_scale=s1, weight_offset=torch.zeros_like(s1),
             weight_scale_second=s2, weight_offset_second=torch.zeros_like(s2, dtype=torch.int64))
    mine = PreparedLinear.build("W4A8_DYNAMIC", t, backend=backend)
    assert mine.extra["per_group"] == (form == "int4")
    assert isinstance(mine.prepared, cpu.CpuWeightOnly if form == "int4" else cpu.CpuInt8Weight)
    if form == "int4":
        assert mine.prepared.gemv is not None
    theirs = PreparedLinear.build("W4A8_DYNAMIC", t, backend=REF)
    bias = torch.randn(n, generator=g)
    for m in TOKENS:
        x = torch.randn(m, k, generator=g)
        _close(mine(x, bias), theirs(x, bias), torch.float32)


def test_two_stage_as_int8_is_the_group_scaled_weight_exactly():
    """w4 * s2 with the channel scale bf16(s1) is w4 times the two-stage group scale, value for
    value (written out here), and the integer dot products with it are the group-scaled sums of
    those with w4; a non-integer s2 or a product outside int8 is declined."""
    g = torch.Generator().manual_seed(11)
    n, k, gs = 16, 128, 32
    w4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    s1 = torch.rand(n, generator=g) * 0.01 + 1e-3
    s2 = torch.randint(1, 16, (n, k // gs), generator=g).float()
    w8, s = numerics.two_stage_int8(w4, s1, s2)
    assert w8.dtype == torch.int8 and s.shape == (n,)
    s1b = s1.to(torch.bfloat16).float()
    group_scale = s2.repeat_interleave(gs, 1) * s1b[:, None]
    assert torch.equal(w8.float() * s[:, None], w4.float() * group_scale)
    x = torch.randint(-128, 128, (5, k), generator=g).double()
    per_group = sum((x[:, i:i + gs] @ w4[:, i:i + gs].double().t()) * s2[:, i // gs].double()
                    for i in range(0, k, gs))
    assert torch.equal(x @ w8.double().t(), per_group)
    assert numerics.two_stage_int8(w4, s1, s2 + 0.5) is None
    big = s2.clone()
    big[0, 0] = 17.0                                   # 17 * -8 = -136: outside int8
    w4_neg = w4.clone()
    w4_neg[0, 0] = -8
    assert numerics.two_stage_int8(w4_neg, s1, big) is None


def test_two_stage_switch_is_checked(monkeypatch):
    monkeypatch.setenv(cpu.TWO_STAGE_ENV, "int2")
    w4, s1, s2 = numerics.two_stage_int4(torch.randn(8, 64) * 0.05, 32)
    with pytest.raises(ValueError, match="ASCEND_QUANT_CPU_W4A8_GROUPED='int2'"):
        CpuBackend(gemm="f32").widen_two_stage(w4, s1, s2)


def test_isa_switch(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "sse")
    with pytest.raises(ValueError, match="ASCEND_QUANT_CPU_ISA=.sse.: use one of amx, avx512bf16, avx512, avx2, off"):
        CpuBackend(gemm="f32")
    monkeypatch.setenv(ISA_ENV, "off")          # the torch path: integers in the [k, n] layout
    b = CpuBackend(gemm="f32")
    assert b.gemv_lib is None
    w_int, scale = numerics.quantize_weight(torch.randn(40, 64) * 0.05, 4, 32)
    prep = b.prepare_weight_only(w_int, scale, None, 4)
    assert prep.gemv is None and prep.weight_t is not None
    x = torch.randn(3, 64)
    _close(b.weight_only_matmul(x, prep), REF.weight_only_matmul(x, REF.prepare_weight_only(w_int, scale, None, 4)),
           torch.float32)
    wider = cpu.ISAS[:cpu.ISAS.index(cpu_isa())]
    for isa in wider:                           # refused, not run into an illegal instruction
        monkeypatch.setenv(ISA_ENV, isa)
        with pytest.raises(ValueError, match=f"this CPU has no {isa}"):
            CpuBackend(gemm="f32")


def test_gemv_layout_round_trips():
    """What the GEMM path (more than GEMV_MAX_M tokens) reads back from the kernel's layout."""
    g = torch.Generator().manual_seed(1)
    for bits, k, groups in [(4, 72, 3), (4, 78, 1), (8, 77, 1), (8, 72, 3)]:
        lo, hi = numerics.qrange(bits)
        q = torch.randint(lo, hi + 1, (6, k), generator=g, dtype=torch.int8)
        gw = cpu.GemvWeight.build(q, torch.rand(6, groups), None, bits)
        assert gw.q.numel() * (2 if bits == 4 else 1) == 6 * groups * gw.gp
        assert torch.equal(gw.values(0, k), q) and torch.equal(gw.values(5, k - 7), q[:, 5:k - 7])


@pytest.mark.parametrize("k_tail", [0, 5])
def test_dynamic_quantizer_rounds_as_the_reference(backend, k_tail):
    """The C per-token quantizer equals numerics (IEEE division, half-to-even) bit for bit on
    rounding boundaries, with a vector tail (k not a multiple of 16), an all-zero row, and
    bfloat16 input."""
    x = rounding_boundaries(300, 1)
    x = torch.cat([x, x[:, 1:1 + k_tail]], 1)
    x[7] = 0
    q, s = backend.quantize_dynamic(x)
    rq, rs = REF.quantize_dynamic(x)
    assert torch.equal(s, rs) and s[7].item() == 1.0
    assert torch.equal(q, rq), f"{int((q != rq).sum())} of {q.numel()} values round differently"
    xb = (torch.randn(9, 3, 64 + k_tail) * torch.logspace(-3, 3, 9).reshape(9, 1, 1)).to(torch.bfloat16)
    q, s = backend.quantize_dynamic(xb)
    rq, rs = REF.quantize_dynamic(xb)
    assert q.shape == xb.shape and s.shape == (9, 3, 1)
    assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize("k", [48, 389])
def test_gated_product_quantizer_equals_multiply_then_quantize(backend, k):
    """`quantize_glu_dynamic(h)` (a MoE expert's [SiLU(gate), up] -> int8 product, one C pass)
    equals torch's product h[:, :k] * h[:, k:] quantized by the reference, bit for bit, in
    float32 and in bfloat16 (where the product is rounded to bfloat16 first, as torch does),
    with a vector tail and an all-zero row."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(70, 2 * k, generator=g) * torch.logspace(-2, 2, 70).reshape(70, 1)
    h[5, :k] = 0
    for dtype in (torch.float32, torch.bfloat16):
        hd = h.to(dtype)
        q, s = backend.quantize_glu_dynamic(hd)
        rq, rs = REF.quantize_dynamic(hd[:, :k] * hd[:, k:])
        assert torch.equal(s, rs) and s[5].item() == 1.0, dtype
        assert torch.equal(q, rq), (dtype, f"{int((q != rq).sum())} of {q.numel()} values differ")
