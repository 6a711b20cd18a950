/* Reading and writing one cache row (a token of one KV head) in every format the decode step
 * runs: what kvlab.cache.codecs does in PyTorch, bit for bit where it matters.
 *
 * Stores must produce the bytes PyTorch would, so the module path reading the same pool (or
 * taking over mid-generation) sees identical cache contents:
 *   fp16/bf16: round to nearest even, as torch's .to() does;
 *   fp8:       x / scale, clamped to the format's largest finite value, rounded to nearest
 *              even straight from fp32 (torch's c10 conversion; no double rounding via fp16);
 *   int8/4/2:  kvlab.cache.quantize.quantize_groups: min-max per group in fp32, scale =
 *              (max - min) / levels (255, 15, 3) and zero = min stored as fp16, codes =
 *              round-half-even of (x - zero) / scale against the *stored* fp16 values,
 *              clamped to 0..levels; int4/int2 codes packed as pack_codes packs them.
 * Loads widen eight channels to fp32 lanes. fp8 never goes through a lookup table: e5m2 is
 * the top byte of an fp16, and e4m3 placed in an fp16's bits is its value times 2^-8, so
 * both are one F16C conversion (the 2^8 joins the per-head scale, applied to whole dot
 * products by the caller).
 */
#ifndef KVLAB_KV_CODECS_H
#define KVLAB_KV_CODECS_H

#include <math.h>
#include <string.h>

#include "llama_decode.h"

static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

static inline uint16_t f32_to_f16(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (isnan(x)) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16); /* round to nearest even */
}

/* x -> fp8 bits (e4m3fn when e4m3, else e5m2), saturating, round to nearest even. */
static inline uint8_t fp8_encode(float x, int e4m3) {
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const float limit = e4m3 ? 448.0f : 57344.0f;
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return sign | 0x7F;
    float a = fabsf(x) > limit ? limit : fabsf(x); /* fp8_quantize clamps before converting */
    if (a == 0.0f) return sign;
    int e;
    frexpf(a, &e); /* a = f 2^e, f in [0.5, 1): its binade is 2^(e-1) */
    const int binade = e - 1 < 1 - bias ? 1 - bias : e - 1; /* subnormals share the lowest binade's step */
    const float step = ldexpf(1.0f, binade - mbits);
    a = rintf(a / step) * step; /* exact scaling by powers of two; rintf rounds half to even */
    if (a == 0.0f) return sign; /* below half the smallest subnormal */
    frexpf(a, &e);
    if (e - 1 < 1 - bias) return sign | (uint8_t)(a / ldexpf(1.0f, 1 - bias - mbits)); /* subnormal */
    const int mant = (int)(a / ldexpf(1.0f, e - 1 - mbits)) - (1 << mbits);
    return sign | (uint8_t)(((e - 1 + bias) << mbits) | mant);
}

/* fp8_encode of eight values at once, the same bytes, in the low 8 bytes. Normals round to
 * nearest even by the integer carry trick on the fp32 bits (adding half a step less one, plus
 * the kept bit's parity, then shifting the dropped bits out: a carry into the exponent is the
 * next binade, as it should be); subnormals and zero are round-half-even of a / step by the
 * conversion to int32 (the multiply by a power of two is exact). The scalar loop cost 20 ns a
 * value (frexpf, ldexpf), 3-4% of a 16-row decode step and more of a prefill. */
static inline __m128i fp8_encode8(__m256 x, int e4m3) {
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, shift = 23 - mbits;
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256i sign = _mm256_srli_epi32(_mm256_castps_si256(_mm256_and_ps(x, sign_bit)), 24);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign_bit, x), _mm256_set1_ps(e4m3 ? 448.0f : 57344.0f));
    const __m256i u = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, shift), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32((1 << (shift - 1)) - 1), odd)), shift);
    const __m256i normal = _mm256_sub_epi32(rounded, _mm256_set1_epi32((127 - bias) << mbits));
    const __m256i small = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(ldexpf(1.0f, bias - 1 + mbits))));
    const __m256 below = _mm256_cmp_ps(a, _mm256_set1_ps(ldexpf(1.0f, 1 - bias)), _CMP_LT_OQ);
    __m256i code = _mm256_or_si256(_mm256_blendv_epi8(normal, small, _mm256_castps_si256(below)), sign);
    code = _mm256_blendv_epi8(code, _mm256_or_si256(sign, _mm256_set1_epi32(0x7F)), _mm256_castps_si256(nan));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    return _mm_packus_epi16(words, words);
}

/* One row x[d] as groups of `gsize` channels (the last may be partial) of `bits`-bit codes
 * (8, 4 or 2): codes packed 8 / bits a byte, the first channel in the lowest bits (row of
 * d * bits / 8 bytes, rounded up), scale and zero [ceil(d / gsize)] as fp16 bits. Plain fp32
 * division, never a reciprocal multiply, and no fused multiply-add: the codes must be
 * quantize_groups' and pack_codes' to the byte. */
static inline void group_quantize_row(const float *x, int d, int gsize, int bits, uint8_t *codes, uint16_t *scale,
                                      uint16_t *zero) {
    const int levels = (1 << bits) - 1, per_byte = 8 / bits;
    if (bits < 8) memset(codes, 0, (size_t)(d * bits + 7) / 8);
    for (int g = 0, at = 0; at < d; g++, at += gsize) {
        const int end = at + gsize < d ? at + gsize : d;
        float lo = INFINITY, hi = -INFINITY;
        for (int i = at; i < end; i++) lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
        const float range = hi - lo; /* -0 where fminf / fmaxf took a group of zeros' signs the other way round */
        scale[g] = f32_to_f16((range == 0.0f ? 0.0f : range) / (float)levels);
        zero[g] = f32_to_f16(lo);
        const float z = f16_to_f32(zero[g]), s = f16_to_f32(scale[g]), step = s == 0.0f ? 1.0f : s;
        for (int i = at; i < end; i++) {
            const float code = rintf((x[i] - z) / step);
            const uint8_t c = (uint8_t)(code < 0.0f ? 0.0f : code > (float)levels ? (float)levels : code);
            if (bits == 8)
                codes[i] = c;
            else
                codes[i / per_byte] |= (uint8_t)(c << (i % per_byte * bits));
        }
    }
}

/* Bytes of one cache row of d channels (d a multiple of 8). */
static inline size_t row_bytes(int dtype, int d) {
    if (cache_grouped(dtype)) return (size_t)d * cache_code_bits(dtype) / 8;
    return (size_t)d * (dtype == CACHE_F32 ? 4 : dtype <= CACHE_BF16 ? 2 : 1);
}

/* Row `slot` (a token of one KV head: block x heads x block_size + head x block_size + offset)
 * of plane p takes src[d]; `head` picks fp8's scale. */
static inline void store_row(const kv_plane *p, int dtype, size_t slot, int head, const float *src, int d,
                             int gsize) {
    const size_t at = slot * d;
    switch (dtype) {
    case CACHE_F32:
        memcpy((float *)p->data + at, src, d * sizeof(float));
        break;
    case CACHE_F16:
        for (int j = 0; j < d; j += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)p->data + at + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
        break;
    case CACHE_BF16:
        for (int j = 0; j < d; j++) ((uint16_t *)p->data)[at + j] = to_bf16(src[j]);
        break;
    case CACHE_FP8_E4M3:
    case CACHE_FP8_E5M2: {
        uint8_t *row = (uint8_t *)p->data + at;
        const __m256 scale = _mm256_set1_ps(p->fp8_scale[head]); /* divided, not multiplied by 1 / scale: torch's bytes */
        int j = 0;
        for (; j + 8 <= d; j += 8)
            _mm_storel_epi64((__m128i *)(row + j),
                             fp8_encode8(_mm256_div_ps(_mm256_loadu_ps(src + j), scale), dtype == CACHE_FP8_E4M3));
        for (; j < d; j++) row[j] = fp8_encode(src[j] / p->fp8_scale[head], dtype == CACHE_FP8_E4M3);
        break;
    }
    case CACHE_INT8:
    case CACHE_INT4:
    case CACHE_INT2: {
        const size_t groups = (size_t)(d + gsize - 1) / gsize;
        group_quantize_row(src, d, gsize, cache_code_bits(dtype), (uint8_t *)p->data + slot * row_bytes(dtype, d),
                           p->scale + slot * groups, p->zero + slot * groups);
        break;
    }
    }
}

/* Channels i .. i + 7 of row `slot`, widened to fp32 but not yet scaled: fp8 lanes come back
 * without their per-head scale (e4m3 also 2^-8 too small), int8/int4/int2 lanes as the bare
 * codes (int4's eight codes are one 32-bit word, int2's one 16-bit word: broadcast to every
 * lane, each lane shifts its own code down, a mask keeps it). The
 * attention loop applies scales to whole dot products and weights instead (fp8_factor, the
 * int8 groups' scale and zero), which costs one multiply per token instead of one per lane. */
static inline __attribute__((always_inline)) __m256 load8(const kv_plane *p, int dtype, size_t slot, int i, int d) {
    const size_t at = slot * d + i;
    switch (dtype) {
    case CACHE_F32:
        return _mm256_loadu_ps((const float *)p->data + at);
    case CACHE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p->data + at)));
    case CACHE_BF16: /* bf16 is the high half of an fp32 */
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p->data + at))), 16));
    case CACHE_FP8_E5M2: {
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p->data + at)));
        return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
    }
    case CACHE_FP8_E4M3: { /* sign to bit 15, exponent and mantissa to bits 7..14 */
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p->data + at)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
        return _mm256_cvtph_ps(h);
    }
    case CACHE_INT4: {
        uint32_t word;
        memcpy(&word, (const uint8_t *)p->data + slot * (d / 2) + i / 2, sizeof word);
        const __m256i codes =
            _mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(0xF)));
    }
    case CACHE_INT2: {
        uint16_t word;
        memcpy(&word, (const uint8_t *)p->data + slot * (d / 4) + i / 4, sizeof word);
        const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        return _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(0x3)));
    }
    default: /* CACHE_INT8 */
        return _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p->data + at))));
    }
}

/* int4/int2 rows read a word of eight bytes at a time, as planes (kvlab's packed layout, channel
 * c in byte c / P at bits (c % P) * bits, P = 8 / bits codes a byte, unchanged): the word's bytes
 * widened to eight 32-bit lanes, plane k is lane m's code k, channel P m + k of the word's W = 8 P
 * channels. One zero-extending load, then per plane a shift and a mask (the top plane needs no
 * mask, the lowest no shift) and a conversion: sixteen int4 codes for five operations where
 * load8 paid eight (a broadcast, a variable shift, a mask and a conversion per eight). The attention loop takes the
 * planes as they come, against query heads whose channels layer_step permuted the same way once
 * per step (packed_order), and puts the value sums back in channel order once per chunk. */
static inline int packed_width(int dtype) { return 64 / cache_code_bits(dtype); } /* W: channels a word holds */

/* Whether rows of d channels in groups of gsize (>= d: one group) can be read as whole words: every
 * word inside one group, so a group's scale and zero still apply to whole dot products. */
static inline int packed_rows(int dtype, int d, int gsize) {
    const int w = (dtype == CACHE_INT4 || dtype == CACHE_INT2) ? packed_width(dtype) : 0;
    return w && d % w == 0 && (gsize >= d || gsize % w == 0);
}

/* The word holding channel i (a multiple of W) of the row `at` bytes into plane p's codes. */
static inline __attribute__((always_inline)) __m256i packed_word(const kv_plane *p, int dtype, size_t at, int i) {
    const uint8_t *word = (const uint8_t *)p->data + at + (unsigned)i * (unsigned)cache_code_bits(dtype) / 8;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)word));
}

static inline __attribute__((always_inline)) __m256 packed_plane(__m256i word, int dtype, int k) {
    const int bits = cache_code_bits(dtype), shift = k * bits;
    __m256i codes = shift ? _mm256_srli_epi32(word, shift) : word;
    if (shift + bits < 8) codes = _mm256_and_si256(codes, _mm256_set1_epi32((1 << bits) - 1));
    return _mm256_cvtepi32_ps(codes);
}

/* Channel c of a row as its planes order it: at word c / W * W, plane c % P, lane c % W / P. */
static inline int packed_order(int dtype, int c) {
    const int P = 8 / cache_code_bits(dtype), w = packed_width(dtype);
    return c / w * w + c % P * 8 + c % w / P;
}

/* A query head's d channels into packed_order, in place (once per step and head, not per chunk). */
static inline void packed_permute(float *x, int dtype, int d) {
    float tmp[d];
    memcpy(tmp, x, sizeof tmp);
    for (int c = 0; c < d; c++) x[packed_order(dtype, c)] = tmp[c];
}

/* Ask for row `slot` of plane p (and, for the group formats, its scale and zero) ahead of use. Attention
 * walks a row's blocks in table order, which the hardware prefetchers cannot follow past a
 * block (blocks sit anywhere in the pool): without this the loop waited on memory for each
 * block's first rows, and at long context stalls, not arithmetic, were most of its time. */
static inline __attribute__((always_inline)) void prefetch_row(const kv_plane *p, int dtype, size_t slot, int d,
                                                              int groups) {
    const int bytes = (int)row_bytes(dtype, d);
    const char *row = (const char *)p->data + slot * (size_t)bytes;
    for (int at = 0; at < bytes; at += 64) _mm_prefetch(row + at, _MM_HINT_T0);
    if (cache_grouped(dtype)) {
        _mm_prefetch((const char *)(p->scale + slot * groups), _MM_HINT_T0);
        _mm_prefetch((const char *)(p->zero + slot * groups), _MM_HINT_T0);
    }
}

/* What fp8 dot products are multiplied by to be in the cache's units (1 for other formats). */
static inline float fp8_factor(const kv_plane *p, int dtype, int head) {
    if (dtype == CACHE_FP8_E4M3) return 256.0f * p->fp8_scale[head];
    if (dtype == CACHE_FP8_E5M2) return p->fp8_scale[head];
    return 1.0f;
}

#endif
