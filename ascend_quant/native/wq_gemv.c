/* Quantized-weight GEMV for decode and small batches (ascend-quant): y[m, n] from x[m, k]
 * and int8 or int4 weights, read once per call and converted in registers (no float weight
 * matrix is ever written).
 *
 * Weight layout (made by runtime/kernels/cpu.py), per output channel j: `groups` groups of
 * `gp` values, each holding the group's `gsz` in-features then zeros up to gp (a multiple of
 * 32); int8 one value per byte, int4 two per byte along k: in each block of 32 values, byte
 * i holds value i in its low nibble and value i + 16 in its high one (so a table lookup on
 * each nibble gives 16 consecutive values). scale / offset: float32 [n, groups]. Per-channel is
 * groups = 1, gsz = k. The activations are copied once per call into a float32 buffer of the
 * same padded layout, so the inner loop has no tails.
 *
 * mode 0 (weight-only): y = x @ ((w - offset) * scale)^T + bias. Each vector lane sums one
 * group's products, the group's scale multiplies the lanes once per group, the lanes are
 * added at the end of the row; the offset enters as offset * scale * sum(x over the group).
 * mode 1 (int8 activations, per-channel int4/int8 weights): acc = x_q @ w^T exactly, then
 * y = ((acc * scale[j]) * pertoken[t]) + bias[j] in float32 (the reference's epilogue, in its
 * order); per channel it runs in integers (wq_int8_gemv, below). Otherwise (float lanes, kept
 * for per-group weights) exact while every lane's partial sum is an integer below 2^24.
 *
 * Built four times: AMX (tiles, below), -mavx512bf16 (bfloat16 activations through VDPBF16PS:
 * the GEMV below 10 tokens, bfloat16 panels from 10 on; the rest as AVX-512), -mavx512f
 * -mavx512bw (16 floats a vector) and -mavx2 -mfma (8 floats);
 * without -ffast-math and with -ffp-contract=off, so only the explicit FMAs fuse.
 * OpenMP spreads the output channels over threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vld(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vset(float s) { return _mm512_set1_ps(s); }
static inline vf wload8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 32 weights starting at p into NV vectors, in k order */
#define NV 2
static inline void wload32_8(const int8_t *p, vf *w) { w[0] = wload8(p); w[1] = wload8(p + 16); }
static inline void wload32_4(const uint8_t *p, vf *w) {       /* 16 bytes: nibble lookup */
    const __m512 tab = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    w[0] = _mm512_permutexvar_ps(v, tab);                   /* uses the low 4 bits of each index */
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab);
}
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline int32_t vsum_int(vf a) { return _mm512_reduce_add_epi32(_mm512_cvtps_epi32(a)); }
#if defined(__AMX_BF16__)
int wq_isa(void) { return 1024; }    /* AMX-BF16 tiles, AVX-512 with BF16 */
#elif defined(__AVX512BF16__)
int wq_isa(void) { return 516; }     /* AVX-512 with BF16 */
#else
int wq_isa(void) { return 512; }
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vld(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vset(float s) { return _mm256_set1_ps(s); }
static inline vf wload8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define NV 4
static inline void wload32_8(const int8_t *p, vf *w) {
    for (int v = 0; v < 4; v++) w[v] = wload8(p + 8 * v);
}
static inline void wload32_4(const uint8_t *p, vf *w) {       /* 16 bytes: nibble lookup */
    const __m128i tab = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m128i f = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_shuffle_epi8(tab, _mm_and_si128(b, f));
    __m128i hi = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(b, 4), f));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline int32_t vsum_int(vf a) {
    __m256i i = _mm256_cvtps_epi32(a);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
int wq_isa(void) { return 2; }
#else
#error "wq_gemv.c needs AVX-512 (F, BW) or AVX2 + FMA"
#endif

#define MT_MAX 8        /* tokens per register tile */
#define RB 4            /* output channels per block: R rows of a tile share each activation load */

/* R output channels x MT tokens: per-group scaled lane sums (mode 0) or the exact integer dot
 * products (mode 1, stored as int32 bits in res). R > 1 gives small tiles independent FMA
 * chains (one chain is bound by the FMA latency). res[r * MT_MAX + t]. */
static inline __attribute__((always_inline)) void row_tile(
        const int R, const int MT, const int BITS, const float *xb, int64_t ldb, const void *wrow,
        int64_t row_bytes, int64_t groups, int64_t gp, const float *srow, int per_group, int exact, float *res) {
    vf tot[RB][MT_MAX], ga[RB][MT_MAX];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MT; t++) tot[r][t] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        for (int r = 0; r < R; r++)
            for (int t = 0; t < MT; t++) ga[r][t] = vzero();
        const float *xg = xb + g * gp;
        for (int64_t i = 0; i < gp; i += 32) {
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = (const uint8_t *)wrow + r * row_bytes;
                vf w[NV];
                if (BITS == 4) wload32_4(wr + (g * gp + i) / 2, w);
                else wload32_8((const int8_t *)wr + g * gp + i, w);
                for (int v = 0; v < NV; v++)
                    for (int t = 0; t < MT; t++) ga[r][t] = vfma(w[v], vld(xg + t * ldb + i + v * VW), ga[r][t]);
            }
        }
        for (int r = 0; r < R; r++) {
            if (per_group) {
                vf s = vset(srow[r * groups + g]);
                for (int t = 0; t < MT; t++) tot[r][t] = vfma(ga[r][t], s, tot[r][t]);
            } else {
                for (int t = 0; t < MT; t++) tot[r][t] = ga[r][t];   /* groups == 1 */
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MT; t++) {
            if (exact) {
                int32_t a = vsum_int(tot[r][t]);
                memcpy(&res[r * MT_MAX + t], &a, 4);
            } else {
                res[r * MT_MAX + t] = vsum(tot[r][t]);
            }
        }
}

#define TILE(R, M) { if (bits == 4) row_tile(R, M, 4, xb, ldb, wrow, row_bytes, groups, gp, srow, per_group, exact, res); \
                     else row_tile(R, M, 8, xb, ldb, wrow, row_bytes, groups, gp, srow, per_group, exact, res); }

/* The register tile for `rows` output channels (RB, or fewer at the end of n) and `mt` tokens:
 * 4 x 1 for one token, 2 x mt for up to 3, else 1 x mt (mt <= MT_MAX). Runs TILE_FN(R, MT) and
 * returns R, the channels it did. Shared by the float, bfloat16 and integer tiles below. */
#define PICK_TILE(TILE_FN) \
    if (mt == 1 && rows >= 4) { TILE_FN(4, 1) return 4; } \
    if (mt <= 3 && rows >= 2) { \
        switch (mt) { case 1: TILE_FN(2, 1) break; case 2: TILE_FN(2, 2) break; default: TILE_FN(2, 3) } \
        return 2; \
    } \
    switch (mt) { \
        case 1: TILE_FN(1, 1) break; case 2: TILE_FN(1, 2) break; case 3: TILE_FN(1, 3) break; \
        case 4: TILE_FN(1, 4) break; case 5: TILE_FN(1, 5) break; case 6: TILE_FN(1, 6) break; \
        case 7: TILE_FN(1, 7) break; default: TILE_FN(1, 8) \
    } \
    return 1;

static inline int tile(int rows, int mt, int bits, const float *xb, int64_t ldb, const void *wrow, int64_t row_bytes,
                       int64_t groups, int64_t gp, const float *srow, int per_group, int exact, float *res) {
    PICK_TILE(TILE)
}
#undef TILE


#if defined(__AVX512BF16__)
/* bfloat16 activations (mode 0): the weights convert exactly to bfloat16 (integers of at
 * most 8 significant bits) and VDPBF16PS multiplies 32 pairs a vector into float32 lanes.
 * Per 64 values of a group: the weight vectors hold values [0..15, 32..47] and [16..31,
 * 48..63] (what one nibble lookup of 32 bytes gives); the activation buffer holds the same
 * order, and a trailing 32-value chunk of a group has zeros in the other slots. */
#define HAVE_BF16 1
static const uint16_t BF16_INT4[32] = {   /* bfloat16 of the int4 value of the low nibble, twice */
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};

static inline int64_t bf16_slot(int64_t q) {        /* position q of a 64-chunk in the buffer */
    return q < 16 ? q : q < 32 ? q + 16 : q < 48 ? q - 16 : q;
}

static inline __m512bh high_words(__m512 a, __m512 b) {  /* bfloat16 of exact floats: their high halves */
    const __m512i idx = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                          0x001B0019, 0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D,
                                          0x00330031, 0x00370035, 0x003B0039, 0x003F003D);
    return (__m512bh)_mm512_permutex2var_epi16(_mm512_castps_si512(a), idx, _mm512_castps_si512(b));
}

static inline void wbf16_8(const int8_t *p, int full, __m512bh *lo, __m512bh *hi) {
    __m512 a = wload8(p), b = wload8(p + 16);
    __m512 c = full ? wload8(p + 32) : _mm512_setzero_ps(), d = full ? wload8(p + 48) : _mm512_setzero_ps();
    *lo = high_words(a, c);                         /* values 0..15 of a, then c's */
    *hi = high_words(b, d);
}

static inline void wbf16_4(const uint8_t *p, int full, __m512i tab, __m512bh *lo, __m512bh *hi) {
    __m256i b = full ? _mm256_loadu_si256((const __m256i *)p)
                     : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m512i v = _mm512_cvtepu8_epi16(b);            /* index bits 0-4: low nibble (+16: same entry) */
    *lo = (__m512bh)_mm512_permutexvar_epi16(v, tab);
    *hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
}

static inline __attribute__((always_inline)) void row_tile_bf16(
        const int R, const int MT, const int BITS, const uint16_t *xb, int64_t ldb, int64_t gq, const void *wrow,
        int64_t row_bytes, int64_t groups, int64_t gp, const float *srow, int per_group, float *res) {
    __m512 tot[RB][MT_MAX], ga[RB][MT_MAX], gb[RB][MT_MAX];   /* gb: the hi halves (a second FMA chain) */
    const __m512i tab = _mm512_loadu_si512((const void *)BF16_INT4);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MT; t++) tot[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        for (int r = 0; r < R; r++)
            for (int t = 0; t < MT; t++) ga[r][t] = gb[r][t] = _mm512_setzero_ps();
        const uint16_t *xg = xb + g * gq;
        for (int64_t i = 0; i < gp; i += 64) {
            const int full = i + 64 <= gp;
            for (int r = 0; r < R; r++) {
                const uint8_t *wr = (const uint8_t *)wrow + r * row_bytes;
                __m512bh lo, hi;
                if (BITS == 4) wbf16_4(wr + (g * gp + i) / 2, full, tab, &lo, &hi);
                else wbf16_8((const int8_t *)wr + g * gp + i, full, &lo, &hi);
                for (int t = 0; t < MT; t++) {
                    const uint16_t *xt = xg + t * ldb + i;
                    ga[r][t] = _mm512_dpbf16_ps(ga[r][t], lo, (__m512bh)_mm512_loadu_si512((const void *)xt));
                    gb[r][t] = _mm512_dpbf16_ps(gb[r][t], hi, (__m512bh)_mm512_loadu_si512((const void *)(xt + 32)));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            for (int t = 0; t < MT; t++) ga[r][t] = _mm512_add_ps(ga[r][t], gb[r][t]);
            if (per_group) {
                __m512 s = _mm512_set1_ps(srow[r * groups + g]);
                for (int t = 0; t < MT; t++) tot[r][t] = _mm512_fmadd_ps(ga[r][t], s, tot[r][t]);
            } else {
                for (int t = 0; t < MT; t++) tot[r][t] = ga[r][t];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MT; t++) res[r * MT_MAX + t] = _mm512_reduce_add_ps(tot[r][t]);
}

#define TILE_BF(R, M) { if (bits == 4) row_tile_bf16(R, M, 4, xb, ldb, gq, wrow, row_bytes, groups, gp, srow, per_group, res); \
                        else row_tile_bf16(R, M, 8, xb, ldb, gq, wrow, row_bytes, groups, gp, srow, per_group, res); }

static inline int tile_bf16(int rows, int mt, int bits, const uint16_t *xb, int64_t ldb, int64_t gq, const void *wrow,
                            int64_t row_bytes, int64_t groups, int64_t gp, const float *srow, int per_group, float *res) {
    PICK_TILE(TILE_BF)
}
#undef TILE_BF
#define BF16_SLOT(q) bf16_slot(q)
#else
#define HAVE_BF16 0
#define BF16_SLOT(q) (q)
#endif

static inline float load_x(const void *x, int xdt, int64_t i) {
    if (xdt == 0) return ((const float *)x)[i];
    if (xdt == 2) return (float)((const int8_t *)x)[i];
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)x)[i] << 16;          /* bfloat16 */
    return c.f;
}

static inline void store_y(void *y, int ydt, int64_t i, float v) {
    if (ydt == 0) { ((float *)y)[i] = v; return; }
    union { uint32_t u; float f; } c;
    c.f = v;
    uint32_t r = c.u + 0x7FFFu + ((c.u >> 16) & 1u);          /* bfloat16, round to nearest even */
    ((uint16_t *)y)[i] = (uint16_t)(r >> 16);
}

#if HAVE_BF16
/* Helpers of the two bfloat16 panel paths below (AVX-512 with BF16; AMX tiles). */
static inline __m512i bf16_row32_8(const int8_t *p) {     /* 32 int8 values -> 32 bfloat16 */
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);           /* a: the low half */
}

static inline __m512i bf16_row32_4(const uint8_t *p, __m256i tab) {   /* 16 bytes of int4 pairs */
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i lo = _mm256_permutexvar_epi16(v, tab);                       /* values 0..15 */
    __m256i hi = _mm256_permutexvar_epi16(_mm256_srli_epi16(v, 4), tab); /* values 16..31 */
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* r[i] element j -> r[j] element i, for 16 x 16 32-bit elements (a bfloat16 pair each) */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {           /* r[4i + q], lane L: column 4L + q of rows 4i..4i+3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    __m512i o[16];
    for (int q = 0; q < 4; q++) {
        __m512i s1 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x88), s2 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xDD);
        __m512i s3 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x88), s4 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xDD);
        o[q] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        o[8 + q] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
        o[4 + q] = _mm512_shuffle_i32x4(s2, s4, 0x88);
        o[12 + q] = _mm512_shuffle_i32x4(s2, s4, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = o[i];
}

/* Row `tok` of y, channels j0 .. j0 + nj (nj <= 32; v[0] holds 0-15, v[1] 16-31, mask[h] the
 * valid ones) in y's dtype (0 float32, 1 bfloat16, rounded to nearest even). Whole cache lines
 * (32 bfloat16 or 16 float32 channels, where y is aligned) go around the cache when `stream`
 * (y large): no read for ownership of lines that are overwritten whole (measured: 28 -> 18 ms,
 * 4096 x 576 x 3072, the GEMV's AMX path). */
static inline void store_row32(void *y, int ydt, int64_t ldy, int64_t tok, int64_t j0, int64_t nj,
                               const __mmask16 mask[2], const __m512 v[2], int stream) {
    if (ydt == 0) {
        for (int h = 0; h < 2; h++) {
            float *dst = (float *)y + tok * ldy + j0 + h * 16;
            if (stream && mask[h] == 0xFFFF && ((uintptr_t)dst & 63) == 0) _mm512_stream_ps(dst, v[h]);
            else if (mask[h]) _mm512_mask_storeu_ps(dst, mask[h], v[h]);
        }
    } else {
        uint16_t *dst = (uint16_t *)y + tok * ldy + j0;
        const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
        if (stream && nj == 32 && ((uintptr_t)dst & 63) == 0) _mm512_stream_si512((void *)dst, packed);
        else _mm512_mask_storeu_epi16(dst, (__mmask32)mask[0] | (__mmask32)mask[1] << 16, packed);
    }
}

/* The panel paths' end of one token's 32 channels: v[h] the float32 sums of channels 16h..16h+15
 * (per group already scaled; per channel times st here), minus sum over groups of offset * scale
 * * sum(x over the group) (xs: the token's group sums, NULL without offsets), plus bias, stored
 * in y's dtype. st / ost: scale and offset * scale as [group][32 channels] (panel_scales). */
static inline void finish_row32(__m512 v[2], int per_group, const float *st, const float *ost, const float *xs,
                                int64_t groups, const float *bias, void *y, int ydt, int64_t ldy, int64_t tok,
                                int64_t j0, int64_t nj, const __mmask16 mask[2], int stream) {
    for (int h = 0; h < 2; h++) {
        if (!per_group) v[h] = _mm512_mul_ps(v[h], _mm512_load_ps(st + h * 16));
        if (xs) {
            __m512 c = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g++)
                c = _mm512_add_ps(c, _mm512_mul_ps(_mm512_load_ps(ost + g * 32 + h * 16), _mm512_set1_ps(xs[g])));
            v[h] = _mm512_sub_ps(v[h], c);
        }
        if (bias) v[h] = _mm512_add_ps(v[h], _mm512_maskz_loadu_ps(mask[h], bias + j0 + h * 16));
    }
    store_row32(y, ydt, ldy, tok, j0, nj, mask, v, stream);
}

/* st[g][jj] = scale of channel j0 + jj in group g, ost the same times its offset (zeros past
 * the nj channels of a tail block, and for ost without offsets). */
static inline void panel_scales(const float *scale, const float *offset, int64_t j0, int64_t nj, int64_t groups,
                                float *st, float *ost) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t jj = 0; jj < 32; jj++) {
            const float sv = jj < nj ? scale[(j0 + jj) * groups + g] : 0.f;
            st[g * 32 + jj] = sv;
            ost[g * 32 + jj] = jj < nj && offset ? offset[(j0 + jj) * groups + g] * sv : 0.f;
        }
}

/* Larger batches (prefill) with bfloat16 activations on AVX512-BF16 without AMX tiles (mode 0,
 * from PANEL_MIN_M tokens on). A block of 32 output channels is converted once per span of
 * tokens into a panel of bfloat16 pairs, [in-feature pair][32 channels] (each int8 / int4 value
 * is exact in bfloat16), and VDPBF16PS multiplies one pair of a token, broadcast to every lane,
 * by the panel's 16 channels of that pair: the lanes are output channels, so the per-group
 * scales multiply whole vectors and no lane sums are added across (the GEMV above sums lanes
 * per row). A register tile is PANEL_MT tokens x 32 channels. Products of two bfloat16 values
 * are exact in float32; only the order of the float32 sums differs from the reference. */
#define PANEL_MT 6
#define PANEL_MIN_M 10

static inline __attribute__((always_inline)) void panel_tile(
        const int MT, const uint32_t *panel, const uint32_t *xp, int64_t ldp, int64_t groups, int64_t gpp,
        const float *st, int per_group, __m512 out[PANEL_MT][2]) {
    __m512 tot[PANEL_MT][2], acc[PANEL_MT][2];
    for (int t = 0; t < MT; t++) tot[t][0] = tot[t][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        for (int t = 0; t < MT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
        for (int64_t p = g * gpp; p < (g + 1) * gpp; p++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(panel + p * 32));
            const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(panel + p * 32 + 16));
            for (int t = 0; t < MT; t++) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[t * ldp + p]);
                acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, xb);
                acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, xb);
            }
        }
        if (per_group) {
            const __m512 s0 = _mm512_load_ps(st + g * 32), s1 = _mm512_load_ps(st + g * 32 + 16);
            for (int t = 0; t < MT; t++) {
                tot[t][0] = _mm512_fmadd_ps(acc[t][0], s0, tot[t][0]);
                tot[t][1] = _mm512_fmadd_ps(acc[t][1], s1, tot[t][1]);
            }
        } else {
            for (int t = 0; t < MT; t++) { tot[t][0] = acc[t][0]; tot[t][1] = acc[t][1]; }
        }
    }
    for (int t = 0; t < MT; t++) { out[t][0] = tot[t][0]; out[t][1] = tot[t][1]; }
}

#define PANEL_TILE(M) panel_tile(M, panel, xp + t0 * ldp, ldp, groups, gpp, st, per_group, out)

static void bf16_panel_gemm(const uint16_t *x, int64_t m, int64_t ldx, const void *w, int bits, int64_t n,
                            int64_t groups, int64_t gsz, int64_t gp, const float *scale, const float *offset,
                            const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    const int64_t kp = groups * gp, chunks = kp / 32, row_bytes = bits == 4 ? kp / 2 : kp;
    const int64_t ldp = kp / 2, gpp = gp / 2;          /* pairs per token, per group */
    /* the activations, [m][kp] bfloat16 with zeros in each group's padding (the padded weights
     * are zeros too, and 0 x garbage could be NaN) */
    uint32_t *xp = aligned_alloc(64, (size_t)(m * kp * 2 + 64) / 64 * 64);
    float *xsum = offset ? calloc((size_t)(m * groups), sizeof(float)) : NULL;
    if (!xp || (offset && !xsum)) { free(xp); free(xsum); *status = 1; return; }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < m; t++) {
        uint16_t *dst = (uint16_t *)xp + t * kp;
        for (int64_t g = 0; g < groups; g++) {
            memcpy(dst + g * gp, x + t * ldx + g * gsz, (size_t)(gsz * 2));
            memset(dst + g * gp + gsz, 0, (size_t)((gp - gsz) * 2));
            if (xsum) {
                float s = 0.f;
                for (int64_t i = 0; i < gsz; i++) s += load_x(x, 1, t * ldx + g * gsz + i);
                xsum[t * groups + g] = s;
            }
        }
    }
    const int per_group = groups > 1;
    const int64_t blocks = (n + 31) / 32;
    const int stream = m * n * (ydt == 0 ? 4 : 2) >= (4 << 20);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *panel = aligned_alloc(64, (size_t)(kp * 64));                   /* [kp / 2][32 ch] pairs */
        float *st = aligned_alloc(64, (size_t)(groups * 32 * 2 * sizeof(float)));  /* scale, offset * scale: [g][32 ch] */
        const __m256i tab = _mm256_loadu_si256((const __m256i *)BF16_INT4);
        if (!panel || !st) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *ost = st + groups * 32;
            /* tokens in spans of about 512 KiB of activations, which stay in a core's cache while
             * every block of channels passes over them (the panels are converted once per span) */
            const int64_t fit = 512 * 1024 / (kp * 2) / PANEL_MT * PANEL_MT, span = fit > 48 ? fit : 48;
            for (int64_t m0 = 0; m0 < m; m0 += span) {
                const int64_t m1 = m0 + span < m ? m0 + span : m;
#pragma omp for schedule(static)
                for (int64_t b = 0; b < blocks; b++) {
                    const int64_t j0 = b * 32, nj = n - j0 < 32 ? n - j0 : 32;
                    for (int h = 0; h < 2; h++)
                        for (int64_t c = 0; c < chunks; c++) {
                            __m512i r[16];
                            for (int i = 0; i < 16; i++) {
                                const int64_t j = j0 + h * 16 + i;
                                const uint8_t *src = (const uint8_t *)w + j * row_bytes;
                                r[i] = j >= n ? _mm512_setzero_si512()
                                     : bits == 4 ? bf16_row32_4(src + c * 16, tab) : bf16_row32_8((const int8_t *)src + c * 32);
                            }
                            transpose16(r);        /* r[q]: pair q of the chunk, 16 channels */
                            for (int q = 0; q < 16; q++)
                                _mm512_store_si512((void *)(panel + (c * 16 + q) * 32 + h * 16), r[q]);
                        }
                    panel_scales(scale, offset, j0, nj, groups, st, ost);
                    const __mmask16 mask[2] = {(__mmask16)(nj >= 16 ? 0xFFFF : (1u << nj) - 1),
                                               (__mmask16)(nj <= 16 ? 0 : nj >= 32 ? 0xFFFF : (1u << (nj - 16)) - 1)};
                    for (int64_t t0 = m0; t0 < m1; t0 += PANEL_MT) {
                        const int mt = m1 - t0 < PANEL_MT ? (int)(m1 - t0) : PANEL_MT;
                        __m512 out[PANEL_MT][2];
                        switch (mt) {
                            case 1: PANEL_TILE(1); break; case 2: PANEL_TILE(2); break; case 3: PANEL_TILE(3); break;
                            case 4: PANEL_TILE(4); break; case 5: PANEL_TILE(5); break; default: PANEL_TILE(6);
                        }
                        for (int t = 0; t < mt; t++) {
                            const int64_t tok = t0 + t;
                            finish_row32(out[t], per_group, st, ost, xsum ? xsum + tok * groups : NULL, groups, bias,
                                         y, ydt, ldy, tok, j0, nj, mask, stream);
                        }
                    }
                }
            }
        }
        free(panel);
        free(st);
        if (stream) _mm_sfence();
    }
    free(xp);
    free(xsum);
    if (failed) *status = 1;
}
#undef PANEL_TILE
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX (the `amx` build: -mamx-tile -mamx-bf16 on top of AVX512-BF16), bfloat16 activations in
 * mode 0 from AMX_MIN_M tokens on, prefill included. TDPBF16PS multiplies a 16 x 32 bfloat16
 * tile A by a 32 x 16 tile B (stored as 16 rows of in-feature pairs: B[r][j][p] = value
 * 2r + p of column j) into 16 x 16 float32 sums C. A is 16 output channels of weights:
 * a block of 32 channels is converted to bfloat16 exactly (integers of at most 8 significant
 * bits), row by row (sequential reads), into a per-thread panel that every tile of tokens
 * reuses. B is 16 tokens of activations, transposed into pair rows once per call (zeros in the
 * padding of groups and tokens). The C tiles ([channel][token]) hold the float32 sums over one
 * group; per-group scales multiply them as the vector path's lanes (mode 0 above); they are
 * transposed to [token][channel] for the offset, bias and store, as there. Products of two
 * bfloat16 values are exact in float32; only the order of the float32 sums differs from the
 * reference (AMX also treats denormal inputs and sums as zero). */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_MIN_M 4

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* Linux gives a process the AMX register state only when asked (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); without it the first tile instruction faults. */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
}

/* This thread's tile registers: all eight 16 rows x 64 bytes (palette 1). */
static inline void load_tiles_16x64(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}

static void amx_gemv(const uint16_t *x, int64_t m, int64_t ldx, const void *w, int bits, int64_t n,
                     int64_t groups, int64_t gsz, int64_t gp, const float *scale, const float *offset,
                     const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    const int64_t kp = groups * gp, chunks = kp / 32, row_bytes = bits == 4 ? kp / 2 : kp;
    const int64_t ttiles = (m + 15) / 16;
    /* xv: per tile of 16 tokens and chunk of 32 in-features, the B tile (16 pair rows x 16 tokens) */
    uint32_t *xv = aligned_alloc(64, (size_t)(ttiles * chunks * 1024));
    float *xsum = offset ? calloc((size_t)(m * groups), sizeof(float)) : NULL;
    int failed = !xv || (offset && !xsum);
#pragma omp parallel num_threads(nthreads) if (ttiles > 1)
    {
        uint16_t *rows = failed ? NULL : aligned_alloc(64, (size_t)(16 * kp * 2));   /* 16 tokens, padded */
        if (!failed && !rows) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t tt = 0; tt < ttiles; tt++) {
            if (!rows) continue;
            memset(rows, 0, (size_t)(16 * kp * 2));
            for (int64_t t = tt * 16; t < m && t < tt * 16 + 16; t++)
                for (int64_t g = 0; g < groups; g++) {
                    memcpy(rows + (t - tt * 16) * kp + g * gp, x + t * ldx + g * gsz, (size_t)(gsz * 2));
                    if (xsum) {
                        float s = 0.f;
                        for (int64_t i = 0; i < gsz; i++) s += load_x(x, 1, t * ldx + g * gsz + i);
                        xsum[t * groups + g] = s;
                    }
                }
            for (int64_t c = 0; c < chunks; c++) {
                __m512i r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512((const void *)(rows + i * kp + c * 32));
                transpose16(r);
                for (int i = 0; i < 16; i++) _mm512_store_si512((void *)(xv + (tt * chunks + c) * 256 + i * 16), r[i]);
            }
        }
        free(rows);
    }
    if (failed) { free(xv); free(xsum); *status = 1; return; }
    const int per_group = groups > 1;
    const int64_t blocks = (n + 31) / 32;
    const int stream = m * n * (ydt == 0 ? 4 : 2) >= (4 << 20);
#pragma omp parallel num_threads(nthreads)
    {
        load_tiles_16x64();
        uint16_t *panel = aligned_alloc(64, (size_t)(32 * kp * 2));               /* [32 ch][kp] bfloat16 */
        float *cb = aligned_alloc(64, 4 * 256 * sizeof(float));                 /* C tiles [tile][16 ch][16 tokens] */
        float *acc = aligned_alloc(64, 4 * 256 * sizeof(float));                /* per-group sums, same layout */
        float *st = aligned_alloc(64, (size_t)(groups * 32 * 2 * sizeof(float)));  /* scale, offset * scale: [g][32 ch] */
        const __m256i tab = _mm256_loadu_si256((const __m256i *)BF16_INT4);
        if (!panel || !cb || !acc || !st) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *ost = st + groups * 32;
            /* tokens in spans of about 512 KiB of activations, which stay in a core's cache while
             * every block of channels passes over them (the panels are converted once per span) */
            const int64_t fit = 512 * 1024 / (kp * 2) / 32 * 32, span = fit > 64 ? fit : 64;
            for (int64_t m0 = 0; m0 < m; m0 += span) {
            const int64_t m1 = m0 + span < m ? m0 + span : m;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t j0 = b * 32, nj = n - j0 < 32 ? n - j0 : 32;
                for (int64_t jj = 0; jj < 32; jj++) {
                    uint16_t *dst = panel + jj * kp;
                    if (jj >= nj) { memset(dst, 0, (size_t)(kp * 2)); continue; }
                    const uint8_t *src = (const uint8_t *)w + (j0 + jj) * row_bytes;
                    if (j0 + 32 + jj < n)       /* the next block's row into L2 (cold weights: ~10% faster) */
                        for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)src + 32 * row_bytes + o, _MM_HINT_T1);
                    for (int64_t c = 0; c < chunks; c++)
                        _mm512_store_si512((void *)(dst + c * 32), bits == 4 ? bf16_row32_4(src + c * 16, tab)
                                                                             : bf16_row32_8((const int8_t *)src + c * 32));
                }
                panel_scales(scale, offset, j0, nj, groups, st, ost);
                const __mmask16 mask[2] = {(__mmask16)(nj >= 16 ? 0xFFFF : (1u << nj) - 1),
                                           (__mmask16)(nj <= 16 ? 0 : nj >= 32 ? 0xFFFF : (1u << (nj - 16)) - 1)};
                for (int64_t t0 = m0; t0 < m1; t0 += 32) {
                    const int64_t nt = m1 - t0 < 32 ? m1 - t0 : 32;
                    const int two = nt > 16;
                    const uint32_t *xa = xv + (t0 / 16) * chunks * 256, *xb = xa + chunks * 256;
                    if (per_group) memset(acc, 0, 4 * 256 * sizeof(float));
                    for (int64_t g = 0; g < groups; g++) {
                        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                        for (int64_t c = g * gp / 32; c < (g + 1) * gp / 32; c++) {
                            _tile_loadd(4, panel + c * 32, kp * 2);             /* channels 0-15 */
                            _tile_loadd(5, panel + 16 * kp + c * 32, kp * 2);   /* channels 16-31 */
                            _tile_loadd(6, xa + c * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 5, 6);
                            if (two) {
                                _tile_loadd(7, xb + c * 256, 64);
                                _tile_dpbf16ps(2, 4, 7);
                                _tile_dpbf16ps(3, 5, 7);
                            }
                        }
                        _tile_stored(0, cb, 64);
                        _tile_stored(1, cb + 256, 64);
                        if (two) { _tile_stored(2, cb + 512, 64); _tile_stored(3, cb + 768, 64); }
                        if (per_group)
                            for (int tile = 0; tile < (two ? 4 : 2); tile++)
                                for (int i = 0; i < 16; i++) {
                                    float *a = acc + tile * 256 + i * 16;
                                    _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(cb + tile * 256 + i * 16),
                                                                       _mm512_set1_ps(st[g * 32 + (tile & 1) * 16 + i]),
                                                                       _mm512_load_ps(a)));
                                }
                    }
                    const float *sums = per_group ? acc : cb;
                    for (int u = 0; u < (two ? 2 : 1); u++) {     /* a tile of 16 tokens: [token][channel] */
                        __m512i r[2][16];
                        for (int h = 0; h < 2; h++) {
                            for (int i = 0; i < 16; i++) r[h][i] = _mm512_load_si512((const void *)(sums + (u * 2 + h) * 256 + i * 16));
                            transpose16(r[h]);
                        }
                        for (int64_t t = 0; t < 16 && u * 16 + t < nt; t++) {
                            const int64_t tok = t0 + u * 16 + t;
                            __m512 v[2] = {_mm512_castsi512_ps(r[0][t]), _mm512_castsi512_ps(r[1][t])};
                            finish_row32(v, per_group, st, ost, xsum ? xsum + tok * groups : NULL, groups, bias,
                                         y, ydt, ldy, tok, j0, nj, mask, stream);
                        }
                    }
                }
            }
            }
        }
        free(panel);
        free(cb);
        free(acc);
        free(st);
        _tile_release();
        if (stream) _mm_sfence();       /* the streamed lines are visible before the caller reads y */
    }
    free(xv);
    free(xsum);
    if (failed) *status = 1;
}
#else
#define HAVE_AMX 0
#endif

/* x: [m, k] with row stride ldx, dtype xdt (0 float32, 1 bfloat16, 2 int8); y: [m, n] with row
 * stride ldy, dtype ydt (0 float32, 1 bfloat16). offset, bias, pertoken may be NULL.
 * Returns through y only; a failed allocation leaves y untouched and sets *status = 1. */
void wq_int8_gemv(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *pertoken,
                  const void *w, int bits, int wfull, int64_t n, int64_t groups, int64_t gp, const float *scale,
                  const int32_t *qbias, const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status);

void wq_gemv(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx,
             const void *w, int bits, int64_t n, int64_t groups, int64_t gsz, int64_t gp,
             const float *scale, const float *offset, const float *bias, const float *pertoken,
             int mode, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    if (mode == 1 && groups == 1) {     /* per-channel int8 activations: in integers (wq_int8_gemv) */
        wq_int8_gemv(x, xdt, m, k, ldx, pertoken, w, bits, bits == 8, n, 1, gp, scale, NULL, bias, y, ydt, ldy, nthreads,
                     status);
        return;
    }
#if HAVE_AMX
    if (xdt == 1 && mode == 0 && m >= AMX_MIN_M && ldx % 2 == 0 && amx_permitted()) {
        amx_gemv(x, m, ldx, w, bits, n, groups, gsz, gp, scale, offset, bias, y, ydt, ldy, nthreads, status);
        return;
    }
#endif
#if HAVE_BF16
    if (xdt == 1 && mode == 0 && m >= PANEL_MIN_M) {
        bf16_panel_gemm(x, m, ldx, w, bits, n, groups, gsz, gp, scale, offset, bias, y, ydt, ldy, nthreads, status);
        return;
    }
#endif
    const int64_t kp = groups * gp;
    const int64_t row_bytes = bits == 4 ? kp / 2 : kp;
    const int use_bf16 = HAVE_BF16 && xdt == 1 && mode == 0;
    const int64_t gq = (gp + 63) / 64 * 64;           /* bfloat16 buffer: per group */
    const int64_t ldb = use_bf16 ? groups * gq : kp;   /* buffer elements per token */
    const size_t esz = use_bf16 ? 2 : 4;
    void *buf = aligned_alloc(64, (m * ldb * esz + 64) / 64 * 64);
    float *xsum = offset ? calloc((size_t)(m * groups), sizeof(float)) : NULL;
    if (!buf || (offset && !xsum)) { free(buf); free(xsum); *status = 1; return; }
    float *xb = buf;
    uint16_t *xh = buf;
    if (use_bf16) memset(buf, 0, m * ldb * esz);
    for (int64_t t = 0; t < m; t++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            if (use_bf16) {
                const uint16_t *src = (const uint16_t *)x + t * ldx + g * gsz;
                uint16_t *dst = xh + t * ldb + g * gq;
                for (int64_t i = 0; i < gsz; i++) {
                    dst[i / 64 * 64 + BF16_SLOT(i % 64)] = src[i];
                    if (xsum) s += load_x(src, 1, i);
                }
            } else {
                float *dst = xb + t * kp + g * gp;
                for (int64_t i = 0; i < gsz; i++) {
                    dst[i] = load_x(x, xdt, t * ldx + g * gsz + i);
                    s += dst[i];
                }
                for (int64_t i = gsz; i < gp; i++) dst[i] = 0.f;
            }
            if (xsum) xsum[t * groups + g] = s;
        }
    const int per_group = groups > 1;
    const int64_t blocks = (n + RB - 1) / RB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n * kp * (m < 4 ? m : 4) >= (1 << 16))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * RB, j1 = j0 + RB < n ? j0 + RB : n;
        float res[RB * MT_MAX];
        for (int64_t t0 = 0; t0 < m; t0 += MT_MAX) {
            int mt = m - t0 < MT_MAX ? (int)(m - t0) : MT_MAX;
            for (int64_t jr = j0; jr < j1;) {
                const void *wr = (const uint8_t *)w + jr * row_bytes;
                int done;
#if HAVE_BF16
                if (use_bf16)
                    done = tile_bf16((int)(j1 - jr), mt, bits, xh + t0 * ldb, ldb, gq, wr, row_bytes, groups, gp,
                                     scale + jr * groups, per_group, res);
                else
#endif
                    done = tile((int)(j1 - jr), mt, bits, xb + t0 * kp, kp, wr, row_bytes, groups, gp,
                                scale + jr * groups, per_group, mode == 1, res);
                for (int r = 0; r < done; r++) {
                    const int64_t j = jr + r;
                    const float *srow = scale + j * groups;
                    for (int t = 0; t < mt; t++) {
                        float v, rv = res[r * MT_MAX + t];
                        if (mode == 1) {
                            int32_t a;
                            memcpy(&a, &rv, 4);
                            v = (float)a * srow[0];
                            if (pertoken) v = v * pertoken[t0 + t];
                        } else {
                            v = per_group ? rv : rv * srow[0];
                            if (offset) {
                                float c = 0.f;
                                for (int64_t g = 0; g < groups; g++)
                                    c += offset[j * groups + g] * srow[g] * xsum[(t0 + t) * groups + g];
                                v = v - c;
                            }
                        }
                        if (bias) v = v + bias[j];
                        store_y(y, ydt, (t0 + t) * ldy + j, v);
                    }
                }
                jr += done;
            }
        }
    }
    free(buf);
    free(xsum);
}

/* Columns [start, end) of the dequantized weight, float32: out[j * ldo + (c - start)] =
 * (w[j, c] - offset[j, g]) * scale[j, g] with g = c / gsz (no offset: w * scale), the formula
 * and order of GemvWeight.dequantized; for the large-batch GEMMs of the `wq_linear` operator. */
void wq_dequant(const void *w, int bits, int64_t n, int64_t groups, int64_t gsz, int64_t gp, const float *scale,
                const float *offset, int64_t start, int64_t end, float *out, int64_t ldo, int nthreads) {
    const int64_t row_bytes = bits == 4 ? groups * gp / 2 : groups * gp;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n * (end - start) >= (1 << 16))
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = (const uint8_t *)w + j * row_bytes;
        float *o = out + j * ldo - start;
        for (int64_t g = start / gsz; g < groups && g * gsz < end; g++) {      /* no division per value */
            const int64_t c0 = start > g * gsz ? start : g * gsz, c1 = end < (g + 1) * gsz ? end : (g + 1) * gsz;
            const int64_t base = g * gp - g * gsz;                              /* layout index of column c: base + c */
            const float s = scale[j * groups + g], off = offset ? offset[j * groups + g] : 0.f;
            if (bits == 8) {
                const int8_t *r8 = (const int8_t *)row + base;
                if (offset) for (int64_t c = c0; c < c1; c++) o[c] = ((float)r8[c] - off) * s;
                else for (int64_t c = c0; c < c1; c++) o[c] = (float)r8[c] * s;
            } else {
#define INT4_AT(byte, hi) ((float)(((((hi) ? (byte) >> 4 : (byte)) & 0xF) ^ 8) - 8))
#define DEQ(v) (offset ? ((v) - off) * s : (v) * s)
                int64_t c = c0;
                for (; c < c1 && ((base + c) & 31); c++) {          /* up to a block of 32 */
                    const int64_t idx = base + c, p = idx & 31;
                    o[c] = DEQ(INT4_AT(row[(idx >> 5) * 16 + (p & 15)], p >= 16));
                }
                for (; c + 32 <= c1; c += 32) {                     /* whole blocks: 16 bytes, 32 values */
                    const uint8_t *b = row + ((base + c) >> 5) * 16;
                    for (int i = 0; i < 16; i++) {
                        o[c + i] = DEQ(INT4_AT(b[i], 0));
                        o[c + 16 + i] = DEQ(INT4_AT(b[i], 1));
                    }
                }
                for (; c < c1; c++) {
                    const int64_t idx = base + c, p = idx & 31;
                    o[c] = DEQ(INT4_AT(row[(idx >> 5) * 16 + (p & 15)], p >= 16));
                }
#undef DEQ
#undef INT4_AT
            }
        }
    }
}

/* x[i .. i + VW) of a float32 (xdt 0) or bfloat16 (xdt 1) row as floats */
static inline vf load_xv(const void *x, int xdt, int64_t i) {
#if VW == 16
    if (xdt == 0) return _mm512_loadu_ps((const float *)x + i);
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
#else
    if (xdt == 0) return _mm256_loadu_ps((const float *)x + i);
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
#endif
}

/* Per-token symmetric int8 quantization of x [m, k] (row stride ldx; float32 or bfloat16),
 * as numerics.quantize_activation_dynamic defines it: s_t = max|x_t| / 127 (1.0 for an
 * all-zero row), q = clamp(round_half_even(x / s_t), -127, 127). The division is an IEEE
 * division, as in the reference: x * (1 / s_t) differs from it by an ulp now and then, which
 * moves a value sitting on a rounding boundary to the other integer. q: [m, k] contiguous,
 * scale: [m]. quant_row is one row: x_t [k] -> q_t [k], returns s_t. */
/* VW values rounded half to even, clamped to [lo, hi], stored as int8 at q */
static inline void store_int8(int8_t *q, vf v, vf lo, vf hi) {
#if VW == 16
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
#else
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_cvtps_epi32(v)),
                                _mm256_extracti128_si256(_mm256_cvtps_epi32(v), 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(w, w));
#endif
}

static inline float quant_row(const char *row, int xdt, int64_t k, int8_t *qt) {
    float amax = 0.0f;
    int64_t i = 0;
#if VW == 16
    __m512 mx = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load_xv(row, xdt, i)));
    amax = _mm512_reduce_max_ps(mx);
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load_xv(row, xdt, i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#endif
    for (; i < k; i++) {
        float a = load_x(row, xdt, i);
        a = a < 0 ? -a : a;
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    i = 0;
    const vf vs = vset(s), lo = vset(-127.0f), hi = vset(127.0f);
#if VW == 16
    for (; i + VW <= k; i += VW) store_int8(qt + i, _mm512_div_ps(load_xv(row, xdt, i), vs), lo, hi);
#else
    for (; i + VW <= k; i += VW) store_int8(qt + i, _mm256_div_ps(load_xv(row, xdt, i), vs), lo, hi);
#endif
    for (; i < k; i++) {
        float v = __builtin_rintf(load_x(row, xdt, i) / s);   /* default rounding: half to even */
        qt[i] = (int8_t)(v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v));
    }
    return s;
}

void wq_quant_dynamic(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *scale,
                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * k >= (1 << 15))
    for (int64_t t = 0; t < m; t++)
        scale[t] = quant_row((const char *)x + t * ldx * (xdt == 1 ? 2 : 4), xdt, k, q + t * k);
}

/* bfloat16 of a float, rounding to nearest even (as torch converts; no NaN here: the inputs are
 * finite activations). */
static inline float round_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    c.u = (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) & 0xFFFF0000u;
    return c.f;
}

/* The gated MLP's product quantized per token: h_t = [g_t, u_t] (2k values, the gate already
 * through SiLU), a_t = g_t * u_t in h's dtype (bfloat16: the float product rounded to nearest
 * even, as torch multiplies two bfloat16 tensors), then wq_quant_dynamic's q_t and s_t of a_t.
 * One pass over h instead of torch's multiply plus the quantizer's read of its output. */
void wq_glu_quant_dynamic(const void *h, int hdt, int64_t m, int64_t k, int64_t ldh, int8_t *q, float *scale,
                          int nthreads) {
#pragma omp parallel num_threads(nthreads) if (m * k >= (1 << 15))
    {
        float *a = (float *)malloc((size_t)k * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            const char *row = (const char *)h + t * ldh * (hdt == 1 ? 2 : 4);
            int64_t j = 0;
#if VW == 16
            const __m512i lsb = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF),
                          top = _mm512_set1_epi32((int)0xFFFF0000u);
            for (; j + 16 <= k; j += 16) {
                __m512 p = _mm512_mul_ps(load_xv(row, hdt, j), load_xv(row, hdt, k + j));
                if (hdt == 1) {
                    __m512i u = _mm512_castps_si512(p);
                    u = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), lsb)));
                    p = _mm512_castsi512_ps(_mm512_and_si512(u, top));
                }
                _mm512_storeu_ps(a + j, p);
            }
#else
            const __m256i lsb = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF),
                          top = _mm256_set1_epi32((int)0xFFFF0000u);
            for (; j + 8 <= k; j += 8) {
                __m256 p = _mm256_mul_ps(load_xv(row, hdt, j), load_xv(row, hdt, k + j));
                if (hdt == 1) {
                    __m256i u = _mm256_castps_si256(p);
                    u = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), lsb)));
                    p = _mm256_castsi256_ps(_mm256_and_si256(u, top));
                }
                _mm256_storeu_ps(a + j, p);
            }
#endif
            for (; j < k; j++) {
                float p = load_x(row, hdt, j) * load_x(row, hdt, k + j);
                a[j] = hdt == 1 ? round_bf16(p) : p;
            }
            scale[t] = quant_row((const char *)a, 0, k, q + t * k);
        }
        free(a);
    }
}

/* The online rotation of a Linear's input (numerics.rotate_activation, input_rotation):
 * y_t = ((x_t * signs) · (H_{2^r} ⊗ P)) * inv (inv = float32 of 1 / sqrt(k)) in float32, y in
 * x's dtype (bfloat16 rounded to nearest even, as torch converts). P is the c x c Paley core
 * (c = 1: H is Sylvester alone). A row viewed as [2^r, c]: each c-chunk is multiplied by P, then
 * the Sylvester part runs as the fast Walsh-Hadamard butterflies between chunks (H_{2^r} is
 * symmetric, so H^T X = H X): with c = 1 the first log2(VW) stages inside each vector (lane
 * permutes), the rest two stages a pass over the row (radix 4), one pass for an odd stage left.
 * k log2 k adds a row instead of the k^2 of a dense Q, on a row that stays in L1. The order of
 * the float additions is not torch's: equal to numerics within the tests' tolerance.
 * Rows spread over the threads. */
#if VW == 16
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline void vst(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vneg_lanes(vf a, const int32_t *mask) {     /* flip the sign of the masked lanes */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_loadu_si512(mask)));
}
/* the 16-point Walsh-Hadamard transform of a vector's lanes (stages 1, 2, 4, 8) */
static inline vf fwht_lanes(vf v) {
    static const int32_t m1[16] = {0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN,
                                   0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN};
    static const int32_t m2[16] = {0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN,
                                   0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN};
    static const int32_t m4[16] = {0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                                   0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    static const int32_t m8[16] = {0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                                   INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    v = vadd(_mm512_permute_ps(v, 0xB1), vneg_lanes(v, m1));     /* lane i: a_i ± a_(i^1) */
    v = vadd(_mm512_permute_ps(v, 0x4E), vneg_lanes(v, m2));
    v = vadd(_mm512_shuffle_f32x4(v, v, 0xB1), vneg_lanes(v, m4));
    return vadd(_mm512_shuffle_f32x4(v, v, 0x4E), vneg_lanes(v, m8));
}
static inline void store_row_v(void *y, int ydt, int64_t i, vf v) {     /* VW values at y[i] */
    if (ydt == 0) { _mm512_storeu_ps((float *)y + i, v); return; }
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                         _mm512_set1_epi32(1))));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#else
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline void vst(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vneg_lanes(vf a, const int32_t *mask) {
    return _mm256_xor_ps(a, _mm256_loadu_ps((const float *)mask));
}
/* the 8-point Walsh-Hadamard transform of a vector's lanes (stages 1, 2, 4) */
static inline vf fwht_lanes(vf v) {
    static const int32_t m1[8] = {0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN};
    static const int32_t m2[8] = {0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN};
    static const int32_t m4[8] = {0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    v = vadd(_mm256_permute_ps(v, 0xB1), vneg_lanes(v, m1));     /* lane i: a_i ± a_(i^1) */
    v = vadd(_mm256_permute_ps(v, 0x4E), vneg_lanes(v, m2));
    return vadd(_mm256_permute2f128_ps(v, v, 1), vneg_lanes(v, m4));
}
static inline void store_row_v(void *y, int ydt, int64_t i, vf v) {
    if (ydt == 0) { _mm256_storeu_ps((float *)y + i, v); return; }
    __m256i u = _mm256_castps_si256(v);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                                         _mm256_set1_epi32(1))));
    u = _mm256_srli_epi32(u, 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
#endif

/* Static per-tensor int8 quantization (W8A8), as numerics.quantize_activation_static defines it
 * with its parameters already rounded (numerics.static_activation_params): q = clamp(round_half_even(
 * x * inv + offset), -128, 127), the product and the sum each rounded to float32 (no FMA: this
 * file is built with -ffp-contract=off). x [m, k] with row stride ldx, float32 or bfloat16; q:
 * [m, k] contiguous. */
void wq_quant_static(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, float inv, float offset, int8_t *q,
                     int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * k >= (1 << 15))
    for (int64_t t = 0; t < m; t++) {
        const char *row = (const char *)x + t * ldx * (xdt == 1 ? 2 : 4);
        int8_t *qt = q + t * k;
        int64_t i = 0;
        const vf vi = vset(inv), vo = vset(offset), lo = vset(-128.0f), hi = vset(127.0f);
        for (; i + VW <= k; i += VW) store_int8(qt + i, vadd(vmul(load_xv(row, xdt, i), vi), vo), lo, hi);
        for (; i < k; i++) {
            float v = load_x(row, xdt, i) * inv;
            v = __builtin_rintf(v + offset);
            qt[i] = (int8_t)(v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v));
        }
    }
}

/* The float32 epilogue of an int8 GEMM in one pass, as reference.int8_epilogue computes it:
 * y = (float(acc + qbias[j]) * scale[j]) * pertoken[t] + bias[j], then y's dtype (float32, or
 * bfloat16 rounded to nearest even). acc: int32 [m, n] contiguous (the int32 sum wraps as
 * torch's does); qbias, pertoken, bias may be NULL; y: [m, n] contiguous. One pass instead of
 * torch's four, each of which allocates an [m, n] result (page faults on every prefill call). */
static inline vf acc_float(const int32_t *a, const int32_t *qb) {
#if VW == 16
    __m512i v = _mm512_loadu_si512((const void *)a);
    if (qb) v = _mm512_add_epi32(v, _mm512_loadu_si512((const void *)qb));
    return _mm512_cvtepi32_ps(v);
#else
    __m256i v = _mm256_loadu_si256((const __m256i *)a);
    if (qb) v = _mm256_add_epi32(v, _mm256_loadu_si256((const __m256i *)qb));
    return _mm256_cvtepi32_ps(v);
#endif
}

void wq_int8_epilogue(const int32_t *acc, int64_t m, int64_t n, const int32_t *qbias, const float *scale,
                      const float *pertoken, const float *bias, void *y, int ydt, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * n >= (1 << 15))
    for (int64_t t = 0; t < m; t++) {
        const int32_t *a = acc + t * n;
        int64_t j = 0;
        for (; j + VW <= n; j += VW) {
            vf v = vmul(acc_float(a + j, qbias ? qbias + j : NULL), vld(scale + j));
            if (pertoken) v = vmul(v, vset(pertoken[t]));
            if (bias) v = vadd(v, vld(bias + j));
            store_row_v(y, ydt, t * n + j, v);
        }
        for (; j < n; j++) {
            int32_t q = qbias ? (int32_t)((uint32_t)a[j] + (uint32_t)qbias[j]) : a[j];
            float v = (float)q * scale[j];
            if (pertoken) v = v * pertoken[t];
            if (bias) v = v + bias[j];
            store_y(y, ydt, t * n + j, v);
        }
    }
}

#define HD_CMAX 64      /* cores up to this order take the vector product below */

/* one butterfly pass of stride h (stages h and, with `two`, 2h) over b[0 .. k) */
static inline void fwht_pass(float *b, int64_t k, int64_t h, int two) {
    const int64_t step = two ? 4 * h : 2 * h;
    for (int64_t s = 0; s < k; s += step) {
        float *p0 = b + s, *p1 = p0 + h, *p2 = p1 + h, *p3 = p2 + h;
        int64_t j = 0;
        if (two) {
            for (; j + VW <= h; j += VW) {
                vf a0 = vld(p0 + j), a1 = vld(p1 + j), a2 = vld(p2 + j), a3 = vld(p3 + j);
                vf t0 = vadd(a0, a1), t1 = vsub(a0, a1), t2 = vadd(a2, a3), t3 = vsub(a2, a3);
                vst(p0 + j, vadd(t0, t2)); vst(p1 + j, vadd(t1, t3));
                vst(p2 + j, vsub(t0, t2)); vst(p3 + j, vsub(t1, t3));
            }
            for (; j < h; j++) {
                const float t0 = p0[j] + p1[j], t1 = p0[j] - p1[j], t2 = p2[j] + p3[j], t3 = p2[j] - p3[j];
                p0[j] = t0 + t2; p1[j] = t1 + t3; p2[j] = t0 - t2; p3[j] = t1 - t3;
            }
        } else {
            for (; j + VW <= h; j += VW) {
                vf a0 = vld(p0 + j), a1 = vld(p1 + j);
                vst(p0 + j, vadd(a0, a1)); vst(p1 + j, vsub(a0, a1));
            }
            for (; j < h; j++) {
                const float a = p0[j], d = p1[j];
                p0[j] = a + d; p1[j] = a - d;
            }
        }
    }
}

/* o[s .. s + c) = b[s .. s + c) · P for every chunk s of c values, P's rows padded to cp = NVC
 * vectors (NVC = HD_CMAX / VW: any cp up to HD_CMAX, the loop bounded by cp); four chunks at a
 * time, so that 4 x NVC independent FMA chains hide the FMA latency. */
static inline __attribute__((always_inline)) void core_chunks(const int NVC, const float *b, float *o, int64_t k,
                                                              const float *pc, int64_t c, int64_t cp) {
    const int64_t nv = NVC == HD_CMAX / VW ? cp / VW : NVC;
    int64_t s = 0;
    for (; s + 4 * c <= k; s += 4 * c) {
        vf a0[HD_CMAX / VW], a1[HD_CMAX / VW], a2[HD_CMAX / VW], a3[HD_CMAX / VW];
        for (int64_t v = 0; v < nv; v++) a0[v] = a1[v] = a2[v] = a3[v] = vzero();
        for (int64_t i = 0; i < c; i++) {
            const vf x0 = vset(b[s + i]), x1 = vset(b[s + c + i]), x2 = vset(b[s + 2 * c + i]),
                     x3 = vset(b[s + 3 * c + i]);
            for (int64_t v = 0; v < nv; v++) {
                const vf p = vld(pc + i * cp + v * VW);
                a0[v] = vfma(x0, p, a0[v]); a1[v] = vfma(x1, p, a1[v]);
                a2[v] = vfma(x2, p, a2[v]); a3[v] = vfma(x3, p, a3[v]);
            }
        }
        for (int64_t v = 0; v < nv; v++) vst(o + s + v * VW, a0[v]);      /* in order: each chunk's padding */
        for (int64_t v = 0; v < nv; v++) vst(o + s + c + v * VW, a1[v]);  /* is overwritten by the next one */
        for (int64_t v = 0; v < nv; v++) vst(o + s + 2 * c + v * VW, a2[v]);
        for (int64_t v = 0; v < nv; v++) vst(o + s + 3 * c + v * VW, a3[v]);
    }
    for (; s < k; s += c) {
        vf a0[HD_CMAX / VW];
        for (int64_t v = 0; v < nv; v++) a0[v] = vzero();
        for (int64_t i = 0; i < c; i++) {
            const vf x0 = vset(b[s + i]);
            for (int64_t v = 0; v < nv; v++) a0[v] = vfma(x0, vld(pc + i * cp + v * VW), a0[v]);
        }
        for (int64_t v = 0; v < nv; v++) vst(o + s + v * VW, a0[v]);
    }
}

/* b [k] <- b · (H_{2^r} ⊗ P); pc: P's rows padded to cp floats (c <= HD_CMAX), else P itself
 * (c x c); o: k + cp floats of scratch. Returns the buffer that holds the result (b or o). With
 * c = 1 and k a multiple of VW the caller has run the in-vector stages (fwht_lanes) already. */
static float *hadamard_row(float *b, int64_t k, const float *pc, int64_t c, int64_t cp, float *o) {
    int64_t h = c;
    if (c > 1 && c <= HD_CMAX) {         /* chunk by chunk into o, whole vectors (the padding lands on the next chunk) */
        const int64_t nv = cp / VW;
        if (nv == 1) core_chunks(1, b, o, k, pc, c, cp);
        else if (nv == 2) core_chunks(2, b, o, k, pc, c, cp);
        else core_chunks(HD_CMAX / VW, b, o, k, pc, c, cp);
        b = o;
    } else if (c > 1) {
        for (int64_t s = 0; s < k; s += c)
            for (int64_t j = 0; j < c; j++) {
                float a = 0.f;
                for (int64_t i = 0; i < c; i++) a += b[s + i] * pc[i * c + j];
                o[s + j] = a;
            }
        b = o;
    } else if (k % VW == 0) {            /* c = 1: the in-vector stages ran as the row was loaded */
        h = VW;
    }
    for (; 4 * h <= k; h *= 4) fwht_pass(b, k, h, 1);
    if (2 * h <= k) fwht_pass(b, k, h, 0);
    return b;
}

void wq_hadamard(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *signs, const float *core,
                 int64_t c, float inv, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    const int64_t cp = c <= HD_CMAX ? (c + VW - 1) / VW * VW : c;
    float *pc = (float *)aligned_alloc(64, ((size_t)(c * cp) * sizeof(float) + 63) / 64 * 64);
    if (!pc) { *status = 1; return; }
    for (int64_t i = 0; i < c; i++)
        for (int64_t j = 0; j < cp; j++) pc[i * cp + j] = j < c ? core[i * c + j] : 0.f;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (m * k >= (1 << 14)) reduction(| : failed)
    {
        float *b = (float *)aligned_alloc(64, ((size_t)(2 * k + cp) * sizeof(float) + 63) / 64 * 64);
        if (!b) failed = 1;
        const vf vinv = vset(inv);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            if (!b) continue;
            const char *row = (const char *)x + t * ldx * (xdt == 1 ? 2 : 4);
            int64_t i = 0;
            if (c == 1 && k % VW == 0)       /* the first log2(VW) stages in registers (hadamard_row) */
                for (; i < k; i += VW) vst(b + i, fwht_lanes(vmul(load_xv(row, xdt, i), vld(signs + i))));
            for (; i + VW <= k; i += VW) vst(b + i, vmul(load_xv(row, xdt, i), vld(signs + i)));
            for (; i < k; i++) b[i] = load_x(row, xdt, i) * signs[i];
            const float *r = hadamard_row(b, k, pc, c, cp, b + k);
            char *out = (char *)y + t * ldy * (ydt == 1 ? 2 : 4);
            for (i = 0; i + VW <= k; i += VW) store_row_v(out, ydt, i, vmul(vld(r + i), vinv));
            for (; i < k; i++) store_y(out, ydt, i, r[i] * inv);
        }
        free(b);
    }
    free(pc);
    *status = failed;
}

/* The int8-activation Linear in integers, on AVX2 instructions in every build: the int8 GEMM of
 * CPUs without VNNI (`ASCEND_QUANT_CPU_GEMM=gemv`), mode 1 of wq_gemv, and two-stage per-group
 * W4A8 everywhere. Weights in the GEMV layout above (`groups` groups of gp values a row, gp a
 * multiple of 32). Per channel (groups = 1):
 *
 *     y[t, j] = (((acc[t, j] + qbias[j]) * scale[j]) * s_t[t]) + bias[j],  acc = x_q @ w^T (int32)
 *
 * the reference's epilogue in its order, float32, cast to y's dtype last; x as wq_int8_linear
 * takes it (int8 with `pertoken` or none, or float32 / bfloat16 quantized here by quant_row).
 * Per group (groups > 1, no qbias): the exact int32 sums of each group, converted per vector lane
 * and multiplied by the group's scale into float32 lanes (the float path's order: lanes, then
 * their sum), then * s_t[t] + bias[j].
 * VPMADDUBSW multiplies 32 unsigned by 32 signed bytes into 16 int16 pair sums, VPMADDWD by
 * ones widens them to int32. The operands are chosen so that no pair sum saturates (|sum| < 2^15):
 *   int4, per channel: unsigned = the weight + 8 (0..15: the nibble XOR 8), signed = x_q: pairs
 *         at most 2 * 15 * 128; the 8 * sum(x_q) this adds is subtracted per token at the end.
 *   int8, and int4 per group, one of two forms (VPSIGNB cannot negate -128), chosen per call:
 *         form 1: unsigned = |w| (at most 128), signed = x_q with w's sign, while no x_q is -128
 *                 (activations quantized here lie in [-127, 127]; int8 ones handed in, xdt 2,
 *                 are checked while copied);
 *         form 2: unsigned = |x_q|, signed = w with x_q's sign, for a call whose x_q holds a
 *                 -128, while no weight is -128 (`wfull` = 0: the caller knows its weights;
 *                 int4 never is). Pairs at most 2 * 128 * 127 either way.
 *         A call with both (an x_q of -128, int8 weights holding -128) returns *status = 3 with
 *         y untouched: the callers then take the exact float32 k-chunk GEMMs.
 * Exact while gp * 128 * 128 < 2^31. Output channels in blocks of RB over the threads. */
static inline int32_t hsum_epi32(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline float hsum_ps256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* R output channels x MT tokens. Per channel (G = 0): res[r * MT_MAX + t] holds acc as int32 bits
 * (int4: before the 8 * sum(x_q) correction). Per group (G = 1): the scaled float32 sum. */
static inline __attribute__((always_inline)) void row_tile_int(
        const int R, const int MT, const int BITS, const int G, const int FORM, const int8_t *xq, const uint8_t *xa,
        int64_t ldb, const uint8_t *wrow, int64_t row_bytes, int64_t groups, int64_t gp, const float *srow, float *res) {
    __m256i acc[RB][MT_MAX];
    __m256 tot[RB][MT_MAX];
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    const __m128i flip = _mm_set1_epi8((char)0x88);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MT; t++) tot[r][t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        for (int r = 0; r < R; r++)
            for (int t = 0; t < MT; t++) acc[r][t] = _mm256_setzero_si256();
        for (int64_t i = g * gp; i < (g + 1) * gp; i += 32) {
            for (int r = 0; r < R; r++) {
                __m256i w;
                if (BITS == 4) {    /* 16 bytes: values i..i+15 in the low nibbles, i+16..i+31 in the high */
                    const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(wrow + r * row_bytes + i / 2)), flip);
                    w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);     /* weight + 8 */
                    if (G) w = _mm256_sub_epi8(w, eight);
                } else {
                    w = _mm256_loadu_si256((const __m256i *)(wrow + r * row_bytes + i));
                }
                /* FORM 0: int4 + 8 per channel; 1: |w| (|-128| reads as unsigned 128); 2: |x_q| from xa */
                const __m256i wu = FORM == 1 ? _mm256_abs_epi8(w) : w;
                for (int t = 0; t < MT; t++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + t * ldb + i));
                    const __m256i p = FORM == 0 ? _mm256_maddubs_epi16(wu, x)
                                    : FORM == 1 ? _mm256_maddubs_epi16(wu, _mm256_sign_epi8(x, w))
                                    : _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xa + t * ldb + i)),
                                                           _mm256_sign_epi8(w, x));
                    acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(p, ones));
                }
            }
        }
        if (G)
            for (int r = 0; r < R; r++) {
                const __m256 sc = _mm256_set1_ps(srow[r * groups + g]);
                for (int t = 0; t < MT; t++) tot[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][t]), sc, tot[r][t]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < MT; t++) {
            if (G) {
                res[r * MT_MAX + t] = hsum_ps256(tot[r][t]);
            } else {
                const int32_t a = hsum_epi32(acc[r][t]);
                memcpy(&res[r * MT_MAX + t], &a, 4);
            }
        }
}

#define TILE_INT(R, M) { \
    if (form == 0) row_tile_int(R, M, 4, 0, 0, xq, xa, ldb, wrow, row_bytes, 1, gp, srow, res); \
    else if (groups > 1 && form == 1) row_tile_int(R, M, 4, 1, 1, xq, xa, ldb, wrow, row_bytes, groups, gp, srow, res); \
    else if (groups > 1) row_tile_int(R, M, 4, 1, 2, xq, xa, ldb, wrow, row_bytes, groups, gp, srow, res); \
    else if (form == 1) row_tile_int(R, M, 8, 0, 1, xq, xa, ldb, wrow, row_bytes, 1, gp, srow, res); \
    else row_tile_int(R, M, 8, 0, 2, xq, xa, ldb, wrow, row_bytes, 1, gp, srow, res); }

static inline int tile_int(int rows, int mt, int form, const int8_t *xq, const uint8_t *xa, int64_t ldb,
                           const uint8_t *wrow, int64_t row_bytes, int64_t groups, int64_t gp, const float *srow,
                           float *res) {
    PICK_TILE(TILE_INT)
}
#undef TILE_INT

void wq_int8_gemv(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *pertoken,
                  const void *w, int bits, int wfull, int64_t n, int64_t groups, int64_t gp, const float *scale,
                  const int32_t *qbias, const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    if (groups > 1 && bits != 4) { *status = 2; return; }      /* per group: int4 only */
    if (m <= 0) return;
    const int64_t kp = groups * gp, gsz = k / groups;
    const int grouped = groups > 1;
    const size_t xbytes = ((size_t)(m * kp) + 63) / 64 * 64;
    int8_t *xq = aligned_alloc(64, xbytes);
    const int signed_x = bits == 8 || grouped;      /* the VPSIGNB forms: no x_q may be -128 */
    float *st = malloc((size_t)m * sizeof(float));
    int32_t *xs = malloc((size_t)m * sizeof(int32_t));               /* sum(x_q) per token */
    int8_t *tmp = xdt != 2 && grouped ? malloc((size_t)(m * k)) : NULL;   /* x_q before the group padding */
    if (!xq || !st || !xs || (xdt != 2 && grouped && !tmp)) {
        free(xq); free(st); free(xs); free(tmp); *status = 1; return;
    }
    int minus128 = 0;
    const int esz = xdt == 0 ? 4 : xdt == 1 ? 2 : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(|:minus128) if (m * k >= (1 << 15))
    for (int64_t t = 0; t < m; t++) {
        int8_t *row = xq + t * kp;
        const char *src = (const char *)x + t * ldx * esz;
        const int8_t *q = (const int8_t *)src;
        if (xdt == 2) {
            st[t] = pertoken ? pertoken[t] : 1.f;
        } else {
            int8_t *dst = grouped ? tmp + t * k : row;
            st[t] = quant_row(src, xdt, k, dst);
            q = dst;
        }
        for (int64_t g = 0; g < groups; g++) {        /* each group's gsz values, then zeros up to gp */
            if (q != row || g) memmove(row + g * gp, q + g * gsz, (size_t)gsz);
            memset(row + g * gp + gsz, 0, (size_t)(gp - gsz));
        }
        int32_t s = 0;
        for (int64_t i = 0; i < kp; i++) {
            s += row[i];
            minus128 |= row[i] == -128;
        }
        xs[t] = s;
    }
    const int form = !signed_x ? 0 : !minus128 ? 1 : 2;
    if (form == 2 && bits == 8 && wfull) { free(xq); free(st); free(xs); free(tmp); *status = 3; return; }
    uint8_t *xa = form == 2 ? aligned_alloc(64, xbytes) : NULL;      /* |x_q| (form 2) */
    if (form == 2 && !xa) { free(xq); free(st); free(xs); free(tmp); *status = 1; return; }
    if (xa)
        for (int64_t i = 0; i < m * kp; i++) xa[i] = (uint8_t)(xq[i] < 0 ? -xq[i] : xq[i]);
    const int use_st = xdt != 2 || pertoken;
    const int64_t row_bytes = bits == 4 ? kp / 2 : kp, blocks = (n + RB - 1) / RB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n * kp * (m < 4 ? m : 4) >= (1 << 16))
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j0 = b * RB, j1 = j0 + RB < n ? j0 + RB : n;
        float res[RB * MT_MAX];
        /* per group at most 4 tokens a tile: its int32 and float32 accumulators both stay in registers */
        const int mt_max = grouped ? 4 : MT_MAX;
        for (int64_t t0 = 0; t0 < m; t0 += mt_max) {
            const int mt = m - t0 < mt_max ? (int)(m - t0) : mt_max;
            for (int64_t jr = j0; jr < j1;) {
                const int done = tile_int((int)(j1 - jr), mt, form, xq + t0 * kp, xa ? xa + t0 * kp : NULL, kp,
                                          (const uint8_t *)w + jr * row_bytes, row_bytes, groups, gp,
                                          scale + jr * groups, res);
                for (int r = 0; r < done; r++) {
                    const int64_t j = jr + r;
                    for (int t = 0; t < mt; t++) {
                        float v;
                        if (grouped) {
                            v = res[r * MT_MAX + t];
                        } else {
                            int32_t a;
                            memcpy(&a, &res[r * MT_MAX + t], 4);
                            if (bits == 4) a -= 8 * xs[t0 + t];
                            if (qbias) a += qbias[j];
                            v = (float)a * scale[j];
                        }
                        if (use_st) v = v * st[t0 + t];
                        if (bias) v = v + bias[j];
                        store_y(y, ydt, (t0 + t) * ldy + j, v);
                    }
                }
                jr += done;
            }
        }
    }
    free(xq);
    free(xa);
    free(st);
    free(xs);
    free(tmp);
}

/* The int8 x int8 Linear on AMX-INT8 tiles (the `amx` build with -mamx-int8):
 *
 *     y[t, j] = (((acc[t, j] + qbias[j]) * scale[j]) * s_t[t]) + bias[j],  acc = x_q @ w^T (int32)
 *
 * the reference's epilogue (runtime/kernels/reference.py: int8_epilogue) in its order, in
 * float32, cast to y's dtype last. x is either int8 (xdt 2: x_q given, s_t = pertoken[t] or
 * no multiply when pertoken is NULL) or float32 / bfloat16 (xdt 0 / 1: quantized here per
 * token by quant_row, wq_quant_dynamic's quantizer, into the tiles' buffer; s_t its scales).
 * qbias, bias may be NULL.
 *
 * Weight layout (made by runtime/kernels/cpu.py: AmxInt8Weight): n padded to a multiple of 32
 * channels and k to kp, a multiple of 64, with zeros; for each block of 32 channels and each
 * 64 in-features, two 1 KiB B tiles (channels 0-15, then 16-31), each 16 rows of 4 in-features
 * x 16 channels: byte ((b * kp/64 + c) * 2 + h) * 1024 + r * 64 + j * 4 + q holds
 * w[32 b + 16 h + j, 64 c + 4 r + q]. TDPBSSD multiplies a 16-token x 64 tile of x_q by one of
 * them into 16 x 16 int32 sums, exact (|acc| <= 127 * 128 * kp < 2^31 for kp < 2^17).
 * The output channels are spread over threads, tokens go in spans whose int8 rows stay in a
 * core's cache while every block of channels passes over them. Sets *status: 1 for a failed
 * allocation, 2 where this build or the kernel cannot run AMX-INT8 (y untouched). */
#if HAVE_AMX && defined(__AMX_INT8__)
#define PF_AHEAD 8192       /* bytes of weights prefetched ahead in decode (below) */
void wq_int8_linear(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *pertoken,
                    const int8_t *wp, int64_t n, int64_t kp, const float *scale, const int32_t *qbias,
                    const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    if (!amx_permitted() || kp % 64 || k > kp) { *status = 2; return; }
    const int64_t mp = (m + 15) / 16 * 16, kb = kp / 64, blocks = (n + 31) / 32;
    int8_t *xq = aligned_alloc(64, (size_t)(mp * kp));
    float *st = malloc((size_t)mp * sizeof(float));
    if (!xq || !st) { free(xq); free(st); *status = 1; return; }
    const int esz = xdt == 0 ? 4 : xdt == 1 ? 2 : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * k >= (1 << 15))
    for (int64_t t = 0; t < mp; t++) {
        int8_t *row = xq + t * kp;
        if (t >= m) { memset(row, 0, (size_t)kp); st[t] = 0.f; continue; }
        const char *src = (const char *)x + t * ldx * esz;
        if (xdt == 2) {
            memcpy(row, src, (size_t)k);
            st[t] = pertoken ? pertoken[t] : 1.f;
        } else {
            st[t] = quant_row(src, xdt, k, row);
        }
        if (kp > k) memset(row + k, 0, (size_t)(kp - k));
    }
    const int use_st = xdt != 2 || pertoken;
    const int stream = m * n * (ydt == 0 ? 4 : 2) >= (4 << 20);
    /* tokens per span: about 512 KiB of int8 rows, a multiple of 32 */
    const int64_t fit = 512 * 1024 / kp / 32 * 32, span = fit > 32 ? fit : 32;
#pragma omp parallel num_threads(nthreads)
    {
        load_tiles_16x64();
        int32_t cb[1024] __attribute__((aligned(64)));      /* C tiles [tile][16 tokens][16 ch] */
        for (int64_t m0 = 0; m0 < mp; m0 += span) {
            const int64_t m1 = m0 + span < mp ? m0 + span : mp;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t j0 = b * 32, nj = n - j0 < 32 ? n - j0 : 32;
                const int8_t *wb = wp + b * kb * 2048;
                const __mmask16 mask[2] = {(__mmask16)(nj >= 16 ? 0xFFFF : (1u << nj) - 1),
                                           (__mmask16)(nj <= 16 ? 0 : nj >= 32 ? 0xFFFF : (1u << (nj - 16)) - 1)};
                __m512 sc[2], bi[2];
                __m512i qb[2];
                for (int h = 0; h < 2; h++) {
                    sc[h] = _mm512_maskz_loadu_ps(mask[h], scale + j0 + h * 16);
                    bi[h] = bias ? _mm512_maskz_loadu_ps(mask[h], bias + j0 + h * 16) : _mm512_setzero_ps();
                    qb[h] = qbias ? _mm512_maskz_loadu_epi32(mask[h], qbias + j0 + h * 16) : _mm512_setzero_si512();
                }
                /* weights PF_AHEAD bytes ahead (into the next block's) into the cache on the first
                 * pass over them: in decode they come cold from memory and the tiles wait on them */
                const int pf = m0 == 0 && b + 1 < blocks;
                for (int64_t t0 = m0; t0 < m1; t0 += 32) {
                    const int two = m1 - t0 > 16;
                    const int8_t *xa = xq + t0 * kp, *xb = xa + 16 * kp;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t c = 0; c < kb; c++) {
                        if (pf && t0 == m0)
                            for (int o = 0; o < 2048; o += 64) _mm_prefetch((const char *)wb + c * 2048 + PF_AHEAD + o, _MM_HINT_T0);
                        _tile_loadd(6, wb + c * 2048, 64);           /* channels 0-15 */
                        _tile_loadd(7, wb + c * 2048 + 1024, 64);    /* channels 16-31 */
                        _tile_loadd(4, xa + c * 64, kp);
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbssd(1, 4, 7);
                        if (two) {
                            _tile_loadd(5, xb + c * 64, kp);
                            _tile_dpbssd(2, 5, 6);
                            _tile_dpbssd(3, 5, 7);
                        }
                    }
                    _tile_stored(0, cb, 64);
                    _tile_stored(1, cb + 256, 64);
                    if (two) { _tile_stored(2, cb + 512, 64); _tile_stored(3, cb + 768, 64); }
                    for (int64_t t = 0; t < (two ? 32 : 16) && t0 + t < m; t++) {
                        const int64_t tok = t0 + t;
                        const __m512 s = _mm512_set1_ps(st[tok]);
                        __m512 v[2];
                        for (int h = 0; h < 2; h++) {
                            __m512i a = _mm512_load_si512((const void *)(cb + ((t >> 4) * 2 + h) * 256 + (t & 15) * 16));
                            if (qbias) a = _mm512_add_epi32(a, qb[h]);
                            v[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(a), sc[h]);
                            if (use_st) v[h] = _mm512_mul_ps(v[h], s);
                            if (bias) v[h] = _mm512_add_ps(v[h], bi[h]);
                        }
                        store_row32(y, ydt, ldy, tok, j0, nj, mask, v, stream);
                    }
                }
            }
        }
        _tile_release();
        if (stream) _mm_sfence();
    }
    free(xq);
    free(st);
}
#else
void wq_int8_linear(const void *x, int xdt, int64_t m, int64_t k, int64_t ldx, const float *pertoken,
                    const int8_t *wp, int64_t n, int64_t kp, const float *scale, const int32_t *qbias,
                    const float *bias, void *y, int ydt, int64_t ldy, int nthreads, int *status) {
    (void)x; (void)xdt; (void)m; (void)k; (void)ldx; (void)pertoken; (void)wp; (void)n; (void)kp; (void)scale;
    (void)qbias; (void)bias; (void)y; (void)ydt; (void)ldy; (void)nthreads;
    *status = 2;        /* this build has no AMX-INT8 */
}
#endif
