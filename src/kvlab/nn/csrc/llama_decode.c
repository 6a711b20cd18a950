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
    float *normed, *qkv, *att, *gate_up, *act;
    float *scores, *part_max, *part_sum, *part_out; /* attention's per-chunk work (attend_chunk) */
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

/* e^x for eight lanes, x <= 0 here (scores minus their maximum): x = n ln2 + r with |r| <= ln2/2,
 * e^r by its degree-6 Taylor-like polynomial (Cephes' coefficients), 2^n built in the exponent
 * bits. About 1e-7 relative error, as expf; scalar expf per score cost more than the dot products. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f)); /* below, e^x is 0 to fp32's normal range anyway */
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts, for precision */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* y = e^x for n values x <= 0, with exp8 (exported so tests can hold it to expf). */
void exp_nonpositive(const float *x, float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = expf(x[i]);
}

#define CHUNK 128 /* tokens per attention work unit */
#define MAX_GROUP 16 /* query heads per KV head handled in one pass over the cache */

/* Attention is split into units of (row, KV head, chunk of CHUNK tokens), so two threads stay
 * busy however few KV heads there are, and each unit reads its keys and values once for all
 * the query heads sharing them. A unit leaves, per query head, the chunk's softmax partials:
 * its largest score, the sum of exp(score - largest) and the exp-weighted sum of values;
 * `combine_heads` merges the chunks, as flash-decoding does. */
static void attend_chunk(const llama_model *m, const llama_layer *l, int pos, int unit, const float *qkv,
                         int width, scratch *s) {
    const int d = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, dtype = m->cache_dtype;
    const int chunks = pos / CHUNK + 1, c = unit % chunks, kvh = unit / chunks % hkv, r = unit / chunks / hkv;
    const int start = c * CHUNK, end = start + CHUNK <= pos + 1 ? start + CHUNK : pos + 1;
    const size_t base = ((size_t)r * hkv + kvh) * m->capacity * d;
    const float scale = 1.0f / sqrtf((float)d);
    float *scores = s->scores + (size_t)unit * group * CHUNK;
    for (int t = start; t < end; t++) {
        __m256 acc[MAX_GROUP];
        for (int j = 0; j < group; j++) acc[j] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            const __m256 k = load8(l->k_cache, dtype, base + (size_t)t * d + i);
            for (int j = 0; j < group; j++) {
                const float *q = qkv + (size_t)r * width + (size_t)(kvh * group + j) * d;
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), k, acc[j]);
            }
        }
        for (int j = 0; j < group; j++) scores[j * CHUNK + (t - start)] = hsum(acc[j]) * scale;
    }
    for (int j = 0; j < group; j++) {
        float *sj = scores + j * CHUNK, top = -INFINITY, total = 0.0f;
        const int len = end - start;
        for (int t = 0; t < len; t++) top = fmaxf(top, sj[t]);
        __m256 sum = _mm256_setzero_ps();
        int t = 0;
        for (; t + 8 <= len; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), _mm256_set1_ps(top)));
            _mm256_storeu_ps(sj + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        total = hsum(sum);
        for (; t < len; t++) total += sj[t] = expf(sj[t] - top);
        const size_t at = (size_t)unit * group + j;
        s->part_max[at] = top, s->part_sum[at] = total;
        float *out = s->part_out + at * d;
        for (int i = 0; i < d; i++) out[i] = 0.0f;
    }
    for (int t = start; t < end; t++) {
        for (int i = 0; i < d; i += 8) {
            const __m256 v = load8(l->v_cache, dtype, base + (size_t)t * d + i);
            for (int j = 0; j < group; j++) {
                float *out = s->part_out + ((size_t)unit * group + j) * d + i;
                _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_set1_ps(scores[j * CHUNK + (t - start)]), v,
                                                      _mm256_loadu_ps(out)));
            }
        }
    }
}

/* Query head h of row r: merge its chunks' partials into softmax(q k / sqrt(d)) v. */
static void combine_heads(const llama_model *m, int pos, int r, int h, const scratch *s, float *out) {
    const int d = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, chunks = pos / CHUNK + 1;
    const int kvh = h / group, j = h % group;
    const size_t first = (((size_t)r * hkv + kvh) * chunks) * group + j; /* unit (r, kvh, 0), head j */
    float top = -INFINITY, total = 0.0f;
    for (int c = 0; c < chunks; c++) top = fmaxf(top, s->part_max[first + (size_t)c * group]);
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int c = 0; c < chunks; c++) {
        const size_t at = first + (size_t)c * group;
        const float weight = expf(s->part_max[at] - top);
        total += weight * s->part_sum[at];
        for (int i = 0; i < d; i++) out[i] += weight * s->part_out[at * d + i];
    }
    for (int i = 0; i < d; i++) out[i] /= total;
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
    const int units = rows * hkv * (pos / CHUNK + 1);
#pragma omp for schedule(static)
    for (int unit = 0; unit < units; unit++) attend_chunk(m, l, pos, unit, s->qkv, width, s);
#pragma omp for schedule(static)
    for (int rh = 0; rh < rows * hq; rh++)
        combine_heads(m, pos, rh / hq, rh % hq, s, s->att + (size_t)rh * d);
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
 * scratch memory cannot be had, -2 when `pos` is outside the cache, -3 when more than
 * MAX_GROUP query heads share a KV head. */
int llama_decode_step(const llama_model *m, int pos, float *x, float *logits) {
    if (pos < 0 || pos >= m->capacity) return -2;
    if (m->n_heads / m->n_kv_heads > MAX_GROUP) return -3;
    const int rows = m->batch, widest = m->hidden > m->dim ? m->hidden : m->dim;
    const size_t chunk_heads = (size_t)rows * m->n_heads * (pos / CHUNK + 1); /* (unit, query head) pairs */
    const int attn_width = m->n_heads * m->head_dim > widest ? m->n_heads * m->head_dim : widest;
    scratch s = {
        .normed = malloc((size_t)rows * m->dim * sizeof(float)),
        .qkv = malloc((size_t)rows * (m->n_heads + 2 * m->n_kv_heads) * m->head_dim * sizeof(float)),
        .att = malloc((size_t)rows * m->n_heads * m->head_dim * sizeof(float)),
        .gate_up = malloc((size_t)rows * 2 * m->hidden * sizeof(float)),
        .act = malloc((size_t)rows * m->hidden * sizeof(float)),
        .scores = malloc(chunk_heads * CHUNK * sizeof(float)),
        .part_max = malloc(chunk_heads * sizeof(float)),
        .part_sum = malloc(chunk_heads * sizeof(float)),
        .part_out = malloc(chunk_heads * m->head_dim * sizeof(float)),
        .qx = malloc((size_t)rows * attn_width * sizeof(int16_t)),
        .dx = malloc((size_t)rows * (attn_width / QK) * sizeof(float)),
        .sx = malloc((size_t)rows * (attn_width / QK) * sizeof(float)),
    };
    int status = 0;
    if (!s.normed || !s.qkv || !s.att || !s.gate_up || !s.act || !s.scores || !s.part_max || !s.part_sum ||
        !s.part_out || !s.qx || !s.dx || !s.sx) {
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
    free(s.part_max), free(s.part_sum), free(s.part_out);
    free(s.qx), free(s.dx), free(s.sx);
    return status;
}
