/* attend_int8.h's integer attention passes, built for AVX-512 VNNI like ggml_gemm_x8_vnni.c
 * (only this file uses those instructions; llama_decode.c calls it where kvlab_x8_isa says the
 * machine has them).
 *
 * Keys: a dot product sums over channels, but vpdpbusd sums the 4 bytes inside each 32-bit
 * lane, so 16 tokens' rows are transposed as 16 x 16 dwords first: then lane u of vector c
 * holds channels 4c .. 4c + 3 of token u, one broadcast of the query's 4 bytes serves 16 tokens,
 * and the sums come out one token per lane. The transpose is shared by every query head of
 * the pack and both halves of the query.
 * Values: a weighted sum runs over tokens, so two tokens' codes are interleaved into 16-bit
 * pairs and vpdpwssd multiplies each pair by the two tokens' weights; lanes are channels, in
 * an order the last step undoes.
 * Overflow: a key lane sums at most 256 channels of 255 x 128, a value lane at most CHUNK
 * (128) tokens of 255 x 32767: both stay below 2^31.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attend_avx512.h"
#include "attend_int8.h"
#include "llama_decode.h"

_Static_assert(CHUNK <= 128, "value sums of more than 128 tokens could overflow int32");

static const uint8_t zero_row[INT8_DOT_MAX_HEAD_DIM] __attribute__((aligned(64)));

static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* q[d] rounded to 15 bits, q ~ scale (128 hi + lo) with hi in -128..127 and lo in 0..127 (the
 * signed operand of vpdpbusd takes either); returns the scale and leaves the rounded query's
 * sum in *sum, so that the int8 zero term pairs with the same rounded query as the codes and
 * a score is exactly the rounded query times the dequantised key. Done per chunk and pack,
 * so in vectors: in scalar code it cost more than the chunk's dot products. */
static float split_query(const float *q, int d, int8_t *hi, int8_t *lo, float *sum) {
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(q + i)));
    const float largest = _mm512_reduce_max_ps(top);
    const float scale = largest / 16383.0f;
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 16383.0f / largest : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < d; i += 16) { /* rounds to nearest; |v| <= 16383 by construction */
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + i), inverse));
        total = _mm512_add_epi32(total, v);
        /* an arithmetic shift floors, so hi * 128 + lo == v */
        _mm_storeu_si128((__m128i *)(hi + i), _mm512_cvtepi32_epi8(_mm512_srai_epi32(v, 7)));
        _mm_storeu_si128((__m128i *)(lo + i), _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(127))));
    }
    *sum = scale * (float)_mm512_reduce_add_epi32(total);
    return scale;
}

/* w[len] (0 <= w <= largest) rounded to 15-bit words, token pairs (2j, 2j + 1) packed as the
 * low and high words of pairs[j] (the operand order of vpdpwssd); returns the scale. */
static float pair_weights(const float *w, int len, float largest, int32_t *pairs) {
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
    for (int t = 0; t < len; t += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live_lanes(len - t), w + t), inverse);
        const __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(x), _mm512_setzero_si512()),
                                           _mm512_set1_epi32(32767));
        _mm256_storeu_si256((__m256i *)(pairs + t / 2), _mm512_cvtepi32_epi16(v));
    }
    return largest / 32767.0f;
}

static inline __attribute__((always_inline)) void key_dots(const uint8_t *codes, const uint8_t *values,
                                                          const size_t *slots, int len, int d, const float *q,
                                                          float *dots, float *sums, const int H) {
    int8_t hi[4][INT8_DOT_MAX_HEAD_DIM], lo[4][INT8_DOT_MAX_HEAD_DIM];
    float qscale[4];
    for (int h = 0; h < H; h++) qscale[h] = split_query(q + h * d, d, hi[h], lo[h], sums + h);
    for (int t0 = 0; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? len - t0 : 16;
        const uint8_t *rows[16];
        for (int u = 0; u < 16; u++) rows[u] = u < n ? codes + slots[t0 + u] * d : zero_row;
        for (int u = t0 + 16; u < t0 + 32 && u < len; u++) /* the next 16 keys, and their values for the pass after */
            for (int at = 0; at < d; at += 64) {
                _mm_prefetch((const char *)(codes + slots[u] * d + at), _MM_HINT_T0);
                _mm_prefetch((const char *)(values + slots[u] * d + at), _MM_HINT_T1);
            }
        __m512i acc_hi[4], acc_lo[4];
        for (int h = 0; h < H; h++) acc_hi[h] = acc_lo[h] = _mm512_setzero_si512();
        for (int seg = 0; seg < d; seg += 64) {
            __m512i r[16];
            for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_si512(rows[u] + seg);
            transpose_dwords(r);
            for (int c = 0; c < 16; c++)
                for (int h = 0; h < H; h++) {
                    acc_hi[h] = _mm512_dpbusd_epi32(acc_hi[h], r[c], _mm512_set1_epi32(four_bytes(hi[h] + seg + 4 * c)));
                    acc_lo[h] = _mm512_dpbusd_epi32(acc_lo[h], r[c], _mm512_set1_epi32(four_bytes(lo[h] + seg + 4 * c)));
                }
        }
        for (int h = 0; h < H; h++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(acc_hi[h], 7), acc_lo[h]));
            _mm512_mask_storeu_ps(dots + h * CHUNK + t0, live_lanes(n), _mm512_mul_ps(dot, _mm512_set1_ps(qscale[h])));
        }
    }
}

static inline __attribute__((always_inline)) void value_sums(const uint8_t *codes, const size_t *slots, int len,
                                                            int d, const float *w, const float *largest,
                                                            const float *offset, float factor, float *out,
                                                            const int H) {
    int32_t pairs[4][CHUNK / 2 + 8]; /* tokens 2j and 2j + 1's weights as two 16-bit words (+8: whole stores) */
    float wscale[4];
    for (int h = 0; h < H; h++) wscale[h] = pair_weights(w + h * CHUNK, len, largest[h], pairs[h]);
    const __m512i none = _mm512_setzero_si512();
    for (int seg = 0; seg < d; seg += 64) {
        __m512i acc[4][4];
        for (int h = 0; h < H; h++)
            for (int m = 0; m < 4; m++) acc[h][m] = none;
        for (int t = 0; t < len; t += 2) {
            const __m512i a = _mm512_loadu_si512(codes + slots[t] * d + seg);
            const __m512i b = t + 1 < len ? _mm512_loadu_si512(codes + slots[t + 1] * d + seg) : none;
            /* lane L of lo: channels 16L .. 16L + 7 of a and b alternating; hi: 16L + 8 .. 15 */
            const __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
            /* x[m] lane L: the (a, b) word pairs of channels 16L + 4m .. 16L + 4m + 3 */
            const __m512i x[4] = {_mm512_unpacklo_epi8(lo, none), _mm512_unpackhi_epi8(lo, none),
                                  _mm512_unpacklo_epi8(hi, none), _mm512_unpackhi_epi8(hi, none)};
            for (int h = 0; h < H; h++) {
                const __m512i pair = _mm512_set1_epi32(pairs[h][t / 2]);
                for (int m = 0; m < 4; m++) acc[h][m] = _mm512_dpwssd_epi32(acc[h][m], x[m], pair);
            }
        }
        for (int h = 0; h < H; h++) {
            __m512i sums[4]; /* lane m of sums[L] is lane L of acc[h][m]: channels 16L .. 16L + 15 in order */
            transpose_lanes(acc[h][0], acc[h][1], acc[h][2], acc[h][3], sums);
            for (int L = 0; L < 4; L++) {
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[L]), _mm512_set1_ps(wscale[h]),
                                                 _mm512_set1_ps(offset[h]));
                _mm512_storeu_ps(out + h * d + seg + 16 * L, _mm512_mul_ps(v, _mm512_set1_ps(factor)));
            }
        }
    }
}

/* Scores to softmax weights for H heads, two passes of sixteen tokens: score = (dot scale +
 * zero sum(q)) k_factor and the largest; then e = exp(score - largest), its sum, the value
 * pass's weights e v_scale (in place of the dots) with their largest, and the weights' share
 * of the value zeros. The AVX2 loop took five passes of eight (a sixth of a 16-row step). */
static inline __attribute__((always_inline)) void softmax_weights(const int8_chunk *c, float *dots, const float *qsums,
                                                                 float k_factor, float *top, float *total,
                                                                 float *largest, float *offset, const int H) {
    const __m512 kf = _mm512_set1_ps(k_factor);
    for (int h = 0; h < H; h++) {
        float *x = dots + h * CHUNK;
        const __m512 qs = _mm512_set1_ps(qsums[h]);
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < c->len; t += 16) {
            const __mmask16 m = live_lanes(c->len - t);
            const __m512 zero_term = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, c->k_zero + t), qs);
            const __m512 score = _mm512_mul_ps(
                _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + t), _mm512_maskz_loadu_ps(m, c->k_scale + t), zero_term), kf);
            _mm512_mask_storeu_ps(x + t, m, score);
            most = _mm512_mask_max_ps(most, m, most, score);
        }
        const float best = _mm512_reduce_max_ps(most);
        __m512 sum = _mm512_setzero_ps(), share = _mm512_setzero_ps(), wmost = _mm512_setzero_ps();
        for (int t = 0; t < c->len; t += 16) {
            const __mmask16 m = live_lanes(c->len - t);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + t), _mm512_set1_ps(best))));
            sum = _mm512_add_ps(sum, e);
            share = _mm512_fmadd_ps(e, _mm512_maskz_loadu_ps(m, c->v_zero + t), share);
            const __m512 w = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, c->v_scale + t));
            wmost = _mm512_max_ps(wmost, w);
            _mm512_mask_storeu_ps(x + t, m, w);
        }
        top[h] = best, total[h] = _mm512_reduce_add_ps(sum), offset[h] = _mm512_reduce_add_ps(share);
        largest[h] = _mm512_reduce_max_ps(wmost);
    }
}

static inline __attribute__((always_inline)) void attend(const int8_chunk *c, const float *q, float k_factor,
                                                        float v_factor, float *top, float *total, float *out,
                                                        const int H) {
    float dots[4 * CHUNK], qsums[4], largest[4], offset[4];
    key_dots(c->keys, c->values, c->slots, c->len, c->d, q, dots, qsums, H);
    softmax_weights(c, dots, qsums, k_factor, top, total, largest, offset, H);
    value_sums(c->values, c->slots, c->len, c->d, dots, largest, offset, v_factor, out, H);
}

void int8_attend_vnni(const int8_chunk *c, const float *q, int heads, float k_factor, float v_factor, float *top,
                      float *total, float *out) {
    FOR_HEAD_PACK(heads, attend, c, q, k_factor, v_factor, top, total, out)
}
