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
 *
 * The products themselves are in x8_kernel.h, compiled here for AVX2 and in
 * ggml_gemm_x8_vnni.c for AVX-512 VNNI; x8_gemm runs the best one the machine has.
 */
#include <string.h>

#include "cpu_features.h"
#include "ggml_gemv.h"
#include "x8_layout.h"

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


/* The AVX2 kernels, which every machine the library loads on has. */
#define X8_ENTRY x8_gemm_avx2
#define X8_TILE 6
#include "x8_kernel.h"

void x8_gemm_vnni(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate); /* _vnni.c */

/* Whether the CPU has AVX-512 (cpu_features.h) with VNNI. */
static int vnni_usable(void) { return avx512_usable() && __builtin_cpu_supports("avx512vnni"); }

static int x8_isa = -1; /* X8_ISA_*, chosen on first use: the best this machine has */

int kvlab_x8_isa(void) {
    if (x8_isa < 0) x8_isa = vnni_usable() ? X8_ISA_AVX512_VNNI : X8_ISA_AVX2;
    return x8_isa;
}

/* Use `isa` from now on (a benchmark's or test's choice); -1 where this machine lacks it. */
int kvlab_x8_set_isa(int isa) {
    if (isa == X8_ISA_AVX2 || (isa == X8_ISA_AVX512_VNNI && vnni_usable())) return x8_isa = isa, 0;
    return -1;
}

void x8_gemm(const qmatrix *w, int rows, const qacts *a, float *y, int ldy, int accumulate) {
    if (kvlab_x8_isa() == X8_ISA_AVX512_VNNI)
        x8_gemm_vnni(w, rows, a, y, ldy, accumulate);
    else
        x8_gemm_avx2(w, rows, a, y, ldy, accumulate);
}
