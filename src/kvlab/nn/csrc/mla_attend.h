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
 * RoPE key would fetch each chunk from memory G times. A narrow pool's chunk (fp16, bf16, fp8) is
 * widened to fp32 once per unit, into the thread's own buffer, before the head packs read it:
 * widening it per pack (as the GQA loop does, where one pack usually covers a KV head's queries)
 * made the F16C conversions, not the multiply-adds, the bound, and SmolLM2's exact conversion
 * reads each latent channel for nine heads. W_uk and W_uv are fp32 matrices (the module path's
 * `up_weights`, the same values), applied per head in plain fp32.
 *
 * Included by llama_decode.c after the helpers it shares (exp8, hsum4, hmax, rms_norm, rope,
 * norm_quantize, stack_gemm); static like them. Float caches only (fp32, fp16, bf16, fp8 with
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

/* One unit's chunk of cached rows. */
typedef struct {
    size_t slots[CHUNK]; /* row of each of the chunk's tokens (block x block_size + offset: one "head") */
    int len, width, rank;
    int scored; /* latent channels the scores read: rank, or 0 where no key channel is position-free
                   (qk_nope_dim 0: kvlab's exact conversion), so q_lat is 0 and only the RoPE keys score */
} mla_chunk;

/* dots[h][t] = q_h . [c_t, k_rope_t] for GH heads reading the RoPE key at channel rope_at, TB keys
 * from t0 on: each key's lanes are widened once for all GH heads (q stride qw). */
static inline __attribute__((always_inline)) void mla_key_dots(const kv_plane *k, int dtype, const mla_chunk *c,
                                                              const float *q, int qw, int rope_at, int rope, int t0,
                                                              float *dots, const int GH, const int TB) {
    __m256 acc[12]; /* GH x TB <= 12 */
    for (int a = 0; a < GH * TB; a++) acc[a] = _mm256_setzero_ps();
    for (int i = 0; i < c->scored; i += 8)
        for (int u = 0; u < TB; u++) {
            const __m256 x = load8(k, dtype, c->slots[t0 + u], i, c->width);
            for (int h = 0; h < GH; h++) acc[h * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qw + i), x, acc[h * TB + u]);
        }
    for (int i = 0; i < rope; i += 8)
        for (int u = 0; u < TB; u++) {
            const __m256 x = load8(k, dtype, c->slots[t0 + u], rope_at + i, c->width);
            for (int h = 0; h < GH; h++)
                acc[h * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qw + c->rank + i), x, acc[h * TB + u]);
        }
    float sums[16];
    int a = 0;
    for (; a + 4 <= GH * TB; a += 4) _mm_storeu_ps(sums + a, hsum4(acc[a], acc[a + 1], acc[a + 2], acc[a + 3]));
    for (; a < GH * TB; a++) sums[a] = hsum(acc[a]);
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < TB; u++) dots[h * CHUNK + t0 + u] = sums[h * TB + u];
}

/* out[h][i0 .. i0 + 8 NV) = factor sum_t w[h][t] c_t for GH heads (w stride CHUNK, out stride rank). */
static inline __attribute__((always_inline)) void mla_value_sums(const kv_plane *k, int dtype, const mla_chunk *c,
                                                                const float *w, int i0, float factor, float *out,
                                                                const int GH, const int NV) {
    __m256 acc[4][8];
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NV; u++) acc[h][u] = _mm256_setzero_ps();
    for (int t = 0; t < c->len; t++) {
        __m256 wt[4];
        for (int h = 0; h < GH; h++) wt[h] = _mm256_broadcast_ss(w + h * CHUNK + t);
        for (int u = 0; u < NV; u++) {
            const __m256 x = load8(k, dtype, c->slots[t], i0 + 8 * u, c->width);
            for (int h = 0; h < GH; h++) acc[h][u] = _mm256_fmadd_ps(wt[h], x, acc[h][u]);
        }
    }
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NV; u++)
            _mm256_storeu_ps(out + h * c->rank + i0 + 8 * u, _mm256_mul_ps(acc[h][u], _mm256_set1_ps(factor)));
}

/* GH (1..4) query heads that read one RoPE key, over one chunk: scores, softmax partials (largest
 * score, sum of exp), then the exp-weighted latent. */
static inline __attribute__((always_inline)) void mla_attend_heads(const kv_plane *k, int dtype, const mla_chunk *c,
                                                                  const float *q, int qw, int rope_at, int rope,
                                                                  float *scores, float k_factor, float v_factor,
                                                                  float *part_max, float *part_sum, float *out,
                                                                  const int GH) {
    const int TB = GH <= 3 ? 4 : 3, NV = GH == 1 ? 8 : GH <= 3 ? 4 : 2;
    int t;
    for (t = 0; t + TB <= c->len; t += TB) {
        for (int u = t + PREFETCH; u < t + PREFETCH + TB && u < c->len; u++)
            prefetch_row(k, dtype, c->slots[u], c->width, 1);
        mla_key_dots(k, dtype, c, q, qw, rope_at, rope, t, scores, GH, TB);
    }
    for (; t < c->len; t++) mla_key_dots(k, dtype, c, q, qw, rope_at, rope, t, scores, GH, 1);
    const __m256 kf = _mm256_set1_ps(k_factor);
    for (int h = 0; h < GH; h++) { /* as attend_heads: each head's partials, exp'd in place */
        float *sh = scores + h * CHUNK;
        for (t = 0; t + 8 <= c->len; t += 8) _mm256_storeu_ps(sh + t, _mm256_mul_ps(_mm256_loadu_ps(sh + t), kf));
        for (; t < c->len; t++) sh[t] *= k_factor;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (t = 0; t + 8 <= c->len; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sh + t));
        float top = hmax(top8), total;
        for (; t < c->len; t++) top = fmaxf(top, sh[t]);
        __m256 sum = _mm256_setzero_ps();
        for (t = 0; t + 8 <= c->len; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), _mm256_set1_ps(top)));
            _mm256_storeu_ps(sh + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        total = hsum(sum);
        for (; t < c->len; t++) total += sh[t] = expf(sh[t] - top);
        part_max[h] = top, part_sum[h] = total;
    }
    int i = 0;
    for (; i + 8 * NV <= c->rank; i += 8 * NV) mla_value_sums(k, dtype, c, scores, i, v_factor, out, GH, NV);
    for (; i < c->rank; i += 8) mla_value_sums(k, dtype, c, scores, i, v_factor, out, GH, 1);
}

/* Unit `unit` (a row's chunk, every head): its heads in packs of up to four that share a RoPE key. */
static inline __attribute__((always_inline)) void mla_attend_chunk(const llama_model *m, const llama_layer *l,
                                                                  const paged_view *v, int unit, scratch *s,
                                                                  const int dtype) {
    const int hq = m->n_heads, keys = m->n_kv_heads, group = hq / keys, bs = v->block_size;
    const int rank = m->kv_lora_rank, rope = m->qk_rope_dim, qw = mla_query_width(m);
    const int r = s->unit_row[0][unit], pos = v->positions[r], ch = unit - s->unit_first[0][r];
    const int start = ch * CHUNK, end = (ch + 1) * CHUNK <= pos + 1 ? (ch + 1) * CHUNK : pos + 1;
    const int32_t *table = v->tables + (size_t)r * v->max_blocks;
    mla_chunk c;
    c.len = end - start, c.width = mla_row_width(m), c.rank = rank, c.scored = m->qk_nope_dim ? rank : 0;
    for (int t = start, at = 0; t < end;) {
        const size_t base = (size_t)table[t / bs] * bs;
        const int offset = t % bs, run = bs - offset < end - t ? bs - offset : end - t;
        for (int u = 0; u < run; u++) c.slots[at++] = base + offset + u;
        t += run;
    }
    for (int t = 0; t < PREFETCH && t < c.len; t++) prefetch_row(&l->k, dtype, c.slots[t], c.width, 1);
    const float scale = m->query_scale > 0.0f ? m->query_scale : 1.0f / sqrtf((float)(m->qk_nope_dim + rope));
    kv_plane rows = l->k;
    float factor = fp8_factor(&l->k, dtype, 0);
    if (dtype != CACHE_F32) { /* the chunk widened once, scaled to the cache's units, rows 0 .. len - 1 */
        float *wide = s->mla_rows + (size_t)omp_get_thread_num() * CHUNK * c.width;
        const __m256 f = _mm256_set1_ps(factor);
        for (int t = 0; t < c.len; t++) {
            if (t + PREFETCH < c.len) prefetch_row(&l->k, dtype, c.slots[t + PREFETCH], c.width, 1);
            for (int i = 0; i < c.width; i += 8)
                _mm256_storeu_ps(wide + (size_t)t * c.width + i, _mm256_mul_ps(load8(&l->k, dtype, c.slots[t], i, c.width), f));
            c.slots[t] = t;
        }
        rows.data = wide, factor = 1.0f;
    }
    const float *q = s->mq + (size_t)r * hq * qw;
    for (int h = 0; h < hq;) {
        const int key = h / group, pack = (key + 1) * group - h < 4 ? (key + 1) * group - h : 4;
        const size_t at = (size_t)unit * hq + h;
        FOR_HEAD_PACK(pack, mla_attend_heads, &rows, CACHE_F32, &c, q + (size_t)h * qw, qw, rank + key * rope, rope,
                      s->scores + at * CHUNK, factor * scale, factor, s->part_max + at, s->part_sum + at,
                      s->part_out + at * rank)
        h += pack;
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
    for (int rh = 0; rh < rows * hq; rh++) { /* merge each head's chunks, as combine_heads */
        const int r = rh / hq, h = rh % hq, chunks = chunks_at(v->positions[r], 0);
        const size_t first = (size_t)s->unit_first[0][r] * hq + h;
        float *out = s->lat + (size_t)rh * rank, top = -INFINITY, total = 0.0f;
        for (int c = 0; c < chunks; c++) top = fmaxf(top, s->part_max[first + (size_t)c * hq]);
        for (int i = 0; i < rank; i++) out[i] = 0.0f;
        for (int c = 0; c < chunks; c++) {
            const size_t at = first + (size_t)c * hq;
            const float weight = expf(s->part_max[at] - top);
            total += weight * s->part_sum[at];
            for (int i = 0; i < rank; i++) out[i] += weight * s->part_out[at * rank + i];
        }
        for (int i = 0; i < rank; i++) out[i] /= total;
    }
#pragma omp for schedule(static)
    for (int h = 0; h < hq; h++) /* each head's W_uv row read once for every row */
        for (int j = 0; j < dv; j += 4) {
            float y[4];
            for (int r = 0; r < rows; r++) {
                dots4(l->w_uv + ((size_t)h * dv + j) * rank, rank, s->lat + ((size_t)r * hq + h) * rank, y);
                memcpy(s->att + (size_t)r * hq * dv + (size_t)h * dv + j, y, sizeof y);
            }
        }
}

#endif
