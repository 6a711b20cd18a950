/* fp8 attention on AVX-512 (attend_fp8_vbmi.c), for heads of a multiple of 64 channels.
 *
 * The AVX2 loop widens every fp8 code to fp32 in eight lanes (kv_codecs.h's load8) before the
 * multiply-adds fp16 does after one conversion, and an fp8 pool ran at 0.80-0.91x fp16's
 * speed at 4,096 tokens though it reads half the bytes: those passes were bound by
 * instructions, not memory (with the K/V held in cache, fp16 and fp8 steps ran only 12% and
 * 5% faster). Here each code becomes an fp32 lane through byte tables, 64 at a time, and the
 * products are fp32 multiply-adds on sixteen lanes with the query and weights whole, so the
 * sums are those of the AVX2 loop up to summation order.
 * Tried first, on AVX512_BF16's vdpbf16ps (32 products per instruction): with the query and
 * weights rounded to bf16 a 16-row step ran 1.21x fp16's speed but its logits moved 3e-3 of
 * their scale from the fp32 products; split into two bf16 parts each (hi + lo) to keep 16
 * bits, it ran 0.96x. Multiply-adds on fp32 lanes need no rounding and ran faster than both
 * in precise form.
 */
#ifndef KVLAB_ATTEND_FP8_H
#define KVLAB_ATTEND_FP8_H

#include <stddef.h>
#include <stdint.h>

#define FP8_DOT_MAX_HEAD_DIM 256 /* the widest head this path takes (its zero row) */

/* One attention unit's rows: the codes (e4m3 when e4m3, else e5m2). */
typedef struct {
    const uint8_t *keys, *values; /* [rows, d] codes */
    const size_t *slots;          /* the chunk's `len` (<= CHUNK) rows */
    int len, d, e4m3;
} fp8_chunk;

/* Whether this CPU and OS run this path (AVX-512 F, BW, VL and VBMI). */
int fp8_vbmi_usable(void);

/* Softmax partials of `heads` (1..4) query heads (q, stride d) over the chunk, as
 * int8_attend_vnni leaves them: top[h] the largest score q_h . k_t k_factor, total[h] the sum
 * of exp(score - top), out[h] (stride d) the exp-weighted sum of values times v_factor. */
void fp8_attend_vbmi(const fp8_chunk *c, const float *q, int heads, float k_factor, float v_factor, float *top,
                     float *total, float *out);

#endif
