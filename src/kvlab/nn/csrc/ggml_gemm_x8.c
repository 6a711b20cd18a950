/* Products of activation rows (a batch, a prompt, one decode row) on weights interleaved eight
 * output rows at a time.
 *
 * ggml_gemv.c takes one output row's block, multiplies it with a row of activations into
 * eight int32 lanes that all belong to that one output, and then spends a conversion, a
 * scale product, a broadcast and a float multiply-add on those 32 products, plus a
 * horizontal sum at the end. With many activation rows that bookkeeping, not the integer
 * multiplies, is the step: SmolLM2's batch-16 products ran at about 5 multiply-adds per
 * cycle on a core that issues two 16-wide vpmaddwd per cycle (Zen 3).
 *
 * Here lane j of every vector belongs to output row 8g + j (llama.cpp's repacked "x8"
 * layouts do the same). One 256-bit vector holds, for eight outputs, the two weights that
 * meet activation pair i of a block; one vpmaddwd with that pair broadcast gives eight
 * outputs' partial sums, and sixteen of them, added as int32, give eight whole-block dot
 * products exactly. The block's float work (conversion, the scales of eight outputs in one
 * load, the multiply-add) is then shared by eight outputs instead of spent on one.
 *
 * The interleaved copy (qmatrix_interleave) sits beside the row-major planes, which stay for
 * dequantising and exports and for a qmatrix without the copy. It serves one row too: a
 * batch-1 SmolLM2 step here is bound by the kernel's instructions, not memory (about 8 of
 * the 23 GB/s this machine streams), and its Q4_1 products ran 1.2-1.3x faster this way.
 *   kind 0 "q4_1": per group g of eight outputs and block b, 128 bytes: byte q of 16-byte
 *                  chunk p holds, in its low nibble, element q of pair vector 2p and in its
 *                  high nibble element q of pair vector 2p + 1; pair vector i's element
 *                  2j + t is output 8g + j's weight 2i + t of the block. d8 and m8 hold
 *                  the eight outputs' scales and offsets per block.
 *   kind 3 "q4_1" on int8 activations (llama.cpp's arithmetic for 4-bit blocks): per group and
 *                  block, 128 bytes: byte 4j + t of 32-byte chunk p holds output 8g + j's
 *                  weight 8p + t in its low nibble and weight 8p + 4 + t in its high one.
 *                  Masked, each nibble plane is a vector whose 32-bit lane j holds four
 *                  consecutive weights of output 8g + j as bytes: one vpmaddubsw with four int8
 *                  activations broadcast gives eight outputs' partial sums in pairs of int16,
 *                  eight of them add up in int16 without overflow (at most 8 * 2 * 15 * 127 =
 *                  30,480) and one vpmaddwd by ones makes them the eight block dot products in
 *                  int32. Twice vpmaddwd's multiply-adds per instruction and no widening of the
 *                  nibbles: SmolLM2's Q4_1 products ran 1.3-1.8x faster at 8 to 128 rows. The
 *                  price is the int8 codes' rounding (ggml_gemv.h's qacts): 3e-3 of relative
 *                  error per product against int16's 5e-5. d8 and m8 as for kind 0.
 *   kind 1 "q8_0", kind 2 "q6_k": the sixteen pair vectors as int8, 256 bytes per group
 *                  and block; q6_k has two scales per block (weights 0..15, 16..31), so
 *                  d8 holds two sets of eight per block.
 * Outputs past n in the last group are zero weights with zero scales, never stored.
 */
#include <string.h>

#include "ggml_gemv.h"

#define X8 8          /* output rows interleaved into one vector's lanes */
#define X8_TILE 6     /* activation rows per pass over a group's blocks */
#define X8_CHUNK 64   /* activation rows per unit of work: a prompt's rows stay in L2 */
#define X8_SHARE 4    /* groups (32 output rows) per unit of work */

static inline int group_bytes(int kind) { return kind == 0 || kind == 3 ? 128 : 256; } /* per group, block */
static inline int scale_sets(int kind) { return kind == 2 ? 2 : 1; }

size_t x8_codes_bytes(int kind, int n, int k) { return (size_t)((n + X8 - 1) / X8) * (k / QK) * group_bytes(kind); }

size_t x8_scales_count(int kind, int n, int k) {
    return (size_t)((n + X8 - 1) / X8) * (k / QK) * X8 * scale_sets(kind);
}

/* Output o's 32 codes of block b, unpacked (0..15 for q4_1, as stored for the others). */
static void block_codes(int kind, const void *codes, int k, int o, int b, int8_t out[QK]) {
    if (kind == 0 || kind == 3) {
        const uint8_t *c = (const uint8_t *)codes + ((size_t)o * (k / QK) + b) * 16;
        for (int q = 0; q < 16; q++) out[q] = (int8_t)(c[q] & 0x0F), out[q + 16] = (int8_t)(c[q] >> 4);
    } else {
        memcpy(out, (const int8_t *)codes + (size_t)o * k + (size_t)b * QK, QK);
    }
}

void qmatrix_interleave(int kind, const void *codes, const float *d, const float *m, int n, int k, void *codes8,
                        float *d8, float *m8) {
    const int nb = k / QK, groups = (n + X8 - 1) / X8, sets = scale_sets(kind);
    uint8_t *out = codes8;
#pragma omp parallel for schedule(static) if ((size_t)n * k >= 65536)
    for (int g = 0; g < groups; g++) {
        for (int b = 0; b < nb; b++) {
            int8_t pair[16][16]; /* the int16 kinds' pair vector i, element 2j + t */
            int8_t w[X8][QK];    /* the eight outputs' codes of this block */
            const size_t at = (size_t)g * nb + b;
            for (int j = 0; j < X8; j++) {
                const int o = g * X8 + j;
                if (o < n)
                    block_codes(kind, codes, k, o, b, w[j]);
                else
                    memset(w[j], 0, QK);
                for (int i = 0; i < 16; i++) pair[i][2 * j] = w[j][2 * i], pair[i][2 * j + 1] = w[j][2 * i + 1];
                for (int h = 0; h < sets; h++) /* q6_k: d holds k / 16 scales per row */
                    d8[(at * sets + h) * X8 + j] = o < n ? d[(size_t)o * nb * sets + (size_t)b * sets + h] : 0.0f;
                if (kind == 0 || kind == 3) m8[at * X8 + j] = o < n ? m[(size_t)o * nb + b] : 0.0f;
            }
            uint8_t *dst = out + at * group_bytes(kind);
            if (kind == 0) {
                for (int p = 0; p < 8; p++)
                    for (int q = 0; q < 16; q++)
                        dst[p * 16 + q] = (uint8_t)((pair[2 * p][q] & 0x0F) | (pair[2 * p + 1][q] << 4));
            } else if (kind == 3) {
                for (int p = 0; p < 4; p++)
                    for (int j = 0; j < X8; j++)
                        for (int t = 0; t < 4; t++)
                            dst[p * 32 + 4 * j + t] = (uint8_t)(w[j][8 * p + t] | (w[j][8 * p + 4 + t] << 4));
            } else {
                memcpy(dst, pair, sizeof pair);
            }
        }
    }
}

/* An empty asm that claims to change v: the compiler must have v in a register here and may not
 * move the adds into it across this point. Without it GCC reassociates each block's integer
 * adds into a tree of all the tile's products and spills them to the stack (48 256-bit stores
 * and loads per block at six rows, measured in its assembly). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))

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
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[X8_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *qb[X8_TILE];
        for (int r = 0; r < R; r++) qb[r] = a->q8 + (size_t)(r0 + r) * k + (size_t)b * QK;
        __m256i dot[X8_TILE]; /* int16 pairs: eight products of 4 bits by 8 stay under 2^15 */
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) { /* weights 8p .. 8p + 3 (low nibbles) and 8p + 4 .. 8p + 7 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(cg + (size_t)b * 128 + p * 32));
            const __m256i lo = _mm256_and_si256(raw, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
            for (int r = 0; r < R; r++) {
                dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(lo, lane_bcast(qb[r] + 8 * p)));
                dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(hi, lane_bcast(qb[r] + 8 * p + 4)));
                KEEP_IN_REGISTER(dot[r]);
            }
        }
        const __m256 d = _mm256_loadu_ps(dg + (size_t)b * X8), m = _mm256_loadu_ps(mg + (size_t)b * X8);
        const __m256 d_8 = _mm256_mul_ps(d, _mm256_set1_ps(8.0f));
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b;
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r], ones));
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
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(v0, lane_bcast(qb[r] + 4 * p)));
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(v1, lane_bcast(qb[r] + 4 * p + 2)));
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

/* Group g against activation rows first .. last - 1: whole tiles, then the rest. */
static inline __attribute__((always_inline)) void x8_rows(const qmatrix *w, const int kind, int g, int first,
                                                         int last, const qacts *a, float *y, int ldy, int accumulate) {
    int r = first;
    for (; r + X8_TILE <= last; r += X8_TILE) x8_tile(w, kind, g, r, X8_TILE, a, y, ldy, accumulate);
    switch (last - r) {
    case 5: x8_tile(w, kind, g, r, 5, a, y, ldy, accumulate); break;
    case 4: x8_tile(w, kind, g, r, 4, a, y, ldy, accumulate); break;
    case 3: x8_tile(w, kind, g, r, 3, a, y, ldy, accumulate); break;
    case 2: x8_tile(w, kind, g, r, 2, a, y, ldy, accumulate); break;
    case 1: x8_tile(w, kind, g, r, 1, a, y, ldy, accumulate); break;
    default: break;
    }
}

/* One entry point per kind, each with its kind a constant so x8_rows inlines without a kind test. */
#define X8_ROWS_OF(name, kind)                                                                              \
    static void name(const qmatrix *w, int g, int first, int last, const qacts *a, float *y, int ldy,     \
                     int accumulate) {                                                                  \
        x8_rows(w, kind, g, first, last, a, y, ldy, accumulate);                                           \
    }
X8_ROWS_OF(x8_rows_q4_1, 0)
X8_ROWS_OF(x8_rows_q8_0, 1)
X8_ROWS_OF(x8_rows_q6_k, 2)
X8_ROWS_OF(x8_rows_q4_1_int8, 3)

/* Units of work are (row chunk, share of groups), handed out as threads ask: a thread
 * descheduled by other work on the machine then holds up one unit, not half the product. */
void x8_gemm(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate) {
    const int groups = (w->n + X8 - 1) / X8, shares = (groups + X8_SHARE - 1) / X8_SHARE;
    const int chunks = (rows + X8_CHUNK - 1) / X8_CHUNK;
    void (*run)(const qmatrix *, int, int, int, const qacts *, float *, int, int) =
        w->kind == 0 ? x8_rows_q4_1 : w->kind == 1 ? x8_rows_q8_0 : w->kind == 2 ? x8_rows_q6_k : x8_rows_q4_1_int8;
#pragma omp for schedule(dynamic, 1)
    for (int unit = 0; unit < chunks * shares; unit++) {
        const int chunk = unit / shares, share = unit % shares;
        const int first = chunk * X8_CHUNK, last = first + X8_CHUNK < rows ? first + X8_CHUNK : rows;
        const int g_end = (share + 1) * X8_SHARE < groups ? (share + 1) * X8_SHARE : groups;
        for (int g = share * X8_SHARE; g < g_end; g++) run(w, g, first, last, a, y, ldy, accumulate);
    }
}
