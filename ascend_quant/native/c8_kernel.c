/* int8 (C8) paged KV cache: write and attention kernels for the CPU (ascend-quant).
 *
 * Page layout, per (block, kv head): 2 * block_size * head_dim int8 values,
 *   K transposed  [head_dim][block_size]   at offset 0          (element (d, j) at d*bs + j)
 *   V             [block_size][head_dim]   at offset bs * D     (element (j, d) at bs*D + j*D + d)
 * which is exactly the bytes of vLLM's CPU page [num_kv_heads, block_size, 2 * head_dim] for one
 * block and head (this layout is private to the C8 implementation: only it writes and reads pages).
 *
 * Quantization: q = clamp(round_half_even(x / scale[h*D + d]), -128, 127).
 * Attention: the softmax scale and the per-channel K scale are folded into the query
 * (q' = q * q_mul, q_mul = sm_scale * k_scale of the head's kv head) and the per-channel V
 * scale into the output (out_mul), so the kernel works on the raw int8 values: out = softmax(q' . k_q) @ v_q, with an online softmax
 * over blocks. Work items are (request, query tile, kv head); every query head of the kv head's
 * group (GQA) shares the converted block.
 *
 * Sliding window (window > 0, causal only): the query at position p sees keys in (p - window, p];
 * a tile starts at the first block its earliest query can see, so blocks wholly outside the
 * window (which vLLM may have freed and replaced by its null block) are never read.
 * Logits soft-cap (softcap > 0): scores become softcap * tanh(score / softcap) before the softmax.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* element types of query / key / value / output: 0 = float32, 1 = bfloat16 */
static inline float ld(const void *p, int64_t i, int dt) {
    if (dt == 0) return ((const float *)p)[i];
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)p)[i] << 16;
    return c.f;
}

static inline void st(void *p, int64_t i, int dt, float x) {
    if (dt == 0) { ((float *)p)[i] = x; return; }
    union { uint32_t u; float f; } c;
    c.f = x;
    uint32_t r = c.u + 0x7FFFu + ((c.u >> 16) & 1u);       /* round to nearest even */
    ((uint16_t *)p)[i] = (uint16_t)(r >> 16);
}

/* dst[d] = clamp(round_half_even(x[d] / s[d]), -128, 127) for one head's D values of a K or V row
 * (x float32 or bf16 at src + off); the division, not a reciprocal, as the reference quantizes. */
static void quant_row(const void *src, int64_t off, int dt, const float *s, int8_t *dst, int D) {
    float x[D];
    if (dt == 0) {
        const float *f = (const float *)src + off;
#pragma omp simd
        for (int d = 0; d < D; d++) x[d] = f[d];
    } else {
        const uint16_t *b = (const uint16_t *)src + off;
#pragma omp simd
        for (int d = 0; d < D; d++) {
            union { uint32_t u; float f; } c;
            c.u = (uint32_t)b[d] << 16;
            x[d] = c.f;
        }
    }
#pragma omp simd
    for (int d = 0; d < D; d++) {
        float q = nearbyintf(x[d] / s[d]);
        q = q < -128.f ? -128.f : (q > 127.f ? 127.f : q);
        dst[d] = (int8_t)(int)q;
    }
}

/* The attention's inner products run on GCC vectors of VW floats (one AVX-512 or AVX2 register,
 * or scalars, whatever -march gives), over NR query rows at a time: each K or V vector loaded
 * serves NR rows. VW is the register's width: with 16-float vectors on AVX2 (two registers each)
 * GCC kept the row accumulators on the stack, and decode ran 12-29x slower than the AVX-512 build. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) ((void)(p))
#endif
#if defined(__AVX512F__)
#define NR 8              /* 32 vector registers: 8 row accumulators and the operands */
#else
#define NR 4              /* 16 (AVX2) */
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vload8(const int8_t *p) {     /* GCC's own vector conversion of int8 is scalar */
    vf v;
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#else
    for (int i = 0; i < VW; i++) v[i] = (float)p[i];
#endif
    return v;
}

/* Element i of a K or V operand: the block converted to float (i8 = 0), or the int8 page itself
 * (i8 = 1: each vector converted in registers; for a few rows, decode, converting the whole block
 * first costs more than the products). */
static inline __attribute__((always_inline)) vf opv(const void *x, int64_t i, const int i8) {
    return i8 ? vload8((const int8_t *)x + i) : vload((const float *)x + i);
}

static inline __attribute__((always_inline)) float op1(const void *x, int64_t i, const int i8) {
    return i8 ? (float)((const int8_t *)x)[i] : ((const float *)x)[i];
}

/* Several key (scores) or channel (values) vectors per pass: a row's FMAs form a dependency
 * chain (4-cycle latency, two FMA ports), so a few rows (decode: the G query heads of one KV
 * head) need several vectors at once to keep the ports busy; and with 8 key vectors a pass reads
 * whole 128-byte rows of K^T, a sequential stream instead of a 128-byte stride. ACC is how many
 * VW-float accumulators fit in the registers (AVX-512: 32 registers, AVX2: 16). */
#if defined(__AVX512F__)
#define ACC 24
#else
#define ACC 12
#endif

/* the vectors per pass for nr rows when nvec are left: a power of two, at most 8 */
static inline int span(int nr, int nvec) {
    int nv = 1;
    while (nv < 8 && 2 * nv * nr <= ACC && 2 * nv <= nvec) nv *= 2;
    return nv;
}

#define BY_SPAN(nv, call) switch (nv) { case 8: call(8); break; case 4: call(4); break; case 2: call(2); break; \
                                        default: call(1); }

/* S[r][j] = q_r . k_j for rows r < nr (q: [nr][D]) and keys [ja, jb), ja a multiple of VW, from
 * K^T [D][ldk] (ldk: bsp for the float block, a multiple of VW; bs for the page, also one, so whole
 * vectors stay inside it). */
static inline __attribute__((always_inline)) void scores_span(const int nr, const int nv, const int i8, const float *q,
                                                              int D, const void *k, int ldk, int j, float *S, int bsp,
                                                              const int8_t *pf) {
    vf a[NR][8];
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nv; u++) a[r][u] = (vf){0};
    for (int d = 0; d < D; d++) {
        if (pf)
            for (int64_t o = (int64_t)d * ldk; o < (int64_t)(d + 1) * ldk; o += 64) PREFETCH(pf + o);
        for (int u = 0; u < nv; u++) {
            const vf kv = opv(k, (int64_t)d * ldk + j + u * VW, i8);
            for (int r = 0; r < nr; r++) a[r][u] += q[(int64_t)r * D + d] * kv;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nv; u++) vstore(S + (int64_t)r * bsp + j + u * VW, a[r][u]);
}

static inline __attribute__((always_inline)) void block_scores(const int nr, const int i8, const float *q, int D,
                                                               const void *k, int ldk, int ja, int jb, float *S,
                                                               int bsp, const int8_t *pf) {
    for (int j = ja; j < jb;) {
        const int nv = span(nr, (jb - j + VW - 1) / VW);
#define SCORES_SPAN(n) scores_span(nr, n, i8, q, D, k, ldk, j, S, bsp, j == ja ? pf : NULL)
        BY_SPAN(nv, SCORES_SPAN)
#undef SCORES_SPAN
        j += nv * VW;
    }
}

/* acc[r][x, x + nv*VW) += sum over keys j in [ja, jb) of P[r][j] * v_j for rows r < nr, from
 * V [bs][D] (P is zero outside each row's keys). */
static inline __attribute__((always_inline)) void values_span(const int nr, const int nv, const int i8, const float *P,
                                                              int bsp, const void *v, int D, int ja, int jb, int x,
                                                              float *acc, const int8_t *pf) {
    vf a[NR][8];
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nv; u++) a[r][u] = vload(acc + (int64_t)r * D + x + u * VW);
    for (int j = ja; j < jb; j++) {
        if (pf)
            for (int64_t o = (int64_t)j * D; o < (int64_t)(j + 1) * D; o += 64) PREFETCH(pf + o);
        for (int u = 0; u < nv; u++) {
            const vf vv = opv(v, (int64_t)j * D + x + u * VW, i8);
            for (int r = 0; r < nr; r++) a[r][u] += P[(int64_t)r * bsp + j] * vv;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nv; u++) vstore(acc + (int64_t)r * D + x + u * VW, a[r][u]);
}

static inline __attribute__((always_inline)) void block_values(const int nr, const int i8, const float *P, int bsp,
                                                               const void *v, int D, int ja, int jb, float *acc,
                                                               const int8_t *pf) {
    int x = 0;
    while (x + VW <= D) {
        const int nv = span(nr, (D - x) / VW);
#define VALUES_SPAN(n) values_span(nr, n, i8, P, bsp, v, D, ja, jb, x, acc, x == 0 ? pf : NULL)
        BY_SPAN(nv, VALUES_SPAN)
#undef VALUES_SPAN
        x += nv * VW;
    }
    for (; x < D; x++)
        for (int r = 0; r < nr; r++) {
            float t = acc[(int64_t)r * D + x];
            for (int j = ja; j < jb; j++) t += P[(int64_t)r * bsp + j] * op1(v, (int64_t)j * D + x, i8);
            acc[(int64_t)r * D + x] = t;
        }
}

/* exp(x) for x <= 0 on VW lanes (the softmax's s - max): 2^n * e^g with n = round(x / ln 2),
 * |g| <= ln(2) / 2 and a degree-6 Taylor polynomial (relative error about 2e-7); x below -87
 * gives e^-87 (about 1.6e-38). Written out because the compiler's vector expf is an 8-lane call
 * that spills the registers, the largest part of the softmax's time. */
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));
static inline vf vexp_neg(vf x) {
    const vf lo = (vf){0} - 87.f;
    const vi small = x < lo;
    x = (vf)(((vi)lo & small) | ((vi)x & ~small));
    const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);     /* x <= 0: truncation rounds */
    const vf nf = __builtin_convertvector(n, vf);
    const vf g = x - nf * 0.693145751953125f - nf * 1.428606765330187e-6f;
    vf p = 1.f + g * (1.f / 6.f);                                          /* Horner: 1 + g + ... + g^6/720 */
    p = 1.f + g * 0.2f * p;
    p = 1.f + g * 0.25f * p;
    p = 1.f + g * (1.f / 3.f) * p;
    p = 1.f + g * 0.5f * p;
    p = 1.f + g * p;
    return p * (vf)((n + 127) << 23);
}

static inline vf vmax(vf a, vf b) {
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* max of s[j0..j1), j1 > j0 */
static float row_max(const float *s, int j0, int j1) {
    float mx = s[j0];
    int j = j0;
    if (j1 - j0 >= 2 * VW) {                      /* two chains of vector maxima */
        vf a = vload(s + j), b = vload(s + j + VW);
        for (j += 2 * VW; j + 2 * VW <= j1; j += 2 * VW) {
            a = vmax(a, vload(s + j));
            b = vmax(b, vload(s + j + VW));
        }
        a = vmax(a, b);
        for (int u = 0; u < VW; u++) mx = a[u] > mx ? a[u] : mx;
    }
    for (; j < j1; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

/* s[j] = exp(s[j] - m) over [j0, j1); returns their sum. Lanes past j1 are neither written nor summed. */
static float row_exp(float *s, int j0, int j1, float m) {
    vf sum = (vf){0};
    int j = j0;
    for (; j + VW <= j1; j += VW) {
        const vf p = vexp_neg(vload(s + j) - m);
        vstore(s + j, p);
        sum += p;
    }
    float tot = 0.f;
    for (int u = 0; u < VW; u++) tot += sum[u];
    if (j < j1) {
        vf x = (vf){0} - 100.f;
        for (int u = 0; u < j1 - j; u++) x[u] = s[j + u] - m;
        const vf p = vexp_neg(x);
        for (int u = 0; u < j1 - j; u++) {
            s[j + u] = p[u];
            tot += p[u];
        }
    }
    return tot;
}

/* The two above with nr (1..NR) and i8 constants, so that the row accumulators stay in registers. */
#define ROWS_CASE(n, call) case n: if (i8) call(n, 1); else call(n, 0); break;
#if NR > 4
#define BY_ROWS(call) switch (nr) { ROWS_CASE(8, call) ROWS_CASE(7, call) ROWS_CASE(6, call) ROWS_CASE(5, call) \
                                    ROWS_CASE(4, call) ROWS_CASE(3, call) ROWS_CASE(2, call) default: ROWS_CASE(1, call) }
#else
#define BY_ROWS(call) switch (nr) { ROWS_CASE(4, call) ROWS_CASE(3, call) ROWS_CASE(2, call) default: ROWS_CASE(1, call) }
#endif

static void rows_scores(int nr, int i8, const float *q, int D, const void *k, int ldk, int ja, int jb, float *S,
                        int bsp, const int8_t *pf) {
#define SCORES(n, c) block_scores(n, c, q, D, k, ldk, ja, jb, S, bsp, pf)
    BY_ROWS(SCORES)
#undef SCORES
}

static void rows_values(int nr, int i8, const float *P, int bsp, const void *v, int D, int ja, int jb, float *acc,
                        const int8_t *pf) {
#define VALUES(n, c) block_values(n, c, P, bsp, v, D, ja, jb, acc, pf)
    BY_ROWS(VALUES)
#undef VALUES
}

void c8_write(const void *key, int64_t key_tok_stride, const void *value, int64_t value_tok_stride, int dt,
              const int64_t *slots, int64_t num_tokens, int8_t *cache, int64_t blk_stride,
              int64_t head_stride, int num_kv_heads, int head_dim, int block_size,
              const float *k_scale, const float *v_scale, int nthreads) {
    const int D = head_dim, bs = block_size;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (num_tokens * num_kv_heads >= 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t b = slot / bs, o = slot % bs;
        for (int h = 0; h < num_kv_heads; h++) {
            int8_t *page = cache + b * blk_stride + h * head_stride;
            const int64_t k0 = t * key_tok_stride + (int64_t)h * D, v0 = t * value_tok_stride + (int64_t)h * D;
            const float *ks = k_scale + (int64_t)h * D, *vs = v_scale + (int64_t)h * D;
            int8_t kq[D];
            quant_row(key, k0, dt, ks, kq, D);
            for (int d = 0; d < D; d++) page[(int64_t)d * bs + o] = kq[d];       /* K is stored transposed */
            quant_row(value, v0, dt, vs, page + (int64_t)bs * D + o * D, D);
        }
    }
}

/* Read the pages back (int8 -> raw int values as float, no scale): K [ctx, Hkv, D] and V, for
 * tests and the torch fallback. */
void c8_gather(const int8_t *cache, int64_t blk_stride, int64_t head_stride, const int32_t *blocks,
               int64_t n_tokens, int num_kv_heads, int head_dim, int block_size, float *k_out, float *v_out) {
    const int D = head_dim, bs = block_size;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t b = blocks[t / bs], o = t % bs;
        for (int h = 0; h < num_kv_heads; h++) {
            const int8_t *page = cache + b * blk_stride + h * head_stride;
            for (int d = 0; d < D; d++) {
                k_out[(t * num_kv_heads + h) * D + d] = page[(int64_t)d * bs + o];
                v_out[(t * num_kv_heads + h) * D + d] = page[(int64_t)bs * D + o * D + d];
            }
        }
    }
}

void c8_attention(const void *q, int64_t q_tok_stride, int q_dt, const float *q_mul,
                  const int8_t *cache, int64_t blk_stride,
                  int64_t head_stride, const int32_t *query_start_loc, const int32_t *seq_lens,
                  const int32_t *block_table, int64_t bt_stride, int num_reqs, int num_heads,
                  int num_kv_heads, int head_dim, int block_size, int causal, int window, float softcap, int q_tile,
                  void *out, int64_t out_tok_stride, int out_dt, const float *out_mul, int nthreads) {
    const int D = head_dim, bs = block_size, G = num_heads / num_kv_heads;
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (num_reqs + 1));
    item_start[0] = 0;
    for (int r = 0; r < num_reqs; r++) {
        int qlen = query_start_loc[r + 1] - query_start_loc[r];
        int tiles = (qlen + q_tile - 1) / q_tile;
        item_start[r + 1] = item_start[r] + (int64_t)tiles * num_kv_heads;
    }
    const int64_t n_items = item_start[num_reqs];
    const int max_rows = q_tile * G;

#pragma omp parallel num_threads(nthreads)
    {
        const int bsp = (bs + VW - 1) / VW * VW;
        /* zeroed once: the lanes past a block's keys are read by whole vectors, always finite */
        float *kf = (float *)calloc((size_t)D * bsp + VW, sizeof(float));
        float *vb = (float *)calloc((size_t)D * bs + VW, sizeof(float));
        float *S = (float *)calloc((size_t)NR * bsp + VW, sizeof(float));
        float *acc = (float *)malloc(sizeof(float) * ((size_t)max_rows * D + VW));
        float *qbuf = (float *)malloc(sizeof(float) * ((size_t)max_rows * D + VW));
        float *m = (float *)malloc(sizeof(float) * max_rows);
        float *l = (float *)malloc(sizeof(float) * max_rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; it++) {
            int lo = 0, hi = num_reqs - 1;           /* request owning this item */
            while (lo < hi) {
                int mid = (lo + hi + 1) / 2;
                if (item_start[mid] <= it) lo = mid; else hi = mid - 1;
            }
            const int r = lo;
            const int64_t local = it - item_start[r];
            const int tile = (int)(local / num_kv_heads), kvh = (int)(local % num_kv_heads);
            const int qlen = query_start_loc[r + 1] - query_start_loc[r];
            const int ctx = seq_lens[r];
            const int i0 = tile * q_tile;
            const int nq = qlen - i0 < q_tile ? qlen - i0 : q_tile;
            const int64_t t0 = query_start_loc[r] + i0;
            const int first_pos = ctx - qlen + i0;           /* absolute position of the tile's first query */
            const int kv_end = causal ? first_pos + nq : ctx;
            /* keys before kv_begin are outside every query's window in this tile */
            const int kv_begin = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
            const int rows = nq * G;
            for (int rr = 0; rr < rows; rr++) {
                const int i = rr / G, hq = kvh * G + rr % G;
                m[rr] = -FLT_MAX;
                l[rr] = 0.f;
                const int64_t q0 = (t0 + i) * q_tok_stride + (int64_t)hq * D;
                for (int d = 0; d < D; d++) {
                    acc[(int64_t)rr * D + d] = 0.f;
                    qbuf[(int64_t)rr * D + d] = ld(q, q0 + d, q_dt) * q_mul[(int64_t)hq * D + d];
                }
            }
            const int nblocks = (kv_end + bs - 1) / bs;
            for (int b = kv_begin / bs; b < nblocks; b++) {
                const int64_t phys = block_table[(int64_t)r * bt_stride + b];
                const int8_t *page = cache + phys * blk_stride + (int64_t)kvh * head_stride;
                /* In a serving step the pages come from memory, not cache. In decode (direct) the scores
                 * pass asks for this block's V, read next, and the values pass for the next block's
                 * K, a line or two per step (a burst of prefetches would fill the line buffers and stall). */
                const int8_t *next = b + 1 < nblocks ? cache + block_table[(int64_t)r * bt_stride + b + 1] * blk_stride +
                                                       (int64_t)kvh * head_stride : NULL;
                const int base = b * bs;
                const int nk = kv_end - base < bs ? kv_end - base : bs;
                const int jlo = kv_begin - base > 0 ? kv_begin - base : 0;   /* first key any row sees */
                /* one pass of rows (decode): products on the int8 page; else convert the block once */
                const int direct = rows <= NR && bs % VW == 0;
                for (int d = 0; d < D && !direct; d++) {
                    const int8_t *src = page + (int64_t)d * bs;
                    float *dst = kf + (int64_t)d * bsp;
#pragma omp simd
                    for (int j = jlo; j < nk; j++) dst[j] = (float)src[j];
                }
                if (!direct) {
                    const int8_t *src = page + (int64_t)bs * D;
                    const int n = nk * D;
#pragma omp simd
                    for (int e = jlo * D; e < n; e++) vb[e] = (float)src[e];
                }
                for (int r0 = 0; r0 < rows; r0 += NR) {
                    const int nr = rows - r0 < NR ? rows - r0 : NR;
                    int jr0[NR], jr1[NR];                     /* each row's keys [jr0, jr1) in this block */
                    int ja = bs, jb = 0;
                    for (int x = 0; x < nr; x++) {
                        const int i = (r0 + x) / G;
                        const int limit = causal ? first_pos + i + 1 : ctx;   /* keys [start, limit) */
                        const int start = window > 0 ? first_pos + i - window + 1 : 0;
                        int nkr = limit - base;
                        nkr = nkr > nk ? nk : nkr;
                        const int j0 = start - base > 0 ? start - base : 0;
                        jr0[x] = j0;
                        jr1[x] = nkr > j0 ? nkr : j0;                         /* empty: no key here */
                        if (jr1[x] > jr0[x]) {
                            ja = j0 < ja ? j0 : ja;
                            jb = nkr > jb ? nkr : jb;
                        }
                    }
                    if (jb <= ja) continue;
                    ja = ja / VW * VW;
                    rows_scores(nr, direct, qbuf + (int64_t)r0 * D, D, direct ? (const void *)page : kf,
                                direct ? bs : bsp, ja, jb, S, bsp, direct ? page + (int64_t)bs * D : NULL);
                    for (int x = 0; x < nr; x++) {
                        const int rr = r0 + x, j0 = jr0[x], nkr = jr1[x];
                        float *s = S + (int64_t)x * bsp;
                        for (int j = ja; j < (j0 < jb ? j0 : jb); j++) s[j] = 0.f;
                        for (int j = nkr > ja ? nkr : ja; j < jb; j++) s[j] = 0.f;
                        if (nkr <= j0) continue;                /* this row sees no key of the block */
                        if (softcap > 0.f) {
                            const float inv_cap = 1.f / softcap;
#pragma omp simd
                            for (int j = j0; j < nkr; j++) s[j] = softcap * tanhf(s[j] * inv_cap);
                        }
                        const float mx = row_max(s, j0, nkr);
                        const int first = l[rr] == 0.f;
                        const float m_new = first || mx > m[rr] ? mx : m[rr];
                        const float corr = first ? 0.f : expf(m[rr] - m_new);
                        const float sum = row_exp(s, j0, nkr, m_new);
                        m[rr] = m_new;
                        l[rr] = l[rr] * corr + sum;
                        if (!first) {
                            float *ar = acc + (int64_t)rr * D;
#pragma omp simd
                            for (int d = 0; d < D; d++) ar[d] *= corr;
                        }
                    }
                    rows_values(nr, direct, S, bsp, direct ? (const void *)(page + (int64_t)bs * D) : vb, D, ja,
                                jb, acc + (int64_t)r0 * D, direct ? next : NULL);
                }
            }
            for (int rr = 0; rr < rows; rr++) {
                const int i = rr / G, hq = kvh * G + rr % G;
                const int64_t o0 = (t0 + i) * out_tok_stride + (int64_t)hq * D;
                const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
                const float *om = out_mul + (int64_t)hq * D;
                for (int d = 0; d < D; d++) st(out, o0 + d, out_dt, acc[(int64_t)rr * D + d] * inv * om[d]);
            }
        }
        free(kf); free(vb); free(S); free(acc); free(qbuf); free(m); free(l);
    }
    free(item_start);
}
