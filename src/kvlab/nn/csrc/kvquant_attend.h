/* KVQuant attention in the C step (kvquant.h): each row's keys and values written (kvquant_write.h),
 * then attention over the seat's sinks and the blocks' rows.
 *
 * Keys are cached before RoPE. Rotating each key once after decoding it costs a rotation
 * per key per KV head; rotating the query back instead (score = (R(p)^T q) . k) costs one per key
 * per query head, which is `group` times as many: so a key is decoded (its codes looked up in the
 * 8- or 16-entry codebook, times its channel's range plus zero), its outliers put in place, rotated
 * with its position's table and dotted with every query head of its group. A query-folded table
 * (q_c T_c[code]) would skip the decode but not the rotation, which mixes channels differently at
 * every position. Values are decoded the same way once for the group's heads. Sink tokens are fp16
 * rows in the seat, read as they are. 4-bit rows of 64-channel heads are looked up 32 codes at a
 * time with vpshufb (kvquant_nibbles.h), the rest eight at a time with vpermps; a row's outliers are
 * corrections added after its dense dot products and sums.
 */
#ifndef KVLAB_KVQUANT_ATTEND_H
#define KVLAB_KVQUANT_ATTEND_H

#include "kvquant_write.h"

/* Codes c .. c + 7 (c a multiple of 8) of a row packed `bits` to a code (kvlab.cache.bitpack: eight
 * codes fill `bits` bytes, code j at bit bits j, lowest first), as eight lanes. */
static inline __attribute__((always_inline)) __m256i kvq_codes8(const uint8_t *row, int c, const int bits) {
    const uint8_t *at = row + c / 8 * bits;
    uint32_t word; /* 3 or 4 bytes, never past the row, put together in a register (a 3-byte memcpy went
                      through the stack, and its 4-byte reload waited on the two stores every time) */
    if (bits == 4) {
        memcpy(&word, at, 4);
    } else {
        uint16_t low;
        memcpy(&low, at, 2);
        word = low | (uint32_t)at[2] << 16;
    }
    const __m256i shifts = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                     : _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), _mm256_set1_epi32((1 << bits) - 1));
}

/* Each lane's centroid: an 8-entry codebook is one vpermps, a 16-entry one two and a blend on the code's bit 3. */
static inline __attribute__((always_inline)) __m256 kvq_lookup(__m256i codes, __m256 lo, __m256 hi, const int bits) {
    const __m256 a = _mm256_permutevar8x32_ps(lo, codes);
    if (bits == 3) return a;
    return _mm256_blendv_ps(a, _mm256_permutevar8x32_ps(hi, codes), _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}

/* A codebook's first and last eight centroids as fp32 lanes (3 bits: the second is zeros). */
static inline void kvq_codebook(const uint16_t *book, int bits, __m256 *lo, __m256 *hi) {
    float t[16] = {0};
    for (int i = 0; i < 1 << bits; i++) t[i] = f16_to_f32(book[i]);
    *lo = _mm256_loadu_ps(t), *hi = _mm256_loadu_ps(t + 8);
}

/* x rotated at the position whose tables are cos, sin into y: kvlab.nn.rope's rotation (llama_decode.c's
 * rope), eight lanes at a time where the halves are whole vectors. */
static inline void kvq_rotate(const float *x, const float *cos, const float *sin, int d, int interleaved, float *y) {
    if (interleaved || d % 16) {
        memcpy(y, x, (size_t)d * sizeof(float));
        rope(y, cos, sin, d, interleaved);
        return;
    }
    const int half = d / 2;
    for (int i = 0; i < half; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + half);
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)),
                                              _mm256_mul_ps(b, _mm256_loadu_ps(sin + i))));
        _mm256_storeu_ps(y + i + half, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + i + half)),
                                                     _mm256_mul_ps(a, _mm256_loadu_ps(sin + i + half))));
    }
}

/* Code c of a packed row, alone (an outlier's dense value, to correct it by). */
static inline int kvq_code_at(const uint8_t *row, int c, int bits) {
    const int bit = c * bits, shift = bit % 8;
    int word = row[bit / 8];
    if (shift + bits > 8) word |= row[bit / 8 + 1] << 8;
    return (word >> shift) & ((1 << bits) - 1);
}

/* scores[j][t] = (sum of lanes[j][t]'s 8 lanes + fix[j][t]) * scale for t0 <= t < len: a token's dot products
 * are left as vectors by the key loops and added up eight tokens at a time (a transpose by horizontal adds),
 * where one horizontal sum a token and head cost as much as a fifth of the token's key. */
static inline __attribute__((always_inline)) void kvq_reduce_scores(float lanes[][CHUNK][8], float fix[][CHUNK], int t0,
                                                                   int len, float scale, float *scores, const int GH) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int j = 0; j < GH; j++) {
        int t = t0;
        for (; t + 8 <= len; t += 8) {
            const __m256 h01 = _mm256_hadd_ps(_mm256_loadu_ps(lanes[j][t]), _mm256_loadu_ps(lanes[j][t + 1]));
            const __m256 h23 = _mm256_hadd_ps(_mm256_loadu_ps(lanes[j][t + 2]), _mm256_loadu_ps(lanes[j][t + 3]));
            const __m256 h45 = _mm256_hadd_ps(_mm256_loadu_ps(lanes[j][t + 4]), _mm256_loadu_ps(lanes[j][t + 5]));
            const __m256 h67 = _mm256_hadd_ps(_mm256_loadu_ps(lanes[j][t + 6]), _mm256_loadu_ps(lanes[j][t + 7]));
            const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
            _mm256_storeu_ps(scores + (size_t)j * CHUNK + t, _mm256_mul_ps(_mm256_add_ps(sums, _mm256_loadu_ps(fix[j] + t)), sc));
        }
        for (; t < len; t++) scores[(size_t)j * CHUNK + t] = (hsum(_mm256_loadu_ps(lanes[j][t])) + fix[j][t]) * scale;
    }
}

/* The fast path's key scores (rope_halves, at most 4 query heads a KV head): scores[j][t] for t0 <= t < len.
 * A key is decoded, rotated and dotted in registers, half a row against the other half: with cos [C, C]
 * and sin [-S, S], y_i = a C - b S and y_{i+h} = b C + a S for a = x_i, b = x_{i+h}. C and S follow the
 * positions by angle addition (C' = C C1 - S S1, S' = S C1 + C S1, C1 and S1 the tables' position 1),
 * taken from the table again every 16 positions: a table row is 2 d floats, seven times a 4-bit key's
 * bytes, and reading one per key cost more than the key. An outlier is the decoded row plus
 * (value - dense value) at its channel, rotated into its channel and its partner: a correction to the
 * dot products, so the row never leaves the registers. */
static inline __attribute__((always_inline)) void kvq_fast_keys(const kvquant_layer *kl, const float *cos_tab,
                                                               const float *sin_tab, const size_t *slots, int start,
                                                               int t0, int len, int d, const float *range,
                                                               const float *zero, const float *book, __m256 lo,
                                                               __m256 hi, const float *q, float scale, int capacity,
                                                               const uint16_t *k_out, const uint8_t *k_index, int off,
                                                               float *scores, const int bits, const int GH) {
    const int h = d / 2, rb = d * bits / 8;
    float C[h], S[h], lanes[GH][CHUNK][8], fix[GH][CHUNK];
    const float *C1 = cos_tab + d, *S1 = sin_tab + d + h;
    for (int t = t0; t < len; t++) {
        const int p = start + t;
        if (t == t0 || p % 16 == 0) {
            memcpy(C, cos_tab + (size_t)p * d, sizeof C);
            memcpy(S, sin_tab + (size_t)p * d + h, sizeof S);
        } else {
            for (int i = 0; i < h; i += 8) {
                const __m256 c = _mm256_loadu_ps(C + i), s = _mm256_loadu_ps(S + i);
                const __m256 c1 = _mm256_loadu_ps(C1 + i), s1 = _mm256_loadu_ps(S1 + i);
                _mm256_storeu_ps(C + i, _mm256_fnmadd_ps(s, s1, _mm256_mul_ps(c, c1)));
                _mm256_storeu_ps(S + i, _mm256_fmadd_ps(c, s1, _mm256_mul_ps(s, c1)));
            }
        }
        const uint8_t *row = kl->k_codes + slots[t] * rb;
        if (t + 8 < len) _mm_prefetch((const char *)(kl->k_codes + slots[t + 8] * rb), _MM_HINT_T0);
        __m256 acc[4];
        for (int j = 0; j < GH; j++) acc[j] = _mm256_setzero_ps();
        for (int i = 0; i < h; i += 8) {
            const __m256 a = _mm256_fmadd_ps(kvq_lookup(kvq_codes8(row, i, bits), lo, hi, bits), _mm256_loadu_ps(range + i),
                                             _mm256_loadu_ps(zero + i));
            const __m256 b = _mm256_fmadd_ps(kvq_lookup(kvq_codes8(row, i + h, bits), lo, hi, bits),
                                             _mm256_loadu_ps(range + i + h), _mm256_loadu_ps(zero + i + h));
            const __m256 c = _mm256_loadu_ps(C + i), s = _mm256_loadu_ps(S + i);
            const __m256 ya = _mm256_fnmadd_ps(b, s, _mm256_mul_ps(a, c)), yb = _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c));
            for (int j = 0; j < GH; j++) {
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), ya, acc[j]);
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i + h), yb, acc[j]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < GH; j++) _mm256_storeu_ps(lanes[j][t], acc[j]), fix[j][t] = 0.0f;
        const int n = kvq_min(kl->k_counts[slots[t]], capacity - off);
        for (int k = 0; k < n; k++) {
            const int ch = k_index[off + k];
            if (ch >= d) continue;
            const float dense = fmaf(book[kvq_code_at(row, ch, bits)], range[ch], zero[ch]);
            const float delta = f16_to_f32(k_out[off + k]) - dense;
            const int i = ch % h;
            const float da = ch < h ? delta * C[i] : -delta * S[i], db = ch < h ? delta * S[i] : delta * C[i];
            for (int j = 0; j < GH; j++) fix[j][t] += q[j * d + i] * da + q[j * d + i + h] * db;
        }
        off += n > 0 ? n : 0;
    }
    kvq_reduce_scores(lanes, fix, t0, len, scale, scores, GH);
}

/* The fast path's weighted values over t0 <= t < len, added to out [GH, d]: NV vectors of channels a pass
 * over the chunk, the GH x NV sums in registers; the rows' outliers as corrections after. */
static inline __attribute__((always_inline)) void kvq_fast_values(const kvquant_layer *kl, const size_t *slots, int t0,
                                                                 int len, int d, __m256 lo, __m256 hi, const float *w_scaled,
                                                                 float *out, const int bits, const int GH, const int NV) {
    const int rb = d * bits / 8;
    for (int i0 = 0; i0 < d; i0 += 8 * NV) {
        __m256 acc[4][4];
        for (int j = 0; j < GH; j++)
            for (int u = 0; u < NV; u++) acc[j][u] = _mm256_setzero_ps();
        for (int t = t0; t < len; t++) {
            const uint8_t *row = kl->v_codes + slots[t] * rb;
            __m256 w[4];
            for (int j = 0; j < GH; j++) w[j] = _mm256_broadcast_ss(w_scaled + (size_t)j * CHUNK + t);
            for (int u = 0; u < NV; u++) {
                const __m256 x = kvq_lookup(kvq_codes8(row, i0 + 8 * u, bits), lo, hi, bits);
                for (int j = 0; j < GH; j++) acc[j][u] = _mm256_fmadd_ps(w[j], x, acc[j][u]);
            }
        }
        for (int j = 0; j < GH; j++)
            for (int u = 0; u < NV; u++) {
                float *o = out + (size_t)j * d + i0 + 8 * u;
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[j][u]));
            }
    }
}

#define KVQ_FAST_VALUES(kl, slots, t0, len, d, lo, hi, w, out, bits, GH)              \
    do {                                                                            \
        if (GH <= 2 && d % 32 == 0)                                                 \
            kvq_fast_values(kl, slots, t0, len, d, lo, hi, w, out, bits, GH, 4);    \
        else                                                                        \
            kvq_fast_values(kl, slots, t0, len, d, lo, hi, w, out, bits, GH, 2);    \
    } while (0)

#include "kvquant_nibbles.h" /* the 4-bit fast path: it uses the helpers above */

/* One attention unit (row, KV head, chunk) of a KVQuant layer: each query head's softmax partials, as
 * attend_chunk leaves them for combine_heads. `bits` is fixed per instance, so the lookups are constant.
 * The fast path (kvq_fast_keys, kvq_fast_values; kvquant_nibbles.h's for kvquant4 at 64-channel heads)
 * takes every row past the sinks where the tables are
 * half style and a KV head serves at most 4 query heads; the rest go through the plain loops: the row
 * decoded into memory, its outliers put in place, rotated with its position's table row. */
static inline __attribute__((always_inline)) void kvq_attend_chunk(const llama_model *m, const llama_layer *l,
                                                                  const kvquant_layer *kl, const paged_view *v,
                                                                  int unit, const float *qkv, int width, scratch *s,
                                                                  const int bits) {
    const kvquant_cache *kc = m->kvq;
    const int d = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, bs = v->block_size, L = s->layout;
    const int r = s->unit_row[L][unit], pos = v->positions[r], chunks = pos / CHUNK + 1;
    const int local = unit - s->unit_first[L][r], kvh = local / chunks, start = local % chunks * CHUNK;
    const int len = kvq_min(start + CHUNK, pos + 1) - start, seat = kc->row_seats[r], sinks = kc->sinks;
    const int rb = d * bits / 8, nv = kc->v_outliers;
    const int t0 = sinks > start ? kvq_min(sinks - start, len) : 0; /* the chunk's sink rows come first */
    const int fast = kc->rope_halves && group <= 4, plain_end = fast ? t0 : len;
    const int32_t *table = v->tables + (size_t)r * v->max_blocks;
    size_t slots[CHUNK];
    float vs[CHUNK], vz[CHUNK];
    for (int p = start + t0; p < start + len;) { /* block by block: a division per token cost more than its key */
        const size_t base = ((size_t)table[p / bs] * hkv + kvh) * bs;
        const int offset = p % bs, run = kvq_min(bs - offset, start + len - p);
        for (int u = 0; u < run; u++) slots[p - start + u] = base + offset + u;
        for (int u = 0; u < run; u += 64) { /* the run's counts and value outliers: asked for now, read in the loops */
            _mm_prefetch((const char *)(kl->k_counts + base + offset + u), _MM_HINT_T0);
            _mm_prefetch((const char *)(kl->v_outlier_index + (base + offset + u) * nv), _MM_HINT_T0);
            for (int b = 0; b < 2 * nv; b++) _mm_prefetch((const char *)(kl->v_outliers + (base + offset + u) * nv) + 64 * b, _MM_HINT_T0);
        }
        int u = 0; /* the run's value scales and zeros, eight at a time */
        for (; u + 8 <= run; u += 8) {
            _mm256_storeu_ps(vs + p - start + u, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kl->v_scale + base + offset + u))));
            _mm256_storeu_ps(vz + p - start + u, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kl->v_zero + base + offset + u))));
        }
        for (; u < run; u++)
            vs[p - start + u] = f16_to_f32(kl->v_scale[base + offset + u]), vz[p - start + u] = f16_to_f32(kl->v_zero[base + offset + u]);
        p += run;
    }
    float zero[d], range[d], kr[d], rot[d], k_book[16], v_book[16];
    for (int c = 0; c < d; c++)
        zero[c] = f16_to_f32(kl->k_zero[(size_t)kvh * d + c]), range[c] = f16_to_f32(kl->k_range[(size_t)kvh * d + c]);
    for (int j = 0; j < 1 << bits; j++) k_book[j] = f16_to_f32(kl->k_codebook[j]), v_book[j] = f16_to_f32(kl->v_codebook[j]);
    __m256 k_lo, k_hi, v_lo, v_hi;
    kvq_codebook(kl->k_codebook, bits, &k_lo, &k_hi);
    kvq_codebook(kl->v_codebook, bits, &v_lo, &v_hi);
    const float scale = m->query_scale > 0.0f ? m->query_scale : 1.0f / sqrtf((float)d);
    const float *q = qkv + (size_t)r * width + (size_t)kvh * group * d;
    const size_t at = (size_t)unit * group;
    float *scores = s->scores + at * CHUNK, *out = s->part_out + at * d;
    const size_t pool = ((size_t)seat * hkv + kvh) * kc->capacity;
    const uint16_t *k_out = kl->k_outliers + pool;
    const uint8_t *k_index = kl->k_outlier_index + pool;
    int off = s->kvq_off[unit];
    for (int t = 0; t < plain_end; t++) { /* scores, plain */
        const int p = start + t;
        if (p < sinks) {
            const uint16_t *row = kl->k_sink + (((size_t)seat * hkv + kvh) * sinks + p) * d;
            for (int c = 0; c < d; c += 8) _mm256_storeu_ps(kr + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + c))));
        } else {
            const uint8_t *row = kl->k_codes + slots[t] * rb;
            for (int c = 0; c < d; c += 8) {
                const __m256 x = kvq_lookup(kvq_codes8(row, c, bits), k_lo, k_hi, bits);
                _mm256_storeu_ps(kr + c, _mm256_fmadd_ps(x, _mm256_loadu_ps(range + c), _mm256_loadu_ps(zero + c)));
            }
            const int n = kvq_min(kl->k_counts[slots[t]], kc->capacity - off); /* a corrupt count stays in the pool */
            for (int i = 0; i < n; i++)
                if (k_index[off + i] < d) kr[k_index[off + i]] = f16_to_f32(k_out[off + i]);
            off += n > 0 ? n : 0;
        }
        kvq_rotate(kr, l->rope_cos + (size_t)p * d, l->rope_sin + (size_t)p * d, d, m->rope_interleaved, rot);
        for (int j = 0; j < group; j++) {
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < d; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)j * d + c), _mm256_loadu_ps(rot + c), acc);
            scores[(size_t)j * CHUNK + t] = hsum(acc) * scale;
        }
    }
    const int nib = fast && bits == 4 && d == 64; /* kvquant_nibbles.h: SmolLM2's and most small models' heads */
    uint8_t perm[128], inv[128];
    kvq_nib_book k_nib, v_nib;
    memset(&k_nib, 0, sizeof k_nib), memset(&v_nib, 0, sizeof v_nib); /* read only where nib */
    if (nib) {
        kvq_nib_order(d, perm, inv);
        k_nib = kvq_nib_book_of(kl->k_codebook), v_nib = kvq_nib_book_of(kl->v_codebook);
        float q_nib[group * d], range_nib[d], zero_nib[d];
        for (int j = 0; j < group; j++) kvq_nib_permute(q + (size_t)j * d, d, perm, q_nib + (size_t)j * d);
        kvq_nib_permute(range, d, perm, range_nib), kvq_nib_permute(zero, d, perm, zero_nib);
        FOR_HEAD_PACK(group, kvq_nib_keys, kl, l->rope_cos, l->rope_sin, slots, start, t0, len, 64, perm, inv,
                      range_nib, zero_nib, range, zero, k_book, &k_nib, q_nib, q, scale, kc->capacity, k_out, k_index,
                      off, scores)
    } else if (fast)
        FOR_HEAD_PACK(group, kvq_fast_keys, kl, l->rope_cos, l->rope_sin, slots, start, t0, len, d, range, zero, k_book,
                      k_lo, k_hi, q, scale, kc->capacity, k_out, k_index, off, scores, bits)
    for (int j = 0; j < group; j++) { /* softmax partials, as attend_heads leaves them */
        float *sh = scores + (size_t)j * CHUNK, total = 0.0f;
        int t = 0;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= len; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sh + t));
        float top = hmax(top8);
        for (; t < len; t++) top = sh[t] > top ? sh[t] : top; /* not fmaxf: a libm call per score */
        t = 0;
        __m256 sum = _mm256_setzero_ps();
        for (; t + 8 <= len; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), _mm256_set1_ps(top)));
            _mm256_storeu_ps(sh + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        total = hsum(sum);
        for (; t < len; t++) total += sh[t] = expf(sh[t] - top);
        s->part_max[at + j] = top, s->part_sum[at + j] = total;
    }
    memset(out, 0, (size_t)group * d * sizeof(float));
    for (int t = 0; t < plain_end; t++) { /* the weighted values, plain */
        const int p = start + t;
        if (p < sinks) {
            const uint16_t *row = kl->v_sink + (((size_t)seat * hkv + kvh) * sinks + p) * d;
            for (int c = 0; c < d; c += 8) _mm256_storeu_ps(kr + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + c))));
        } else {
            const size_t slot = slots[t];
            const uint8_t *row = kl->v_codes + slot * rb;
            const __m256 sc = _mm256_set1_ps(vs[t]), z = _mm256_set1_ps(vz[t]);
            for (int c = 0; c < d; c += 8)
                _mm256_storeu_ps(kr + c, _mm256_fmadd_ps(kvq_lookup(kvq_codes8(row, c, bits), v_lo, v_hi, bits), sc, z));
            for (int i = 0; i < nv; i++)
                if (kl->v_outlier_index[slot * nv + i] < d) kr[kl->v_outlier_index[slot * nv + i]] = f16_to_f32(kl->v_outliers[slot * nv + i]);
        }
        for (int j = 0; j < group; j++) {
            const __m256 w = _mm256_set1_ps(scores[(size_t)j * CHUNK + t]);
            float *o = out + (size_t)j * d;
            for (int c = 0; c < d; c += 8)
                _mm256_storeu_ps(o + c, _mm256_fmadd_ps(w, _mm256_loadu_ps(kr + c), _mm256_loadu_ps(o + c)));
        }
    }
    if (fast) { /* the rows' scales folded into the weights, their zeros added once: sum_t w_t z_t */
        float w[group * CHUNK];
        for (int j = 0; j < group; j++) {
            const float *sh = scores + (size_t)j * CHUNK;
            float *wj = w + (size_t)j * CHUNK, zsum = 0.0f;
            for (int t = t0; t < len; t++) wj[t] = sh[t] * vs[t], zsum += sh[t] * vz[t];
            for (int c = 0; c < d; c++) out[(size_t)j * d + c] += zsum;
        }
        if (nib)
            FOR_HEAD_PACK(group, kvq_nib_values, kl, slots, t0, len, 64, &v_nib, w, out)
        else
            FOR_HEAD_PACK(group, KVQ_FAST_VALUES, kl, slots, t0, len, d, v_lo, v_hi, w, out, bits)
        for (int t = t0; t < len; t++) { /* each row's outliers: value - dense value, weighted */
            const size_t slot = slots[t];
            const uint8_t *row = kl->v_codes + slot * rb;
            for (int i = 0; i < nv; i++) {
                const int ch = kl->v_outlier_index[slot * nv + i];
                if (ch >= d) continue;
                const float delta = f16_to_f32(kl->v_outliers[slot * nv + i]) - fmaf(v_book[kvq_code_at(row, ch, bits)], vs[t], vz[t]);
                for (int j = 0; j < group; j++) out[(size_t)j * d + ch] += scores[(size_t)j * CHUNK + t] * delta;
            }
        }
    }
}

static void kvq_attend_unit(const llama_model *m, const llama_layer *l, const kvquant_layer *kl, const paged_view *v,
                            int unit, const float *qkv, int width, scratch *s) {
    if (m->kvq->bits == 3)
        kvq_attend_chunk(m, l, kl, v, unit, qkv, width, s, 3);
    else
        kvq_attend_chunk(m, l, kl, v, unit, qkv, width, s, 4);
}

/* A KVQuant layer's attention for every row: s->att [rows, n_heads head_dim] receives the heads' outputs. */
static void kvq_attend_layer(const llama_model *m, const llama_layer *l, const paged_view *v, const float *x,
                             scratch *s) {
    const int rows = v->rows, d = m->head_dim, hq = m->n_heads, hkv = m->n_kv_heads;
    const int width = (hq + 2 * hkv) * d;
    const kvquant_layer *kl = &m->kvq->layers[l - m->layers];
    norm_quantize(x, l->attn_norm, rows, m->dim, m->eps, s->normed, s);
    stack_gemm(&l->qkv, rows, s, s->qkv, width);
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) /* RoPE on the queries only: the pool keeps keys before it */
        norm_rotate_heads(m, l, s->qkv + (size_t)r * width, v->positions[r], hq);
#pragma omp for schedule(dynamic, 1)
    for (int h = 0; h < hkv; h++) kvq_store_head(m, kl, v, s, h, width, s->qkv);
    const int units = s->unit_first[s->layout][rows];
#pragma omp for schedule(dynamic, 1)
    for (int unit = 0; unit < units; unit++) kvq_attend_unit(m, l, kl, v, unit, s->qkv, width, s);
#pragma omp for schedule(static)
    for (int rh = 0; rh < rows * hq; rh++) combine_heads(m, v, rh / hq, rh % hq, s, s->att + (size_t)rh * d);
}

/* A KVQuant model's descriptor and the step's rows, checked before any step: 0, -2 (a seat or position
 * outside the pool) or -4 (a descriptor the step cannot run). */
static int kvq_check_step(const llama_model *m, int rows, const int32_t *positions) {
    const kvquant_cache *kc = m->kvq;
    if (!kc || (kc->bits != 3 && kc->bits != 4) || m->head_dim % 8 || m->head_dim > 255 || kc->outlier_percent < 0 ||
        kc->sinks < 0 || kc->v_outliers < 0 || kc->v_outliers >= m->head_dim || kc->capacity < 0 || !kc->row_seats ||
        !kc->layers || m->kv_lora_rank)
        return -4;
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].window || m->layers[i].attention != ATTN_GQA) return -4;
    for (int r = 0; r < rows; r++)
        if (kc->row_seats[r] < 0 || kc->row_seats[r] >= kc->seats || positions[r] >= kc->max_tokens) return -2;
    return 0;
}

#endif
