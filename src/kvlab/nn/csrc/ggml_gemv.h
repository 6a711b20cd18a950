/* The GGML block kernels (AVX2) shared by the per-layer entry point (ggml_gemv.c) and the fused
 * Llama decode step (llama_decode.c). */
#ifndef KVLAB_GGML_GEMV_H
#define KVLAB_GGML_GEMV_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define QK 32

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_i a[i] b[i], eight lanes at a time (Q4_1's offset term, attention scores). */
static inline float dot_f32(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* One matrix W [n, k] as planes (see ggml_gemv.c). */
typedef struct {
    int kind; /* 0: "q4_1", 1: "q8_0", 2: "q6_k", 3: "q4_1" on int8 activations (kvlab.nn.ggml.KIND_IDS) */
    int n, k;
    const void *codes;
    const float *d, *m; /* m: Q4_1 offsets, NULL for Q8_0 */
    /* the same weights interleaved eight output rows at a time (ggml_gemm_x8.c), or NULL */
    const void *codes8;
    const float *d8, *m8;
} qmatrix;

/* Activations quantised per 32-value block, twice: int16 codes q with scale d (what Q8_0 and
 * Q6_K weights meet: their products are no faster in int8 on AVX2), int8 codes q8 with scale
 * d8 (what Q4_1 weights meet, in vpmaddubsw: twice the multiply-adds per instruction of
 * vpmaddwd, as llama.cpp's Q8_1 activations do), each block's exact sum s (Q4_1's offsets)
 * and e8, s minus the sum the int8 codes stand for (d8 times theirs). Each array holds the
 * blocks of `rows` rows one after another.
 *
 * Why e8: Q4_1's codes q are 0..15, so d * sum q x carries the activations' rounding errors
 * e times q, about 8 on average: 8 d sum e of it is the block's sum error, known exactly, and
 * taking it off leaves the error of the centred codes q - 8, half the size. */
typedef struct {
    int16_t *q;
    float *d, *s;
    int8_t *q8;
    float *d8, *e8;
} qacts;

/* x[k] -> a, every block. */
void quantize_act(const float *x, size_t k, const qacts *a);

/* The same for blocks first .. last - 1 only, on the calling thread (a row's share of a loop). */
void quantize_blocks(const float *x, long first, long last, const qacts *a);

/* y[r * ldy + o] (+)= sum_k W[o, k] x[r, k] for r < rows, from x quantised by quantize_act,
 * on the interleaved copy where the qmatrix has one (x8_gemm, at any row count: on SmolLM2 its
 * Q4_1 products beat the row-major kernel 1.2-1.6x from one row up; its Q8_0 ones win 1.1x at
 * one row and lose 1.1x at 2 and 3), else row by row on the planes
 * (ldy > n writes into a wider output, as stacked matrices do). Output rows are shared out
 * with an orphaned `omp for`: called inside a parallel region the threads split the work (and
 * meet at its end), called outside it runs on one thread. */
void qmatrix_gemm(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate);

/* The interleaved copy's sizes, and the copy itself (codes8 of x8_codes_bytes, d8 and m8 of
 * x8_scales_count floats; m8 only for "q4_1"). */
size_t x8_codes_bytes(int kind, int n, int k);
size_t x8_scales_count(int kind, int n, int k);
void qmatrix_interleave(int kind, const void *codes, const float *d, const float *m, int n, int k, void *codes8,
                        float *d8, float *m8);

/* qmatrix_gemm on the interleaved copy (same contract). */
void x8_gemm(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate);

/* Up to three matrices whose outputs are laid side by side (Q, K, V rows; gate, up rows):
 * stored apart when their kinds differ, as in llama.cpp's Q4_K_M files. */
typedef struct {
    qmatrix part[3];
    int parts;
} qstack;

#endif
