/* GPTQ's column sweep over one block of columns (Frantar et al., 2022), for the calibrator.
 *
 * The weight is held transposed: row i of `w` (b rows of n floats) is column i1 + i of W.
 * For each column i of the block, every one of the n output channels (independently):
 *     q      = clamp(round_half_even(w[i] / s[i]), qmin, qmax)
 *     err    = (w[i] - q * s[i]) / hinv[i][i]
 *     w[l]  -= hinv[i][l] * err          for the block's later columns l > i
 * q goes to `q`, err to `err` (the caller applies the block's errors to the columns after
 * the block with one matrix product). `hinv` points at the block's diagonal element of the
 * upper Cholesky factor of H^-1, with row stride `ldh`.
 *
 * Channels are independent, so chunks of 64 are spread over OpenMP threads and each chunk's
 * rows stay in cache for the whole block. Compiled without -ffast-math: IEEE arithmetic,
 * nearbyintf rounds half to even like torch.round.
 */
#include <math.h>
#include <stdint.h>

#define CHUNK 64

void gptq_sweep_block(float *w, const float *s, float *q, float *err, const float *hinv,
                      int64_t b, int64_t n, int64_t ldh, float qmin, float qmax) {
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t j0 = c * CHUNK;
        int64_t m = n - j0 < CHUNK ? n - j0 : CHUNK;
        for (int64_t i = 0; i < b; i++) {
            float *wi = w + i * n + j0, *qi = q + i * n + j0, *ei = err + i * n + j0;
            const float *si = s + i * n + j0;
            const float *hi = hinv + i * ldh;
            float inv_d = 1.0f / hi[i];
            for (int64_t j = 0; j < m; j++) {
                float v = nearbyintf(wi[j] / si[j]);
                v = v < qmin ? qmin : (v > qmax ? qmax : v);
                qi[j] = v;
                ei[j] = (wi[j] - v * si[j]) * inv_d;
            }
            for (int64_t l = i + 1; l < b; l++) {
                float h = hi[l];
                float *wl = w + l * n + j0;
                for (int64_t j = 0; j < m; j++)
                    wl[j] -= h * ei[j];
            }
        }
    }
}
