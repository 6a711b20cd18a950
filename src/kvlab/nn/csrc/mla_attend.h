/* An MLA layer's attention in the decode step (llama_layer.attention == ATTN_MLA): DeepSeek-V2's
 * absorbed decode over the pool's latent rows, what kvlab.nn.mla.MLA.absorbed computes.
 *
 * Each token caches one row [c, k_rope_0 .. k_rope_{G-1}]: the latent c (kv_lora_rank channels,
 * RMS-normalised where the layout has a latent norm) and G RoPE keys (DeepSeek: G = 1, shared by
 * every head; kvlab's exact conversion of a GQA model: one per source KV head, query head h reading
 * key h / (heads / G)). Per head, k_h = [c W_uk_h^T, k_rope_g(h)] and v_h = c W_uv_h^T; absorbed,
 *     q_lat_h = q_nope_h W_uk_h                 (W_uk folded into the query: kv_lora_rank channels)
 *     score_t = q_lat_h . c_t + q_rope_h . k_rope_g(h),t      (times 1 / sqrt(nope + rope))
 *     out_h   = (sum_t p_t c_t) W_uv_h^T        (the values are the latent: V reads K's row)
 * so attention runs over the cached rows alone and never up-projects a token. An attention unit
 * is (row, chunk of CHUNK tokens) with every query head, not one per KV head as for GQA: all
 * heads read the same latent, and a chunk's rows (128 tokens of 384 fp16 channels on SmolLM2's
 * conversion: 96 KiB) stay in the core's L2 while the head packs go over them, where units per
 * RoPE key would fetch each chunk from memory G times. The rows are widened to fp32 a few at a
 * time, into the thread's own L1-sized buffer, before the packs of heads read them: widening
 * per pack (as the GQA loop does, where one pack usually covers a KV head's queries) repeats the
 * F16C conversions for every pack, and SmolLM2's exact conversion reads each latent channel for
 * nine heads. W_uk and W_uv are fp32 matrices (the module path's
 * `up_weights`, the same values), applied per head in plain fp32.
 *
 * Included by llama_decode.c after the helpers it shares (exp8, hsum4, hmax, rms_norm, rope,
 * norm_quantize, stack_gemm, merge_partials); static like them. Float caches only (fp32, fp16, bf16, fp8 with
 * its one static scale): load8 and store_row (kv_codecs.h) read and write the rows.
 */
#ifndef KVLAB_MLA_ATTEND_H
#define KVLAB_MLA_ATTEND_H

#include <omp.h>

/* Channels of one cached row, of one absorbed query head, and of one token's projections row
 * (the queries, nope + rope per head, then the latent and its RoPE keys). */
static inline int mla_row_width(const llama_model *m) { return m->kv_lora_rank + m->n_kv_heads * m->qk_rope_dim; }

static inline int mla_query_width(const llama_model *m) { return m->kv_lora_rank + m->qk_rope_dim; }

static inline int mla_qkv_width(const llama_model *m) {
    return m->n_heads * (m->qk_nope_dim + m->qk_rope_dim) + mla_row_width(m);
}

#define MLA_SUB 8 /* tokens widened to fp32 at a time: 8 rows of SmolLM2's 384 channels are 12 KiB, in L1 */
#define MLA_AHEAD 16 /* rows the score sweep asks memory for ahead of use: a sub-block's few hundred
                        multiply-adds hide far less than a row's fetch, so the requests run well ahead */

/* A sub-block of a unit's chunk: its rows in `k` at `slots` (the pool's, or a widened copy). */
typedef struct {
    const kv_plane *k;
    const size_t *slots;
    int len, width, rank;
    int scored; /* latent channels the scores read: rank, or 0 where no key channel is position-free
                   (qk_nope_dim 0: kvlab's exact conversion), so q_lat is 0 and only the RoPE keys score */
} mla_rows;

/* Channels [lo, hi) of `n` cached rows (slots) into buf, widened and scaled to the cache's units. */
static inline __attribute__((always_inline)) void mla_widen(const kv_plane *k, int dtype, const size_t *slots, int n,
                                                           int width, int lo, int hi, float factor, float *buf) {
    const __m256 f = _mm256_set1_ps(factor);
    for (int t = 0; t < n; t++)
        for (int i = lo; i < hi; i += 8)
            _mm256_storeu_ps(buf + (size_t)t * width + i, _mm256_mul_ps(load8(k, dtype, slots[t], i, width), f));
}

/* dots[h][t] = q_h . [c_t, k_rope_t] for GH heads reading the RoPE key at channel rope_at, TB rows
 * from t0 on: each row's lanes are loaded once for all GH heads (q stride qw, dots stride CHUNK). */
static inline __attribute__((always_inline)) void mla_key_dots(const mla_rows *c, int dtype, const float *q, int qw,
                                                              int rope_at, int rope, int t0, float *dots,
                                                              const int GH, const int TB) {
    __m256 acc[12]; /* GH x TB <= 12 */
    for (int a = 0; a < GH * TB; a++) acc[a] = _mm256_setzero_ps();
    for (int i = 0; i < c->scored; i += 8)
        for (int u = 0; u < TB; u++) {
            const __m256 x = load8(c->k, dtype, c->slots[t0 + u], i, c->width);
            for (int h = 0; h < GH; h++) acc[h * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qw + i), x, acc[h * TB + u]);
        }
    for (int i = 0; i < rope; i += 8)
        for (int u = 0; u < TB; u++) {
            const __m256 x = load8(c->k, dtype, c->slots[t0 + u], rope_at + i, c->width);
            for (int h = 0; h < GH; h++)
                acc[h * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qw + c->rank + i), x, acc[h * TB + u]);
        }
    store_dots(acc, t0, dots, GH, TB);
}

/* A pack of GH heads' dots over the sub-block's rows. */
static inline __attribute__((always_inline)) void mla_score_pack(const mla_rows *c, int dtype, const float *q, int qw,
                                                                int rope_at, int rope, float *dots, const int GH) {
    const int TB = GH <= 3 ? 4 : 3;
    int t = 0;
    for (; t + TB <= c->len; t += TB) mla_key_dots(c, dtype, q, qw, rope_at, rope, t, dots, GH, TB);
    for (; t < c->len; t++) mla_key_dots(c, dtype, q, qw, rope_at, rope, t, dots, GH, 1);
}

/* out[h][i0 .. i0 + 8 NV) += sum_t w[h][t] c_t over the sub-block's rows for GH heads (w stride
 * CHUNK, out stride rank): the accumulators stay in registers over the rows. */
static inline __attribute__((always_inline)) void mla_value_sums(const mla_rows *c, const float *w, int i0, float *out,
                                                                const int GH, const int NV) {
    __m256 acc[4][8];
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NV; u++) acc[h][u] = _mm256_loadu_ps(out + h * c->rank + i0 + 8 * u);
    for (int t = 0; t < c->len; t++) {
        __m256 wt[4];
        for (int h = 0; h < GH; h++) wt[h] = _mm256_broadcast_ss(w + h * CHUNK + t);
        for (int u = 0; u < NV; u++) {
            const __m256 x = _mm256_loadu_ps((const float *)c->k->data + c->slots[t] * c->width + i0 + 8 * u);
            for (int h = 0; h < GH; h++) acc[h][u] = _mm256_fmadd_ps(wt[h], x, acc[h][u]);
        }
    }
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NV; u++) _mm256_storeu_ps(out + h * c->rank + i0 + 8 * u, acc[h][u]);
}

static inline __attribute__((always_inline)) void mla_value_pack(const mla_rows *c, const float *w, float *out,
                                                                const int GH) {
    const int NV = GH == 1 ? 8 : GH <= 3 ? 4 : 2;
    int i = 0;
    for (; i + 8 * NV <= c->rank; i += 8 * NV) mla_value_sums(c, w, i, out, GH, NV);
    for (; i < c->rank; i += 8) mla_value_sums(c, w, i, out, GH, 1);
}

/* One head's scores over the chunk (len of them, at sh) scaled, then exp'd in place minus their
 * largest: the softmax partials, as attend_heads leaves them (MLA's and KIVI's units call it). */
static void chunk_softmax(float *sh, int len, float scale, float *part_max, float *part_sum) {
    const __m256 kf = _mm256_set1_ps(scale);
    int t;
    for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(sh + t, _mm256_mul_ps(_mm256_loadu_ps(sh + t), kf));
    for (; t < len; t++) sh[t] *= scale;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (t = 0; t + 8 <= len; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sh + t));
    float top = hmax(top8), total;
    for (; t < len; t++) top = fmaxf(top, sh[t]);
    __m256 sum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), _mm256_set1_ps(top)));
        _mm256_storeu_ps(sh + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = hsum(sum);
    for (; t < len; t++) total += sh[t] = expf(sh[t] - top);
    *part_max = top, *part_sum = total;
}

/* Unit `unit` (a row's chunk, every head): two sweeps over the chunk in sub-blocks of MLA_SUB rows,
 * the packs of heads (one RoPE key's heads, in even packs of up to four) taking turns on each: the
 * scores, each head's softmax partials, then the weighted latent. The scores read the pool's rows
 * in place where each key's channels serve one pack (kvlab's exact conversion: three heads per
 * key), so the loads from memory interleave with the arithmetic, as in the GQA loop; where several
 * packs read the latent (DeepSeek's one shared key) a sub-block is widened to fp32 into the
 * thread's L1-sized buffer once and the packs read it there. The weighted latent always reads a
 * widened copy: every head reads all of it, and the chunk's rows are in L2 since the scores.
 * Widening a whole chunk at once (196 KiB on SmolLM2's conversion) was slower: its stores to L2,
 * and the loads from memory before them, waited on nothing else. */
static inline __attribute__((always_inline)) void mla_attend_chunk(const llama_model *m, const llama_layer *l,
                                                                  const paged_view *v, int unit, scratch *s,
                                                                  const int dtype) {
    const int hq = m->n_heads, keys = m->n_kv_heads, group = hq / keys, bs = v->block_size;
    const int rank = m->kv_lora_rank, rope = m->qk_rope_dim, qw = mla_query_width(m), width = mla_row_width(m);
    const int r = s->unit_row[0][unit], pos = v->positions[r], ch = unit - s->unit_first[0][r];
    const int start = ch * CHUNK, end = (ch + 1) * CHUNK <= pos + 1 ? (ch + 1) * CHUNK : pos + 1, len = end - start;
    const int32_t *table = v->tables + (size_t)r * v->max_blocks;
    size_t slots[CHUNK];
    for (int t = start, at = 0; t < end;) {
        const size_t base = (size_t)table[t / bs] * bs;
        const int offset = t % bs, run = bs - offset < end - t ? bs - offset : end - t;
        for (int u = 0; u < run; u++) slots[at++] = base + offset + u;
        t += run;
    }
    const float scale = m->query_scale > 0.0f ? m->query_scale : 1.0f / sqrtf((float)(m->qk_nope_dim + rope));
    const float factor = fp8_factor(&l->k, dtype, 0);
    float *buf = s->mla_rows + (size_t)omp_get_thread_num() * MLA_SUB * width;
    static const size_t ident[MLA_SUB] = {0, 1, 2, 3, 4, 5, 6, 7}; /* the widened copy's rows */
    const kv_plane wide = {buf, NULL, NULL, NULL};
    mla_rows c = {&wide, ident, 0, width, rank, m->qk_nope_dim ? rank : 0};
    const float *q = s->mq + (size_t)r * hq * qw;
    const size_t first = (size_t)unit * hq;
    float *scores = s->scores + first * CHUNK, *out = s->part_out + first * rank;
    const int even = (group + (group + 3) / 4 - 1) / ((group + 3) / 4); /* a key's heads in even packs: 9 as 3 x 3 */
    for (int t = 0; t < MLA_AHEAD && t < len; t++) prefetch_row(&l->k, dtype, slots[t], width, 1);
    const int in_place = even == group; /* one pack per key: each channel the scores read is read once */
    mla_rows direct = {&l->k, slots, 0, width, rank, c.scored};
    for (int t0 = 0; t0 < len; t0 += MLA_SUB) { /* the scores */
        c.len = direct.len = len - t0 < MLA_SUB ? len - t0 : MLA_SUB;
        direct.slots = slots + t0;
        for (int t = t0 + MLA_AHEAD; t < t0 + MLA_AHEAD + MLA_SUB && t < len; t++)
            prefetch_row(&l->k, dtype, slots[t], width, 1);
        if (!in_place) mla_widen(&l->k, dtype, slots + t0, c.len, width, 0, width, factor, buf);
        for (int h = 0; h < hq;) {
            const int key = h / group, pack = (key + 1) * group - h < even ? (key + 1) * group - h : even;
            if (in_place)
                FOR_HEAD_PACK(pack, mla_score_pack, &direct, dtype, q + (size_t)h * qw, qw, rank + key * rope, rope,
                              scores + (size_t)h * CHUNK + t0)
            else
                FOR_HEAD_PACK(pack, mla_score_pack, &c, CACHE_F32, q + (size_t)h * qw, qw, rank + key * rope, rope,
                              scores + (size_t)h * CHUNK + t0)
            h += pack;
        }
    }
    const float k_scale = in_place ? factor * scale : scale; /* a widened copy is in the cache's units already */
    for (int h = 0; h < hq; h++)
        chunk_softmax(scores + (size_t)h * CHUNK, len, k_scale, s->part_max + first + h, s->part_sum + first + h);
    memset(out, 0, (size_t)hq * rank * sizeof(float));
    for (int t0 = 0; t0 < len; t0 += MLA_SUB) { /* the weighted latent */
        c.len = len - t0 < MLA_SUB ? len - t0 : MLA_SUB; /* the chunk's rows are in L2 since the scores */
        for (int t = t0 + MLA_SUB; t < t0 + 2 * MLA_SUB && t < len; t++) /* the next sub-block's latent, into L1 */
            for (size_t b = 0; b < row_bytes(dtype, rank); b += 64)
                _mm_prefetch((const char *)l->k.data + slots[t] * row_bytes(dtype, width) + b, _MM_HINT_T0);
        mla_widen(&l->k, dtype, slots + t0, c.len, width, 0, rank, factor, buf);
        for (int h = 0; h < hq;) {
            const int pack = hq - h < even ? hq - h : even; /* any heads together: the values need no key */
            FOR_HEAD_PACK(pack, mla_value_pack, &c, scores + (size_t)h * CHUNK + t0, out + (size_t)h * rank)
            h += pack;
        }
    }
}

static void mla_attend_unit(const llama_model *m, const llama_layer *l, const paged_view *v, int unit, scratch *s) {
    switch (m->cache_dtype) {
    case CACHE_F32: mla_attend_chunk(m, l, v, unit, s, CACHE_F32); break;
    case CACHE_F16: mla_attend_chunk(m, l, v, unit, s, CACHE_F16); break;
    case CACHE_BF16: mla_attend_chunk(m, l, v, unit, s, CACHE_BF16); break;
    case CACHE_FP8_E4M3: mla_attend_chunk(m, l, v, unit, s, CACHE_FP8_E4M3); break;
    default: mla_attend_chunk(m, l, v, unit, s, CACHE_FP8_E5M2); break;
    }
}

/* y[j] = w[j] . x for four rows of w (stride n) at once: four independent sums, x loaded once. */
static inline void dots4(const float *w, int n, const float *x, float *y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < n; i += 8) {
        const __m256 xi = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), xi, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + n + i), xi, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * n + i), xi, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * n + i), xi, a3);
    }
    _mm_storeu_ps(y, hsum4(a0, a1, a2, a3));
}

/* dots4 for three vectors at once: y[3 k + j] = w[j] . x_k (x_k at x + k stride), each w load serving three
 * rows: dots4 alone loads five vectors per four multiply-adds, and W_uv's products were a third of the
 * step's cost beyond the source's at 16 rows x 128 tokens. */
static inline void dots4x3(const float *w, int n, const float *x, size_t stride, float *y) {
    __m256 a[12];
    for (int k = 0; k < 12; k++) a[k] = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + stride + i),
                     x2 = _mm256_loadu_ps(x + 2 * stride + i);
        for (int j = 0; j < 4; j++) {
            const __m256 wj = _mm256_loadu_ps(w + (size_t)j * n + i);
            a[j] = _mm256_fmadd_ps(wj, x0, a[j]);
            a[4 + j] = _mm256_fmadd_ps(wj, x1, a[4 + j]);
            a[8 + j] = _mm256_fmadd_ps(wj, x2, a[8 + j]);
        }
    }
    for (int k = 0; k < 3; k++) _mm_storeu_ps(y + 4 * k, hsum4(a[4 * k], a[4 * k + 1], a[4 * k + 2], a[4 * k + 3]));
}

/* An MLA layer's attention for every row: s->att [rows, n_heads head_dim] receives the heads'
 * outputs, ready for the output projection (layer_step does the rest, as for GQA). */
static void mla_attend_layer(const llama_model *m, const llama_layer *l, const paged_view *v, const float *x,
                             scratch *s) {
    const int rows = v->rows, hq = m->n_heads, bs = v->block_size, width = mla_qkv_width(m);
    const int nope = m->qk_nope_dim, rd = m->qk_rope_dim, rank = m->kv_lora_rank, qw = mla_query_width(m);
    const int head_in = nope + rd, dv = m->head_dim, row_width = mla_row_width(m);
    norm_quantize(x, l->attn_norm, rows, m->dim, m->eps, s->normed, s);
    stack_gemm(&l->qkv, rows, s, s->qkv, width);
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) { /* the latent's norm, RoPE on the keys and queries, the row into its block */
        const int pos = v->positions[r];
        float *heads = s->qkv + (size_t)r * width, *latent = heads + (size_t)hq * head_in;
        if (l->latent_norm) rms_norm(latent, l->latent_norm, rank, m->eps, latent);
        const float *cos = l->rope_cos + (size_t)pos * rd, *sin = l->rope_sin + (size_t)pos * rd;
        for (int g = 0; g < m->n_kv_heads; g++) rope(latent + rank + g * rd, cos, sin, rd, m->rope_interleaved);
        for (int h = 0; h < hq; h++) rope(heads + h * head_in + nope, cos, sin, rd, m->rope_interleaved);
        const int32_t block = v->tables[(size_t)r * v->max_blocks + pos / bs];
        store_row(&l->k, m->cache_dtype, (size_t)block * bs + pos % bs, 0, latent, row_width, m->group_size);
    }
#pragma omp for schedule(static)
    for (int rh = 0; rh < rows * hq; rh++) { /* absorbed queries [q_nope W_uk, q_rope] */
        const float *in = s->qkv + (size_t)(rh / hq) * width + (size_t)(rh % hq) * head_in;
        float *q = s->mq + (size_t)rh * qw;
        memcpy(q + rank, in + nope, rd * sizeof(float));
        if (!nope) continue; /* no position-free channels: the scores never read q_lat */
        const float *w = l->w_uk + (size_t)(rh % hq) * nope * rank;
        for (int i0 = 0; i0 < rank; i0 += 32) { /* 32 channels in registers over the nope inputs */
            const int lanes = rank - i0 < 32 ? (rank - i0) / 8 : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int i = 0; i < nope; i++) {
                const __m256 qi = _mm256_broadcast_ss(in + i);
                for (int u = 0; u < lanes; u++)
                    acc[u] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(w + (size_t)i * rank + i0 + 8 * u), acc[u]);
            }
            for (int u = 0; u < lanes; u++) _mm256_storeu_ps(q + i0 + 8 * u, acc[u]);
        }
    }
    const int units = s->unit_first[0][rows];
#pragma omp for schedule(dynamic, 1)
    for (int unit = 0; unit < units; unit++) mla_attend_unit(m, l, v, unit, s);
#pragma omp for schedule(static)
    for (int rh = 0; rh < rows * hq; rh++) { /* each head's chunks merged: unit (r, chunk c) holds head h at c hq + h */
        const int r = rh / hq;
        merge_partials(s, (size_t)s->unit_first[0][r] * hq + rh % hq, hq, chunks_at(v->positions[r], 0), rank,
                       s->lat + (size_t)rh * rank);
    }
#pragma omp for schedule(static)
    for (int h = 0; h < hq; h++) /* each head's W_uv row read once for every row */
        for (int j = 0; j < dv; j += 4) {
            float y[12];
            int r = 0;
            for (; r + 3 <= rows; r += 3) {
                dots4x3(l->w_uv + ((size_t)h * dv + j) * rank, rank, s->lat + ((size_t)r * hq + h) * rank,
                        (size_t)hq * rank, y);
                for (int k = 0; k < 3; k++)
                    memcpy(s->att + (size_t)(r + k) * hq * dv + (size_t)h * dv + j, y + 4 * k, 4 * sizeof(float));
            }
            for (; r < rows; r++) {
                dots4(l->w_uv + ((size_t)h * dv + j) * rank, rank, s->lat + ((size_t)r * hq + h) * rank, y);
                memcpy(s->att + (size_t)r * hq * dv + (size_t)h * dv + j, y, 4 * sizeof(float));
            }
        }
}

#endif
