/* KIVI pools (CACHE_KIVI4/2) in the paged step: what kvlab.cache.kivi_pool.KiviPlanes stores, written and
 * attended in place.
 *
 * KIVI quantises keys per channel over groups of G tokens and values per token over groups of G
 * channels, and holds a sequence's newest tokens in full precision until a whole group lies R
 * tokens back: of T tokens, q = max(0, (T - R) / G) G sit quantised in the sequence's blocks, the
 * rest (R .. R + G - 1 of them) in its seat's ring of R + G fp32 rows, position p in row p % (R + G).
 *
 * Writing follows KiviPlanes.store, per sequence and KV head, once every row of the layer has its
 * K/V (a prompt's rows share one seat): the groups that fell R tokens back are quantised from the
 * ring (positions before this step's) and the new rows, then the new positions past them join the
 * ring. The quantiser is group_quantize_row (kv_codecs.h), so the codes, scales and zeros are
 * quantize_groups' to the byte: values are its rows as they are, keys a channel's G tokens at a
 * time, their codes then packed per token along the channels as pack_codes packs them.
 *
 * Attention reads the bytes int4/int2 read (the same packed code rows): a key group's per-channel
 * scale s_c and zero z_c fold into the query, q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c,
 * so key_dots runs unchanged against (q s), once per group of G tokens (as planes against (q s)
 * permuted to packed_order where rows and groups are whole words, packed_rows; else lane by lane);
 * values take the group formats' per-token scale and zero (packed_value_sums, value_sums).
 * Memory is asked for as attend_chunk's key pass asks: a chunk's first rows at its start, then each row
 * (codes, and the value scales and zeros of eight rows) PREFETCH rows ahead of the key loop, the key
 * groups' scales and zeros a batch of KIVI_FOLDS groups ahead; the value scales are widened after the key
 * pass. Asked all at once at the chunk's start and widened before the key loop, the step ran 0.94x fp16's
 * at 16 rows x 4,096 tokens (int4's 1.10x; AMD EPYC Zen 2): the core waited on its fill buffers.
 * Every row attends as the module path does after the whole step's stores: positions below its
 * sequence's q (after the step) from the blocks, the rest from the ring, in one softmax per chunk.
 *
 * Included by llama_decode.c after the helpers it shares (key_dots, packed_value_sums, exp8, ...).
 */
#ifndef KVLAB_KIVI_ATTEND_H
#define KVLAB_KIVI_ATTEND_H

/* The tokens of `tokens` a KIVI cache holds quantised: whole groups at least R back. */
static inline int kivi_quantised(int tokens, int group, int residual) {
    return tokens > residual ? (tokens - residual) / group * group : 0;
}

/* The int4/int2 code layout KIVI rows share (packed_word, packed_plane, packed_order take it). */
static inline int kivi_codes(int dtype) { return dtype == CACHE_KIVI4 ? CACHE_INT4 : CACHE_INT2; }

/* Store one sequence's head h: its positions start .. end - 1 are new, row i's keys at k_new + i stride
 * and values at v_new + i stride (fp32, d channels); table is its block table. */
static void kivi_store_head(const kv_plane *k, const kv_plane *v, int bits, int G, int R, int bs, int hkv, int d,
                            int h, int seat, int start, int end, const float *k_new, const float *v_new,
                            size_t stride, const int32_t *table) {
    const int ring = R + G, first = kivi_quantised(start, G, R), last = kivi_quantised(end, G, R);
    const int per = 8 / bits, mask = (1 << bits) - 1, vgroups = (d + G - 1) / G;
    const size_t rb = (size_t)d * bits / 8;
    const size_t seat_rows = ((size_t)seat * hkv + h) * ring * d;
    float *k_ring = k->ring + seat_rows, *v_ring = v->ring + seat_rows;
    for (int gp = first; gp < last; gp += G) { /* whole groups that fell R back: from the ring, then the new rows */
        const float *keys[KIVI_MAX_GROUP], *values[KIVI_MAX_GROUP];
        for (int t = 0; t < G; t++) {
            const int p = gp + t;
            keys[t] = p < start ? k_ring + (size_t)(p % ring) * d : k_new + (size_t)(p - start) * stride;
            values[t] = p < start ? v_ring + (size_t)(p % ring) * d : v_new + (size_t)(p - start) * stride;
        }
        const int32_t block = table[gp / bs];
        const int row = gp % bs;
        const size_t slot = ((size_t)block * hkv + h) * bs + row; /* the group's first token */
        const size_t meta = (((size_t)block * hkv + h) * (bs / G) + row / G) * d;
        uint8_t *codes = (uint8_t *)k->data + slot * rb;
        memset(codes, 0, G * rb);
        for (int c = 0; c < d; c++) { /* channel c over the group's tokens: one group of G */
            float x[KIVI_MAX_GROUP];
            uint8_t packed[KIVI_MAX_GROUP];
            for (int t = 0; t < G; t++) x[t] = keys[t][c];
            group_quantize_row(x, G, G, bits, packed, k->scale + meta + c, k->zero + meta + c);
            for (int t = 0; t < G; t++) {
                const int code = bits == 8 ? packed[t] : packed[t / per] >> (t % per * bits) & mask;
                codes[t * rb + c / per] |= (uint8_t)(code << (c % per * bits));
            }
        }
        for (int t = 0; t < G; t++)
            group_quantize_row(values[t], d, G, bits, (uint8_t *)v->data + (slot + t) * rb,
                               v->scale + (slot + t) * vgroups, v->zero + (slot + t) * vgroups);
    }
    for (int p = start > last ? start : last; p < end; p++) { /* the new positions still in full precision */
        memcpy(k_ring + (size_t)(p % ring) * d, k_new + (size_t)(p - start) * stride, d * sizeof(float));
        memcpy(v_ring + (size_t)(p % ring) * d, v_new + (size_t)(p - start) * stride, d * sizeof(float));
    }
}

/* Every sequence's new K/V of this layer (s->qkv, after RoPE), each by the thread that takes its first
 * row, head by head: a sequence's rows are adjacent and share its seat (check_kivi). */
static void kivi_store_layer(const llama_model *m, const llama_layer *l, const paged_view *v, const scratch *s,
                             int width) {
    const int rows = v->rows, hq = m->n_heads, hkv = m->n_kv_heads, d = m->head_dim;
    const int32_t *info = m->kivi_rows;
#pragma omp for schedule(dynamic, 1)
    for (int rh = 0; rh < rows * hkv; rh++) {
        const int r = rh / hkv, h = rh % hkv;
        if (r > 0 && info[2 * (r - 1)] == info[2 * r]) continue; /* not its sequence's first row */
        int n = 1;
        while (r + n < rows && info[2 * (r + n)] == info[2 * r]) n++;
        const float *row = s->qkv + (size_t)r * width;
        kivi_store_head(&l->k, &l->v, cache_code_bits(m->cache_dtype), m->group_size, m->kivi_residual,
                        v->block_size, hkv, d, h, info[2 * r], v->positions[r], v->positions[r] + n,
                        row + (size_t)(hq + h) * d, row + (size_t)(hq + hkv + h) * d, width,
                        v->tables + (size_t)r * v->max_blocks);
    }
}

/* x [d] in natural channel order -> y in packed_order (d a multiple of the word's W channels), by
 * shuffles: plane k of a word is lanes m = 0..7 holding channel P m + k (int4: the even channels, then
 * the odd; int2: every fourth). A scalar or gathered permutation per key group cost a tenth of the step. */
static inline __attribute__((always_inline)) void planes_permute(const float *x, float *y, int d, const int dtype) {
    if (dtype == CACHE_INT4) {
        const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        for (int w = 0; w < d; w += 16) {
            const __m256 a = _mm256_loadu_ps(x + w), b = _mm256_loadu_ps(x + w + 8);
            _mm256_storeu_ps(y + w, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                                             order));
            _mm256_storeu_ps(y + w + 8,
                             _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)), order));
        }
        return;
    }
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int w = 0; w < d; w += 32) {
        const __m256 a = _mm256_loadu_ps(x + w), b = _mm256_loadu_ps(x + w + 8);
        const __m256 c = _mm256_loadu_ps(x + w + 16), e = _mm256_loadu_ps(x + w + 24);
        const __m256 ab02 = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 ce02 = _mm256_shuffle_ps(c, e, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 ab13 = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
        const __m256 ce13 = _mm256_shuffle_ps(c, e, _MM_SHUFFLE(3, 1, 3, 1));
        /* p0: channels 0, 8, 16, 24 | 4, 12, 20, 28, which `order` puts in place; p1 .. p3 likewise */
        const __m256 p0 = _mm256_shuffle_ps(ab02, ce02, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 p1 = _mm256_shuffle_ps(ab13, ce13, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 p2 = _mm256_shuffle_ps(ab02, ce02, _MM_SHUFFLE(3, 1, 3, 1));
        const __m256 p3 = _mm256_shuffle_ps(ab13, ce13, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(y + w, _mm256_permutevar8x32_ps(p0, order));
        _mm256_storeu_ps(y + w + 8, _mm256_permutevar8x32_ps(p1, order));
        _mm256_storeu_ps(y + w + 16, _mm256_permutevar8x32_ps(p2, order));
        _mm256_storeu_ps(y + w + 24, _mm256_permutevar8x32_ps(p3, order));
    }
}

/* The chunk's quantised rows' value scales and zeros, every group, once per unit: v_meta[f][g CHUNK + t]
 * (f 0 the scale, 1 the zero), zero-padded to a multiple of 8 rows. Rows run consecutively within a
 * block (`runs`), so one or two groups a row convert 8 rows at once (two: 16 halves, then their even or
 * odd lanes); more groups, one by one. */
static void kivi_value_meta(const llama_layer *l, const chunk_rows *c, int nq, const int *runs, int n_runs,
                            float *v_meta) {
    const int groups = c->groups;
    const uint16_t *from[2] = {l->v.scale, l->v.zero};
    for (int f = 0; f < 2; f++) {
        float *to = v_meta + (size_t)f * groups * CHUNK;
        for (int r = 0, t = 0; r < n_runs; t += runs[r], r++) {
            int u = t;
            for (; groups <= 2 && u + 8 <= t + runs[r]; u += 8) {
                const uint16_t *at = from[f] + c->slots[u] * groups;
                const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
                if (groups == 1) {
                    _mm256_storeu_ps(to + u, lo);
                    continue;
                }
                const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 8)));
                for (int g = 0; g < 2; g++) {
                    const __m256 pick = g ? _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1))
                                          : _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
                    _mm256_storeu_ps(to + g * CHUNK + u, _mm256_castpd_ps(_mm256_permute4x64_pd(
                                                             _mm256_castps_pd(pick), _MM_SHUFFLE(3, 1, 2, 0))));
                }
            }
            for (; u < t + runs[r]; u++)
                for (int g = 0; g < groups; g++) to[g * CHUNK + u] = half_at(from[f], c->slots[u] * groups + g);
        }
        for (int g = 0; g < groups; g++)
            for (int u = nq; u % 8; u++) to[g * CHUNK + u] = 0.0f;
    }
}

/* Ask memory for quantised row t of the chunk: its K and V codes and, every eighth row, the lines of its
 * values' scales and zeros (eight rows' at one or two groups a row, consecutive within a block). Asked
 * PREFETCH rows ahead of the key loop, as key_pass does: all of a chunk's rows asked at once stalled
 * the core on its fill buffers before any arithmetic could overlap them. */
static inline __attribute__((always_inline)) void kivi_prefetch_row(const llama_layer *l, const chunk_rows *c, int t,
                                                                   size_t rb) {
    for (size_t b = 0; b < rb; b += 64) {
        _mm_prefetch((const char *)l->k.data + c->at[t] + b, _MM_HINT_T0);
        _mm_prefetch((const char *)l->v.data + c->at[t] + b, _MM_HINT_T0);
    }
    if (t % 8 == 0) {
        _mm_prefetch((const char *)(l->v.scale + c->slots[t] * c->groups), _MM_HINT_T0);
        _mm_prefetch((const char *)(l->v.zero + c->slots[t] * c->groups), _MM_HINT_T0);
    }
}

/* Ask memory for the per-channel key scales and zeros of the group holding position p. */
static inline void kivi_prefetch_key_meta(const llama_layer *l, const int32_t *table, int p, int G, int bs, int hkv,
                                          int kvh, int d) {
    const size_t meta = (((size_t)table[p / bs] * hkv + kvh) * (bs / G) + p % bs / G) * d;
    for (int b = 0; b < d; b += 32) {
        _mm_prefetch((const char *)(l->k.scale + meta + b), _MM_HINT_T0);
        _mm_prefetch((const char *)(l->k.zero + meta + b), _MM_HINT_T0);
    }
}

#define KIVI_FOLDS 4 /* key groups folded into the query at a time, ahead of their tokens' dot products */

/* Key group (holding position p)'s per-channel scales s and zeros z folded into GH query heads: qs = q s in the
 * key loop's channel order (qp is q in that order), zq[h] = q_h . z. */
static inline __attribute__((always_inline)) void kivi_fold_group(const llama_layer *l, const int32_t *table, int p,
                                                                 int G, int bs, int hkv, int kvh, int d,
                                                                 const float *q, const float *qp, float *qs,
                                                                 float *zq, const int dtype, const int GH) {
    const size_t meta = (((size_t)table[p / bs] * hkv + kvh) * (bs / G) + p % bs / G) * d;
    float natural[d], ks[d], kz[d];
    for (int i = 0; i < d; i += 8) { /* the scales in the key loop's order; the zeros meet q in channel order */
        _mm256_storeu_ps(natural + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(l->k.scale + meta + i))));
        _mm256_storeu_ps(kz + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(l->k.zero + meta + i))));
    }
    if (packed_rows(dtype, d, G)) /* as kivi_attend_chunk's c.packed */
        planes_permute(natural, ks, d, dtype);
    else
        memcpy(ks, natural, sizeof(float) * d);
    for (int h = 0; h < GH; h++) {
        __m256 zs = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            _mm256_storeu_ps(qs + h * d + i, _mm256_mul_ps(_mm256_loadu_ps(qp + h * d + i), _mm256_loadu_ps(ks + i)));
            zs = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + i), _mm256_loadu_ps(kz + i), zs);
        }
        zq[h] = hsum(zs);
    }
}

/* GH query heads of one KV head over one chunk: its first nq tokens quantised (c->at, slots in the
 * blocks), the rest ring rows (slots into the ring); scores, softmax partials and the weighted values
 * as attend_heads leaves them (out in channel order). `dtype` is the codes' layout (CACHE_INT4/2). */
static inline __attribute__((always_inline)) void kivi_heads(const llama_model *m, const llama_layer *l,
                                                            chunk_rows *c, int nq, int start, const int32_t *table,
                                                            int kvh, int bs, const float *q, float *scores,
                                                            float k_factor, float *part_max, float *part_sum,
                                                            float *out, float *v_meta, int *v_meta_ready,
                                                            const int *runs, int n_runs, const int dtype,
                                                            const int GH) {
    const int d = c->d, G = m->group_size, hkv = m->n_kv_heads, len = c->len, packed = c->packed;
    /* keys a pass, fixed at compile time so the accumulators stay in registers (as attend_heads') */
    const int TBP = GH == 1 ? 4 : GH <= 3 ? 3 : 2, TB = GH <= 3 ? 4 : 3;
    float part[4 * CHUNK];
    float qp[4 * d]; /* the query heads in the key loop's channel order */
    if (packed)
        for (int h = 0; h < GH; h++) planes_permute(q + h * d, qp + h * d, d, dtype);
    else
        memcpy(qp, q, sizeof(float) * GH * d);
    const size_t rb = (size_t)d * cache_code_bits(dtype) / 8;
    float qs[KIVI_FOLDS][4 * d], zq[KIVI_FOLDS][4];
    int t = 0;
    while (t < nq) { /* up to KIVI_FOLDS key groups at a time: (q s) and q . z of each, then their tokens */
        int runs_of[KIVI_FOLDS], n = 0;
        for (int u = t; u < nq && n < KIVI_FOLDS; n++) { /* the folds first: their scales' loads overlap */
            const int p = start + u, run = (p / G + 1) * G - p < nq - u ? (p / G + 1) * G - p : nq - u;
            kivi_fold_group(l, table, p, G, bs, hkv, kvh, d, q, qp, qs[n], zq[n], dtype, GH);
            runs_of[n] = run;
            u += run;
        }
        int ahead = t; /* the first group after this batch's */
        for (int i = 0; i < n; i++) ahead += runs_of[i];
        if (ahead < nq) kivi_prefetch_key_meta(l, table, start + ahead, G, bs, hkv, kvh, d);
        for (int i = 0; i < n; i++) {
            const int run = runs_of[i];
            int u = t;
            if (packed)
                for (; u + TBP <= t + run; u += TBP) {
                    for (int a = u + PREFETCH; a < u + PREFETCH + TBP && a < nq; a++) kivi_prefetch_row(l, c, a, rb);
                    key_dots(&l->k, dtype, c, qs[i], 0, d, u, scores, GH, TBP);
                }
            else
                for (; u + TB <= t + run; u += TB) {
                    for (int a = u + PREFETCH; a < u + PREFETCH + TB && a < nq; a++) kivi_prefetch_row(l, c, a, rb);
                    key_dots(&l->k, dtype, c, qs[i], 0, d, u, scores, GH, TB);
                }
            for (int a = u + PREFETCH; a < t + run + PREFETCH && a < nq; a++) kivi_prefetch_row(l, c, a, rb);
            if (u + 2 <= t + run) /* a group's last two keys together (32 = 3 x 10 + 2) */
                key_dots(&l->k, dtype, c, qs[i], 0, d, u, scores, GH, 2), u += 2;
            for (; u < t + run; u++) key_dots(&l->k, dtype, c, qs[i], 0, d, u, scores, GH, 1);
            for (int h = 0; h < GH; h++) {
                const __m256 z = _mm256_set1_ps(zq[i][h]);
                for (u = t; u + 8 <= t + run; u += 8)
                    _mm256_storeu_ps(scores + h * CHUNK + u, _mm256_add_ps(_mm256_loadu_ps(scores + h * CHUNK + u), z));
                for (; u < t + run; u++) scores[h * CHUNK + u] += zq[i][h];
            }
            t += run;
        }
    }
    const kv_plane k_ring = {l->k.ring, NULL, NULL, NULL, NULL};
    for (; t + TB <= len; t += TB) {
        for (int u = t + PREFETCH; u < t + PREFETCH + TB && u < len; u++) /* fp32 rows, four lines each: ask ahead */
            for (int b = 0; b < d; b += 16) {
                _mm_prefetch((const char *)(l->k.ring + c->slots[u] * d + b), _MM_HINT_T0);
                _mm_prefetch((const char *)(l->v.ring + c->slots[u] * d + b), _MM_HINT_T0);
            }
        key_dots(&k_ring, CACHE_F32, c, q, 0, d, t, scores, GH, TB);
    }
    for (; t < len; t++) key_dots(&k_ring, CACHE_F32, c, q, 0, d, t, scores, GH, 1);
    if (nq && !*v_meta_ready) { /* after the key pass has brought the rows in: the first pack's */
        kivi_value_meta(l, c, nq, runs, n_runs, v_meta);
        *v_meta_ready = 1;
    }
    for (int h = 0; h < GH; h++) { /* each head's softmax partials, exp'd in place (as attend_heads) */
        float *sh = scores + h * CHUNK;
        chunk_softmax(sh, len, k_factor, part_max + h, part_sum + h);
        for (t = len; t % 8; t++) sh[t] = 0.0f; /* pad the last vector for the value groups' passes below */
    }
    if (nq > 0) { /* the quantised values, group by group of channels: scales folded into the weights */
        const int P = 8 / cache_code_bits(dtype), W = 8 * P, V = GH == 1 ? 8 : GH == 2 ? 4 : 2;
        const int NV = GH == 1 ? 8 : GH == 2 ? 4 : 2, groups = c->groups, gsize = c->gsize;
        float offset[4];
        c->len = nq; /* the value loops run over the quantised tokens alone */
        for (int g = 0; g < groups; g++) {
            const int lo = g * gsize, hi = lo + gsize < d ? lo + gsize : d;
            const float *v_scale = v_meta + (size_t)g * CHUNK, *v_zero = v_meta + (size_t)(groups + g) * CHUNK;
            for (int h = 0; h < GH; h++) {
                __m256 share = _mm256_setzero_ps();
                for (t = 0; t < nq; t += 8) { /* past nq the scale and zero are 0: ring weights drop out */
                    const __m256 w = _mm256_loadu_ps(scores + h * CHUNK + t);
                    share = _mm256_fmadd_ps(w, _mm256_loadu_ps(v_zero + t), share);
                    _mm256_storeu_ps(part + h * CHUNK + t, _mm256_mul_ps(w, _mm256_loadu_ps(v_scale + t)));
                }
                offset[h] = hsum(share);
            }
            int i = lo;
            if (!packed) { /* codes widened lane by lane (rows or groups not whole words) */
                for (; i + 8 * NV <= hi; i += 8 * NV) value_sums(&l->v, dtype, c, part, i, offset, 1.0f, out, GH, NV);
                for (; i < hi; i += 8) value_sums(&l->v, dtype, c, part, i, offset, 1.0f, out, GH, 1);
            } else if (V >= P) {
                for (; i + (V / P) * W <= hi; i += (V / P) * W)
                    packed_value_sums(&l->v, dtype, c, part, i, V / P, 0, P, offset, 1.0f, out, GH);
                for (; i < hi; i += W) packed_value_sums(&l->v, dtype, c, part, i, 1, 0, P, offset, 1.0f, out, GH);
            } else {
                for (; i < hi; i += W)
                    for (int k0 = 0; k0 < P; k0 += V)
                        packed_value_sums(&l->v, dtype, c, part, i, 1, k0, V, offset, 1.0f, out, GH);
            }
        }
        c->len = len;
    } else {
        memset(out, 0, (size_t)GH * d * sizeof(float));
    }
    if (nq < len) /* the ring's values, added in fp32, two vectors of each head's channels a pass */
        for (int i = 0; i < d; i += 16) {
            const int two = i + 16 <= d;
            __m256 acc[4][2];
            for (int h = 0; h < GH; h++) {
                acc[h][0] = _mm256_loadu_ps(out + h * d + i);
                acc[h][1] = two ? _mm256_loadu_ps(out + h * d + i + 8) : acc[h][0];
            }
            for (t = nq; t < len; t++) {
                const float *row = l->v.ring + c->slots[t] * d + i;
                const __m256 x0 = _mm256_loadu_ps(row), x1 = two ? _mm256_loadu_ps(row + 8) : x0;
                for (int h = 0; h < GH; h++) {
                    const __m256 w = _mm256_broadcast_ss(scores + h * CHUNK + t);
                    acc[h][0] = _mm256_fmadd_ps(w, x0, acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(w, x1, acc[h][1]);
                }
            }
            for (int h = 0; h < GH; h++) {
                _mm256_storeu_ps(out + h * d + i, acc[h][0]);
                if (two) _mm256_storeu_ps(out + h * d + i + 8, acc[h][1]);
            }
        }
}

/* One attention unit (row, KV head, chunk) of a KIVI layer: attend_chunk's work split, its partials
 * where combine_heads merges them. Inlined once per codes layout (kivi_attend_unit), so the planes'
 * shifts and masks are constants. */
static inline __attribute__((always_inline)) void kivi_attend_chunk(const llama_model *m, const llama_layer *l,
                                                                   const paged_view *v, int unit, const float *qkv,
                                                                   int width, scratch *s, const int dtype) {
    const int d = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, bs = v->block_size;
    const int G = m->group_size, ring = m->kivi_residual + G, L = s->layout, window = s->layout_window[L];
    const int r = s->unit_row[L][unit], pos = v->positions[r], chunks = chunks_at(pos, window);
    const int local = unit - s->unit_first[L][r], kvh = local / chunks;
    /* a sliding layer's chunks start at its window's first position (no sinks: check_kivi), which may fall
     * inside a key group: kivi_heads folds each group's scales from whichever of its tokens comes first */
    const int first = first_seen(pos, window), ch = first / CHUNK + local % chunks;
    const int start = ch * CHUNK > first ? ch * CHUNK : first;
    const int end = (ch + 1) * CHUNK <= pos + 1 ? (ch + 1) * CHUNK : pos + 1;
    const int seat = m->kivi_rows[2 * r], quantised = m->kivi_rows[2 * r + 1];
    const int nq = quantised <= start ? 0 : quantised >= end ? end - start : quantised - start;
    const int32_t *table = v->tables + (size_t)r * v->max_blocks;
    const size_t rb = row_bytes(dtype, d);
    chunk_rows c;
    c.len = end - start, c.d = d, c.gsize = G < d ? G : d, c.groups = (d + c.gsize - 1) / c.gsize;
    c.integer = 0, c.packed = packed_rows(dtype, d, G), c.tables = 0;
    int runs[CHUNK], n_runs = 0; /* the quantised rows' runs of consecutive rows, one per block */
    for (int t = start, at = 0; t < start + nq;) { /* block by block, as attend_chunk */
        const size_t base = ((size_t)table[t / bs] * hkv + kvh) * bs;
        const int offset = t % bs, run = bs - offset < start + nq - t ? bs - offset : start + nq - t;
        runs[n_runs++] = run;
        for (int u = 0; u < run; u++, at++) {
            c.slots[at] = base + offset + u;
            c.at[at] = c.slots[at] * rb;
        }
        t += run;
    }
    for (int t = start + nq; t < end; t++) c.slots[t - start] = ((size_t)seat * hkv + kvh) * ring + t % ring;
    for (int t = 0; t < PREFETCH && t < nq; t++) kivi_prefetch_row(l, &c, t, rb); /* the key loop asks for the rest */
    if (nq) kivi_prefetch_key_meta(l, table, start, G, bs, hkv, kvh, d);
    for (int t = nq; t < nq + PREFETCH && t < c.len; t++) /* the first ring rows; the key loop asks for the rest */
        for (int b = 0; b < d; b += 16) {
            _mm_prefetch((const char *)(l->k.ring + c.slots[t] * d + b), _MM_HINT_T0);
            _mm_prefetch((const char *)(l->v.ring + c.slots[t] * d + b), _MM_HINT_T0);
        }
    float v_meta[2 * c.groups * CHUNK];
    int v_meta_ready = 0; /* filled by the first pack of heads, after its key pass */
    const float scale = m->query_scale > 0.0f ? m->query_scale : 1.0f / sqrtf((float)d);
    const float *q = qkv + (size_t)r * width + (size_t)kvh * group * d;
    for (int h = 0; h < group;) {
        const int pack = group - h < 4 ? group - h : 4;
        const size_t at = (size_t)unit * group + h;
        float *scores = s->scores + at * CHUNK, *out = s->part_out + at * d;
        FOR_HEAD_PACK(pack, kivi_heads, m, l, &c, nq, start, table, kvh, bs, q + (size_t)h * d, scores, scale,
                      s->part_max + at, s->part_sum + at, out, v_meta, &v_meta_ready, runs, n_runs, dtype)
        h += pack;
    }
}

static void kivi_attend_unit(const llama_model *m, const llama_layer *l, const paged_view *v, int unit,
                             const float *qkv, int width, scratch *s) {
    if (m->cache_dtype == CACHE_KIVI4)
        kivi_attend_chunk(m, l, v, unit, qkv, width, s, CACHE_INT4);
    else
        kivi_attend_chunk(m, l, v, unit, qkv, width, s, CACHE_INT2);
}

/* A KIVI model's descriptor and this step's rows, checked before any step: 0, -2 for rows whose seats,
 * positions or quantised counts disagree, -4 for a format the loops cannot run. */
static int check_kivi(const llama_model *m, int rows, const int32_t *positions, int block_size) {
    const int G = m->group_size, d = m->head_dim;
    if (G < 1 || G > KIVI_MAX_GROUP || block_size % G || m->kivi_residual < 0 || m->kivi_seats < 1 ||
        m->kv_lora_rank || (G < d && G % 8))
        return -4;
    for (int i = 0; i < m->n_layers; i++) {
        const llama_layer *l = &m->layers[i];
        if (l->sinks || l->attention != ATTN_GQA || !l->k.data || !l->k.scale || !l->k.zero || !l->k.ring ||
            !l->v.data || !l->v.scale || !l->v.zero || !l->v.ring)
            return -4;
    }
    if (!m->kivi_rows) return -2;
    char *seen = calloc((size_t)m->kivi_seats, 1);
    if (!seen) return -1;
    int status = 0;
    for (int r = 0; r < rows && !status;) { /* a sequence: adjacent rows of one seat at consecutive positions */
        const int seat = m->kivi_rows[2 * r];
        int n = 1;
        while (r + n < rows && m->kivi_rows[2 * (r + n)] == seat) n++;
        const int quantised = kivi_quantised(positions[r + n - 1] + 1, G, m->kivi_residual);
        if (seat < 0 || seat >= m->kivi_seats || seen[seat]) status = -2;
        for (int i = 0; i < n && !status; i++)
            if (positions[r + i] != positions[r] + i || m->kivi_rows[2 * (r + i) + 1] != quantised) status = -2;
        if (!status) seen[seat] = 1;
        r += n;
    }
    free(seen);
    return status;
}

/* Test hook: one sequence's new K/V (k_new, v_new [n, hkv, d] fp32) at positions start .. start + n - 1 stored
 * into KIVI planes k and v as a step stores them, so tests can hold it to KiviPlanes.store byte for byte. */
void kvlab_kivi_store(const kv_plane *k, const kv_plane *v, int bits, int group, int residual, int block_size,
                      int hkv, int d, int seat, int start, int n, const float *k_new, const float *v_new,
                      const int32_t *table) {
    for (int h = 0; h < hkv; h++)
        kivi_store_head(k, v, bits, group, residual, block_size, hkv, d, h, seat, start, start + n,
                        k_new + (size_t)h * d, v_new + (size_t)h * d, (size_t)hkv * d, table);
}

#endif
