/* Matrix-vector products on llama.cpp's Q4_1 and Q8_0 weights (AVX2 + FMA).
 *
 * Activations are quantised per 32-element block to int8 with one float scale (llama.cpp's
 * Q8 activations), so each block's dot product is integer: 32 multiply-adds in a handful of
 * instructions (maddubs), then one float multiply-add by the two blocks' scales.
 *
 * Weights are the file's blocks split into planes, so the inner loop does no fp16 work:
 *   Q4_1: codes [n, k/2] (per block 16 bytes: low nibbles = weights 0..15, high = 16..31),
 *         d [n, k/32], m [n, k/32] as float; w = q d + m.
 *   Q8_0: codes [n, k] int8, d [n, k/32] as float;                        w = q d.
 * Output rows are split over OpenMP threads; built with -fopenmp, this library shares the
 * libgomp.so.1 torch has already loaded, so torch.set_num_threads governs it too.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x[k] -> qx (int8), dx (scale per block), sx (dx * sum of the block's codes). */
static void quantize_q8(const float *x, size_t k, int8_t *qx, float *dx, float *sx) {
    for (size_t b = 0; b < k / QK; b++) {
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

static inline __m256i q4_codes(const uint8_t *c) {
    __m128i raw = _mm_loadu_si128((const __m128i *)c);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* y[r, n] = sum_k w[n, k] x[r, k]; two accumulators break the fmadd latency chain. */
static void q4_1_gemm(const uint8_t *codes, const float *d, const float *m, int n, int k, int rows,
                      const int8_t *qx, const float *dx, const float *sx, float *y) {
    const int nb = k / QK;
#pragma omp parallel for schedule(static) if (n >= 256)
    for (int o = 0; o < n; o++) {
        const uint8_t *c = codes + (size_t)o * nb * 16;
        const float *dr = d + (size_t)o * nb, *mr = m + (size_t)o * nb;
        for (int r = 0; r < rows; r++) {
            const int8_t *q = qx + (size_t)r * k;
            const float *d8 = dx + (size_t)r * nb, *s8 = sx + (size_t)r * nb;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float offsets = 0.0f;
            int b = 0;
            for (; b + 1 < nb; b += 2) {
                __m256i p0 = dot_u8s8(q4_codes(c + b * 16), _mm256_loadu_si256((const __m256i *)(q + b * QK)));
                __m256i p1 = dot_u8s8(q4_codes(c + (b + 1) * 16), _mm256_loadu_si256((const __m256i *)(q + (b + 1) * QK)));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dr[b] * d8[b]), _mm256_cvtepi32_ps(p0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dr[b + 1] * d8[b + 1]), _mm256_cvtepi32_ps(p1), acc1);
            }
            for (; b < nb; b++) {
                __m256i p0 = dot_u8s8(q4_codes(c + b * 16), _mm256_loadu_si256((const __m256i *)(q + b * QK)));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dr[b] * d8[b]), _mm256_cvtepi32_ps(p0), acc0);
            }
            for (b = 0; b < nb; b++) offsets += mr[b] * s8[b];  /* vectorised by the compiler */
            y[(size_t)r * n + o] = hsum(_mm256_add_ps(acc0, acc1)) + offsets;
        }
    }
}

static void q8_0_gemm(const int8_t *codes, const float *d, int n, int k, int rows, const int8_t *qx,
                      const float *dx, float *y) {
    const int nb = k / QK;
#pragma omp parallel for schedule(static) if (n >= 256)
    for (int o = 0; o < n; o++) {
        const int8_t *c = codes + (size_t)o * k;
        const float *dr = d + (size_t)o * nb;
        for (int r = 0; r < rows; r++) {
            const int8_t *q = qx + (size_t)r * k;
            const float *d8 = dx + (size_t)r * nb;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(c + b * QK));
                __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * QK));
                /* signed x signed as |w| (unsigned) x (a carrying w's sign) */
                __m256i p = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
                if (b & 1)
                    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dr[b] * d8[b]), _mm256_cvtepi32_ps(p), acc1);
                else
                    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dr[b] * d8[b]), _mm256_cvtepi32_ps(p), acc0);
            }
            y[(size_t)r * n + o] = hsum(_mm256_add_ps(acc0, acc1));
        }
    }
}

/* y[rows, n] = x[rows, k] W^T for W in `kind` (0: Q4_1, 1: Q8_0): quantise x, then multiply. */
int ggml_linear(int kind, const void *codes, const float *d, const float *m, int n, int k, int rows,
                const float *x, float *y) {
    const size_t blocks = (size_t)rows * (k / QK);
    int8_t *qx = malloc((size_t)rows * k);
    float *dx = malloc(blocks * sizeof(float)), *sx = malloc(blocks * sizeof(float));
    if (!qx || !dx || !sx) {
        free(qx), free(dx), free(sx);
        return -1;
    }
    quantize_q8(x, (size_t)rows * k, qx, dx, sx);
    if (kind == 0)
        q4_1_gemm(codes, d, m, n, k, rows, qx, dx, sx, y);
    else
        q8_0_gemm(codes, d, n, k, rows, qx, dx, y);
    free(qx), free(dx), free(sx);
    return 0;
}
