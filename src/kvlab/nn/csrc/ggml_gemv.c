/* Matrix-vector products on llama.cpp's Q4_1 and Q8_0 weights (AVX2 + FMA).
 *
 * Activations are quantised per 32-element block to int16 with one float scale, so each
 * block's dot product is integer: 32 multiply-adds in two madd instructions on the codes
 * widened to int16, then one float multiply-add by the two blocks' scales. quantize_act also
 * writes int8 codes, which ggml_gemm_x8.c's kind 3 multiplies Q4_1 weights with (llama.cpp's
 * arithmetic: faster, on steps 258 times coarser); here kind 3 runs as kind 0, on the int16 codes.
 *
 * Weights are planes (kvlab.nn.ggml.Planes, built from GGUF blocks without changing a
 * weight), so the inner loop does no fp16 work:
 *   kind 0 "q4_1": codes [n, k/2] (per 32 weights 16 bytes: low nibbles = weights 0..15,
 *                  high = 16..31), d [n, k/32], m [n, k/32] as float;   w = q d + m.
 *   kind 1 "q8_0": codes [n, k] int8, d [n, k/32] as float;             w = q d.
 *   kind 2 "q6_k": codes [n, k] int8, d [n, k/16] as float;             w = q d.
 * Output rows are split over OpenMP threads; built with -fopenmp, this library shares the
 * libgomp.so.1 torch has already loaded, so torch.set_num_threads governs it too.
 *
 * The products kvlab runs go through ggml_gemm_x8.c's interleaved copy of these planes; the
 * row-by-row loops below serve a qmatrix without that copy, and are the reference the
 * interleaved kernel is tested against (tests/nn/test_ggml.py).
 */
#include <math.h>
#include <stdlib.h>

#include "ggml_gemv.h"

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* Block b of x -> a's int16 codes and scale, int8 codes and scale, and exact sum, eight lanes
 * at a time: the codes are lrintf's (cvtps rounds to nearest even, as lrintf does in the
 * default mode); the sum is added in a tree rather than in order. */
static inline void quantize_block(const float *x, long b, const qacts *a) {
    const float *xb = x + b * QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
                 v3 = _mm256_loadu_ps(xb + 24);
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const float d = amax / 32767.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    const __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi)), c1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi)),
                  c2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi)), c3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi));
    /* packs interleaves 128-bit lanes: put the four quarters back in order */
    _mm256_storeu_si256((__m256i *)(a->q + b * QK), _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8));
    _mm256_storeu_si256((__m256i *)(a->q + b * QK + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(c2, c3), 0xD8));
    a->d[b] = d;
    a->s[b] = hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    const float d8 = amax / 127.0f, inv8 = d8 > 0.0f ? 1.0f / d8 : 0.0f;
    const __m256 vi8 = _mm256_set1_ps(inv8);
    const __m256i e0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi8)), e1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi8)),
                  e2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi8)), e3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi8));
    /* two packs leave four-byte groups in the order e0 e1 e2 e3 per 128-bit lane (low halves
     * in the first lane): one permute of 32-bit lanes puts them back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(e0, e1), _mm256_packs_epi32(e2, e3));
    _mm256_storeu_si256((__m256i *)(a->q8 + b * QK),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    a->d8[b] = d8;
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(e0, e1), _mm256_add_epi32(e2, e3));
    a->e8[b] = a->s[b] - d8 * (float)hsum_epi32(total);
}

void quantize_blocks(const float *x, long first, long last, const qacts *a) {
    for (long b = first; b < last; b++) quantize_block(x, b, a);
}

/* x[k] -> a for every block. Blocks are shared out with an orphaned `omp for`, as
 * qmatrix_gemm's rows are: inside the decode step's parallel region every thread quantises
 * (one worked while the other waited, a tenth of a 16-row step), outside it one does all. */
void quantize_act(const float *x, size_t k, const qacts *a) {
    const long blocks = (long)(k / QK);
#pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++) quantize_block(x, b, a);
}

/* Block b of output row o, widened to int16: weights 0..15 in *lo, 16..31 in *hi. */
static inline __attribute__((always_inline)) void unpack_block(int kind, const void *codes, int b, __m256i *lo,
                                                              __m256i *hi) {
    if (kind == 0) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)codes + b), low4 = _mm_set1_epi8(0x0F);
        *lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
    } else {
        const int8_t *c = (const int8_t *)codes + b * QK;
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
    }
}

/* acc + block b's 32 products with int16 activations q, times its weight scale(s) dr and the
 * activation block's scale dxb. madd sums the products in pairs into 8 int32 lanes; "q6_k"
 * has a scale per 16 weights, so its two halves are scaled apart. */
static inline __attribute__((always_inline)) __m256 block_fma(int kind, __m256i lo, __m256i hi, const int16_t *q,
                                                             const float *dr, int b, float dxb, __m256 acc) {
    const __m256i plo = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)q));
    const __m256i phi = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 16)));
    if (kind == 2) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dr[2 * b] * dxb), _mm256_cvtepi32_ps(plo), acc);
        return _mm256_fmadd_ps(_mm256_set1_ps(dr[2 * b + 1] * dxb), _mm256_cvtepi32_ps(phi), acc);
    }
    return _mm256_fmadd_ps(_mm256_set1_ps(dr[b] * dxb), _mm256_cvtepi32_ps(_mm256_add_epi32(plo, phi)), acc);
}

/* Where row o's codes and scales start. */
static inline const void *row_codes(const qmatrix *w, int kind, int o) {
    return (const uint8_t *)w->codes + (size_t)o * (w->k / QK) * (kind == 0 ? 16 : QK);
}

static inline const float *row_scales(const qmatrix *w, int kind, int o) {
    return w->d + (size_t)o * (w->k / (kind == 2 ? 16 : QK));
}

/* Output row o against activation rows r0 .. rows - 1, one at a time; two accumulators break
 * the fmadd latency chain. Inlined once per block kind, so the loops carry no kind test. */
static inline __attribute__((always_inline)) void single_rows(const qmatrix *w, int kind, int o, int r0, int rows,
                                                             const int16_t *qx, const float *dx, const float *sx,
                                                             float *y, int ldy, int accumulate) {
    const int k = w->k, nb = k / QK;
    const void *codes = row_codes(w, kind, o);
    const float *dr = row_scales(w, kind, o);
    for (int r = r0; r < rows; r++) {
        const int16_t *q = qx + (size_t)r * k;
        const float *d16 = dx + (size_t)r * nb;
        /* Q4_1's offsets first: independent of the products, so the two overlap */
        float sum = kind == 0 ? dot_f32(w->m + (size_t)o * nb, sx + (size_t)r * nb, nb) : 0.0f;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256i lo0, hi0, lo1, hi1;
        int b = 0;
        for (; b + 1 < nb; b += 2) {
            unpack_block(kind, codes, b, &lo0, &hi0);
            unpack_block(kind, codes, b + 1, &lo1, &hi1);
            acc0 = block_fma(kind, lo0, hi0, q + b * QK, dr, b, d16[b], acc0);
            acc1 = block_fma(kind, lo1, hi1, q + (b + 1) * QK, dr, b + 1, d16[b + 1], acc1);
        }
        if (b < nb) {
            unpack_block(kind, codes, b, &lo0, &hi0);
            acc0 = block_fma(kind, lo0, hi0, q + b * QK, dr, b, d16[b], acc0);
        }
        sum += hsum(_mm256_add_ps(acc0, acc1));
        y[(size_t)r * ldy + o] = accumulate ? y[(size_t)r * ldy + o] + sum : sum;
    }
}

#define TILE 4 /* activation rows per pass when there are several (a prompt, a batch) */

/* Output row o against activation rows r0 .. r0 + 3: each weight block is unpacked once for
 * the four rows, which is what makes several rows cheaper than one row several times. */
static inline __attribute__((always_inline)) void tile_rows(const qmatrix *w, int kind, int o, int r0,
                                                           const int16_t *qx, const float *dx, const float *sx,
                                                           float *y, int ldy, int accumulate) {
    const int k = w->k, nb = k / QK;
    const void *codes = row_codes(w, kind, o);
    const float *dr = row_scales(w, kind, o);
    const int16_t *q0 = qx + (size_t)r0 * k, *q1 = q0 + k, *q2 = q1 + k, *q3 = q2 + k;
    const float *d0 = dx + (size_t)r0 * nb, *d1 = d0 + nb, *d2 = d1 + nb, *d3 = d2 + nb;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256i lo, hi;
    for (int b = 0; b < nb; b++) {
        unpack_block(kind, codes, b, &lo, &hi);
        const int at = b * QK;
        a0 = block_fma(kind, lo, hi, q0 + at, dr, b, d0[b], a0);
        a1 = block_fma(kind, lo, hi, q1 + at, dr, b, d1[b], a1);
        a2 = block_fma(kind, lo, hi, q2 + at, dr, b, d2[b], a2);
        a3 = block_fma(kind, lo, hi, q3 + at, dr, b, d3[b], a3);
    }
    const __m256 acc[TILE] = {a0, a1, a2, a3};
    for (int t = 0; t < TILE; t++) {
        const size_t r = (size_t)(r0 + t);
        float sum = hsum(acc[t]);
        if (kind == 0) sum += dot_f32(w->m + (size_t)o * nb, sx + r * nb, nb); /* Q4_1's offsets */
        y[r * ldy + o] = accumulate ? y[r * ldy + o] + sum : sum;
    }
}

/* Output row o of W against every activation row: 4-row tiles, then the rest one by one. */
static inline __attribute__((always_inline)) void output_row(const qmatrix *w, int kind, int o, int rows,
                                                            const int16_t *qx, const float *dx, const float *sx,
                                                            float *y, int ldy, int accumulate) {
    const int tiled = rows / TILE * TILE;
    for (int r0 = 0; r0 < tiled; r0 += TILE) tile_rows(w, kind, o, r0, qx, dx, sx, y, ldy, accumulate);
    single_rows(w, kind, o, tiled, rows, qx, dx, sx, y, ldy, accumulate);
}

static void q4_1_row(const qmatrix *w, int o, int rows, const int16_t *qx, const float *dx, const float *sx,
                     float *y, int ldy, int accumulate) {
    output_row(w, 0, o, rows, qx, dx, sx, y, ldy, accumulate);
}

static void q8_0_row(const qmatrix *w, int o, int rows, const int16_t *qx, const float *dx, const float *sx,
                     float *y, int ldy, int accumulate) {
    output_row(w, 1, o, rows, qx, dx, sx, y, ldy, accumulate);
}

static void q6_k_row(const qmatrix *w, int o, int rows, const int16_t *qx, const float *dx, const float *sx,
                     float *y, int ldy, int accumulate) {
    output_row(w, 2, o, rows, qx, dx, sx, y, ldy, accumulate);
}

/* Output rows per share of a product. With several activation rows, shares are handed out as
 * threads ask (dynamic): on a machine shared with other work a thread is often descheduled
 * mid-product, and with fixed halves the other then waited at the barrier for its whole half
 * (16 rows: a 1.5x faster step under load). At one or two rows a share of 32 output rows is
 * about a microsecond of work, so handing shares out cost more than it saved (a batch-1 step
 * 6-23% slower): those keep the fixed halves. Each output row is computed alone, so the
 * results do not depend on which thread took it. */
#define GEMM_SHARE 32
#define DYNAMIC_ROWS 4 /* activation rows from which shares are handed out dynamically */

static inline void gemm_row(const qmatrix *w, int o, int rows, const int16_t *qx, const float *dx, const float *sx,
                            float *y, int ldy, int accumulate) {
    if (w->kind == 0 || w->kind == 3) /* kind 3's planes are kind 0's: here on int16 codes, the reference */
        q4_1_row(w, o, rows, qx, dx, sx, y, ldy, accumulate);
    else if (w->kind == 1)
        q8_0_row(w, o, rows, qx, dx, sx, y, ldy, accumulate);
    else
        q6_k_row(w, o, rows, qx, dx, sx, y, ldy, accumulate);
}

void qmatrix_gemm(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate) {
    const int16_t *qx = a->q;
    const float *dx = a->d, *sx = a->s;
    if (w->codes8) {
        x8_gemm(w, rows, a, y, ldy, accumulate);
    } else if (rows >= DYNAMIC_ROWS) {
#pragma omp for schedule(dynamic, GEMM_SHARE)
        for (int o = 0; o < w->n; o++) gemm_row(w, o, rows, qx, dx, sx, y, ldy, accumulate);
    } else {
#pragma omp for schedule(static)
        for (int o = 0; o < w->n; o++) gemm_row(w, o, rows, qx, dx, sx, y, ldy, accumulate);
    }
}

/* y[rows, n] = x[rows, k] W^T for W of planes `kind` (ggml_gemv.h): quantise x, then multiply. */
int ggml_linear(int kind, const void *codes, const float *d, const float *m, const void *codes8, const float *d8,
                const float *m8, int n, int k, int rows, const float *x, float *y) {
    const qmatrix w = {kind, n, k, codes, d, m, codes8, d8, m8};
    const size_t blocks = (size_t)rows * (k / QK);
    const qacts a = {malloc((size_t)rows * k * sizeof(int16_t)), malloc(blocks * sizeof(float)),
                     malloc(blocks * sizeof(float)), malloc((size_t)rows * k), malloc(blocks * sizeof(float)),
                     malloc(blocks * sizeof(float))};
    const int ok = a.q && a.d && a.s && a.q8 && a.d8 && a.e8;
    if (ok) {
        quantize_act(x, (size_t)rows * k, &a);
#pragma omp parallel if (n >= 256)
        qmatrix_gemm(&w, rows, &a, y, n, 0);
    }
    free(a.q), free(a.d), free(a.s), free(a.q8), free(a.d8), free(a.e8);
    return ok ? 0 : -1;
}

/* out[n, k] = the weights W encodes, in fp32: what a prompt's matrix-matrix products use. */
void ggml_dequantize(int kind, const void *codes, const float *d, const float *m, int n, int k, float *out) {
    const int nb = k / QK;
    if (kind == 3) kind = 0; /* the same planes */
#pragma omp parallel for schedule(static) if ((size_t)n * k >= 65536)
    for (int o = 0; o < n; o++) {
        for (int b = 0; b < nb; b++) {
            float *w = out + (size_t)o * k + b * QK;
            const float scale = kind == 2 ? 0.0f : d[(size_t)o * nb + b];
            if (kind == 0) {
                const uint8_t *c = (const uint8_t *)codes + ((size_t)o * nb + b) * 16;
                const float offset = m[(size_t)o * nb + b];
                for (int j = 0; j < 16; j++) {
                    w[j] = (float)(c[j] & 0x0F) * scale + offset;
                    w[j + 16] = (float)(c[j] >> 4) * scale + offset;
                }
            } else if (kind == 1) {
                const int8_t *c = (const int8_t *)codes + ((size_t)o * nb + b) * QK;
                for (int j = 0; j < QK; j++) w[j] = (float)c[j] * scale;
            } else { /* a scale per 16 weights */
                const int8_t *c = (const int8_t *)codes + ((size_t)o * nb + b) * QK;
                const float *half = d + ((size_t)o * nb + b) * 2;
                for (int j = 0; j < QK; j++) w[j] = (float)c[j] * half[j / 16];
            }
        }
    }
}
