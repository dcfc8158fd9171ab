"""Op-level tests: every kernel backend available here against the reference arithmetic,
and the npu backend's torch_npu wiring through the emulation module."""

from __future__ import annotations

import pytest
import torch

from ascend_quant import numerics
from ascend_quant.runtime import kernels
from ascend_quant.runtime.kernels import npu_emulation
from ascend_quant.runtime.kernels import cpu
from ascend_quant.runtime.kernels.cpu import CpuBackend, cpu_has_vnni, vllm_cpu_ops
from ascend_quant.runtime.kernels.npu import NpuBackend
from ascend_quant.runtime.kernels.reference import ReferenceBackend
from ascend_quant.schemes import PreparedLinear
from conftest import rounding_boundaries

REF = ReferenceBackend()
HAS_AMX = cpu.cpu_has_amx_int8() and cpu.cpu_isa() == "amx"       # our AMX-INT8 GEMM runs here
# the traceable dynamic int8 paths this CPU runs (neither: the test checks it is not traced)
TRACED_GEMMS = [g for g, ok in (("amx", HAS_AMX), ("onednn", cpu_has_vnni() and vllm_cpu_ops() is not None),
                                 ("gemv", True)) if ok]


def _backends():
    out = [pytest.param(CpuBackend(gemm="f32"), id="cpu-f32"), pytest.param(CpuBackend(gemm="int_mm"), id="cpu-int_mm")]
    if cpu_has_vnni() and vllm_cpu_ops() is not None:
        out.append(pytest.param(CpuBackend(gemm="onednn"), id="cpu-onednn"))
    if HAS_AMX:
        out.append(pytest.param(CpuBackend(gemm="amx"), id="cpu-amx"))
    out.append(pytest.param(NpuBackend(nz=True), id="npu-emulated"))
    return out


BACKENDS = _backends()


@pytest.fixture(autouse=True)
def _emulated_torch_npu():
    with npu_emulation.installed():
        yield


def _weights(n=96, k=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(7, k, generator=g) * 2.0
    x[3] = 0.0                              # an all-zero token
    x[5, 11] = 40.0                          # an outlier
    return w, x


@pytest.mark.parametrize("b", BACKENDS)
def test_quantize_static(b):
    _, x = _weights()
    scale, offset = numerics.activation_qparams(x.min(), x.max() * 0.8)   # some clipping
    got = b.quantize_static(x, scale, offset)
    want = REF.quantize_static(x, scale, offset)
    assert got.dtype == torch.int8 and torch.equal(got, want)


@pytest.mark.parametrize("b", BACKENDS)
def test_quantize_dynamic(b):
    _, x = _weights()
    q, s = b.quantize_dynamic(x)
    rq, rs = REF.quantize_dynamic(x)
    assert s.shape == rs.shape == (7, 1)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert torch.equal(q, rq)


@pytest.mark.parametrize("b", BACKENDS)
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_int8_matmul(b, mode):
    w, x = _weights()
    w_q, s_w = numerics.quantize_weight(w, 8)
    bias = torch.randn(w.shape[0]) * 0.1
    if mode == "static":
        s_x, o_x = numerics.activation_qparams(x.min(), x.max())
        deq = numerics.deq_scale(s_x, s_w)
        qb = numerics.quant_bias(bias, deq, o_x, w_q)
        x_q = REF.quantize_static(x, s_x, o_x)
        args = dict(quant_bias=qb)
        scale = deq
    else:
        x_q, s_t = REF.quantize_dynamic(x)
        args = dict(pertoken_scale=s_t, bias=bias)
        scale = s_w
    got = b.int8_matmul(x_q, b.prepare_int8(w_q, scale), out_dtype=torch.float32, **args)
    want = REF.int8_matmul(x_q, REF.prepare_int8(w_q, scale), out_dtype=torch.float32, **args)
    # int32 accumulation is exact; only the float epilogue may round differently
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and the result approximates the float product
    ref_float = x @ w.t() + bias
    assert (got - ref_float).abs().max() < 0.05 * ref_float.abs().max()


@pytest.mark.skipif(not (cpu_has_vnni() and vllm_cpu_ops() is not None), reason="the oneDNN GEMM needs VNNI")
@pytest.mark.parametrize("m,k", [(1, 576), (9, 1536), (300, 2100)])
def test_static_w8a8_on_the_onednn_gemm_is_exact(m, k):
    """Static W8A8 (quant_bias in the int32 sums) on a VNNI CPU's oneDNN GEMM, which its oneDNN
    handler cannot serve: full-range int8 operands, k past the reference's 1024-chunks; bit for
    bit the reference's result in float32 and bfloat16."""
    b = CpuBackend(gemm="onednn")
    g = torch.Generator().manual_seed(m)
    n = 70
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_q[0], x_q[0] = -128, -128
    scale = torch.rand(n, generator=g) * 1e-4
    qb = torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=torch.int32)
    prep, ref = b.prepare_int8(w_q, scale), REF.prepare_int8(w_q, scale)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = b.int8_matmul(x_q, prep, quant_bias=qb, out_dtype=out_dtype)
        assert torch.equal(got, REF.int8_matmul(x_q, ref, quant_bias=qb, out_dtype=out_dtype))


@pytest.mark.parametrize("b", BACKENDS)
@pytest.mark.parametrize("bits,group", [(8, 0), (8, 32), (4, 32), (4, 0)])
@pytest.mark.parametrize("asym", [False, True])
def test_weight_only_matmul(b, bits, group, asym):
    w, x = _weights()
    w_int, scale = numerics.quantize_weight(w, bits, group)
    offset = None
    if asym:
        offset = torch.randint(-3, 4, scale.shape).float()
    bias = torch.randn(w.shape[0]) * 0.1
    got = b.weight_only_matmul(x, b.prepare_weight_only(w_int, scale, offset, bits, torch.float32), bias=bias)
    want = REF.weight_only_matmul(x, REF.prepare_weight_only(w_int, scale, offset, bits), bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_exact_int8_matmul_is_exact_beyond_one_chunk():
    from ascend_quant.runtime.kernels.reference import exact_int8_matmul

    g = torch.Generator().manual_seed(3)
    x = torch.full((3, 2500), -128, dtype=torch.int8)          # worst case: every product 2^14
    w = torch.full((5, 2500), -128, dtype=torch.int8)
    x[1] = torch.randint(-128, 128, (2500,), generator=g, dtype=torch.int8)
    want = (x.long() @ w.long().t())
    assert want.abs().max() > 2**24                              # a plain float32 GEMM would round
    assert torch.equal(exact_int8_matmul(x, w).long(), want)


def test_module_functions_pick_a_backend_and_agree():
    w, x = _weights()
    w_q, s_w = numerics.quantize_weight(w, 8)
    x_q, s_t = kernels.quantize_dynamic(x)
    y = kernels.int8_matmul(x_q, w_q, s_w, pertoken_scale=s_t)
    y_ref = REF.int8_matmul(x_q, REF.prepare_int8(w_q, s_w), pertoken_scale=s_t)
    torch.testing.assert_close(y, y_ref)
    assert kernels.get_backend("cpu").name == "cpu"


def test_forced_backend_and_rejections(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.get_backend("cpu").name == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no kernel backend can run int8_matmul on cpu: cuda backend"):
            kernels.get_backend("cpu", "int8_matmul")


def test_npu_backend_passes_the_documented_layouts():
    """The wiring itself: what each torch_npu op receives."""
    seen = {}
    emu = npu_emulation.module()

    def spy(name):
        fn = getattr(emu, name)

        def wrapped(*a, **kw):
            seen[name] = (a, kw)
            return fn(*a, **kw)
        return wrapped

    import sys
    for name in ("npu_quantize", "npu_quant_matmul", "npu_weight_quant_batchmatmul"):
        setattr(sys.modules["torch_npu"], name, spy(name))
    b = NpuBackend()
    w, x = _weights()
    s_x, o_x = numerics.activation_qparams(x.min(), x.max())
    b.quantize_static(x, s_x, o_x)
    a, _ = seen["npu_quantize"]
    assert a[1].dtype == torch.bfloat16 and a[1].shape == (x.shape[-1],)       # 1/s, bf16, repeated to k
    assert a[1][0].item() == (1 / s_x).to(torch.bfloat16).item() and a[4:] == (-1, False)
    w_q, s_w = numerics.quantize_weight(w, 8)
    deq = numerics.deq_scale(s_x, s_w)
    b.int8_matmul(b.quantize_static(x, s_x, o_x), b.prepare_int8(w_q, deq),
                  quant_bias=torch.zeros(w.shape[0], dtype=torch.int32), out_dtype=torch.float16)
    a, kw = seen["npu_quant_matmul"]
    assert a[1].shape == (w.shape[1], w.shape[0])                                # w_q^T [k, n]
    assert a[2].dtype == torch.int64 and kw["bias"].dtype == torch.int32         # fp16: int64 deq_scale
    b.int8_matmul(b.quantize_static(x, s_x, o_x), b.prepare_int8(w_q, deq), out_dtype=torch.bfloat16)
    assert seen["npu_quant_matmul"][0][2].dtype == torch.float32                 # bf16: float32 deq_scale
    w4, s4 = numerics.quantize_weight(w, 4, 32)
    b.weight_only_matmul(x, b.prepare_weight_only(w4, s4, None, 4, torch.float32))
    a, kw = seen["npu_weight_quant_batchmatmul"]
    assert a[1].dtype == torch.int32 and a[1].shape == (w.shape[1], w.shape[0] // 8)
    assert kw["antiquant_scale"].shape == (w.shape[1] // 32, w.shape[0]) and kw["antiquant_group_size"] == 32


@pytest.mark.parametrize("b", BACKENDS)
@pytest.mark.parametrize("scheme", ["W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC", "W4A8_group"])
def test_quant_linear_matches_reference(b, scheme):
    """One Linear per scheme through PreparedLinear on each backend vs the reference backend."""
    w, x = _weights(n=64, k=128)
    bias = torch.randn(64) * 0.1
    t: dict[str, torch.Tensor] = {}
    name = scheme
    if scheme == "W8A8":
        w_q, s_w = numerics.quantize_weight(w, 8)
        s_x, o_x = numerics.activation_qparams(x.min(), x.max())
        deq = numerics.deq_scale(s_x, s_w)
        t = dict(weight=w_q, input_scale=s_x, input_offset=o_x, deq_scale=numerics.encode_deq_scale(deq, torch.float16),
                 quant_bias=numerics.quant_bias(bias, deq, o_x, w_q))
    elif scheme in ("W8A8_DYNAMIC", "W8A16"):
        w_q, s_w = numerics.quantize_weight(w, 8)
        t = dict(weight=w_q, weight_scale=s_w, weight_offset=torch.zeros_like(s_w))
    elif scheme == "W4A16":
        w4, s = numerics.quantize_weight(w, 4, 32)
        t = dict(weight=numerics.pack_int4(w4), weight_scale=s, weight_offset=torch.zeros_like(s))
    elif scheme == "W4A8_DYNAMIC":
        w4, s = numerics.quantize_weight(w, 4)
        t = dict(weight=numerics.pack_int4(w4), weight_scale=s, weight_offset=torch.zeros_like(s))
    else:
        name = "W4A8_DYNAMIC"
        w4, s1, s2 = numerics.two_stage_int4(w, 32)
        t = dict(weight=numerics.pack_int4(w4), weight_scale=s1, weight_offset=torch.zeros_like(s1),
                 weight_scale_second=s2, weight_offset_second=torch.zeros_like(s2, dtype=torch.int64))
    got = PreparedLinear.build(name, t, backend=b)(x, bias)
    want = PreparedLinear.build(name, t, backend=REF)(x, bias)
    if b.name == "npu" and name == "W4A8_DYNAMIC":
        # vllm-ascend serves dense W4A8 weight-only: within activation-rounding error of the reference
        assert (got - want).abs().max() < 0.05 * want.abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + bias
    assert (want - exact).norm() < (0.2 if "4" in scheme else 0.05) * exact.norm()


# ------------------------------------------------------------------ the CPU GEMM switch

def test_cpu_gemm_switch_forces_a_path(monkeypatch):
    """ASCEND_QUANT_CPU_GEMM picks the path every layer built afterwards uses (documented in the
    README), so the exact-f32 path is served and tested on VNNI machines as well."""
    from ascend_quant.runtime.kernels.cpu import GEMM_ENV

    monkeypatch.setenv(GEMM_ENV, "f32")
    assert kernels.get_backend("cpu", "int8_matmul").gemm == "f32"
    monkeypatch.setenv(GEMM_ENV, "int_mm")
    assert kernels.get_backend("cpu", "int8_matmul").gemm == "int_mm"
    monkeypatch.setenv(GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="ASCEND_QUANT_CPU_GEMM='fast'"):
        kernels.get_backend("cpu", "int8_matmul")
    monkeypatch.delenv(GEMM_ENV)
    if HAS_AMX:
        expected = "amx"
    else:
        expected = "onednn" if cpu_has_vnni() and vllm_cpu_ops() is not None else "gemv"
    assert kernels.get_backend("cpu", "int8_matmul").gemm == expected


def test_onednn_is_refused_without_vnni(monkeypatch):
    """oneDNN's s8 x s8 GEMM saturates int16 pair sums on CPUs without VNNI: never chosen there,
    not even when asked for."""
    from ascend_quant.runtime.kernels import cpu

    monkeypatch.setattr(cpu, "cpu_has_vnni", lambda: False)
    monkeypatch.setattr(cpu, "cpu_has_amx_int8", lambda: False)    # no CPU has AMX-INT8 without VNNI
    assert cpu.default_gemm() == "gemv"
    with pytest.raises(ValueError, match="needs vLLM's CPU ops and a CPU with VNNI"):
        CpuBackend(gemm="onednn")


def test_dynamic_quantizer_has_no_value_branch():
    """The C per-token quantizer: an all-zero row gets scale 1 and zeros, like the reference
    (no branch on the values in Python), and the result is the same under torch.compile."""
    x = torch.randn(5, 64)
    x[2] = 0
    b = CpuBackend(gemm="f32")
    q, s = b.quantize_dynamic(x)
    q_ref, s_ref = REF.quantize_dynamic(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and s[2].item() == 1.0
    qc, sc = torch.compile(b.quantize_dynamic, fullgraph=False)(x)
    assert torch.equal(qc, q) and torch.equal(sc, s)


@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, False), (torch.bfloat16, True),
                                                 (torch.float32, False)])
def test_finalized_int8_linear_keeps_one_copy(out_dtype, with_bias):
    """A vLLM layer's W8A8_DYNAMIC weight, finalized for its output dtype and bias, leaves the
    integers to oneDNN's prepacked copy (where oneDNN serves: VNNI CPUs) and gives the same
    outputs as before; a float32-finalized weight still serves bfloat16 calls (cast last)."""
    g = torch.Generator().manual_seed(3)
    w_q, s = numerics.quantize_weight(torch.randn(48, 96, generator=g), 8)
    t = {"weight": w_q, "weight_scale": s.float(), "weight_offset": torch.zeros_like(s)}
    b = CpuBackend()
    pl = PreparedLinear.build("W8A8_DYNAMIC", t, backend=b, dtype=out_dtype)
    x = torch.randn(5, 96, generator=g).to(out_dtype)
    bias = torch.randn(48, generator=g).to(out_dtype) if with_bias else None
    before = pl(x, bias)
    b.finalize_linear(pl, out_dtype, with_bias)
    assert pl.prepared.holds_integers() == (not b.use_onednn)
    assert torch.equal(pl(x, bias), before)
    ref = PreparedLinear.build("W8A8_DYNAMIC", t, backend=ReferenceBackend(), dtype=out_dtype)
    assert torch.equal(pl(x, bias), ref(x, bias))
    if out_dtype == torch.float32 or with_bias:
        xb = x.to(torch.bfloat16)
        assert torch.equal(pl(xb, bias if bias is None else bias.to(torch.bfloat16)),
                           ref(xb, bias if bias is None else bias.to(torch.bfloat16)))


@pytest.mark.parametrize("scheme", ["W8A8_DYNAMIC", "W4A8_DYNAMIC"])
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.bfloat16, False), (torch.bfloat16, True),
                                                 (torch.float32, True)])
@pytest.mark.parametrize("gemm", [*TRACED_GEMMS, "f32"])
def test_traced_int8_linear_equals_the_eager_call(scheme, out_dtype, with_bias, gemm):
    """Where the cpu backend says a finalized dynamic int8 Linear is traceable (oneDNN, VNNI
    CPUs: torch ops; AMX-INT8 CPUs and our integer GEMV, every CPU: our operators, which quantize
    inside), torch.compile traces it whole (fullgraph: the C quantizer would break the graph) and
    gives the eager call's outputs bit for bit (oneDNN: inductor's compiled quantizer), on
    rounding boundaries of x / s_t, for token counts 1 to 33 in one dynamic graph. The float32
    GEMMs (which keep integers and call C through Python) are not traceable."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 754                  # 754 of the 763 boundary columns: a vector tail
    w_q, s = numerics.quantize_weight(torch.randn(n, k, generator=g), 4 if scheme == "W4A8_DYNAMIC" else 8)
    t = {"weight": numerics.pack_int4(w_q) if scheme == "W4A8_DYNAMIC" else w_q, "weight_scale": s.float(),
         "weight_offset": torch.zeros_like(s)}
    b = CpuBackend(gemm=gemm)
    pl = PreparedLinear.build(scheme, t, backend=b, dtype=out_dtype)
    ref = PreparedLinear.build(scheme, t, backend=REF, dtype=out_dtype)
    b.finalize_linear(pl, out_dtype, with_bias)
    if gemm == "f32":
        assert not b.traceable(pl)
        return
    assert b.traceable(pl)
    bias = torch.randn(n, generator=g).to(out_dtype) if with_bias else None
    torch._dynamo.reset()           # one code object for every parameter set: no recompile limit
    compiled = torch.compile(lambda x: pl(x, bias), fullgraph=True, dynamic=True)
    for m in (1, 7, 33):
        x = rounding_boundaries(m, seed=m)[:, :k].to(out_dtype)
        eager = pl(x, bias)
        assert torch.equal(compiled(x), eager), (scheme, out_dtype, m)
        torch.testing.assert_close(eager, ref(x, bias), rtol=1e-5, atol=1e-3)    # oneDNN's bias epilogue rounds its own way


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemm", [g for g in TRACED_GEMMS if g != "amx"])
def test_traced_static_w8a8_equals_the_eager_call(out_dtype, gemm):
    """Static W8A8 on the oneDNN GEMM (VNNI CPUs) and the integer GEMV (every CPU) is traceable:
    its quantizer is the `quant_static` operator, so the compiled graph rounds x * (1/s) + o as
    the eager call does (numerics' torch ops, traced, became one FMA in inductor, which moved
    values on a .5 boundary: a different greedy token once). Inputs on every boundary of the
    quantizer and one ulp either side; 1 to 70 tokens (the GEMV's prefill side too) in one
    dynamic graph; compiled = eager = the reference, bit for bit."""
    g = torch.Generator().manual_seed(7)
    s_x, o_x = torch.tensor([0.0371]), torch.tensor([-3.0])
    inv, off = numerics.static_activation_params(s_x, o_x)
    mid = ((torch.arange(-140, 140).float() + 0.5) - off) / inv
    base = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    n, k = 40, base.numel()
    w_q, s_w = numerics.quantize_weight(torch.randn(n, k, generator=g) * 0.05, 8)
    deq = numerics.deq_scale(s_x, s_w)
    bias = torch.randn(n, generator=g)
    t = dict(weight=w_q, input_scale=s_x, input_offset=o_x, deq_scale=numerics.encode_deq_scale(deq, torch.float16),
             quant_bias=numerics.quant_bias(bias, deq, o_x, w_q))
    b = CpuBackend(gemm=gemm)
    pl = PreparedLinear.build("W8A8", t, backend=b, dtype=out_dtype)
    ref = PreparedLinear.build("W8A8", t, backend=REF, dtype=out_dtype)
    assert b.traceable(pl)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: pl(x, None), fullgraph=True, dynamic=True)
    for m in (1, 7, 70):
        x = torch.stack([base.roll(7 * i) for i in range(m)]).to(out_dtype)
        eager = pl(x, None)
        assert torch.equal(compiled(x), eager), (gemm, out_dtype, m)
        assert torch.equal(eager, ref(x, None)), (gemm, out_dtype, m)


@pytest.mark.parametrize("scheme,bits,group,asym", [("W8A16", 8, 0, False), ("W4A16", 4, 64, True),
                                                    ("W4A8_DYNAMIC", 4, 64, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_traced_weight_only_linear_equals_the_eager_call(scheme, bits, group, asym, dtype):
    """Weight-only Linears (and two-stage W4A8, whose int4 product is the same kernel) held in
    the GEMV layout are traceable where the C++ operator `ascend_quant_cpu::wq_linear` is loaded:
    torch.compile traces them whole (fullgraph, one dynamic graph for 1 to 70 tokens, the GEMV
    and the GEMM side of the operator's token threshold) and gives the eager call's outputs bit
    for bit, which agree with the reference within the float-summation tolerance."""
    g = torch.Generator().manual_seed(bits + group)
    n, k = 48, 256
    w = torch.randn(n, k, generator=g) * 0.05
    if scheme == "W4A8_DYNAMIC":
        w4, s1, s2 = numerics.two_stage_int4(w, group)
        t = dict(weight=numerics.pack_int4(w4), weight_scale=s1, weight_offset=torch.zeros_like(s1),
                 weight_scale_second=s2, weight_offset_second=torch.zeros_like(s2, dtype=torch.int64))
    else:
        q, s = numerics.quantize_weight(w, bits, group)
        off = torch.randint(-2, 3, s.shape, generator=g).float() if asym else torch.zeros_like(s)
        t = dict(weight=numerics.pack_int4(q) if bits == 4 else q, weight_scale=s.float(), weight_offset=off)
    b = CpuBackend()
    pl = PreparedLinear.build(scheme, t, backend=b, dtype=dtype)
    ref = PreparedLinear.build(scheme, t, backend=REF, dtype=dtype)
    assert b.wq_op is not None, "the C++ operator did not build: " + str(kernels.cpu.native.WQ_OP.error)
    if b.use_onednn and isinstance(pl.prepared, cpu.CpuInt8Weight):
        # two-stage W4A8 held as int8 per channel on a VNNI CPU without AMX: the oneDNN GEMM,
        # traceable once vLLM's loader has finalized it to its one handler (as in a vLLM layer)
        assert not b.traceable(pl)
        b.finalize_linear(pl, dtype, has_bias=True)
    assert b.traceable(pl)
    bias = torch.randn(n, generator=g).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: pl(x, bias), fullgraph=True, dynamic=True)
    for m in (1, 7, 70):
        x = (torch.randn(m, k, generator=g) * 2).to(dtype)
        eager = pl(x, bias)
        assert torch.equal(compiled(x), eager), (scheme, dtype, m)
        want = ref(x, bias).float()
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(eager.float(), want, rtol=tol, atol=tol * want.abs().max().item())
