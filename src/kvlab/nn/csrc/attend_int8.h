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
 * and for each block's scales and zeros before the dots that need them.
 */
#ifndef KVLAB_ATTEND_INT8_H
#define KVLAB_ATTEND_INT8_H

#include <stddef.h>
#include <stdint.h>

#define INT8_DOT_MAX_HEAD_DIM 256 /* the widest head the integer path quantises the query for */

/* dots[h][t] = q_h . codes_t (the raw codes; scale and zero apply to the whole product after)
 * for `heads` (1..4) query heads (q, stride d) and the `len` (<= CHUNK) cache rows `slots` of
 * `codes` ([rows, d] bytes), dots with stride CHUNK, each q_h rounded to 15 bits (its sum in
 * sums[h], for the zero term); the same rows of `values` are prefetched for the value pass. */
void int8_key_dots_vnni(const uint8_t *codes, const uint8_t *values, const size_t *slots, int len, int d,
                        const float *q, int heads, float *dots, float *sums);

/* out[h][i] = (sum_t w[h][t] codes_t[i] + offset[h]) factor for `heads` (1..4) query heads
 * (w stride CHUNK, weights >= 0; out stride d) over the `len` rows `slots` of `codes`. */
void int8_value_sums_vnni(const uint8_t *codes, const size_t *slots, int len, int d, const float *w, int heads,
                          const float *offset, float factor, float *out);

#endif
