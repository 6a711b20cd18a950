/* The interleaved products for one instruction set, included by ggml_gemm_x8.c (AVX2) and by
 * ggml_gemm_x8_vnni.c (AVX-512 VNNI), each of which defines, before including it:
 *   X8_ENTRY  the name of the entry point (x8_gemm's contract, ggml_gemv.h);
 *   X8_TILE   activation rows per pass over a group's blocks: each row holds an integer and a
 *             float accumulator in registers, so the tile is as large as the register file
 *             allows (16 vector registers under AVX2, 32 with AVX-512VL);
 *   X8_VNNI   (optional) multiply-accumulate in one instruction: vpdpwssd for int16 pairs,
 *             vpdpbusd for four int8 products, into int32. The sums are the same integers as
 *             AVX2's madd-and-add (no step of either can overflow), so both paths give
 *             bit-identical outputs; VNNI spends one instruction where AVX2 spends two or three.
 */
#include <string.h>

#include "ggml_gemv.h"
#include "x8_layout.h"

#ifdef X8_VNNI
#define DOT_I16(dot, w, x) _mm256_dpwssd_epi32(dot, w, x)
#define DOT_U8(dot, w, x) _mm256_dpbusd_epi32(dot, w, x)
#define U8_SUMS(dot) (dot) /* already int32 */
#else
#define DOT_I16(dot, w, x) _mm256_add_epi32(dot, _mm256_madd_epi16(w, x))
#define DOT_U8(dot, w, x) _mm256_add_epi16(dot, _mm256_maddubs_epi16(w, x))
#define U8_SUMS(dot) _mm256_madd_epi16(dot, _mm256_set1_epi16(1)) /* int16 pairs -> int32 */
#endif
#if X8_TILE < 6 || X8_TILE > 8
#error "X8_TILE must be 6 to 8 (ROW_TILES's tails go down from 7 rows, and its cases 5..1 are used as given)"
#endif

/* An empty asm that claims to change v: the compiler must have v in a register here and may not
 * move the adds into it across this point. Without it GCC reassociates each block's integer
 * adds into a tree of all the tile's products and spills them to the stack (48 256-bit stores
 * and loads per block at six rows, measured in its assembly). */
#ifdef X8_VNNI
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v)) /* any of the 32 registers AVX-512VL addresses */
#else
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#endif

/* Four bytes (an int16 pair, or four int8 activations) at q, in every 32-bit lane. */
static inline __m256i lane_bcast(const void *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Tile r's accumulator stored (or added) into the eight outputs of group g. */
static inline void x8_store(const qmatrix *w, int g, __m256 acc, float *out, int accumulate) {
    const int valid = w->n - g * X8 < X8 ? w->n - g * X8 : X8;
    if (valid == X8) {
        _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), acc) : acc);
    } else {
        float lanes[X8];
        _mm256_storeu_ps(lanes, acc);
        for (int j = 0; j < valid; j++) out[j] = accumulate ? out[j] + lanes[j] : lanes[j];
    }
}

/* Kind 3: Q4_1 group g's eight outputs for activation rows r0 .. r0 + R - 1 on the int8 codes
 * (R <= X8_TILE, a constant at each call, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void x8_tile_int8(const qmatrix *w, int g, int r0, const int R,
                                                              const qacts *a, float *y, int ldy, int accumulate) {
    const int k = w->k, nb = k / QK;
    const uint8_t *cg = (const uint8_t *)w->codes8 + (size_t)g * nb * 128;
    const float *dg = w->d8 + (size_t)g * nb * X8, *mg = w->m8 + (size_t)g * nb * X8;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[X8_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *qb[X8_TILE];
        for (int r = 0; r < R; r++) qb[r] = a->q8 + (size_t)(r0 + r) * k + (size_t)b * QK;
        __m256i dot[X8_TILE]; /* AVX2: int16 pairs (eight products of 4 bits by 8 stay under 2^15) */
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) { /* weights 8p .. 8p + 3 (low nibbles) and 8p + 4 .. 8p + 7 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(cg + (size_t)b * 128 + p * 32));
            const __m256i lo = _mm256_and_si256(raw, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
            for (int r = 0; r < R; r++) {
                dot[r] = DOT_U8(dot[r], lo, lane_bcast(qb[r] + 8 * p));
                dot[r] = DOT_U8(dot[r], hi, lane_bcast(qb[r] + 8 * p + 4));
                KEEP_IN_REGISTER(dot[r]);
            }
        }
        const __m256 d = _mm256_loadu_ps(dg + (size_t)b * X8), m = _mm256_loadu_ps(mg + (size_t)b * X8);
        const __m256 d_8 = _mm256_mul_ps(d, _mm256_set1_ps(8.0f));
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b;
            const __m256 sums = _mm256_cvtepi32_ps(U8_SUMS(dot[r]));
            acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_set1_ps(a->d8[at])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s[at]), acc[r]); /* offsets: m times the block's sum */
            acc[r] = _mm256_fmadd_ps(d_8, _mm256_set1_ps(a->e8[at]), acc[r]); /* 8 d times its sum error (qacts) */
        }
    }
    for (int r = 0; r < R; r++) x8_store(w, g, acc[r], y + (size_t)(r0 + r) * ldy + g * X8, accumulate);
}

/* Kinds 0-2: group g's eight outputs for activation rows r0 .. r0 + R - 1 on the int16 codes. */
static inline __attribute__((always_inline)) void x8_tile_int16(const qmatrix *w, const int kind, int g, int r0,
                                                               const int R, const qacts *a, float *y, int ldy,
                                                               int accumulate) {
    const int k = w->k, nb = k / QK, sets = scale_sets(kind);
    const uint8_t *cg = (const uint8_t *)w->codes8 + (size_t)g * nb * group_bytes(kind);
    const float *dg = w->d8 + (size_t)g * nb * X8 * sets;
    const float *mg = kind == 0 ? w->m8 + (size_t)g * nb * X8 : NULL;
    __m256 acc[X8_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int16_t *qb[X8_TILE];
        for (int r = 0; r < R; r++) qb[r] = a->q + (size_t)(r0 + r) * k + (size_t)b * QK;
        const float *db = dg + (size_t)b * X8 * sets;
        /* one int32 accumulator per row: with a second one per row (two chains) the tile no
         * longer fits the sixteen vector registers and spills on every block */
        __m256i dot[X8_TILE];
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) { /* pair vectors 2p and 2p + 1 */
            __m256i v0, v1;
            if (kind == 0) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(cg + (size_t)b * 128 + p * 16));
                const __m128i nibble = _mm_set1_epi8(0x0F);
                v0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, nibble));
                v1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble));
            } else {
                const int8_t *cp = (const int8_t *)cg + (size_t)b * 256 + p * 32;
                v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)cp));
                v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(cp + 16)));
            }
            for (int r = 0; r < R; r++) {
                dot[r] = DOT_I16(dot[r], v0, lane_bcast(qb[r] + 4 * p));
                dot[r] = DOT_I16(dot[r], v1, lane_bcast(qb[r] + 4 * p + 2));
                KEEP_IN_REGISTER(dot[r]);
            }
            if (kind == 2 && p == 3) { /* q6_k: weights 0..15 are done, with their own scales */
                const __m256 d0 = _mm256_loadu_ps(db);
                for (int r = 0; r < R; r++) {
                    const __m256 xs = _mm256_set1_ps(a->d[(size_t)(r0 + r) * nb + b]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d0, xs), acc[r]);
                    dot[r] = _mm256_setzero_si256();
                }
            }
        }
        const __m256 d = _mm256_loadu_ps(db + (kind == 2 ? X8 : 0));
        for (int r = 0; r < R; r++) {
            const __m256 xs = _mm256_set1_ps(a->d[(size_t)(r0 + r) * nb + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, xs), acc[r]);
            if (kind == 0) /* Q4_1's offsets: m times the activation block's sum */
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mg + (size_t)b * X8),
                                         _mm256_set1_ps(a->s[(size_t)(r0 + r) * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) x8_store(w, g, acc[r], y + (size_t)(r0 + r) * ldy + g * X8, accumulate);
}

static inline __attribute__((always_inline)) void x8_tile(const qmatrix *w, const int kind, int g, int r0, const int R,
                                                         const qacts *a, float *y, int ldy, int accumulate) {
    if (kind == 3)
        x8_tile_int8(w, g, r0, R, a, y, ldy, accumulate);
    else
        x8_tile_int16(w, kind, g, r0, R, a, y, ldy, accumulate);
}

/* Rows first .. last - 1 through tile(w, kind, g, r, R, ...): whole tiles of X8_TILE rows, then
 * the rest with R a constant at each call (cases of X8_TILE rows or more never run; TAIL keeps
 * their R within the tile's arrays). x8_rows and x16_kernel.h's x16_rows both use it. */
#define TAIL(n) ((n) < X8_TILE ? (n) : X8_TILE)
#define ROW_TILES(tile, w, kind, g, first, last, a, y, ldy, accumulate)                                      \
    do {                                                                                                  \
        int r_ = (first);                                                                                 \
        for (; r_ + X8_TILE <= (last); r_ += X8_TILE) tile(w, kind, g, r_, X8_TILE, a, y, ldy, accumulate); \
        switch ((last) - r_) {                                                                            \
        case 7: tile(w, kind, g, r_, TAIL(7), a, y, ldy, accumulate); break;                              \
        case 6: tile(w, kind, g, r_, TAIL(6), a, y, ldy, accumulate); break;                              \
        case 5: tile(w, kind, g, r_, 5, a, y, ldy, accumulate); break;                                    \
        case 4: tile(w, kind, g, r_, 4, a, y, ldy, accumulate); break;                                    \
        case 3: tile(w, kind, g, r_, 3, a, y, ldy, accumulate); break;                                    \
        case 2: tile(w, kind, g, r_, 2, a, y, ldy, accumulate); break;                                    \
        case 1: tile(w, kind, g, r_, 1, a, y, ldy, accumulate); break;                                    \
        default: break;                                                                                   \
        }                                                                                                 \
    } while (0)

/* One entry point per kind and width (rows_fn), each with its kind a constant so the tiles
 * inline without a kind test. */
#define ROWS_OF(name, tile, kind)                                                                           \
    static void name(const qmatrix *w, int g, int first, int last, const qacts *a, float *y, int ldy,     \
                     int accumulate) {                                                                  \
        ROW_TILES(tile, w, kind, g, first, last, a, y, ldy, accumulate);                                   \
    }
ROWS_OF(x8_rows_q4_1, x8_tile, 0)
ROWS_OF(x8_rows_q8_0, x8_tile, 1)
ROWS_OF(x8_rows_q6_k, x8_tile, 2)
ROWS_OF(x8_rows_q4_1_int8, x8_tile, 3)

#ifdef X8_PAIRS
#include "x16_kernel.h"
#endif

typedef void (*rows_fn)(const qmatrix *, int, int, int, const qacts *, float *, int, int);

/* Units of work are (row chunk, share of groups), handed out as threads ask: a thread
 * descheduled by other work on the machine then holds up one unit, not half the product.
 * With X8_PAIRS, groups go two at a time (X8_SHARE is even), an odd last one alone. */
void X8_ENTRY(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate) {
    const int groups = (w->n + X8 - 1) / X8, shares = (groups + X8_SHARE - 1) / X8_SHARE;
    const int chunks = (rows + X8_CHUNK - 1) / X8_CHUNK;
    const rows_fn run =
        w->kind == 0 ? x8_rows_q4_1 : w->kind == 1 ? x8_rows_q8_0 : w->kind == 2 ? x8_rows_q6_k : x8_rows_q4_1_int8;
#ifdef X8_PAIRS
    const rows_fn pair = w->kind == 0 ? x16_rows_q4_1 : w->kind == 1 ? x16_rows_q8_0
                       : w->kind == 2 ? x16_rows_q6_k : x16_rows_q4_1_int8;
    const int step = 2;
#else
    const int step = 1;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int unit = 0; unit < chunks * shares; unit++) {
        const int chunk = unit / shares, share = unit % shares;
        const int first = chunk * X8_CHUNK, last = first + X8_CHUNK < rows ? first + X8_CHUNK : rows;
        const int g_end = (share + 1) * X8_SHARE < groups ? (share + 1) * X8_SHARE : groups;
        for (int g = share * X8_SHARE; g < g_end; g += step) {
#ifdef X8_PAIRS
            if (g + 1 < g_end) {
                pair(w, g, first, last, a, y, ldy, accumulate);
                continue;
            }
#endif
            run(w, g, first, last, a, y, ldy, accumulate);
        }
    }
}
