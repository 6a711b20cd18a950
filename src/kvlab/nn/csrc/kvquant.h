/* The structs that describe a KVQuant pool (kvlab.cache.kvquant_pool.KVQuantPlanes) to the C step.
 *
 * A KVQuant pool is not one plane of rows per side as the other formats are: a token's key row is
 * codebook indices over per-channel ranges plus a count of the outliers it keeps in its seat's
 * pool, a value row is codebook indices with an fp16 scale and zero and its own outliers, and a
 * sequence's first `sinks` tokens stay whole in fp16 in its seat. llama_model.kvq points here
 * (NULL for every other format); kvquant_write.h writes it and kvquant_attend.h reads it. kvlab.nn.c_abi mirrors both
 * structs and abi.c exports their layout, as for the others.
 */
#ifndef KVLAB_KVQUANT_H
#define KVLAB_KVQUANT_H

#include <stdint.h>

/* One layer's KVQuant tensors, each the pool's own (contiguous, never moved). */
typedef struct {
    uint8_t *k_codes;             /* [blocks, kv_heads, block_size, head_dim bits / 8] packed codes (kvlab.cache.bitpack) */
    uint8_t *k_counts;            /* [blocks, kv_heads, block_size]: how many of the seat's outlier slots each row took */
    uint8_t *v_codes;             /* [blocks, kv_heads, block_size, head_dim bits / 8] */
    uint16_t *v_zero, *v_scale;   /* [blocks, kv_heads, block_size] fp16 bits */
    uint16_t *v_outliers;         /* [blocks, kv_heads, block_size, v_outliers] fp16 bits, largest |value| first */
    uint8_t *v_outlier_index;     /* [blocks, kv_heads, block_size, v_outliers] their channels */
    uint16_t *k_sink, *v_sink;    /* [seats, kv_heads, sinks, head_dim] fp16 bits: the first tokens, whole */
    uint16_t *k_outliers;         /* [seats, kv_heads, capacity] fp16 bits: key outliers in row order */
    uint8_t *k_outlier_index;     /* [seats, kv_heads, capacity] their channels */
    const uint16_t *k_codebook;   /* [2^bits] fp16, sorted, in [-1, 1] */
    const uint16_t *v_codebook;   /* [2^bits] fp16, sorted, in [0, 1] */
    const uint16_t *k_zero, *k_range; /* [kv_heads, head_dim] fp16: each channel's centre and half-width */
} kvquant_layer;

/* The pool's shape and the step's seats. */
typedef struct {
    int bits;             /* 3 or 4 */
    int outlier_percent;  /* of a row's values kept in fp16 (kvlab.plan.kv_formats) */
    int sinks;            /* a sequence's first tokens kept whole */
    int capacity;         /* outlier slots per seat and head: outlier_capacity(max_tokens - sinks) */
    int v_outliers;       /* outliers per value row: ceil(head_dim percent / 100) */
    int seats, max_tokens;
    int rope_halves;      /* 1: every layer's RoPE tables are kvlab.nn.rope's half style, cos [c, c] and sin [-s, s]
                             (the keys' rotation then runs on a recurrence in registers: kvquant_attend.h) */
    const int32_t *row_seats; /* [rows]: each row's seat, set by the caller before every step */
    const kvquant_layer *layers;
} kvquant_cache;

#endif
