/* The structs the decode steps (llama_decode.c) take from Python, and the constants they share.
 *
 * kvlab.nn.c_abi mirrors every struct here field for field with ctypes; abi.c exports their
 * sizes, field offsets and the constants, and the loader (kvlab.nn.kernels.kernels) refuses a
 * library whose table disagrees with the mirrors, so a field added on one side only fails
 * at load time instead of shifting every later field in silence.
 */
#ifndef KVLAB_LLAMA_DECODE_H
#define KVLAB_LLAMA_DECODE_H

#include "ggml_gemv.h"
#include "kvquant.h"

/* How the cache stores K/V (kvlab.nn.c_abi.CACHE_DTYPES). Row = one token of one KV head. */
enum {
    CACHE_F32 = 0,
    CACHE_F16 = 1,
    CACHE_BF16 = 2,
    CACHE_FP8_E4M3 = 3, /* torch.float8_e4m3fn: value = x * fp8_scale[head] */
    CACHE_FP8_E5M2 = 4, /* torch.float8_e5m2 */
    CACHE_INT8 = 5,     /* uint8 codes, fp16 scale and zero per group: value = code * scale + zero */
    CACHE_INT4 = 6,     /* as int8 with 4-bit codes, two a byte, the first channel in the low nibble */
    CACHE_INT2 = 7,     /* as int8 with 2-bit codes, four a byte, the first channel in the lowest bits */
    CACHE_KVQUANT = 8,  /* KVQuant rows, seats and codebooks: llama_model.kvq (kvquant.h, kvquant_attend.h) */
    CACHE_KIVI4 = 9,    /* KIVI (kivi_attend.h): keys per channel over G tokens, values per token over G channels, */
    CACHE_KIVI2 = 10,   /* codes packed as int4/int2's; the newest tokens in an fp32 residual ring per seat */
};

/* The group formats (int8/int4/int2: codes with an fp16 scale and zero per group of channels)
 * share every loop; only how a row's codes are packed differs. */
static inline int cache_grouped(int dtype) { return dtype >= CACHE_INT8 && dtype <= CACHE_INT2; }

static inline int cache_kivi(int dtype) { return dtype == CACHE_KIVI4 || dtype == CACHE_KIVI2; }

static inline int cache_code_bits(int dtype) {
    return dtype == CACHE_INT4 || dtype == CACHE_KIVI4 ? 4 : dtype == CACHE_INT2 || dtype == CACHE_KIVI2 ? 2 : 8;
}

#define CHUNK 128    /* tokens per attention work unit */
#define MAX_LAYOUTS 4 /* distinct attention windows (full attention counts as one) a model may have */
#define PAGED_STEP_ARGS 13 /* llama_paged_step's parameters: its ctypes binding declares as many */
#define PAGED_ATTEND_ARGS 11 /* llama_paged_attend's */

/* How a layer attends (llama_layer.attention). */
enum {
    ATTN_GQA = 0, /* K and V heads per token (MHA, GQA, MQA) */
    ATTN_MLA = 1, /* DeepSeek-V2's latent: one row [latent, RoPE keys] per token, absorbed attention (mla_attend.h) */
};

/* The MLP's gate (llama_model.activation). */
enum {
    ACT_SWIGLU = 0, /* silu(gate) * up: Llama */
    ACT_GEGLU = 1,  /* gelu_tanh(gate) * up: Gemma */
};

/* F(args..., H) for a pack of `heads` (1..4) query heads, H fixed at compile time in each case
 * so that the attention loops' per-head accumulators stay in registers. */
#define FOR_HEAD_PACK(heads, F, ...)      \
    switch (heads) {                      \
    case 1: F(__VA_ARGS__, 1); break;     \
    case 2: F(__VA_ARGS__, 2); break;     \
    case 3: F(__VA_ARGS__, 3); break;     \
    default: F(__VA_ARGS__, 4);           \
    }
#define MAX_GROUP 16 /* query heads per KV head handled in one pass over the cache */
#define KIVI_MAX_GROUP 256 /* KIVI: tokens (and channels) a group may hold */

/* p = e^r for |r| <= ln2 / 2, the polynomial that exp8 (AVX2, llama_decode.c) and exp16
 * (AVX-512, attend_avx512.h) evaluate with their width's FMADD, MUL, ADD and SET1. */
#define EXP_REDUCED(p, r, FMADD, MUL, ADD, SET1)                                  \
    do {                                                                          \
        p = SET1(1.9875691500e-4f);                                               \
        p = FMADD(p, r, SET1(1.3981999507e-3f));                                  \
        p = FMADD(p, r, SET1(8.3334519073e-3f));                                  \
        p = FMADD(p, r, SET1(4.1665795894e-2f));                                  \
        p = FMADD(p, r, SET1(1.6666665459e-1f));                                  \
        p = FMADD(p, r, SET1(5.0000001201e-1f));                                  \
        p = FMADD(p, MUL(r, r), ADD(r, SET1(1.0f)));                              \
    } while (0)

/* One side (K or V) of one layer's cache. Float and fp8 caches use `data` alone (and fp8 its
 * per-head scales); int8 caches keep codes in `data` and per-group fp16 scale/zero beside. */
typedef struct {
    void *data;              /* [blocks, n_kv_heads, block_size, head_dim] elements; group formats: their
                                packed codes, head_dim * bits / 8 bytes a row */
    uint16_t *scale, *zero;  /* group formats: [blocks, n_kv_heads, block_size, groups] fp16 bits; else NULL */
    const float *fp8_scale;  /* fp8: [n_kv_heads] static scales; else NULL */
    float *ring;             /* KIVI: [seats, n_kv_heads, kivi_residual + group_size, head_dim] fp32 rows, the
                                residual (position p in row p % ring); else NULL. KIVI keys' scale and zero are
                                [blocks, n_kv_heads, block_size / group_size, head_dim], per channel and key group */
} kv_plane;

/* One layer, as a descriptor the step's loop reads: what differs between model families
 * (Llama, Gemma 3) is data here, not code paths. */
typedef struct {
    const float *attn_norm, *mlp_norm;           /* [dim] */
    const float *q_norm, *k_norm;                /* [head_dim]: RMSNorm of each query/key head before RoPE, or NULL */
    const float *post_attn_norm, *post_mlp_norm; /* [dim]: RMSNorm of each sub-block's output before the residual add, or NULL */
    const float *rope_cos, *rope_sin;            /* [rope_len, head_dim]: this layer's tables, sin signed (kvlab.nn.rope) */
    int window;                                  /* 0: full attention; W: a query at t sees keys t - W < p <= t
                                                    (and p < sinks, below) */
    int group;                                   /* which block table (KV group) holds this layer's K/V */
    qstack qkv;                                  /* [(n_heads + 2 n_kv_heads) head_dim, dim]: Q rows, K rows, V rows */
    qmatrix o;                                   /* [dim, n_heads head_dim] */
    qstack gate_up;                              /* [2 hidden, dim]: gate rows, then up rows */
    qmatrix down;                                /* [dim, hidden] */
    kv_plane k, v;
    /* ATTN_MLA (mla_attend.h): qkv stacks the query rows (per head qk_nope_dim position-free channels,
     * then qk_rope_dim rotated ones) and the latent's rows (kv_lora_rank, then n_kv_heads RoPE keys of
     * qk_rope_dim); k holds the cached rows [blocks, 1, block_size, kv_lora_rank + n_kv_heads qk_rope_dim]
     * and v is unused: the values are the latent, the first kv_lora_rank channels of K's row. */
    int attention;             /* ATTN_* */
    const float *latent_norm;  /* MLA: [kv_lora_rank] RMSNorm of the latent before it is cached, or NULL */
    const float *w_uk;         /* MLA: [n_heads, qk_nope_dim, kv_lora_rank], folded into each query; NULL iff qk_nope_dim is 0 */
    const float *w_uv;         /* MLA: [n_heads, head_dim, kv_lora_rank]: each head's output from its attended latent */
    int sinks;                 /* with a window: positions 0 .. sinks - 1 stay visible to every query (StreamingLLM's
                                  sinks, `--kv-window K --sink-tokens S`); 0 otherwise. GQA layers only */
} llama_layer;

/* The model and the cache's format; how many rows a step runs and where they sit in the cache
 * are call arguments, so one struct serves every batch. */
typedef struct {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab;
    int n_groups;         /* KV groups: the step takes one block table per group and row */
    int rope_len;         /* positions the RoPE tables cover */
    int rope_interleaved; /* 0: channel i pairs with i + head_dim/2; 1: 2i pairs with 2i + 1 */
    int cache_dtype;      /* CACHE_*; head_dim is a multiple of 8 */
    int group_size;       /* CACHE_INT8/4/2: channels per scale/zero group (a multiple of 8, or >= head_dim) */
    int activation;       /* ACT_* */
    float eps;
    float query_scale;    /* the attention logits' scale; 0: 1 / sqrt(head_dim) */
    /* MLA models (every layer ATTN_MLA; 0 elsewhere): n_kv_heads counts the RoPE keys (query head h
     * reads key h / (n_heads / n_kv_heads)), head_dim is the value head dim (the output projection's
     * input per head), the RoPE tables are qk_rope_dim wide. */
    int kv_lora_rank, qk_nope_dim, qk_rope_dim;
    const llama_layer *layers;
    const float *final_norm;
    qmatrix lm_head;
    const kvquant_cache *kvq; /* CACHE_KVQUANT: the pool's KVQuant tensors and the step's seats; else NULL */
    /* KIVI (CACHE_KIVI4/2; group_size is G, tokens a key group and channels a value group): */
    int kivi_residual;         /* R: a sequence of T tokens holds max(0, (T - R) / G) G quantised, the rest in its ring */
    int kivi_seats;            /* seats (rings) in the pool */
    const int32_t *kivi_rows;  /* [rows, 2] per step call, set by the caller: each row's seat and its sequence's
                                  quantised tokens after the step (rows of one sequence adjacent, one seat) */
} llama_model;

/* Scratch memory kept between steps: one block, grown when a step needs more, freed by
 * kvlab_arena_free. A step at 4,096 tokens needs megabytes of attention partials; malloc and
 * free of that every token cost page faults on each first touch. */
typedef struct {
    void *base;
    size_t capacity;
} kvlab_arena;

#endif
