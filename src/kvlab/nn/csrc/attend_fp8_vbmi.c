/* attend_fp8.h's attention passes, built for AVX-512 with VBMI (only this file uses those
 * instructions; llama_decode.c calls it where fp8_vbmi_usable() says the machine has them).
 *
 * Conversion: an fp8 value has at most four significant bits, so it is exactly a bf16, and a
 * bf16 in the high half of a 32-bit lane whose low half is zero is that value as an fp32.
 * Two vpermt2b look each of 64 codes' low 7 bits up in 128-byte tables (the bf16's low byte,
 * and its high byte, into which the code's sign bit is OR'd), and interleaving zero words,
 * low and high bytes gives four vectors of sixteen fp32 lanes: 9 instructions per 64 codes,
 * where kv_codecs.h's load8 spends 6 per 8 (a widening, shifts into an fp16's place, an F16C
 * conversion), more than the multiply-adds after it.
 * Keys: as in attend_int8_vnni.c, 16 tokens' codes are transposed as 16 x 16 dwords, so lane u
 * of vector k holds channels 4k .. 4k + 3 of token u; once converted, lane L of vector j holds
 * those four channels of token 4L + j, and one broadcast of the query's four channels serves
 * all four vectors. The four partial sums per token are added at the end.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attend_fp8.h"
#include "cpu_features.h"
#include "llama_decode.h"

/* [format][low byte, high byte][code & 0x7F]: the bf16 of each code, scaled as load8 scales it
 * (e4m3 placed in an fp16's bits is its value times 2^-8; e5m2 is an fp16's top byte), so the
 * callers' fp8 factors apply unchanged. */
static uint8_t tables[2][2][128] __attribute__((aligned(64)));

static int usable; /* fp8_vbmi_usable(), found once */

/* At load, before any thread can ask: whether the path may run, and its tables. Compiled
 * before the AVX-512 target below, since it runs on every machine the library loads on. */
__attribute__((constructor)) static void build_tables(void) {
    usable = avx512_usable() && __builtin_cpu_supports("avx512vbmi");
    for (int e4m3 = 0; e4m3 < 2; e4m3++)
        for (int code = 0; code < 128; code++) {
            const float value = _cvtsh_ss((uint16_t)(e4m3 ? code << 7 : code << 8));
            uint32_t bits;
            memcpy(&bits, &value, sizeof bits); /* the low 16 bits are zero: the value is a bf16 */
            tables[e4m3][0][code] = (uint8_t)(bits >> 16), tables[e4m3][1][code] = (uint8_t)(bits >> 24);
        }
}

int fp8_vbmi_usable(void) { return usable; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi")

#include "attend_avx512.h"

static const uint8_t zero_row[FP8_DOT_MAX_HEAD_DIM] __attribute__((aligned(64)));

/* One format's four table vectors, and the sign bit. */
typedef struct {
    __m512i lo0, lo1, hi0, hi1, sign;
} lut;

static inline lut load_lut(int e4m3) {
    const lut t = {_mm512_load_si512(tables[e4m3][0]), _mm512_load_si512(tables[e4m3][0] + 64),
                   _mm512_load_si512(tables[e4m3][1]), _mm512_load_si512(tables[e4m3][1] + 64),
                   _mm512_set1_epi8((char)0x80)};
    return t;
}

/* 64 codes -> the low and high bytes of their bf16s (the high byte takes the code's sign bit). */
static inline __attribute__((always_inline)) void bf16_bytes(const lut *t, __m512i codes, __m512i *lo, __m512i *hi) {
    *lo = _mm512_permutex2var_epi8(t->lo0, codes, t->lo1);
    *hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, codes, t->hi1), codes, t->sign, 0xF8); /* a | b & c */
}

/* dots[h][t] = q_h . k_t (raw, unscaled) for H heads over the chunk, 16 tokens at a time. */
static inline __attribute__((always_inline)) void key_dots(const fp8_chunk *c, const lut *t, const float *q,
                                                          float *dots, const int H) {
    const int len = c->len, d = c->d;
    const __m512i none = _mm512_setzero_si512();
    for (int t0 = 0; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? len - t0 : 16;
        const uint8_t *rows[16];
        for (int u = 0; u < 16; u++) rows[u] = u < n ? c->keys + c->slots[t0 + u] * d : zero_row;
        for (int u = t0 + 16; u < t0 + 32 && u < len; u++) /* the next 16 keys, and their values for the pass after */
            for (int at = 0; at < d; at += 64) {
                _mm_prefetch((const char *)(c->keys + c->slots[u] * d + at), _MM_HINT_T0);
                _mm_prefetch((const char *)(c->values + c->slots[u] * d + at), _MM_HINT_T1);
            }
        __m512 acc[4][4]; /* acc[h][j] lane L: partial sums of token 4L + j, one per channel of four */
        for (int h = 0; h < H; h++)
            for (int j = 0; j < 4; j++) acc[h][j] = _mm512_setzero_ps();
        for (int seg = 0; seg < d; seg += 64) {
            __m512i r[16];
            for (int u = 0; u < 16; u++) r[u] = _mm512_loadu_si512(rows[u] + seg);
            transpose_dwords(r);
            for (int k = 0; k < 16; k++) {
                __m512i lo, hi;
                bf16_bytes(t, r[k], &lo, &hi);
                /* words: lane L of low, tokens 4L and 4L + 1's four channels; of high, 4L + 2 and 4L + 3 */
                const __m512i low = _mm512_unpacklo_epi8(lo, hi), high = _mm512_unpackhi_epi8(lo, hi);
                const __m512 x[4] = {
                    _mm512_castsi512_ps(_mm512_unpacklo_epi16(none, low)), _mm512_castsi512_ps(_mm512_unpackhi_epi16(none, low)),
                    _mm512_castsi512_ps(_mm512_unpacklo_epi16(none, high)), _mm512_castsi512_ps(_mm512_unpackhi_epi16(none, high))};
                for (int h = 0; h < H; h++) {
                    const __m512 qv = _mm512_broadcast_f32x4(_mm_loadu_ps(q + h * d + seg + 4 * k));
                    for (int j = 0; j < 4; j++) acc[h][j] = _mm512_fmadd_ps(x[j], qv, acc[h][j]);
                }
            }
        }
        for (int h = 0; h < H; h++) { /* each lane's four partial sums -> one; lane L: tokens 4L .. 4L + 3 */
            const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[h][0], acc[h][1]), _mm512_unpackhi_ps(acc[h][0], acc[h][1]));
            const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[h][2], acc[h][3]), _mm512_unpackhi_ps(acc[h][2], acc[h][3]));
            const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
            _mm512_mask_storeu_ps(dots + h * CHUNK + t0, live_lanes(n), sums);
        }
    }
}

/* dots (scores, H x CHUNK) -> exp(score - top) in place, with top and total per head. */
static inline __attribute__((always_inline)) void softmax(float *dots, int len, float k_factor, float *top,
                                                         float *total, const int H) {
    const __m512 kf = _mm512_set1_ps(k_factor);
    for (int h = 0; h < H; h++) {
        float *x = dots + h * CHUNK;
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < len; t += 16) {
            const __mmask16 m = live_lanes(len - t);
            const __m512 score = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + t), kf);
            _mm512_mask_storeu_ps(x + t, m, score);
            most = _mm512_mask_max_ps(most, m, most, score);
        }
        const float best = _mm512_reduce_max_ps(most);
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < len; t += 16) {
            const __mmask16 m = live_lanes(len - t);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + t), _mm512_set1_ps(best))));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(x + t, m, e);
        }
        top[h] = best, total[h] = _mm512_reduce_add_ps(sum);
    }
}

/* out[h] = factor sum_t w[h][t] v_t (w stride CHUNK, out stride d) for H heads: each value's
 * 64 codes become four vectors of fp32 lanes, in attend_int8_vnni.c's channel order, which
 * transpose_lanes undoes. */
static inline __attribute__((always_inline)) void value_sums(const fp8_chunk *c, const lut *t, const float *w,
                                                            float factor, float *out, const int H) {
    const int len = c->len, d = c->d;
    const __m512i none = _mm512_setzero_si512();
    for (int seg = 0; seg < d; seg += 64) {
        __m512 acc[4][4];
        for (int h = 0; h < H; h++)
            for (int m = 0; m < 4; m++) acc[h][m] = _mm512_setzero_ps();
        for (int u = 0; u < len; u++) {
            __m512i lo, hi;
            bf16_bytes(t, _mm512_loadu_si512(c->values + c->slots[u] * d + seg), &lo, &hi);
            /* words: lane L of low, channels 16L .. 16L + 7; of high, 16L + 8 .. 15 */
            const __m512i low = _mm512_unpacklo_epi8(lo, hi), high = _mm512_unpackhi_epi8(lo, hi);
            const __m512 x[4] = { /* x[m] lane L: channels 16L + 4m .. 16L + 4m + 3 */
                _mm512_castsi512_ps(_mm512_unpacklo_epi16(none, low)), _mm512_castsi512_ps(_mm512_unpackhi_epi16(none, low)),
                _mm512_castsi512_ps(_mm512_unpacklo_epi16(none, high)), _mm512_castsi512_ps(_mm512_unpackhi_epi16(none, high))};
            for (int h = 0; h < H; h++) {
                const __m512 weight = _mm512_set1_ps(w[h * CHUNK + u]);
                for (int m = 0; m < 4; m++) acc[h][m] = _mm512_fmadd_ps(x[m], weight, acc[h][m]);
            }
        }
        for (int h = 0; h < H; h++) {
            __m512i sums[4]; /* lane m of sums[L] is lane L of acc[h][m]: channels 16L .. 16L + 15 in order */
            transpose_lanes(_mm512_castps_si512(acc[h][0]), _mm512_castps_si512(acc[h][1]),
                            _mm512_castps_si512(acc[h][2]), _mm512_castps_si512(acc[h][3]), sums);
            for (int L = 0; L < 4; L++)
                _mm512_storeu_ps(out + h * d + seg + 16 * L,
                                 _mm512_mul_ps(_mm512_castsi512_ps(sums[L]), _mm512_set1_ps(factor)));
        }
    }
}

static inline __attribute__((always_inline)) void attend(const fp8_chunk *c, const float *q, float k_factor,
                                                        float v_factor, float *top, float *total, float *out,
                                                        const int H) {
    float dots[4 * CHUNK];
    const lut t = load_lut(c->e4m3);
    key_dots(c, &t, q, dots, H);
    softmax(dots, c->len, k_factor, top, total, H);
    value_sums(c, &t, dots, v_factor, out, H);
}

void fp8_attend_vbmi(const fp8_chunk *c, const float *q, int heads, float k_factor, float v_factor, float *top,
                     float *total, float *out) {
    FOR_HEAD_PACK(heads, attend, c, q, k_factor, v_factor, top, total, out)
}

#pragma GCC pop_options
