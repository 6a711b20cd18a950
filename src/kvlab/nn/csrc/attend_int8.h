/* int8 attention on integer dot products (attend_int8_vnni.c), for heads of a multiple of 64
 * channels with one scale/zero group per row.
 *
 * The AVX2 attention loop widens every int8 code to fp32 and multiplies in fp32, the work fp16
 * does after its conversion, and an int8 pool ran at 1.03x fp16's speed at 4,096 tokens
 * though it reads half the bytes. Here the codes stay bytes: the query is rounded to 15 bits
 * and split into two signed bytes, the softmax weights to 15-bit words, and AVX-512 VNNI sums
 * 4 (or 2) products per 32-bit lane in one instruction; scales and zeros still apply to whole
 * dot products and weights, in fp32. Rounding to 15 bits costs about 3e-5 of the largest
 * value, finer than an fp16 cache's own rounding (2^-11). Fewer instructions alone did not
 * pay: under perf the passes then waited on memory, and the gain (1.18x fp16 at 16 rows)
 * came with asking for the next keys (L1) and values (L2) while the current ones are summed,
 * and for each block's scales and zeros before the dots that need them. The softmax between
 * the passes then took a sixth of a 16-row step in AVX2's five passes of eight lanes; here it
 * is two passes of sixteen, fused with the scale, zero and weight folds (1.30x fp16).
 */
#ifndef KVLAB_ATTEND_INT8_H
#define KVLAB_ATTEND_INT8_H

#include <stddef.h>
#include <stdint.h>

#define INT8_DOT_MAX_HEAD_DIM 256 /* the widest head the integer path quantises the query for */

/* One attention unit's rows for the integer path: the codes, and per row one scale and zero
 * each for K and V, widened to fp32 (llama_decode.c's chunk_rows holds them). */
typedef struct {
    const uint8_t *keys, *values; /* [rows, d] codes */
    const size_t *slots;          /* the chunk's `len` (<= CHUNK) rows */
    int len, d;
    const float *k_scale, *k_zero, *v_scale, *v_zero; /* [len] */
} int8_chunk;

/* Softmax partials of `heads` (1..4) query heads (q, stride d) over the chunk: top[h] the
 * largest score q_h . k_t k_factor, total[h] the sum of exp(score - top), out[h] (stride d)
 * the exp-weighted sum of values times v_factor. Each q_h is rounded to 15 bits against its
 * dot products with the raw codes (its sum meets the zeros), and the weights to 15-bit words
 * against the value codes. */
void int8_attend_vnni(const int8_chunk *c, const float *q, int heads, float k_factor, float v_factor, float *top,
                      float *total, float *out);

#endif
