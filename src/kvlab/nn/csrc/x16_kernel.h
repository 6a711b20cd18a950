/* Two neighbouring groups of the interleaved layout (sixteen outputs) in one 512-bit vector: the
 * AVX-512 VNNI unit's products where both groups exist (x8_kernel.h's X8_ENTRY falls back to
 * one group at a time for an odd last group).
 *
 * Why: on the Xeon this was written on, vpdpwssd and vpdpbusd run two per cycle on 512-bit
 * vectors as on 256-bit ones (measured: 7.2 and 6.2 billion per second on one core), so a zmm
 * instruction does twice the multiply-adds, and each activation broadcast and each block's
 * float work serve sixteen outputs instead of eight.
 *
 * Lanes 0-7 are group g's outputs, lanes 8-15 group g + 1's: each group's bytes for a block
 * are loaded from where the layout keeps them and joined, and the two groups' outputs are
 * neighbours in y, so one store writes all sixteen. The integer sums and every float step per
 * lane are x8_kernel.h's, so the outputs are bit for bit the same.
 *
 * Included by x8_kernel.h where X8_PAIRS is defined (ggml_gemm_x8_vnni.c, compiled for AVX-512).
 */

/* Two 256-bit halves (groups g and g + 1) as one 512-bit vector. */
static inline __m512i join_si(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m512 join_ps(const float *lo, const float *hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(lo))),
                                               _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}

static inline __m512i bcast16(const void *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm512_set1_epi32(v);
}

/* The sixteen outputs of groups g, g + 1 (the valid ones: the last group may be partial). */
static inline void x16_store(const qmatrix *w, int g, __m512 acc, float *out, int accumulate) {
    const int valid = w->n - g * X8 < 2 * X8 ? w->n - g * X8 : 2 * X8;
    const __mmask16 keep = (__mmask16)(valid == 2 * X8 ? 0xFFFF : (1u << valid) - 1);
    if (accumulate) acc = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, out), acc);
    _mm512_mask_storeu_ps(out, keep, acc);
}

/* Kind 3 (Q4_1 on int8 codes), groups g and g + 1, rows r0 .. r0 + R - 1. */
static inline __attribute__((always_inline)) void x16_tile_int8(const qmatrix *w, int g, int r0, const int R,
                                                               const qacts *a, float *y, int ldy, int accumulate) {
    const int k = w->k, nb = k / QK;
    const uint8_t *c0 = (const uint8_t *)w->codes8 + (size_t)g * nb * 128, *c1 = c0 + (size_t)nb * 128;
    const float *d0 = w->d8 + (size_t)g * nb * X8, *d1 = d0 + (size_t)nb * X8;
    const float *m0 = w->m8 + (size_t)g * nb * X8, *m1 = m0 + (size_t)nb * X8;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[X8_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *qb[X8_TILE];
        for (int r = 0; r < R; r++) qb[r] = a->q8 + (size_t)(r0 + r) * k + (size_t)b * QK;
        __m512i dot[X8_TILE];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            const size_t at = (size_t)b * 128 + p * 32;
            const __m512i raw = join_si(_mm256_loadu_si256((const __m256i *)(c0 + at)),
                                        _mm256_loadu_si256((const __m256i *)(c1 + at)));
            const __m512i lo = _mm512_and_si512(raw, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            for (int r = 0; r < R; r++) {
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, bcast16(qb[r] + 8 * p));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, bcast16(qb[r] + 8 * p + 4));
                KEEP_IN_REGISTER(dot[r]);
            }
        }
        const __m512 d = join_ps(d0 + (size_t)b * X8, d1 + (size_t)b * X8);
        const __m512 m = join_ps(m0 + (size_t)b * X8, m1 + (size_t)b * X8);
        const __m512 d_8 = _mm512_mul_ps(d, _mm512_set1_ps(8.0f));
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(a->d8[at])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->s[at]), acc[r]);
            acc[r] = _mm512_fmadd_ps(d_8, _mm512_set1_ps(a->e8[at]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) x16_store(w, g, acc[r], y + (size_t)(r0 + r) * ldy + g * X8, accumulate);
}

/* Kinds 0-2 (int16 codes), groups g and g + 1, rows r0 .. r0 + R - 1. */
static inline __attribute__((always_inline)) void x16_tile_int16(const qmatrix *w, const int kind, int g, int r0,
                                                                const int R, const qacts *a, float *y, int ldy,
                                                                int accumulate) {
    const int k = w->k, nb = k / QK, sets = scale_sets(kind), bytes = group_bytes(kind);
    const uint8_t *c0 = (const uint8_t *)w->codes8 + (size_t)g * nb * bytes, *c1 = c0 + (size_t)nb * bytes;
    const float *d0 = w->d8 + (size_t)g * nb * X8 * sets, *d1 = d0 + (size_t)nb * X8 * sets;
    const float *m0 = kind == 0 ? w->m8 + (size_t)g * nb * X8 : NULL, *m1 = kind == 0 ? m0 + (size_t)nb * X8 : NULL;
    __m512 acc[X8_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int16_t *qb[X8_TILE];
        for (int r = 0; r < R; r++) qb[r] = a->q + (size_t)(r0 + r) * k + (size_t)b * QK;
        const size_t sb = (size_t)b * X8 * sets;
        __m512i dot[X8_TILE];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            __m512i v0, v1;
            if (kind == 0) {
                const size_t at = (size_t)b * 128 + p * 16;
                const __m256i raw = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(c0 + at))),
                    _mm_loadu_si128((const __m128i *)(c1 + at)), 1);
                const __m256i nibble = _mm256_set1_epi8(0x0F);
                v0 = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, nibble));
                v1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble));
            } else {
                const size_t at = (size_t)b * 256 + p * 32;
                v0 = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(c0 + at))),
                    _mm_loadu_si128((const __m128i *)(c1 + at)), 1));
                v1 = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(c0 + at + 16))),
                    _mm_loadu_si128((const __m128i *)(c1 + at + 16)), 1));
            }
            for (int r = 0; r < R; r++) {
                dot[r] = _mm512_dpwssd_epi32(dot[r], v0, bcast16(qb[r] + 4 * p));
                dot[r] = _mm512_dpwssd_epi32(dot[r], v1, bcast16(qb[r] + 4 * p + 2));
                KEEP_IN_REGISTER(dot[r]);
            }
            if (kind == 2 && p == 3) { /* q6_k: weights 0..15 are done, with their own scales */
                const __m512 dl = join_ps(d0 + sb, d1 + sb);
                for (int r = 0; r < R; r++) {
                    const __m512 xs = _mm512_set1_ps(a->d[(size_t)(r0 + r) * nb + b]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dl, xs), acc[r]);
                    dot[r] = _mm512_setzero_si512();
                }
            }
        }
        const size_t last = sb + (kind == 2 ? X8 : 0);
        const __m512 d = join_ps(d0 + last, d1 + last);
        for (int r = 0; r < R; r++) {
            const __m512 xs = _mm512_set1_ps(a->d[(size_t)(r0 + r) * nb + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, xs), acc[r]);
            if (kind == 0)
                acc[r] = _mm512_fmadd_ps(join_ps(m0 + (size_t)b * X8, m1 + (size_t)b * X8),
                                         _mm512_set1_ps(a->s[(size_t)(r0 + r) * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) x16_store(w, g, acc[r], y + (size_t)(r0 + r) * ldy + g * X8, accumulate);
}

static inline __attribute__((always_inline)) void x16_tile(const qmatrix *w, const int kind, int g, int r0,
                                                          const int R, const qacts *a, float *y, int ldy,
                                                          int accumulate) {
    if (kind == 3)
        x16_tile_int8(w, g, r0, R, a, y, ldy, accumulate);
    else
        x16_tile_int16(w, kind, g, r0, R, a, y, ldy, accumulate);
}

/* Groups g and g + 1 against activation rows first .. last - 1 (x8_kernel.h's ROW_TILES). */
ROWS_OF(x16_rows_q4_1, x16_tile, 0)
ROWS_OF(x16_rows_q8_0, x16_tile, 1)
ROWS_OF(x16_rows_q6_k, x16_tile, 2)
ROWS_OF(x16_rows_q4_1_int8, x16_tile, 3)
