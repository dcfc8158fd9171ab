// The weight-only quantized Linear as a torch operator (ascend-quant):
//
//     torch.ops.ascend_quant_cpu.wq_linear(x, q, scale, offset, bias, isa, bits, k, group_size, gp, max_m)
//
// y = x @ ((q - offset) * scale)^T + bias for the weights of `native/wq_gemv.c`'s layout
// (runtime/kernels/cpu.py: GemvWeight), in x's dtype. Being a C++ operator, it is called
// without Python: vLLM's compiled graph calls it directly with the layer's tensors, where our
// Python op (`ascend_quant::linear`) needs a Python call, a forward-context lookup and a ctypes
// call per Linear. The arithmetic is the C kernels', which this file does not contain: the
// instruction-set builds of wq_gemv.c are compiled and loaded by Python (native/__init__.py),
// which hands their entry points to `wq_op_register`, one slot per build (`isa`). The slot is a
// constant of a traced graph: a graph that vLLM's compile cache hands to another process finds
// it registered there as long as that process selects the same build (its layers' backend
// registers it while loading); otherwise the call fails naming the slot, never runs another build.
//
//   m <= max_m tokens: wq_gemv (mode 0) reads the integer weights once, converted in registers;
//   more tokens: float32 GEMMs (ATen's mm) over k-chunks that wq_dequant converts, the
//   algorithm of CpuBackend.weight_only_matmul's torch path.
//
// Beside it, the int8 x int8 Linear on AMX-INT8 tiles (W8A8_DYNAMIC, static W8A8, per-channel W4A8):
//
//     torch.ops.ascend_quant_cpu.int8_linear(x, pertoken, wp, scale, quant_bias, bias, n, out_dtype)
//
// over the amx build's wq_int8_linear (registered by Python through `wq_op_register_int8`),
// which quantizes float activations per token itself, so a traced dynamic Linear is this one call;
// and `int8_gemv_linear`, the same call over the integer GEMV of any build (wq_int8_gemv: AVX2's
// VPMADDUBSW, the int8 GEMM of CPUs without VNNI) for weights in the GEMV layout; static W8A8's
// quantizer `quant_static` and, for the oneDNN GEMM, `int_mm_linear` (ATen's _int_mm and a C
// epilogue), so that a traced static Linear is two calls that round as the reference does. And
//
//     torch.ops.ascend_quant_cpu.hadamard(x, signs, core, isa)
//
// an online input rotation x·Q (wq_hadamard: Walsh-Hadamard butterflies, the float32 x·Q of
// numerics.rotate_activation) for Linears stored with `input_rotation` signs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using gemv_fn = void (*)(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const void *w, int bits,
                         int64_t n, int64_t groups, int64_t gsz, int64_t gp, const float *scale,
                         const float *offset, const float *bias, const float *pertoken, int mode, void *y,
                         int ydt, int64_t ldy, int nthreads, int *status);
using dequant_fn = void (*)(const void *w, int bits, int64_t n, int64_t groups, int64_t gsz, int64_t gp,
                            const float *scale, const float *offset, int64_t start, int64_t end, float *out,
                            int64_t ldo, int nthreads);

constexpr int kSlots = 5;            // the builds' indices (cpu.py: ISAS)
gemv_fn g_gemv[kSlots] = {};
dequant_fn g_dequant[kSlots] = {};
constexpr int64_t kChunk = 1024;     // k-chunk of the large-batch path (reference.EXACT_F32_CHUNK)

const float *opt_ptr(const c10::optional<at::Tensor> &t) {
    return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// xf [m, k] float32 @ (the GEMV layout's weights, wq_dequant: (q - offset) * scale)^T, as
// float32 GEMMs (ATen's mm) over k-chunks of `step` in-features converted one at a time. With
// `exact_int` (per-channel integer weights, scale 1, step <= kChunk) each chunk's product is an
// integer below 2^24, held exactly in float32, and the chunks are summed as int32.
at::Tensor dequant_mm(int64_t isa, const at::Tensor &xf, const at::Tensor &q, int64_t bits, int64_t n, int64_t groups,
                      int64_t gsz, int64_t gp, const float *scale, const float *offset, int64_t step, bool exact_int) {
    const int64_t k = xf.size(1);
    at::Tensor w = at::empty({n, std::min(step, k)}, xf.options()), y;
    for (int64_t start = 0; start < k; start += step) {
        const int64_t end = std::min(start + step, k);
        at::Tensor wc = w.narrow(1, 0, end - start);
        g_dequant[isa](q.data_ptr(), (int)bits, n, groups, gsz, gp, scale, offset, start, end, wc.data_ptr<float>(),
                       w.stride(0), at::get_num_threads());
        at::Tensor part = at::mm(xf.narrow(1, start, end - start), wc.t());
        if (exact_int) part = part.to(at::kInt);
        y = start == 0 ? part : y.add_(part);
    }
    return y;
}

at::Tensor wq_linear(const at::Tensor &x, const at::Tensor &q, const at::Tensor &scale,
                     const c10::optional<at::Tensor> &offset, const c10::optional<at::Tensor> &bias, int64_t isa,
                     int64_t bits, int64_t k, int64_t group_size, int64_t gp, int64_t max_m) {
    TORCH_CHECK(isa >= 0 && isa < kSlots && g_gemv[isa] && g_dequant[isa],
                "ascend_quant_cpu::wq_linear: the GEMV build ", isa, " is not loaded in this process");
    TORCH_CHECK(x.size(-1) == k, "ascend_quant_cpu::wq_linear: x has ", x.size(-1), " in-features, the weight ", k);
    TORCH_CHECK(q.dtype() == at::kChar && q.is_contiguous() && scale.dtype() == at::kFloat && scale.is_contiguous(),
                "ascend_quant_cpu::wq_linear: q must be contiguous int8 and scale contiguous float32");
    TORCH_CHECK(!offset.has_value() || (offset->dtype() == at::kFloat && offset->is_contiguous()),
                "ascend_quant_cpu::wq_linear: offset must be contiguous float32");
    const int64_t n = q.size(0), groups = scale.size(1);
    const at::ScalarType out_dtype = x.scalar_type();
    at::Tensor x2 = x.reshape({-1, k});
    if (x2.scalar_type() != at::kFloat && x2.scalar_type() != at::kBFloat16) x2 = x2.to(at::kFloat);
    if (x2.stride(-1) != 1) x2 = x2.contiguous();
    const int64_t m = x2.size(0);
    c10::optional<at::Tensor> b;
    if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
    const int threads = at::get_num_threads();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(n);

    if (m <= max_m) {
        const bool bf16 = x2.scalar_type() == at::kBFloat16;
        at::Tensor y = at::empty({m, n}, x2.options());
        int status = 0;
        g_gemv[isa](x2.data_ptr(), bf16 ? 1 : 0, m, k, x2.stride(0), q.data_ptr(), (int)bits, n, groups, group_size,
                    gp, scale.data_ptr<float>(), opt_ptr(offset), opt_ptr(b), nullptr, 0, y.data_ptr(),
                    bf16 ? 1 : 0, n, threads, &status);
        TORCH_CHECK(status == 0, "ascend_quant_cpu::wq_linear: wq_gemv could not allocate its activation buffer");
        return (y.scalar_type() == out_dtype ? y : y.to(out_dtype)).view(shape);
    }
    // larger batches: float32 GEMMs over dequantized k-chunks (whole groups per chunk)
    at::Tensor y = dequant_mm(isa, x2.to(at::kFloat), q, bits, n, groups, group_size, gp, scale.data_ptr<float>(),
                              opt_ptr(offset), std::max(group_size, kChunk / group_size * group_size), false);
    if (b.has_value()) y.add_(*b);
    return y.to(out_dtype).view(shape);
}

// The arguments of an int8-activation Linear as its C kernels take them: x as [m, k] (int8, or
// float32 / bfloat16 to be quantized inside), the output y [m, n] in float32 or bfloat16, the
// optional tensors contiguous in the kernels' dtypes.
struct Int8Args {
    at::Tensor x2, y;
    c10::optional<at::Tensor> pt, qb, b;
    int64_t m;
    bool int8_in;
    at::ScalarType want;
    std::vector<int64_t> shape;
    int xdt() const { return int8_in ? 2 : x2.scalar_type() == at::kBFloat16 ? 1 : 0; }
    int ydt() const { return y.scalar_type() == at::kBFloat16 ? 1 : 0; }
    at::Tensor result() const { return (y.scalar_type() == want ? y : y.to(want)).view(shape); }
};

Int8Args int8_args(const char *op, const at::Tensor &x, const c10::optional<at::Tensor> &pertoken,
                   const c10::optional<at::Tensor> &quant_bias, const c10::optional<at::Tensor> &bias, int64_t n,
                   c10::optional<at::ScalarType> out_dtype) {
    Int8Args a;
    const int64_t k = x.size(-1);
    a.x2 = x.reshape({-1, k});
    a.int8_in = a.x2.scalar_type() == at::kChar;
    if (!a.int8_in && a.x2.scalar_type() != at::kFloat && a.x2.scalar_type() != at::kBFloat16) a.x2 = a.x2.to(at::kFloat);
    if (a.x2.stride(-1) != 1) a.x2 = a.x2.contiguous();
    a.m = a.x2.size(0);
    a.want = out_dtype.has_value() ? *out_dtype : (a.int8_in ? at::kFloat : x.scalar_type());
    a.y = at::empty({a.m, n}, a.x2.options().dtype(a.want == at::kBFloat16 ? at::kBFloat16 : at::kFloat));
    if (a.int8_in && pertoken.has_value()) a.pt = pertoken->to(at::kFloat).reshape({-1}).contiguous();
    if (quant_bias.has_value()) a.qb = quant_bias->to(at::kInt).contiguous();
    if (bias.has_value()) a.b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(!a.pt.has_value() || a.pt->numel() == a.m, op, ": one pertoken scale per token");
    a.shape.assign(x.sizes().begin(), x.sizes().end() - 1);
    a.shape.push_back(n);
    return a;
}

using int8_fn = void (*)(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *pertoken,
                        const int8_t *wp, int64_t n, int64_t kp, const float *scale, const int32_t *qbias,
                        const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status);
int8_fn g_int8 = nullptr;

// y = (((x_q @ w^T + quant_bias) * scale) * s_t) + bias on AMX-INT8 tiles (wq_gemv.c: wq_int8_linear)
// for weights in its layout (runtime/kernels/cpu.py: AmxInt8Weight, wp int8 [ceil(n/32) * 32 * kp]).
// x int8: x_q given, s_t = pertoken (none: no multiply), output out_dtype (default float32);
// x float32 / bfloat16: quantized per token inside the call (the reference's quantizer), output
// x's dtype unless out_dtype says otherwise.
at::Tensor int8_linear(const at::Tensor &x, const c10::optional<at::Tensor> &pertoken, const at::Tensor &wp,
                       const at::Tensor &scale, const c10::optional<at::Tensor> &quant_bias,
                       const c10::optional<at::Tensor> &bias, int64_t n, c10::optional<at::ScalarType> out_dtype) {
    TORCH_CHECK(g_int8, "ascend_quant_cpu::int8_linear: the amx build of the GEMV library is not loaded in this process");
    const int64_t k = x.size(-1), np = (n + 31) / 32 * 32, kp = wp.numel() / np;
    TORCH_CHECK(wp.dtype() == at::kChar && wp.is_contiguous() && kp * np == wp.numel() && kp % 64 == 0 && kp >= k,
                "ascend_quant_cpu::int8_linear: the packed weight does not hold ", n, " channels of ", k, " in-features");
    TORCH_CHECK(scale.dtype() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
                "ascend_quant_cpu::int8_linear: scale must be contiguous float32 [n]");
    const Int8Args a = int8_args("ascend_quant_cpu::int8_linear", x, pertoken, quant_bias, bias, n, out_dtype);
    int status = 0;
    g_int8(a.x2.data_ptr(), a.xdt(), a.m, k, a.x2.stride(0), a.pt.has_value() ? a.pt->data_ptr<float>() : nullptr,
           wp.data_ptr<int8_t>(), n, kp, scale.data_ptr<float>(), a.qb.has_value() ? a.qb->data_ptr<int32_t>() : nullptr,
           opt_ptr(a.b), a.y.data_ptr(), a.ydt(), n, at::get_num_threads(), &status);
    TORCH_CHECK(status != 1, "ascend_quant_cpu::int8_linear: could not allocate its activation buffer");
    TORCH_CHECK(status == 0, "ascend_quant_cpu::int8_linear: this CPU or process cannot run AMX-INT8");
    return a.result();
}

using int8_gemv_fn = void (*)(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *pertoken,
                             const void *w, int bits, int wfull, int64_t n, int64_t groups, int64_t gp,
                             const float *scale,
                             const int32_t *qbias, const float *bias, void *y, int ydt, int64_t ldy, int nthreads,
                             int *status);
using quant_fn = void (*)(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *scale,
                         int nthreads);
int8_gemv_fn g_int8_gemv[kSlots] = {};
quant_fn g_quant[kSlots] = {};

// The same Linear on the integer GEMV (wq_gemv.c: wq_int8_gemv, any build: AVX2 instructions) for
// weights in the GEMV layout (runtime/kernels/cpu.py: GemvWeight): q int8 [n, kp] or int4 pairs
// [n, kp / 2], scale float32 [n] (per channel) or [n, groups] (two-stage per-group W4A8: the group
// scales multiply each group's int32 sums; no quant_bias). The arguments and outputs as
// int8_linear's; full_range: the int8 weights hold a -128 (the kernel's choice of form needs it).
// More than max_m tokens (prefill), or int8 activations the kernel declines (status 3: an x_q of
// -128 with int8 weights holding -128): per channel, the exact float32 GEMMs over
// k-chunks of 1024 (reference.exact_int8_matmul's algorithm: ATen's mm on x_q and wq_dequant's
// integer values, every partial sum an integer below 2^24) and the reference's epilogue in ATen
// ops, in its order; per group, x_q times the dequantized weight (whole groups per chunk), then
// * s_t + bias, the reference's two-stage formula.
at::Tensor int8_gemv_linear(const at::Tensor &x, const c10::optional<at::Tensor> &pertoken, const at::Tensor &q,
                            const at::Tensor &scale, const c10::optional<at::Tensor> &quant_bias,
                            const c10::optional<at::Tensor> &bias, int64_t isa, int64_t bits, bool full_range,
                            int64_t max_m, c10::optional<at::ScalarType> out_dtype) {
    TORCH_CHECK(isa >= 0 && isa < kSlots && g_int8_gemv[isa] && g_quant[isa] && g_dequant[isa],
                "ascend_quant_cpu::int8_gemv_linear: the GEMV build ", isa, " is not loaded in this process");
    const int64_t k = x.size(-1), n = q.size(0), kp = q.size(1) * (bits == 4 ? 2 : 1);
    const int64_t groups = n > 0 ? scale.numel() / n : 1, gsz = k / groups, gp = kp / groups;
    TORCH_CHECK(scale.dtype() == at::kFloat && scale.is_contiguous() && scale.numel() == n * groups && groups >= 1
                && k % groups == 0, "ascend_quant_cpu::int8_gemv_linear: scale must be contiguous float32 [n, groups]");
    TORCH_CHECK(q.dtype() == at::kChar && q.is_contiguous() && (bits == 4 || bits == 8) && kp % groups == 0
                && gp % 32 == 0 && gp >= gsz && gp - gsz < 32,
                "ascend_quant_cpu::int8_gemv_linear: the weight does not hold ", k, " in-features");
    TORCH_CHECK(groups == 1 || (!quant_bias.has_value() && bits == 4),
                "ascend_quant_cpu::int8_gemv_linear: per-group weights are int4, without quant_bias");
    const Int8Args a = int8_args("ascend_quant_cpu::int8_gemv_linear", x, pertoken, quant_bias, bias, n, out_dtype);
    const int64_t m = a.m;
    auto chunked = [&]() -> at::Tensor {
        at::Tensor xq = a.x2, st;
        if (!a.int8_in) {
            xq = at::empty({m, k}, a.x2.options().dtype(at::kChar));
            st = at::empty({m, 1}, a.x2.options().dtype(at::kFloat));
            g_quant[isa](a.x2.data_ptr(), a.xdt(), m, k, a.x2.stride(0), xq.data_ptr<int8_t>(), st.data_ptr<float>(),
                         at::get_num_threads());
        } else if (a.pt.has_value()) {
            st = a.pt->reshape({-1, 1});
        }
        const at::Tensor xf = xq.to(at::kFloat);
        at::Tensor yf;
        if (groups > 1) {
            yf = dequant_mm(isa, xf, q, bits, n, groups, gsz, gp, scale.data_ptr<float>(), nullptr,
                            std::max(gsz, kChunk / gsz * gsz), false);
        } else {
            const at::Tensor ones = at::ones({n, 1}, scale.options());
            at::Tensor acc = dequant_mm(isa, xf, q, bits, n, 1, k, kp, ones.data_ptr<float>(), nullptr, kChunk, true);
            if (a.qb.has_value()) acc.add_(*a.qb);
            yf = acc.to(at::kFloat).mul_(scale);
        }
        if (st.defined()) yf.mul_(st);
        if (a.b.has_value()) yf.add_(*a.b);
        return yf.to(a.want).view(a.shape);
    };
    if (m == 0) return a.result();          // nothing to compute (and no zero-byte buffers)
    if (m > max_m) return chunked();
    int status = 0;
    g_int8_gemv[isa](a.x2.data_ptr(), a.xdt(), m, k, a.x2.stride(0), a.pt.has_value() ? a.pt->data_ptr<float>() : nullptr,
                     q.data_ptr(), (int)bits, full_range ? 1 : 0, n, groups, gp, scale.data_ptr<float>(),
                     a.qb.has_value() ? a.qb->data_ptr<int32_t>() : nullptr, opt_ptr(a.b), a.y.data_ptr(), a.ydt(), n,
                     at::get_num_threads(), &status);
    if (status == 3) return chunked();      // an int8 x_q of -128 with int8 weights holding -128 (wq_gemv.c)
    TORCH_CHECK(status == 0, "ascend_quant_cpu::int8_gemv_linear: could not allocate its activation buffer");
    return a.result();
}

using quant_static_fn = void (*)(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, float inv, float offset,
                                int8_t *q, int nthreads);
using epilogue_fn = void (*)(const int32_t *acc, int64_t m, int64_t n, const int32_t *qbias, const float *scale,
                            const float *pertoken, const float *bias, void *y, int ydt, int nthreads);
quant_static_fn g_quant_static[kSlots] = {};
epilogue_fn g_epilogue[kSlots] = {};

// Static per-tensor int8 activations (W8A8; wq_gemv.c: wq_quant_static): q = clamp(round(x * inv +
// offset)) with params = float32 [inv, offset] as numerics.static_activation_params gives them (so
// numerics alone holds the formula's parameters); int8 of x's shape. An operator, so that a traced
// static Linear keeps this rounding (inductor's own loop fused x * inv + offset into an FMA).
at::Tensor quant_static(const at::Tensor &x, const at::Tensor &params, int64_t isa) {
    TORCH_CHECK(isa >= 0 && isa < kSlots && g_quant_static[isa],
                "ascend_quant_cpu::quant_static: the GEMV build ", isa, " is not loaded in this process");
    TORCH_CHECK(params.scalar_type() == at::kFloat && params.numel() == 2,
                "ascend_quant_cpu::quant_static: params must be float32 [inv, offset]");
    const at::Tensor p = params.contiguous();
    const int64_t k = x.size(-1);
    at::Tensor x2 = x.reshape({-1, k});
    if (x2.scalar_type() != at::kFloat && x2.scalar_type() != at::kBFloat16) x2 = x2.to(at::kFloat);
    if (x2.stride(-1) != 1) x2 = x2.contiguous();
    const int64_t m = x2.size(0);
    at::Tensor q = at::empty({m, k}, x2.options().dtype(at::kChar));
    if (m > 0)
        g_quant_static[isa](x2.data_ptr(), x2.scalar_type() == at::kBFloat16 ? 1 : 0, m, k, x2.stride(0),
                            p.data_ptr<float>()[0], p.data_ptr<float>()[1], q.data_ptr<int8_t>(), at::get_num_threads());
    return q.view(x.sizes());
}

// y = (((x_q @ w^T + quant_bias) * scale) * s_t) + bias for int8 x_q: ATen's _int_mm on w_kn int8
// [k, n] (exact int32 sums; on VNNI CPUs oneDNN's s8 x s8 kernel), then the reference's epilogue in
// one pass (wq_gemv.c: wq_int8_epilogue). The oneDNN GEMM's Linears whose epilogue its handler
// cannot take: static W8A8 (quant_bias inside the int32 sums).
at::Tensor int_mm_linear(const at::Tensor &x, const c10::optional<at::Tensor> &pertoken, const at::Tensor &w_kn,
                         const at::Tensor &scale, const c10::optional<at::Tensor> &quant_bias,
                         const c10::optional<at::Tensor> &bias, int64_t isa, c10::optional<at::ScalarType> out_dtype) {
    TORCH_CHECK(isa >= 0 && isa < kSlots && g_epilogue[isa],
                "ascend_quant_cpu::int_mm_linear: the GEMV build ", isa, " is not loaded in this process");
    TORCH_CHECK(x.scalar_type() == at::kChar, "ascend_quant_cpu::int_mm_linear: x must be int8 activations");
    TORCH_CHECK(w_kn.scalar_type() == at::kChar && w_kn.dim() == 2 && w_kn.size(0) == x.size(-1),
                "ascend_quant_cpu::int_mm_linear: w_kn must be int8 [k, n] with k = ", x.size(-1));
    const int64_t n = w_kn.size(1);
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
                "ascend_quant_cpu::int_mm_linear: scale must be contiguous float32 [n]");
    const Int8Args a = int8_args("ascend_quant_cpu::int_mm_linear", x, pertoken, quant_bias, bias, n, out_dtype);
    TORCH_CHECK(!a.qb.has_value() || a.qb->numel() == n, "ascend_quant_cpu::int_mm_linear: one quant_bias per channel");
    TORCH_CHECK(!a.b.has_value() || a.b->numel() == n, "ascend_quant_cpu::int_mm_linear: one bias per channel");
    if (a.m == 0) return a.result();
    const at::Tensor acc = at::_int_mm(a.x2, w_kn);
    g_epilogue[isa](acc.data_ptr<int32_t>(), a.m, n, a.qb.has_value() ? a.qb->data_ptr<int32_t>() : nullptr,
                    scale.data_ptr<float>(), a.pt.has_value() ? a.pt->data_ptr<float>() : nullptr, opt_ptr(a.b),
                    a.y.data_ptr(), a.ydt(), at::get_num_threads());
    return a.result();
}

using hadamard_fn = void (*)(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *signs,
                            const float *core, int64_t c, float inv, void *y, int ydt, int64_t ldy, int nthreads,
                            int *status);
hadamard_fn g_hadamard[kSlots] = {};

// An online input rotation (wq_gemv.c: wq_hadamard; numerics.rotate_activation): x·Q with
// Q = diag(signs)·(H_{2^r} ⊗ core) / sqrt(k), computed in float32, in x's dtype (float32 and
// bfloat16 directly, other dtypes through float32). core: the float32 [c, c] Paley core of
// numerics.hadamard_parts ([[1]] for a power of two).
at::Tensor hadamard(const at::Tensor &x, const at::Tensor &signs, const at::Tensor &core, int64_t isa) {
    TORCH_CHECK(isa >= 0 && isa < kSlots && g_hadamard[isa],
                "ascend_quant_cpu::hadamard: the GEMV build ", isa, " is not loaded in this process");
    const int64_t k = x.size(-1), c = core.size(0);
    TORCH_CHECK(signs.dtype() == at::kFloat && signs.is_contiguous() && signs.numel() == k,
                "ascend_quant_cpu::hadamard: signs must be contiguous float32 [", k, "]");
    TORCH_CHECK(core.dtype() == at::kFloat && core.is_contiguous() && core.dim() == 2 && core.size(1) == c && c >= 1
                && k % c == 0 && ((k / c) & (k / c - 1)) == 0,
                "ascend_quant_cpu::hadamard: core must be contiguous float32 [c, c] with k / c a power of two");
    at::Tensor x2 = x.reshape({-1, k});
    if (x2.scalar_type() != at::kFloat && x2.scalar_type() != at::kBFloat16) x2 = x2.to(at::kFloat);
    if (x2.stride(-1) != 1) x2 = x2.contiguous();
    const int64_t m = x2.size(0);
    at::Tensor y = at::empty({m, k}, x2.options());
    if (m == 0) return y.to(x.scalar_type()).view(x.sizes());
    const int dt = x2.scalar_type() == at::kBFloat16 ? 1 : 0;
    int status = 0;
    g_hadamard[isa](x2.data_ptr(), dt, m, k, x2.stride(0), signs.data_ptr<float>(), core.data_ptr<float>(), c,
                    (float)(1.0 / std::sqrt((double)k)), y.data_ptr(), dt, k, at::get_num_threads(), &status);
    TORCH_CHECK(status == 0, "ascend_quant_cpu::hadamard: could not allocate its row buffers");
    return (y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type())).view(x.sizes());
}

}  // namespace

// Python hands over one build's wq_int8_gemv and wq_quant_dynamic (slot = its index in cpu.ISAS).
extern "C" void wq_op_register_int8_gemv(int slot, void *fn, void *quant) {
    if (slot >= 0 && slot < kSlots) {
        g_int8_gemv[slot] = reinterpret_cast<int8_gemv_fn>(fn);
        g_quant[slot] = reinterpret_cast<quant_fn>(quant);
    }
}

// Python hands over one build's wq_quant_static and wq_int8_epilogue (slot = its index in cpu.ISAS).
extern "C" void wq_op_register_static(int slot, void *quant, void *epilogue) {
    if (slot >= 0 && slot < kSlots) {
        g_quant_static[slot] = reinterpret_cast<quant_static_fn>(quant);
        g_epilogue[slot] = reinterpret_cast<epilogue_fn>(epilogue);
    }
}

// Python hands over one build's wq_hadamard (slot = its index in cpu.ISAS).
extern "C" void wq_op_register_hadamard(int slot, void *fn) {
    if (slot >= 0 && slot < kSlots) g_hadamard[slot] = reinterpret_cast<hadamard_fn>(fn);
}

// Python hands over the amx build's wq_int8_linear (the only build with AMX-INT8).
extern "C" void wq_op_register_int8(void *fn) { g_int8 = reinterpret_cast<int8_fn>(fn); }

// Python hands over the entry points of one build of wq_gemv.c (slot = its index in cpu.ISAS).
extern "C" void wq_op_register(int slot, void *gemv, void *dequant) {
    if (slot >= 0 && slot < kSlots) {
        g_gemv[slot] = reinterpret_cast<gemv_fn>(gemv);
        g_dequant[slot] = reinterpret_cast<dequant_fn>(dequant);
    }
}

TORCH_LIBRARY(ascend_quant_cpu, m) {
    m.def("wq_linear(Tensor x, Tensor q, Tensor scale, Tensor? offset, Tensor? bias, int isa, int bits, int k, "
          "int group_size, int gp, int max_m) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor? pertoken, Tensor wp, Tensor scale, Tensor? quant_bias, Tensor? bias, "
          "int n, ScalarType? out_dtype) -> Tensor");
    m.def("int8_gemv_linear(Tensor x, Tensor? pertoken, Tensor q, Tensor scale, Tensor? quant_bias, Tensor? bias, "
          "int isa, int bits, bool full_range, int max_m, ScalarType? out_dtype) -> Tensor");
    m.def("hadamard(Tensor x, Tensor signs, Tensor core, int isa) -> Tensor");
    m.def("quant_static(Tensor x, Tensor params, int isa) -> Tensor");
    m.def("int_mm_linear(Tensor x, Tensor? pertoken, Tensor w_kn, Tensor scale, Tensor? quant_bias, Tensor? bias, "
          "int isa, ScalarType? out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(ascend_quant_cpu, CPU, m) {
    m.impl("wq_linear", &wq_linear);
    m.impl("int8_linear", &int8_linear);
    m.impl("int8_gemv_linear", &int8_gemv_linear);
    m.impl("hadamard", &hadamard);
    m.impl("quant_static", &quant_static);
    m.impl("int_mm_linear", &int_mm_linear);
}
