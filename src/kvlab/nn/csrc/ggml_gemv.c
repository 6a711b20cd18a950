/* Matrix-vector products straight on llama.cpp's Q4_1 and Q8_0 blocks (AVX2 + FMA + F16C).
 *
 * Activations are quantised per 32-element block to int8 with one float scale (llama.cpp's
 * Q8 activations), so each block's dot product is integer: 32 multiply-adds in a handful of
 * instructions (maddubs), then one float multiply by the two blocks' scales. Weights stay in
 * the file's bytes: 20 bytes per 32 Q4_1 weights, 34 per 32 Q8_0 weights.
 *
 * Output rows are split over OpenMP threads; built with -fopenmp, this library shares the
 * libgomp.so.1 torch has already loaded, so torch.set_num_threads governs it too.
 *
 * Q4_1 block: fp16 d, fp16 m, 16 bytes (low nibbles = weights 0..15, high = 16..31); w = q d + m.
 * Q8_0 block: fp16 d, 32 int8;                                                   w = q d.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x[k] -> qx (int8), dx (scale per block), sx (dx * sum of the block's codes). */
void quantize_q8(const float *x, int k, int8_t *qx, float *dx, float *sx) {
    for (int b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)lrintf(xb[j] * inv);
            qx[b * QK + j] = (int8_t)q;
            sum += q;
        }
        dx[b] = d;
        sx[b] = d * (float)sum;
    }
}

/* One Q4_1 block's contribution, d * dx * (codes . act) accumulated into acc. */
static inline __m256 q4_1_block(const uint8_t *blk, const int8_t *q, float dx, __m256 acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
    __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)q)), ones);
    return _mm256_fmadd_ps(_mm256_set1_ps(fp16(blk) * dx), _mm256_cvtepi32_ps(dot), acc);
}

/* y[m, n] = sum_k w[n, k] x[m, k] for m rows of quantised activations; n rows [n0, n1).
 * Two accumulators per row break the fmadd latency chain (blocks alternate between them). */
void q4_1_gemm(const uint8_t *w, int n0, int n1, int k, int m, const int8_t *qx, const float *dx,
               const float *sx, float *y, int ldy) {
    const int nb = k / QK;
    const size_t row_bytes = (size_t)nb * 20;
#pragma omp parallel for schedule(static) if (n1 - n0 >= 256)
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int r = 0; r < m; r++) {
            const int8_t *q = qx + (size_t)r * k;
            const float *d8 = dx + (size_t)r * nb, *s8 = sx + (size_t)r * nb;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float off0 = 0.0f, off1 = 0.0f;
            int b = 0;
            for (; b + 1 < nb; b += 2) {
                acc0 = q4_1_block(row + b * 20, q + b * QK, d8[b], acc0);
                acc1 = q4_1_block(row + (b + 1) * 20, q + (b + 1) * QK, d8[b + 1], acc1);
                off0 += fp16(row + b * 20 + 2) * s8[b];
                off1 += fp16(row + (b + 1) * 20 + 2) * s8[b + 1];
            }
            for (; b < nb; b++) {
                acc0 = q4_1_block(row + b * 20, q + b * QK, d8[b], acc0);
                off0 += fp16(row + b * 20 + 2) * s8[b];
            }
            y[(size_t)r * ldy + n] = hsum(_mm256_add_ps(acc0, acc1)) + off0 + off1;
        }
    }
}

static inline __m256 q8_0_block(const uint8_t *blk, const int8_t *q, float dx, __m256 acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
    __m256i act = _mm256_loadu_si256((const __m256i *)q);
    /* signed x signed as |w| (unsigned) x (act carrying w's sign) */
    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(act, wq)), ones);
    return _mm256_fmadd_ps(_mm256_set1_ps(fp16(blk) * dx), _mm256_cvtepi32_ps(dot), acc);
}

void q8_0_gemm(const uint8_t *w, int n0, int n1, int k, int m, const int8_t *qx, const float *dx,
               float *y, int ldy) {
    const int nb = k / QK;
    const size_t row_bytes = (size_t)nb * 34;
#pragma omp parallel for schedule(static) if (n1 - n0 >= 256)
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        for (int r = 0; r < m; r++) {
            const int8_t *q = qx + (size_t)r * k;
            const float *d8 = dx + (size_t)r * nb;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            int b = 0;
            for (; b + 1 < nb; b += 2) {
                acc0 = q8_0_block(row + b * 34, q + b * QK, d8[b], acc0);
                acc1 = q8_0_block(row + (b + 1) * 34, q + (b + 1) * QK, d8[b + 1], acc1);
            }
            for (; b < nb; b++) acc0 = q8_0_block(row + b * 34, q + b * QK, d8[b], acc0);
            y[(size_t)r * ldy + n] = hsum(_mm256_add_ps(acc0, acc1));
        }
    }
}

/* y[m, n] = x[m, k] W^T for W in `kind` blocks (0: Q4_1, 1: Q8_0): quantise, then multiply. */
int ggml_linear(int kind, const uint8_t *w, int n, int k, int m, const float *x, float *y) {
    const size_t blocks = (size_t)m * (k / QK);
    int8_t *qx = malloc((size_t)m * k);
    float *dx = malloc(blocks * sizeof(float)), *sx = malloc(blocks * sizeof(float));
    if (!qx || !dx || !sx) {
        free(qx), free(dx), free(sx);
        return -1;
    }
    quantize_q8(x, m * k, qx, dx, sx);
    if (kind == 0)
        q4_1_gemm(w, 0, n, k, m, qx, dx, sx, y, n);
    else
        q8_0_gemm(w, 0, n, k, m, qx, dx, y, n);
    free(qx), free(dx), free(sx);
    return 0;
}

/* out[n, k] = the fp32 weights of rows [0, n) (prefill multiplies many rows at once: a float GEMM
 * on freshly dequantised weights beats re-running integer dot products per activation row). */
void ggml_dequantize(int kind, const uint8_t *w, int n, int k, float *out) {
    const int nb = k / QK, bytes = kind == 0 ? 20 : 34;
#pragma omp parallel for schedule(static) if (n >= 256)
    for (int r = 0; r < n; r++) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + ((size_t)r * nb + b) * bytes;
            float *o = out + (size_t)r * k + b * QK, d = fp16(blk);
            if (kind == 0) {
                float m = fp16(blk + 2);
                for (int j = 0; j < 16; j++) {
                    o[j] = (blk[4 + j] & 0x0F) * d + m;
                    o[j + 16] = (blk[4 + j] >> 4) * d + m;
                }
            } else {
                for (int j = 0; j < QK; j++) o[j] = (int8_t)blk[2 + j] * d;
            }
        }
    }
}
