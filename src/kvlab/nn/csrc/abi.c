/* The library's binary interface as data: every struct Python passes (their sizes and field
 * offsets) and the constants both sides use. kvlab.nn.c_abi reads this table when the library
 * loads and compares it with its ctypes mirrors; a mismatch refuses the library, where a
 * drifted mirror would otherwise pass shifted pointers without a word.
 */
#include <stddef.h>

#include "llama_decode.h"

typedef struct {
    const char *name; /* "struct" (its size), "struct.field" (the field's offset) or a constant */
    long value;
} abi_entry;

#define SIZE(type) {#type, (long)sizeof(type)}
#define FIELD(type, field) {#type "." #field, (long)offsetof(type, field)}
#define CONSTANT(name) {#name, (long)(name)}

static const abi_entry ABI[] = {
    SIZE(qmatrix), FIELD(qmatrix, kind), FIELD(qmatrix, n), FIELD(qmatrix, k), FIELD(qmatrix, codes),
    FIELD(qmatrix, d), FIELD(qmatrix, m), FIELD(qmatrix, codes8), FIELD(qmatrix, d8), FIELD(qmatrix, m8),
    SIZE(qacts), FIELD(qacts, q), FIELD(qacts, d), FIELD(qacts, s), FIELD(qacts, q8), FIELD(qacts, d8),
    FIELD(qacts, e8),
    SIZE(qstack), FIELD(qstack, part), FIELD(qstack, parts),
    SIZE(kv_plane), FIELD(kv_plane, data), FIELD(kv_plane, scale), FIELD(kv_plane, zero),
    FIELD(kv_plane, fp8_scale), FIELD(kv_plane, ring),
    SIZE(llama_layer), FIELD(llama_layer, attn_norm), FIELD(llama_layer, mlp_norm), FIELD(llama_layer, q_norm),
    FIELD(llama_layer, k_norm), FIELD(llama_layer, post_attn_norm), FIELD(llama_layer, post_mlp_norm),
    FIELD(llama_layer, rope_cos), FIELD(llama_layer, rope_sin), FIELD(llama_layer, window),
    FIELD(llama_layer, group), FIELD(llama_layer, qkv), FIELD(llama_layer, o), FIELD(llama_layer, gate_up),
    FIELD(llama_layer, down), FIELD(llama_layer, k), FIELD(llama_layer, v), FIELD(llama_layer, attention),
    FIELD(llama_layer, latent_norm), FIELD(llama_layer, w_uk), FIELD(llama_layer, w_uv),
    FIELD(llama_layer, sinks),
    SIZE(llama_model), FIELD(llama_model, n_layers), FIELD(llama_model, dim), FIELD(llama_model, n_heads),
    FIELD(llama_model, n_kv_heads), FIELD(llama_model, head_dim), FIELD(llama_model, hidden),
    FIELD(llama_model, vocab), FIELD(llama_model, n_groups), FIELD(llama_model, rope_len),
    FIELD(llama_model, rope_interleaved), FIELD(llama_model, cache_dtype), FIELD(llama_model, group_size),
    FIELD(llama_model, activation), FIELD(llama_model, eps), FIELD(llama_model, query_scale),
    FIELD(llama_model, kv_lora_rank), FIELD(llama_model, qk_nope_dim), FIELD(llama_model, qk_rope_dim),
    FIELD(llama_model, layers), FIELD(llama_model, final_norm), FIELD(llama_model, lm_head), FIELD(llama_model, kvq),
    FIELD(llama_model, kivi_residual), FIELD(llama_model, kivi_seats), FIELD(llama_model, kivi_rows),
    SIZE(kvquant_layer), FIELD(kvquant_layer, k_codes), FIELD(kvquant_layer, k_counts), FIELD(kvquant_layer, v_codes),
    FIELD(kvquant_layer, v_zero), FIELD(kvquant_layer, v_scale), FIELD(kvquant_layer, v_outliers),
    FIELD(kvquant_layer, v_outlier_index), FIELD(kvquant_layer, k_sink), FIELD(kvquant_layer, v_sink),
    FIELD(kvquant_layer, k_outliers), FIELD(kvquant_layer, k_outlier_index), FIELD(kvquant_layer, k_codebook),
    FIELD(kvquant_layer, v_codebook), FIELD(kvquant_layer, k_zero), FIELD(kvquant_layer, k_range),
    SIZE(kvquant_cache), FIELD(kvquant_cache, bits), FIELD(kvquant_cache, outlier_percent), FIELD(kvquant_cache, sinks),
    FIELD(kvquant_cache, capacity), FIELD(kvquant_cache, v_outliers), FIELD(kvquant_cache, seats),
    FIELD(kvquant_cache, max_tokens), FIELD(kvquant_cache, rope_halves), FIELD(kvquant_cache, row_seats), FIELD(kvquant_cache, layers),
    CONSTANT(CACHE_F32), CONSTANT(CACHE_F16), CONSTANT(CACHE_BF16), CONSTANT(CACHE_FP8_E4M3),
    CONSTANT(CACHE_FP8_E5M2), CONSTANT(CACHE_INT8), CONSTANT(CACHE_INT4), CONSTANT(CACHE_INT2), CONSTANT(CACHE_KVQUANT),
    CONSTANT(CACHE_KIVI4), CONSTANT(CACHE_KIVI2), CONSTANT(KIVI_MAX_GROUP), CONSTANT(CHUNK),
    CONSTANT(MAX_GROUP), CONSTANT(QK),
    CONSTANT(MAX_LAYOUTS), CONSTANT(PAGED_STEP_ARGS), CONSTANT(PAGED_ATTEND_ARGS), CONSTANT(ACT_SWIGLU), CONSTANT(ACT_GEGLU),
    CONSTANT(ATTN_GQA), CONSTANT(ATTN_MLA),
};

int kvlab_abi_count(void) { return (int)(sizeof ABI / sizeof ABI[0]); }

const char *kvlab_abi_name(int i) { return i >= 0 && i < kvlab_abi_count() ? ABI[i].name : NULL; }

long kvlab_abi_value(int i) { return i >= 0 && i < kvlab_abi_count() ? ABI[i].value : -1; }
