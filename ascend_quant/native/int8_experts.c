/* Routed experts with int8 activations on AVX-512 VNNI (ascend-quant): every expert of a
 * MoE layer in one call per projection, grouped by expert, int8 / int4 weights read once per
 * call and never converted to a float matrix.
 *
 * For the pairs p = 0 .. P-1 (a token routed to an expert, sorted by expert: expert e owns
 * pairs offsets[e] .. offsets[e+1]-1) and one projection of n outputs over k in-features:
 *
 *     acc[p, j] = sum_i x_q[row(p), i] * w_e[j, i]                 exact, int32
 *     v[p, j]   = (acc[p, j] * scale_e[j]) * x_scale[row(p)]       float32, the reference's order
 *
 * then either y[p, j] = v (float32 or bfloat16, ydt), or the weighted combine of the second
 * projection: out[out_row(p), j] += bf(v) * topw[p] (bf: rounding to bfloat16 when ydt is 1,
 * as the reference's expert output is), the experts of a token added in expert order.
 *
 * VPDPBUSD multiplies unsigned by signed bytes, so the activations enter as x_q + 128 (an
 * exclusive or with 0x80) and 128 * sum_i w_e[j, i] (wsum, made once by the caller) comes off
 * the int32 sum. Nothing overflows: x_q + 128 <= 255, |w| <= 127, so k up to 65536 is exact.
 *
 * Weight layout per expert (made by runtime/kernels/cpu.py), for blocks of 16 output channels
 * (n padded with zero rows to a multiple of 16) and kp in-features (k padded with zeros to a
 * multiple of 8): int8 [n/16][kp/4][16][4]: for step q, channel c of the block holds w[c, 4q ..
 * 4q+3]; int4 [n/16][kp/8][16][4] bytes: channel c's 4 bytes at step q hold w[c, 8q + b] in the
 * low nibble of byte b and w[c, 8q + 4 + b] in its high nibble (two's complement nibbles).
 *
 * Built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni, without -ffast-math, -ffp-contract=off.
 * OpenMP spreads pairs of channel blocks over threads; each thread walks the experts in order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define MT 8            /* pairs per register tile */
#define NB 2            /* channel blocks per tile (16 channels each) */
#define PF 32           /* weight prefetch distance, in 64-byte steps */

int ie_available(void) { return 1; }

static inline __attribute__((always_inline)) void tile(
        const int R, const int M, const int BITS, const uint8_t *xu, int64_t ldx, const uint8_t *wb,
        int64_t block_bytes, int64_t steps, int prefetch, __m512i out[NB][MT]) {
    __m512i acc[NB * MT];           /* flat and local: GCC then keeps the sums in registers */
    const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < M; t++) acc[r * MT + t] = _mm512_setzero_si512();
    for (int64_t q = 0; q < steps; q++) {
        /* decode streams the weights from memory once: ask for them PF lines ahead */
        if (prefetch)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(wb + r * block_bytes + (q + PF) * 64), _MM_HINT_T0);
        if (BITS == 8) {
            __m512i w[NB];
            for (int r = 0; r < R; r++) w[r] = _mm512_loadu_si512((const void *)(wb + r * block_bytes + q * 64));
            for (int t = 0; t < M; t++) {
                int32_t xv;
                memcpy(&xv, xu + t * ldx + 4 * q, 4);
                const __m512i x = _mm512_set1_epi32(xv);
                for (int r = 0; r < R; r++) acc[r * MT + t] = _mm512_dpbusd_epi32(acc[r * MT + t], x, w[r]);
            }
        } else {
            __m512i lo[NB], hi[NB];
            for (int r = 0; r < R; r++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(wb + r * block_bytes + q * 64));
                lo[r] = _mm512_shuffle_epi8(tab, _mm512_and_si512(raw, low));
                hi[r] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
            }
            for (int t = 0; t < M; t++) {
                int32_t x0, x1;
                memcpy(&x0, xu + t * ldx + 8 * q, 4);
                memcpy(&x1, xu + t * ldx + 8 * q + 4, 4);
                const __m512i a = _mm512_set1_epi32(x0), b = _mm512_set1_epi32(x1);
                for (int r = 0; r < R; r++) {
                    acc[r * MT + t] = _mm512_dpbusd_epi32(acc[r * MT + t], a, lo[r]);
                    acc[r * MT + t] = _mm512_dpbusd_epi32(acc[r * MT + t], b, hi[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < M; t++) out[r][t] = acc[r * MT + t];
}

#define TILE(R, M) { if (bits == 4) tile(R, M, 4, xu, ldx, wb, block_bytes, steps, prefetch, acc); \
                     else tile(R, M, 8, xu, ldx, wb, block_bytes, steps, prefetch, acc); }

static void run_tile(int R, int M, int bits, const uint8_t *xu, int64_t ldx, const uint8_t *wb, int64_t block_bytes,
                     int64_t steps, int prefetch, __m512i acc[NB][MT]) {
    if (R == 2) {
        switch (M) {
            case 1: TILE(2, 1) break; case 2: TILE(2, 2) break; case 3: TILE(2, 3) break; case 4: TILE(2, 4) break;
            case 5: TILE(2, 5) break; case 6: TILE(2, 6) break; case 7: TILE(2, 7) break; default: TILE(2, 8)
        }
    } else {
        switch (M) {
            case 1: TILE(1, 1) break; case 2: TILE(1, 2) break; case 3: TILE(1, 3) break; case 4: TILE(1, 4) break;
            case 5: TILE(1, 5) break; case 6: TILE(1, 6) break; case 7: TILE(1, 7) break; default: TILE(1, 8)
        }
    }
}
#undef TILE

static inline __m512 round_bf16(__m512 v) {     /* to bfloat16 and back, round to nearest even */
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* x: int8 activations, row stride ldx; rows[p]: the row of x of pair p (NULL: row p);
 * x_scale[row]: the per-token scales. w: [E] experts of the layout above, expert stride
 * w_stride bytes; scale, wsum: [E, n]. Output: y [P, ldy] of dtype ydt (0 float32, 1
 * bfloat16), or, with out non-NULL, the combine into out [.., ldo] float32 at out_rows[p] with
 * weights topw[p] (ydt says whether v is rounded to bfloat16 first). *status = 1 when the
 * activation buffer cannot be allocated (nothing written). */
void ie_experts(const int8_t *x, int64_t ldx, const int64_t *rows, const float *x_scale, int64_t P,
                int64_t E, const int64_t *offsets, const uint8_t *w, int64_t w_stride, int bits, int64_t n,
                int64_t k, int64_t kp, const float *scale, const int32_t *wsum, void *y, int ydt, int64_t ldy,
                float *out, int64_t ldo, const int64_t *out_rows, const float *topw, int nthreads, int *status) {
    uint8_t *xu = aligned_alloc(64, (size_t)((P * kp + 63) / 64 * 64 + 64));
    float *xs = malloc((size_t)(P > 0 ? P : 1) * sizeof(float));
    if (!xu || !xs) { free(xu); free(xs); *status = 1; return; }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (P * kp >= (1 << 16))
    for (int64_t p = 0; p < P; p++) {
        const int64_t src = rows ? rows[p] : p;
        const int8_t *xr = x + src * ldx;
        uint8_t *dst = xu + p * kp;
        for (int64_t i = 0; i < k; i++) dst[i] = (uint8_t)xr[i] ^ 0x80u;
        for (int64_t i = k; i < kp; i++) dst[i] = 0x80u;     /* int 0 (the padded weights are 0 too) */
        xs[p] = x_scale[src];
    }
    const int64_t nblocks = (n + 15) / 16;
    const int64_t steps = bits == 4 ? kp / 8 : kp / 4;
    const int64_t block_bytes = steps * 64;
    const int64_t tiles = (nblocks + NB - 1) / NB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (P * n * kp >= (1 << 17))
    for (int64_t b = 0; b < tiles; b++) {
        const int64_t b0 = b * NB;
        const int R = nblocks - b0 < NB ? (int)(nblocks - b0) : NB;
        __m512i acc[NB][MT];
        for (int64_t e = 0; e < E; e++) {
            const uint8_t *wb = w + e * w_stride + b0 * block_bytes;
            const float *se = scale + e * n;
            const int32_t *ws = wsum + e * n;
            for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += MT) {
                const int M = offsets[e + 1] - p0 < MT ? (int)(offsets[e + 1] - p0) : MT;
                /* the first tile brings the block's weights in; later tiles find them cached */
                run_tile(R, M, bits, xu + p0 * kp, kp, wb, block_bytes, steps, p0 == offsets[e], acc);
                for (int r = 0; r < R; r++) {
                    const int64_t j0 = (b0 + r) * 16;
                    const int64_t left = n - j0;
                    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
                    const __m512i c = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, ws + j0), 7);   /* 128 * wsum */
                    const __m512 s = _mm512_maskz_loadu_ps(m, se + j0);
                    for (int t = 0; t < M; t++) {
                        const int64_t p = p0 + t;
                        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][t], c)), s);
                        v = _mm512_mul_ps(v, _mm512_set1_ps(xs[p]));
                        if (out) {
                            if (ydt == 1) v = round_bf16(v);
                            float *o = out + out_rows[p] * ldo + j0;
                            const __m512 prod = _mm512_mul_ps(v, _mm512_set1_ps(topw[p]));
                            _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), prod));
                        } else if (ydt == 1) {
                            const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
                            _mm256_mask_storeu_epi16((uint16_t *)y + p * ldy + j0, m, _mm512_cvtepi32_epi16(u));
                        } else {
                            _mm512_mask_storeu_ps((float *)y + p * ldy + j0, m, v);
                        }
                    }
                }
            }
        }
    }
    free(xu);
    free(xs);
}
