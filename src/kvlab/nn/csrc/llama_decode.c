/* One decode step of a Llama-family decoder whose matrices are planes of GGUF blocks (ggml_gemv.h).
 *
 * At batch 1 a step is ~120 small matrix-vector products; driven from Python each one pays
 * for module calls, tensor allocations and a thread fork, which on a small model costs more
 * than the arithmetic. Here the whole step (norms, projections, RoPE, the cache write,
 * attention, SwiGLU, the LM head) runs inside one OpenMP parallel region: the threads split
 * each product's output rows and meet at a barrier, as llama.cpp's graph executor does.
 *
 * The arithmetic is the module path's (kvlab.nn.model.Decoder with GGMLLinear layers):
 * activations are quantised to int16 per 32 values before each product, norms, RoPE,
 * softmax and SwiGLU run in fp32. K/V are written into the caller's cache buffers
 * [batch, kv_heads, capacity, head_dim] of fp32, fp16 or bf16 (rounded to nearest even, as
 * torch's .to() rounds), so the cache stays kvlab.cache's and the Python path can carry on
 * from any step.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_gemv.h"

typedef struct {
    const float *attn_norm, *mlp_norm; /* [dim] */
    qstack qkv;                        /* [(n_heads + 2 n_kv_heads) head_dim, dim]: Q rows, K rows, V rows */
    qmatrix o;                         /* [dim, n_heads head_dim] */
    qstack gate_up;                    /* [2 hidden, dim]: gate rows, then up rows */
    qmatrix down;                      /* [dim, hidden] */
    void *k_cache, *v_cache;           /* [batch, n_kv_heads, capacity, head_dim] of cache_dtype */
} llama_layer;

enum { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2 };

typedef struct {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab, batch, capacity;
    int rope_interleaved; /* 0: channel i pairs with i + head_dim/2; 1: 2i pairs with 2i + 1 */
    int cache_dtype;      /* CACHE_F32, CACHE_F16 or CACHE_BF16; head_dim is a multiple of 8 */
    float eps;
    const float *rope_cos, *rope_sin; /* [positions, head_dim]: full width, sin signed (kvlab.nn.rope) */
    const llama_layer *layers;
    const float *final_norm;
    qmatrix lm_head;
} llama_model;

typedef struct {
    float *normed, *qkv, *att, *gate_up, *act, *scores;
    int16_t *qx;
    float *dx, *sx;
} scratch;

/* x [rows, dim] -> rms-normalised, scaled by w, then quantised for the next product. */
static void norm_quantize(const float *x, const float *w, int rows, int dim, float eps, float *out, scratch *s) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = out + (size_t)r * dim;
        float ss = 0.0f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * inv * w[i];
    }
    quantize_act(out, (size_t)rows * dim, s->qx, s->dx, s->sx);
}

/* Rotate one head vector in place at the position whose tables are cos, sin. */
static void rope(float *v, const float *cos, const float *sin, int dim, int interleaved) {
    float tmp[dim];
    memcpy(tmp, v, sizeof tmp);
    for (int i = 0; i < dim; i++) {
        const int partner = interleaved ? (i ^ 1) : (i + dim / 2) % dim;
        v[i] = tmp[i] * cos[i] + tmp[partner] * sin[i];
    }
}

/* Eight cache values from element i on, widened to fp32. */
static inline __m256 load8(const void *cache, int dtype, size_t i) {
    if (dtype == CACHE_F32) return _mm256_loadu_ps((const float *)cache + i);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i));
    if (dtype == CACHE_F16) return _mm256_cvtph_ps(half);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)); /* bf16: the high half */
}

static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (isnan(x)) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16); /* round to nearest even */
}

/* src[0 .. n-1] into the cache from element i on, in its element type. */
static void store_row(void *cache, int dtype, size_t i, const float *src, int n) {
    if (dtype == CACHE_F32) {
        memcpy((float *)cache + i, src, n * sizeof(float));
    } else if (dtype == CACHE_F16) {
        for (int j = 0; j < n; j += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)cache + i + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
    } else {
        for (int j = 0; j < n; j++) ((uint16_t *)cache)[i + j] = to_bf16(src[j]);
    }
}

/* Query head h of row b over tokens 0..pos of its KV head: softmax(q k / sqrt(d)) v. */
static void attend_head(const llama_model *m, const llama_layer *l, int b, int h, int pos, const float *q,
                        float *scores, float *out) {
    const int d = m->head_dim, kvh = h / (m->n_heads / m->n_kv_heads), dtype = m->cache_dtype;
    const size_t base = ((size_t)b * m->n_kv_heads + kvh) * m->capacity * d;
    const float scale = 1.0f / sqrtf((float)d);
    float top = -INFINITY, total = 0.0f;
    for (int t = 0; t <= pos; t++) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(l->k_cache, dtype, base + (size_t)t * d + i), acc);
        scores[t] = hsum(acc) * scale;
        top = fmaxf(top, scores[t]);
    }
    for (int t = 0; t <= pos; t++) total += scores[t] = expf(scores[t] - top);
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int t = 0; t <= pos; t++) {
        const __m256 p = _mm256_set1_ps(scores[t] / total);
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, load8(l->v_cache, dtype, base + (size_t)t * d + i),
                                                      _mm256_loadu_ps(out + i)));
    }
}

/* y [rows, width] = x W^T for W stacked from parts, each writing its own columns. */
static void stack_gemm(const qstack *w, int rows, const scratch *s, float *y, int width) {
    for (int i = 0, at = 0; i < w->parts; at += w->part[i].n, i++)
        qmatrix_gemm(&w->part[i], rows, s->qx, s->dx, s->sx, y + at, width, 0);
}

static void layer_step(const llama_model *m, const llama_layer *l, int pos, float *x, scratch *s) {
    const int rows = m->batch, d = m->head_dim, hq = m->n_heads, hkv = m->n_kv_heads;
    const int width = (hq + 2 * hkv) * d;
#pragma omp single
    norm_quantize(x, l->attn_norm, rows, m->dim, m->eps, s->normed, s);
    stack_gemm(&l->qkv, rows, s, s->qkv, width);
#pragma omp single
    for (int r = 0; r < rows; r++) { /* RoPE on queries and keys, then K and V into the cache */
        float *heads = s->qkv + (size_t)r * width;
        const float *cos = m->rope_cos + (size_t)pos * d, *sin = m->rope_sin + (size_t)pos * d;
        for (int h = 0; h < hq + hkv; h++) rope(heads + h * d, cos, sin, d, m->rope_interleaved);
        for (int h = 0; h < hkv; h++) {
            const size_t slot = (((size_t)r * hkv + h) * m->capacity + pos) * d;
            store_row(l->k_cache, m->cache_dtype, slot, heads + (hq + h) * d, d);
            store_row(l->v_cache, m->cache_dtype, slot, heads + (hq + hkv + h) * d, d);
        }
    }
#pragma omp for schedule(static)
    for (int bh = 0; bh < rows * hq; bh++) {
        const int r = bh / hq, h = bh % hq;
        attend_head(m, l, r, h, pos, s->qkv + (size_t)r * width + h * d, s->scores + (size_t)bh * (pos + 1),
                    s->att + (size_t)r * hq * d + h * d);
    }
#pragma omp single
    quantize_act(s->att, (size_t)rows * hq * d, s->qx, s->dx, s->sx);
    qmatrix_gemm(&l->o, rows, s->qx, s->dx, s->sx, x, m->dim, 1); /* the residual add is the accumulate */
#pragma omp single
    norm_quantize(x, l->mlp_norm, rows, m->dim, m->eps, s->normed, s);
    stack_gemm(&l->gate_up, rows, s, s->gate_up, 2 * m->hidden);
#pragma omp single
    {
        for (int r = 0; r < rows; r++) {
            const float *gate = s->gate_up + (size_t)r * 2 * m->hidden, *up = gate + m->hidden;
            float *a = s->act + (size_t)r * m->hidden;
            for (int i = 0; i < m->hidden; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        }
        quantize_act(s->act, (size_t)rows * m->hidden, s->qx, s->dx, s->sx);
    }
    qmatrix_gemm(&l->down, rows, s->qx, s->dx, s->sx, x, m->dim, 1);
}

/* Advance every row by one token at position `pos`: x [batch, dim] holds the new tokens'
 * embeddings on entry (it is the residual stream, overwritten), logits [batch, vocab] receive
 * the next-token scores, and each layer's cache gains the token at `pos`. Returns 0, -1 when
 * scratch memory cannot be had, -2 when `pos` is outside the cache. */
int llama_decode_step(const llama_model *m, int pos, float *x, float *logits) {
    if (pos < 0 || pos >= m->capacity) return -2;
    const int rows = m->batch, widest = m->hidden > m->dim ? m->hidden : m->dim;
    const int attn_width = m->n_heads * m->head_dim > widest ? m->n_heads * m->head_dim : widest;
    scratch s = {
        .normed = malloc((size_t)rows * m->dim * sizeof(float)),
        .qkv = malloc((size_t)rows * (m->n_heads + 2 * m->n_kv_heads) * m->head_dim * sizeof(float)),
        .att = malloc((size_t)rows * m->n_heads * m->head_dim * sizeof(float)),
        .gate_up = malloc((size_t)rows * 2 * m->hidden * sizeof(float)),
        .act = malloc((size_t)rows * m->hidden * sizeof(float)),
        .scores = malloc((size_t)rows * m->n_heads * (pos + 1) * sizeof(float)),
        .qx = malloc((size_t)rows * attn_width * sizeof(int16_t)),
        .dx = malloc((size_t)rows * (attn_width / QK) * sizeof(float)),
        .sx = malloc((size_t)rows * (attn_width / QK) * sizeof(float)),
    };
    int status = 0;
    if (!s.normed || !s.qkv || !s.att || !s.gate_up || !s.act || !s.scores || !s.qx || !s.dx || !s.sx) {
        status = -1;
    } else {
#pragma omp parallel
        {
            for (int i = 0; i < m->n_layers; i++) layer_step(m, &m->layers[i], pos, x, &s);
#pragma omp single
            norm_quantize(x, m->final_norm, rows, m->dim, m->eps, s.normed, &s);
            qmatrix_gemm(&m->lm_head, rows, s.qx, s.dx, s.sx, logits, m->vocab, 0);
        }
    }
    free(s.normed), free(s.qkv), free(s.att), free(s.gate_up), free(s.act), free(s.scores);
    free(s.qx), free(s.dx), free(s.sx);
    return status;
}
