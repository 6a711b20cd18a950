/* KVQuant rows written by the C step (kvquant.h): each row's keys and values as kvlab.cache.kvquant_pool
 * writes them; kvquant_attend.h reads them.
 *
 * A key row is codebook indices of (x - zero_c) / range_c clipped to [-1, 1], and the
 * values outside that range go to the seat's outlier pool in row order (kvlab.cache.kvquant's
 * take_outliers: row i may fill the pool up to outlier_capacity(i + 1) slots, furthest out first);
 * a value row is codebook indices over its own min-max range with its largest |values| beside
 * it. Each row's outliers depend on how many slots the rows before it took, so a sequence's rows
 * are written in position order: one thread per KV head walks the step's rows, each run of rows of
 * one seat (a prompt's rows at consecutive positions) starting from the sum of the counts its
 * blocks already hold. The same walk notes where each CHUNK of positions starts in the pool (the
 * counts before it), which attention needs to find a row's outliers. Everything is fp32 arithmetic
 * in torch's order (division, not a reciprocal; nearest centroid as bucketize), so the bytes are
 * the module path's: tests hold the two byte for byte.
 */
#ifndef KVLAB_KVQUANT_WRITE_H
#define KVLAB_KVQUANT_WRITE_H

#include "kvquant.h"

static inline int kvq_min(int a, int b) { return a < b ? a : b; }

/* The index of u's nearest centroid, as torch.bucketize(u, middles) (right=False): how many of the
 * midpoints between consecutive centroids lie below u. */
static inline int kvq_nearest(float u, const float *middles, int n) {
    int code = 0;
    for (int j = 0; j < n; j++) code += middles[j] < u;
    return code;
}

static void kvq_middles(const uint16_t *book, int bits, float *middles) {
    for (int j = 0; j + 1 < 1 << bits; j++) middles[j] = (f16_to_f32(book[j + 1]) + f16_to_f32(book[j])) / 2.0f;
}

/* d codes (d a multiple of 8) packed as kvlab.cache.bitpack.pack_bits packs them. */
static void kvq_pack(const uint8_t *codes, int d, int bits, uint8_t *out) {
    for (int g = 0; g < d; g += 8) {
        uint32_t word = 0;
        for (int j = 0; j < 8; j++) word |= (uint32_t)codes[g + j] << (bits * j);
        for (int k = 0; k < bits; k++) out[g / 8 * bits + k] = (uint8_t)(word >> (8 * k));
    }
}

/* Sum of head h's outlier counts at positions a .. b - 1 of a sequence's blocks `table`. */
static int kvq_counted(const kvquant_layer *kl, const int32_t *table, int hkv, int h, int bs, int a, int b) {
    int sum = 0;
    for (int p = a; p < b;) {
        const uint8_t *block = kl->k_counts + ((size_t)table[p / bs] * hkv + h) * bs;
        const int o = p % bs, end = kvq_min(bs, o + b - p);
        for (int i = o; i < end; i++) sum += block[i];
        p += end - o;
    }
    return sum;
}

/* Key row `row` (counting from the first after the sinks) of head h into `slot`, its outliers into the
 * seat's pool after the `used` slots earlier rows took: returns how many it took. */
static int kvq_store_key(const kvquant_cache *kc, const kvquant_layer *kl, int d, int hkv, int h, int seat,
                         size_t slot, int row, int used, const float *x) {
    float xn[d], middles[15];
    uint8_t codes[d];
    const uint16_t *zero = kl->k_zero + (size_t)h * d, *range = kl->k_range + (size_t)h * d;
    int wanted = 0;
    for (int c = 0; c < d; c++) {
        xn[c] = (x[c] - f16_to_f32(zero[c])) / f16_to_f32(range[c]);
        wanted += fabsf(xn[c]) > 1.0f;
    }
    const int room = (int)((long)(row + 1) * d * kc->outlier_percent / 100) - used; /* outlier_capacity(row + 1) */
    const int allowed = wanted < room ? wanted : room;
    uint16_t *values = kl->k_outliers + ((size_t)seat * hkv + h) * kc->capacity + used;
    uint8_t *index = kl->k_outlier_index + ((size_t)seat * hkv + h) * kc->capacity + used;
    int taken = 0;
    for (int c = 0; c < d && allowed > 0; c++) { /* the `allowed` furthest out, ties to the lower channel; stored in channel order */
        const float a = fabsf(xn[c]);
        if (a <= 1.0f) continue;
        int rank = 0;
        for (int o = 0; o < d; o++) {
            const float b = fabsf(xn[o]);
            rank += b > 1.0f && (b > a || (b == a && o < c));
        }
        if (rank < allowed) values[taken] = f32_to_f16(x[c]), index[taken] = (uint8_t)c, taken++;
    }
    kvq_middles(kl->k_codebook, kc->bits, middles);
    for (int c = 0; c < d; c++)
        codes[c] = (uint8_t)kvq_nearest(fminf(fmaxf(xn[c], -1.0f), 1.0f), middles, (1 << kc->bits) - 1);
    kvq_pack(codes, d, kc->bits, kl->k_codes + slot * (size_t)(d * kc->bits / 8));
    kl->k_counts[slot] = (uint8_t)taken;
    return taken;
}

/* Value row y into `slot`: its v_outliers largest |values| (first the largest, ties to the lower channel)
 * kept in fp16, the rest as codes over their min-max range (kvlab.cache.kvquant.KVQuantValueCodec.encode). */
static void kvq_store_value(const kvquant_cache *kc, const kvquant_layer *kl, int d, size_t slot, const float *y) {
    const int n = kc->v_outliers;
    uint8_t taken[d], codes[d];
    float middles[15];
    for (int c = 0; c < d; c++) taken[c] = 0;
    for (int k = 0; k < n; k++) {
        int best = -1;
        for (int c = 0; c < d; c++)
            if (!taken[c] && (best < 0 || fabsf(y[c]) > fabsf(y[best]))) best = c;
        taken[best] = 1;
        kl->v_outliers[slot * n + k] = f32_to_f16(y[best]);
        kl->v_outlier_index[slot * n + k] = (uint8_t)best;
    }
    float lo = INFINITY, hi = -INFINITY;
    for (int c = 0; c < d; c++)
        if (!taken[c]) lo = fminf(lo, y[c]), hi = fmaxf(hi, y[c]);
    kl->v_zero[slot] = f32_to_f16(lo);
    kl->v_scale[slot] = f32_to_f16(hi - lo);
    const float z = f16_to_f32(kl->v_zero[slot]), s = f16_to_f32(kl->v_scale[slot]), step = s == 0.0f ? 1.0f : s;
    kvq_middles(kl->v_codebook, kc->bits, middles);
    for (int c = 0; c < d; c++)
        codes[c] = (uint8_t)kvq_nearest(fminf(fmaxf((y[c] - z) / step, 0.0f), 1.0f), middles, (1 << kc->bits) - 1);
    kvq_pack(codes, d, kc->bits, kl->v_codes + slot * (size_t)(d * kc->bits / 8));
}

/* Every row's K and V of KV head h into the pool (pre-RoPE keys, as qkv holds them), in row order; and
 * each attention unit's start in the seat's outlier pool (s->kvq_off). */
static void kvq_store_head(const llama_model *m, const kvquant_layer *kl, const paged_view *v, scratch *s, int h,
                           int width, const float *qkv) {
    const kvquant_cache *kc = m->kvq;
    const int rows = v->rows, d = m->head_dim, hq = m->n_heads, hkv = m->n_kv_heads, bs = v->block_size;
    const int L = s->layout, sinks = kc->sinks;
    for (int r = 0; r < rows;) {
        const int seat = kc->row_seats[r], p0 = v->positions[r];
        int e = r + 1; /* the run: this seat's rows at consecutive positions */
        while (e < rows && kc->row_seats[e] == seat && v->positions[e] == v->positions[e - 1] + 1) e++;
        const int32_t *table = v->tables + (size_t)r * v->max_blocks;
        int off[v->positions[e - 1] / CHUNK + 1]; /* the counts before each chunk's first position */
        int used = 0, counted = sinks;
        for (int c = 0; c * CHUNK < p0; c++) {
            if (c * CHUNK > counted) used += kvq_counted(kl, table, hkv, h, bs, counted, c * CHUNK), counted = c * CHUNK;
            off[c] = used;
        }
        if (p0 > counted) used += kvq_counted(kl, table, hkv, h, bs, counted, p0);
        for (int j = r; j < e; j++) {
            const int p = v->positions[j];
            const float *k = qkv + (size_t)j * width + (size_t)(hq + h) * d, *val = k + (size_t)hkv * d;
            if (p % CHUNK == 0) off[p / CHUNK] = used;
            if (p < sinks) {
                const size_t at = (((size_t)seat * hkv + h) * sinks + p) * d;
                for (int c = 0; c < d; c++) kl->k_sink[at + c] = f32_to_f16(k[c]), kl->v_sink[at + c] = f32_to_f16(val[c]);
                continue;
            }
            const int32_t *tj = v->tables + (size_t)j * v->max_blocks;
            const size_t slot = ((size_t)tj[p / bs] * hkv + h) * bs + p % bs;
            used += kvq_store_key(kc, kl, d, hkv, h, seat, slot, p - sinks, used, k);
            kvq_store_value(kc, kl, d, slot, val);
        }
        for (int j = r; j < e; j++) {
            const int chunks = v->positions[j] / CHUNK + 1, first = s->unit_first[L][j] + h * chunks;
            for (int c = 0; c < chunks; c++) s->kvq_off[first + c] = off[c];
        }
        r = e;
    }
}

/* Test hook: rows [rows, 2 kv_heads head_dim] (each row's K heads, then its V heads) stored into layer
 * `layer` of a KVQuant pool at positions [rows] with block tables [rows, max_blocks] and the seats in
 * kc->row_seats, as a step stores them: tests hold the bytes to KVQuantPlanes.store's. 0, or -1/-2. */
int kvlab_kvquant_store(const kvquant_cache *kc, int layer, int kv_heads, int head_dim, int rows, const float *kv,
                        const int32_t *positions, const int32_t *tables, int max_blocks, int block_size) {
    llama_model m;
    memset(&m, 0, sizeof m);
    m.n_kv_heads = kv_heads, m.head_dim = head_dim, m.kvq = kc, m.cache_dtype = CACHE_KVQUANT;
    for (int r = 0; r < rows; r++)
        if (kc->row_seats[r] < 0 || kc->row_seats[r] >= kc->seats || positions[r] < 0 ||
            positions[r] >= kc->max_tokens || positions[r] / block_size >= max_blocks)
            return -2;
    scratch s;
    memset(&s, 0, sizeof s);
    int *first = malloc(sizeof(int) * (size_t)(rows + 1)), units = 0;
    for (int r = 0; r < rows; r++) units += kv_heads * (positions[r] / CHUNK + 1);
    int *off = malloc(sizeof(int) * (size_t)(units + 1));
    if (!first || !off) return free(first), free(off), -1;
    first[0] = 0;
    for (int r = 0; r < rows; r++) first[r + 1] = first[r] + kv_heads * (positions[r] / CHUNK + 1);
    s.unit_first[0] = first, s.kvq_off = off;
    const paged_view view = {rows, max_blocks, block_size, positions, tables, tables};
    for (int h = 0; h < kv_heads; h++) kvq_store_head(&m, &kc->layers[layer], &view, &s, h, 2 * kv_heads * head_dim, kv);
    free(first), free(off);
    return 0;
}

#endif
