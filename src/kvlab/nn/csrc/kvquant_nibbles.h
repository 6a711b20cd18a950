/* KVQuant's 4-bit rows read 64 codes at a time: kvquant_attend.h's fast path for kvquant4 at 64-channel heads
 * (SmolLM2's) with half-style RoPE. The code takes any multiple of 64 (D); only 64 is instantiated, to keep
 * the library's build short.
 *
 * Why: looking a code up with vpermps takes a broadcast, a shift and a mask to put eight codes in
 * lanes and two vpermps and a blend to look them up, 8 operations per 8 codes; that was most of a
 * step. A 4-bit code is a nibble, and vpshufb looks up 32 nibbles in a 16-byte table at once. A
 * codebook entry is fp16 widened to fp32, whose low byte is always zero, so three vpshufb (its
 * bytes 1, 2 and 3) and unpacks into 32-bit lanes give the exact fp32 centroids: 26 operations for
 * a 64-channel row instead of 64.
 *
 * The unpacks leave the channels in their own order (kvq_nib_channel): the 8 lanes of one vector hold
 * channels of a head's first half and the matching vector of the second half holds their RoPE
 * partners (channel + d/2), so a key is rotated vector by vector as before. The query, the key
 * ranges and zeros and the rotation's cos and sin are put in that order once per attention unit;
 * the values' sums come out in it and are put back in channel order once per unit. Only the order of
 * additions changes (tests hold the logits to the module path's up to summation order).
 */
#ifndef KVLAB_KVQUANT_NIBBLES_H
#define KVLAB_KVQUANT_NIBBLES_H

/* A 16-entry fp16 codebook as vpshufb tables (in both lanes) of its fp32 values' bytes 1, 2 and 3. */
typedef struct {
    __m256i b1, b2, b3;
} kvq_nib_book;

static inline kvq_nib_book kvq_nib_book_of(const uint16_t *book) {
    uint8_t t[3][16];
    for (int j = 0; j < 16; j++) {
        const float f = f16_to_f32(book[j]);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        t[0][j] = (uint8_t)(u >> 8), t[1][j] = (uint8_t)(u >> 16), t[2][j] = (uint8_t)(u >> 24);
    }
    kvq_nib_book nb;
    nb.b1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t[0]));
    nb.b2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t[1]));
    nb.b3 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t[2]));
    return nb;
}

/* The channel of lane `lane` of vector k (0..3) of slice g: the first half's channels; the matching
 * vector of the second half holds each one's partner, channel + d / 2. Vector k holds nibble k / 2 (0 the
 * even channels, 1 the odd) of bytes 4 (k % 2) .. + 3 of each 8-byte half of the slice's 16 bytes. */
static inline int kvq_nib_channel(int g, int k, int lane) {
    return 32 * g + 16 * (lane / 4) + 8 * (k % 2) + 2 * (lane % 4) + k / 2;
}

/* Nibble n (0: low, 1: high) of slice g's 16 bytes of a row's first half (A) and the same bytes of its
 * second half (B) as fp32 centroids: x[0], x[1] the first half's vectors 2n, 2n + 1, x[2], x[3] their
 * partners. 64 channels (D == 64) are one 32-byte load. */
static inline __attribute__((always_inline)) void kvq_nib_half(const uint8_t *row, int g, const int D,
                                                              const kvq_nib_book *nb, const int n, __m256 x[4]) {
    const uint8_t *A = row + 16 * g, *B = row + D / 4 + 16 * g;
    __m256i y; /* lanes [A 0..7, B 0..7 | A 8..15, B 8..15] */
    if (D == 64) {
        y = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)A), 0xD8);
    } else {
        const __m128i a = _mm_loadu_si128((const __m128i *)A), b = _mm_loadu_si128((const __m128i *)B);
        y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(a, b)), _mm_unpackhi_epi64(a, b), 1);
    }
    const __m256i mask = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const __m256i nib = _mm256_and_si256(n ? _mm256_srli_epi16(y, 4) : y, mask);
    const __m256i p1 = _mm256_shuffle_epi8(nb->b1, nib), p2 = _mm256_shuffle_epi8(nb->b2, nib),
                  p3 = _mm256_shuffle_epi8(nb->b3, nib);
    const __m256i la = _mm256_unpacklo_epi8(zero, p1), ha = _mm256_unpacklo_epi8(p2, p3);
    const __m256i lb = _mm256_unpackhi_epi8(zero, p1), hb = _mm256_unpackhi_epi8(p2, p3);
    x[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(la, ha));
    x[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(la, ha));
    x[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(lb, hb));
    x[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(lb, hb));
}

/* perm[i] for i < d / 2: the channel at place i of the nibble order's first half (its partner's is + d / 2);
 * inv[c] for c < d / 2: where channel c sits. */
static inline void kvq_nib_order(int d, uint8_t *perm, uint8_t *inv) {
    for (int g = 0; g < d / 64; g++)
        for (int k = 0; k < 4; k++)
            for (int lane = 0; lane < 8; lane++) {
                const int i = 32 * g + 8 * k + lane, c = kvq_nib_channel(g, k, lane);
                perm[i] = (uint8_t)c, inv[c] = (uint8_t)i;
            }
}

/* x [d] (channel order) into y [d] in the nibble order: first halves' places, then their partners'. */
static inline void kvq_nib_permute(const float *x, int d, const uint8_t *perm, float *y) {
    const int h = d / 2;
    for (int i = 0; i < h; i++) y[i] = x[perm[i]], y[h + i] = x[h + perm[i]];
}

/* kvq_fast_keys (kvquant_attend.h) for 4-bit rows in the nibble order: q [GH, d], range, zero permuted by
 * kvq_nib_permute; cos and sin read through perm; the outliers' corrections in channel order (q_raw). */
static inline __attribute__((always_inline)) void kvq_nib_keys(const kvquant_layer *kl, const float *cos_tab,
                                                              const float *sin_tab, const size_t *slots, int start,
                                                              int t0, int len, const int D, const uint8_t *perm,
                                                              const uint8_t *inv, const float *range, const float *zero,
                                                              const float *range_raw, const float *zero_raw,
                                                              const float *book, const kvq_nib_book *nb, const float *q,
                                                              const float *q_raw, float scale, int capacity,
                                                              const uint16_t *k_out, const uint8_t *k_index, int off,
                                                              float *scores, const int GH) {
    const int h = D / 2, rb = D / 2;
    float C[h], S[h], C1[h], S1[h];
    float lanes[GH][CHUNK][8], fix[GH][CHUNK]; /* each token's sums before the lanes are added, its outliers' part */
    for (int i = 0; i < h; i++) C1[i] = cos_tab[D + perm[i]], S1[i] = sin_tab[D + h + perm[i]];
    for (int t = t0; t < len; t++) {
        const int p = start + t;
        if (t == t0 || p % 16 == 0) {
            const float *c = cos_tab + (size_t)p * D, *s = sin_tab + (size_t)p * D + h;
            for (int i = 0; i < h; i++) C[i] = c[perm[i]], S[i] = s[perm[i]];
        } else {
            for (int i = 0; i < h; i += 8) {
                const __m256 c = _mm256_loadu_ps(C + i), s = _mm256_loadu_ps(S + i);
                const __m256 c1 = _mm256_loadu_ps(C1 + i), s1 = _mm256_loadu_ps(S1 + i);
                _mm256_storeu_ps(C + i, _mm256_fnmadd_ps(s, s1, _mm256_mul_ps(c, c1)));
                _mm256_storeu_ps(S + i, _mm256_fmadd_ps(c, s1, _mm256_mul_ps(s, c1)));
            }
        }
        const uint8_t *row = kl->k_codes + slots[t] * rb;
        if (t + 8 < len) _mm_prefetch((const char *)(kl->k_codes + slots[t + 8] * rb), _MM_HINT_T0);
        __m256 acc[4];
#pragma GCC unroll 4
        for (int j = 0; j < GH; j++) acc[j] = _mm256_setzero_ps();
        for (int g = 0; g < D / 64; g++)
#pragma GCC unroll 2
            for (int n = 0; n < 2; n++) {
                __m256 x[4];
                kvq_nib_half(row, g, D, nb, n, x);
#pragma GCC unroll 2
                for (int u = 0; u < 2; u++) {
                    const int i = 32 * g + 16 * n + 8 * u;
                    const __m256 a = _mm256_fmadd_ps(x[u], _mm256_loadu_ps(range + i), _mm256_loadu_ps(zero + i));
                    const __m256 b = _mm256_fmadd_ps(x[2 + u], _mm256_loadu_ps(range + h + i), _mm256_loadu_ps(zero + h + i));
                    const __m256 c = _mm256_loadu_ps(C + i), s = _mm256_loadu_ps(S + i);
                    const __m256 ya = _mm256_fnmadd_ps(b, s, _mm256_mul_ps(a, c)), yb = _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c));
#pragma GCC unroll 4
                    for (int j = 0; j < GH; j++) {
                        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + i), ya, acc[j]);
                        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + h + i), yb, acc[j]);
                    }
                }
            }
#pragma GCC unroll 4
        for (int j = 0; j < GH; j++) _mm256_storeu_ps(lanes[j][t], acc[j]), fix[j][t] = 0.0f;
        const int n = kvq_min(kl->k_counts[slots[t]], capacity - off);
        for (int k = 0; k < n; k++) {
            const int ch = k_index[off + k];
            if (ch >= D) continue;
            const float dense = fmaf(book[kvq_code_at(row, ch, 4)], range_raw[ch], zero_raw[ch]);
            const float delta = f16_to_f32(k_out[off + k]) - dense;
            const int c = ch % h, i = inv[c];
            const float da = ch < h ? delta * C[i] : -delta * S[i], db = ch < h ? delta * S[i] : delta * C[i];
            for (int j = 0; j < GH; j++) fix[j][t] += q_raw[j * D + c] * da + q_raw[j * D + c + h] * db;
        }
        off += n > 0 ? n : 0;
    }
    kvq_reduce_scores(lanes, fix, t0, len, scale, scores, GH);
}

/* One pass of kvq_nib_values: slice g's nibble n, the GH x 4 sums in registers. */
static inline __attribute__((always_inline)) void kvq_nib_values_pass(const kvquant_layer *kl, const size_t *slots,
                                                                     int t0, int len, const int D,
                                                                     const kvq_nib_book *nb, const float *w, float *out,
                                                                     const int GH, int g, const int n) {
    const int h = D / 2, rb = D / 2;
    __m256 acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 4 * GH; k++) acc[k] = _mm256_setzero_ps();
    for (int t = t0; t < len; t++) {
        __m256 x[4];
        kvq_nib_half(kl->v_codes + slots[t] * rb, g, D, nb, n, x);
#pragma GCC unroll 4
        for (int j = 0; j < GH; j++) {
            const __m256 wt = _mm256_broadcast_ss(w + (size_t)j * CHUNK + t);
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) acc[4 * j + u] = _mm256_fmadd_ps(wt, x[u], acc[4 * j + u]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < GH; j++)
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) { /* constant indices: acc stays in registers through the loop above */
            float sums[8];
            _mm256_storeu_ps(sums, acc[4 * j + u]);
            for (int lane = 0; lane < 8; lane++)
                out[(size_t)j * D + kvq_nib_channel(g, 2 * n + u % 2, lane) + (u / 2) * h] += sums[lane];
        }
}

/* kvq_fast_values for 4-bit rows: w [GH, CHUNK] the weights times each row's scale (its zero is added by
 * the caller); a pass per slice and nibble, added to out [GH, D] in channel order at the end. */
static inline __attribute__((always_inline)) void kvq_nib_values(const kvquant_layer *kl, const size_t *slots, int t0,
                                                                int len, const int D, const kvq_nib_book *nb,
                                                                const float *w, float *out, const int GH) {
    for (int g = 0; g < D / 64; g++) {
        kvq_nib_values_pass(kl, slots, t0, len, D, nb, w, out, GH, g, 0);
        kvq_nib_values_pass(kl, slots, t0, len, D, nb, w, out, GH, g, 1);
    }
}

#endif
