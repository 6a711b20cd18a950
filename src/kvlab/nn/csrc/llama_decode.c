/* One decode step of a Llama-family decoder whose matrices are planes of GGUF blocks (ggml_gemv.h),
 * for rows that each sit at their own position in a paged KV cache.
 *
 * At batch 1 a step is ~120 small matrix-vector products; driven from Python each one pays
 * for module calls, tensor allocations and a thread fork, which on a small model costs more
 * than the arithmetic. Here the whole step (norms, projections, RoPE, the cache write,
 * attention, SwiGLU, the LM head) for every row and layer runs inside one OpenMP parallel
 * region: the threads split each product's output rows and meet at a barrier, as
 * llama.cpp's graph executor does.
 *
 * The arithmetic is the module path's (kvlab.nn.model.Decoder with GGMLLinear layers):
 * activations are quantised to int16 per 32 values before each product, norms, RoPE,
 * softmax and SwiGLU run in fp32. K/V live where the caller's cache keeps them: per layer a
 * tensor [blocks, kv_heads, block_size, head_dim] (kvlab.cache.KVPool's layout), row r's
 * token at position p in block block_tables[r][p / block_size], offset p % block_size. A
 * contiguous cache [batch, kv_heads, capacity, head_dim] is the case of one block of
 * `capacity` tokens per row (kvlab.cache.PooledRows). Stores and loads of each cache format are
 * kv_codecs.h's, so fp8 and int8/int4/int2 caches are dequantised inside the attention loop
 * and read half of fp16's bytes or less (int4 in groups of 64: 0.28 of it, int2 0.16); with
 * AVX-512 VNNI, int8 heads that attend_int8.h takes run on integer
 * dot products instead (chunk_rows.integer), and fp8 heads that attend_fp8.h takes on sixteen
 * fp32 lanes converted through byte tables (chunk_rows.tables).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attend_fp8.h"
#include "attend_int8.h"
#include "kv_codecs.h"
#include "x8_layout.h"

int kvlab_x8_isa(void); /* ggml_gemm_x8.c: whether AVX-512 VNNI is in use */

/* Where this step's rows are: positions [rows], block_tables [n_groups, rows, max_blocks] (one
 * table per KV group and row); `tables` is the group of the layer being run. */
typedef struct {
    int rows, max_blocks, block_size;
    const int32_t *positions, *block_tables, *tables;
} paged_view;

/* The step's scratch, carved out of the arena: activations, then attention's per-unit work. */
typedef struct {
    float *normed, *qkv, *att, *gate_up, *act;
    float *scores, *part_max, *part_sum, *part_out; /* attention's per-chunk work (attend_chunk) */
    float *sub; /* [rows, dim]: a sub-block's output before its post-norm (Gemma) */
    float *lat, *mq; /* MLA (mla_attend.h): each head's attended latent [rows, heads, rank], absorbed queries */
    float *mla_rows; /* MLA: per thread, MLA_SUB cached rows widened to fp32 */
    int *kvq_off;    /* KVQuant: each attention unit's first slot in its seat's key outliers (kvquant_attend.h) */
    qacts qa; /* the activations of the next product, quantised */
    /* Per attention window (and its sinks) of the model (MAX_LAYOUTS at most, full attention being window 0):
     * row r's units are unit_first[L][r] .. unit_first[L][r + 1] - 1, unit_row[L][u] their row. */
    int layouts, layout_window[MAX_LAYOUTS], layout_sinks[MAX_LAYOUTS];
    int *unit_first[MAX_LAYOUTS], *unit_row[MAX_LAYOUTS];
    int *unit_table; /* where both live: MAX_LAYOUTS x (rows + 1) firsts, then every layout's rows */
    int layout;      /* the layer being run's */
} scratch;

#define PREFETCH 16      /* tokens ahead that attention asks memory for */
#define SWIGLU_PIECE 256 /* channels of one row per share of the SwiGLU loop (a multiple of QK) */

/* The first position a query at `pos` sees in a layer of `window` (0: full attention), and the
 * CHUNK-aligned chunks its attention spans from there. */
static inline int first_seen(int pos, int window) { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }

static inline int chunks_at(int pos, int window) { return pos / CHUNK - first_seen(pos, window) / CHUNK + 1; }

/* The sink positions a query at `pos` sees besides its window (0 .. sink_end - 1: those the window has
 * left behind), and the chunks they take: the window's chunks come after them. */
static inline int sink_end(int pos, int window, int sinks) {
    const int first = first_seen(pos, window);
    return sinks < first ? sinks : first;
}

static inline int sink_chunks(int pos, int window, int sinks) { return (sink_end(pos, window, sinks) + CHUNK - 1) / CHUNK; }

/* A row's attention chunks in a layout: its sinks' and its window's. */
static inline int layout_chunks(const scratch *s, int L, int pos) {
    return sink_chunks(pos, s->layout_window[L], s->layout_sinks[L]) + chunks_at(pos, s->layout_window[L]);
}

/* y = x / rms(x) * w over n values (w NULL: no weight), in place when y == x. */
static void rms_norm(const float *x, const float *w, int n, float eps, float *y) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

/* x [rows, dim] -> rms-normalised, scaled by w, then quantised for the next product. Called by
 * every thread of the step's parallel region: each row is normalised and quantised by one
 * thread, so the pair costs one barrier, not two. */
static void norm_quantize(const float *x, const float *w, int rows, int dim, float eps, float *out, scratch *s) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        rms_norm(x + (size_t)r * dim, w, dim, eps, out + (size_t)r * dim);
        quantize_blocks(out, (long)r * (dim / QK), (long)(r + 1) * (dim / QK), &s->qa);
    }
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

/* e^x for eight lanes, x <= 0 here (scores minus their maximum): x = n ln2 + r with |r| <= ln2/2,
 * e^r by its degree-6 Taylor-like polynomial (Cephes' coefficients), 2^n built in the exponent
 * bits. About 1e-7 relative error, as expf; scalar expf per score cost more than the dot products. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f)); /* below, e^x is 0 to fp32's normal range anyway */
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts, for precision */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p;
    EXP_REDUCED(p, r, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_set1_ps);
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* a = silu(gate) up = gate / (1 + e^-gate) up, eight lanes at a time: e^-|gate| by exp8 (so
 * its argument is <= 0), then sigmoid = 1 / (1 + e) for gate >= 0 and e / (1 + e) below.
 * Scalar expf per channel took several milliseconds of a 16-row SmolLM2 step. */
static void swiglu(const float *gate, const float *up, float *a, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_or_ps(g, sign)); /* e^-|g| */
        const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g); /* blend on g's sign bit */
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* a = gelu_tanh(gate) up = gate / 2 (1 + tanh(u)) up with u = sqrt(2 / pi) (gate + 0.044715 gate^3),
 * PyTorch's gelu(approximate="tanh"): tanh(u) = sign(u) (1 - e) / (1 + e) with e = e^(-2|u|) by exp8. */
static void geglu(const float *gate, const float *up, float *a, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), cube = _mm256_set1_ps(0.044715f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 u = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(cube, g), _mm256_mul_ps(g, g), g));
        const __m256 e = exp8(_mm256_add_ps(_mm256_or_ps(u, sign), _mm256_or_ps(u, sign))); /* e^(-2|u|) */
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));   /* tanh(|u|) */
        const __m256 th = _mm256_or_ps(t, _mm256_and_ps(u, sign));                       /* sign(u) tanh(|u|) */
        const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, th));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        const float g = gate[i];
        a[i] = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * up[i];
    }
}

/* y = e^x for n values x <= 0, with exp8 (exported so tests can hold it to expf). */
void exp_nonpositive(const float *x, float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = expf(x[i]);
}


static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Four horizontal sums at once: [sum a, sum b, sum c, sum d]. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* What one attention unit reads, resolved once: the chunk's cache rows and, for the group formats, one
 * group's scale and zero per row widened to fp32 (refilled per group, used by every head). */
typedef struct {
    size_t slots[CHUNK]; /* row (block, head, offset) of each of the chunk's tokens */
    float k_scale[CHUNK], k_zero[CHUNK], v_scale[CHUNK], v_zero[CHUNK];
    int len, d, gsize, groups;
    int integer; /* int8 on integer dot products (attend_int8.h) */
    int packed;  /* int4/int2 read a word (8 bytes) at a time as planes, the query permuted to match (kv_codecs.h) */
    size_t at[CHUNK]; /* packed: where each row's codes start, in bytes (slots times the row's bytes) */
    int tables;  /* fp8 converted through byte tables on AVX-512 (attend_fp8.h) */
} chunk_rows;

static inline float half_at(const uint16_t *h, size_t i) { return f16_to_f32(h[i]); }

/* Whether the next 8 of n slots are one run of consecutive rows (inside one block, or blocks
 * that happen to be adjacent): checking the ends alone would miss a block in between. */
static inline int consecutive(const size_t *slots, int n) {
    if (n < 8) return 0;
    for (int u = 1; u < 8; u++)
        if (slots[u] != slots[0] + u) return 0;
    return 1;
}

/* Group g's scale and zero (int8/int4/int2) of every row of the chunk into c (K's and V's), zero-padded
 * to a multiple of 8 rows; with one group per row, runs of 8 rows in a block convert at once. */
static void load_group(const llama_layer *l, chunk_rows *c, int g) {
    const uint16_t *from[4] = {l->k.scale, l->k.zero, l->v.scale, l->v.zero};
    float *to[4] = {c->k_scale, c->k_zero, c->v_scale, c->v_zero};
    for (int t = 0; t < c->len;) {
        if (c->groups == 1 && consecutive(c->slots + t, c->len - t)) {
            for (int f = 0; f < 4; f++)
                _mm256_storeu_ps(to[f] + t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(from[f] + c->slots[t]))));
            t += 8;
        } else {
            for (int f = 0; f < 4; f++) to[f][t] = half_at(from[f], c->slots[t] * c->groups + g);
            t++;
        }
    }
    for (int t = c->len; t % 8; t++) c->k_scale[t] = c->k_zero[t] = c->v_scale[t] = c->v_zero[t] = 0.0f;
}

/* dots[h][t0 + u] = the lanes of acc[h * TB + u] summed, four accumulators at a time: the end of
 * every key-dot loop (GQA's key_dots, MLA's mla_key_dots). */
static inline __attribute__((always_inline)) void store_dots(const __m256 *acc, int t0, float *dots, const int GH,
                                                            const int TB) {
    float sums[16];
    int a = 0;
    for (; a + 4 <= GH * TB; a += 4) _mm_storeu_ps(sums + a, hsum4(acc[a], acc[a + 1], acc[a + 2], acc[a + 3]));
    for (; a < GH * TB; a++) sums[a] = hsum(acc[a]);
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < TB; u++) dots[h * CHUNK + t0 + u] = sums[h * TB + u];
}

/* dots[h][t] = q_h . k_t over channels lo .. hi - 1 (raw lanes) for GH query heads (q, stride d)
 * and TB keys from t0 on: each key's lanes are loaded and widened once for all GH heads, each
 * query load serves TB keys, the GH x TB accumulators stay in registers and are summed four
 * at a time. */
static inline __attribute__((always_inline)) void key_dots(const kv_plane *k, int dtype, const chunk_rows *c,
                                                          const float *q, int lo, int hi, int t0, float *dots,
                                                          const int GH, const int TB) {
    __m256 acc[12]; /* GH x TB <= 12; a fixed size, so the accumulators can live in registers */
    for (int a = 0; a < GH * TB; a++) acc[a] = _mm256_setzero_ps();
    if ((dtype == CACHE_INT4 || dtype == CACHE_INT2) && c->packed) { /* q in packed_order: plane p of a word meets q[i + 8 p ..] */
        const int P = 8 / cache_code_bits(dtype);
        for (int i = lo; i < hi; i += 8 * P) {
            __m256i word[4]; /* TB <= 4 words, each widened once for its P planes */
            for (int u = 0; u < TB; u++) word[u] = packed_word(k, dtype, c->at[t0 + u], i);
            for (int p = 0; p < P; p++) {
                __m256 x[4];
                for (int u = 0; u < TB; u++) x[u] = packed_plane(word[u], dtype, p);
                for (int h = 0; h < GH; h++) {
                    const __m256 qv = _mm256_loadu_ps(q + h * c->d + i + 8 * p);
                    for (int u = 0; u < TB; u++) acc[h * TB + u] = _mm256_fmadd_ps(qv, x[u], acc[h * TB + u]);
                }
            }
        }
    } else {
        for (int i = lo; i < hi; i += 8) {
            for (int u = 0; u < TB; u++) {
                const __m256 x = load8(k, dtype, c->slots[t0 + u], i, c->d);
                for (int h = 0; h < GH; h++)
                    acc[h * TB + u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * c->d + i), x, acc[h * TB + u]);
            }
        }
    }
    store_dots(acc, t0, dots, GH, TB);
}

/* out[h][i0 .. i0 + 8 NV) = (sum_t w[h][t] v_t (raw lanes) + offset[h]) factor over the chunk
 * for GH query heads (w stride CHUNK, out stride d): each value's lanes are widened once for
 * all GH heads, the GH x NV accumulators stay in registers across the chunk. */
static inline __attribute__((always_inline)) void value_sums(const kv_plane *v, int dtype, const chunk_rows *c,
                                                            const float *w, int i0, const float *offset,
                                                            float factor, float *out, const int GH, const int NV) {
    __m256 acc[4][8]; /* GH x NV: a fixed size, so the accumulators can live in registers */
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NV; u++) acc[h][u] = _mm256_setzero_ps();
    for (int t = 0; t < c->len; t++) {
        const size_t slot = c->slots[t];
        __m256 wt[4];
        for (int h = 0; h < GH; h++) wt[h] = _mm256_broadcast_ss(w + h * CHUNK + t);
        for (int u = 0; u < NV; u++) {
            const __m256 x = load8(v, dtype, slot, i0 + 8 * u, c->d);
            for (int h = 0; h < GH; h++) acc[h][u] = _mm256_fmadd_ps(wt[h], x, acc[h][u]);
        }
    }
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NV; u++)
            _mm256_storeu_ps(out + h * c->d + i0 + 8 * u,
                             _mm256_mul_ps(_mm256_add_ps(acc[h][u], _mm256_set1_ps(offset[h])),
                                           _mm256_set1_ps(factor)));
}

/* Group g's dot products of the chunk's keys, TB keys at a time: channels lo .. hi - 1 of the query
 * heads q into dots (stride CHUNK); the first group's pass also asks memory for the rows ahead.
 * Packed rows (PK: int4/int2, 36 B a token or less) ask for their scales and zeros every eighth
 * token only, one line holding eight tokens' at four groups a row: six prefetches a token were
 * about a tenth of int4's attention under perf. */
static inline __attribute__((always_inline)) void key_pass(const llama_layer *l, int dtype, const chunk_rows *c,
                                                          const float *q, int lo, int hi, int g, float *dots,
                                                          const int PK, const int GH, const int TB) {
    int t;
    for (t = 0; t + TB <= c->len; t += TB) {
        if (g == 0) /* this pass's keys PREFETCH rows ahead, and the same tokens' values for the pass after */
            for (int u = t + PREFETCH; u < t + PREFETCH + TB && u < c->len; u++) {
                if (PK) {
                    const size_t bytes = row_bytes(dtype, c->d), slot = c->slots[u];
                    for (size_t at = 0; at < bytes; at += 64) {
                        _mm_prefetch((const char *)l->k.data + slot * bytes + at, _MM_HINT_T0);
                        _mm_prefetch((const char *)l->v.data + slot * bytes + at, _MM_HINT_T0);
                    }
                    if (u % 8 == 0) {
                        const uint16_t *meta[4] = {l->k.scale, l->k.zero, l->v.scale, l->v.zero};
                        for (int f = 0; f < 4; f++) _mm_prefetch((const char *)(meta[f] + slot * c->groups), _MM_HINT_T0);
                    }
                    continue;
                }
                prefetch_row(&l->k, dtype, c->slots[u], c->d, c->groups);
                prefetch_row(&l->v, dtype, c->slots[u], c->d, c->groups);
            }
        key_dots(&l->k, dtype, c, q, lo, hi, t, dots, GH, TB);
    }
    for (; t < c->len; t++) key_dots(&l->k, dtype, c, q, lo, hi, t, dots, GH, 1);
}

/* value_sums for int4/int2 rows read as planes (c->packed): words i0, i0 + W, .. (NW of them, W
 * channels each), planes K0 .. K0 + NP - 1 of each, written back to out in channel order (a
 * word's plane p, lane j is channel P j + p). Whole words and planes fixed at compile time, so
 * each plane's shift and mask are constants. */
static inline __attribute__((always_inline)) void packed_value_sums(const kv_plane *v, int dtype, const chunk_rows *c,
                                                                   const float *w, int i0, const int NW, const int K0,
                                                                   const int NP, const float *offset, float factor,
                                                                   float *out, const int GH) {
    const int P = 8 / cache_code_bits(dtype), W = 8 * P;
    __m256 acc[4][8]; /* GH x NW NP <= 4 x 8 */
    for (int h = 0; h < GH; h++)
        for (int u = 0; u < NW * NP; u++) acc[h][u] = _mm256_setzero_ps();
    for (int t = 0; t < c->len; t++) {
        const size_t at = c->at[t];
        __m256 wt[4];
        for (int h = 0; h < GH; h++) wt[h] = _mm256_broadcast_ss(w + h * CHUNK + t);
        for (int n = 0; n < NW; n++) {
            const __m256i word = packed_word(v, dtype, at, i0 + n * W);
            for (int p = 0; p < NP; p++) {
                const __m256 x = packed_plane(word, dtype, K0 + p);
                for (int h = 0; h < GH; h++) acc[h][n * NP + p] = _mm256_fmadd_ps(wt[h], x, acc[h][n * NP + p]);
            }
        }
    }
    for (int h = 0; h < GH; h++)
        for (int n = 0; n < NW; n++)
            for (int p = 0; p < NP; p++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[h][n * NP + p]);
                float *to = out + h * c->d + i0 + n * W + K0 + p;
                for (int j = 0; j < 8; j++) to[j * P] = (lanes[j] + offset[h]) * factor;
            }
}

/* GH (1..4) query heads sharing one KV head over one chunk: scores, softmax partials, then the
 * weighted values (TB keys, NV value vectors a pass, so the accumulators fit AVX2's 16
 * registers). The group formats' scale and zero apply per group of channels to whole dot products and
 * weights, never per lane: q . k = sum_g scale_g (q_g . codes_g) + zero_g sum(q_g), and
 * sum_t p_t v_t = sum_t (p_t scale_t) codes_t + sum_t p_t zero_t, within each group. */
static inline __attribute__((always_inline)) void attend_heads(const llama_layer *l, int dtype, chunk_rows *c,
                                                              const float *q, float *scores, float k_factor,
                                                              float v_factor, float *part_max, float *part_sum,
                                                              float *out, const int GH) {
    const int packed = (dtype == CACHE_INT4 || dtype == CACHE_INT2) && c->packed;
    /* keys a pass: GH x TB accumulators and what they meet in AVX2's 16 registers (GH query vectors; packed
     * rows: TB words, TB planes, a mask) */
    const int TB = GH <= 3 ? 4 : 3, TBP = GH == 1 ? 4 : GH == 2 ? 3 : GH == 3 ? 3 : 2;
    const int NV = GH == 1 ? 8 : GH == 2 ? 4 : 2, d = c->d;
    const int grouped = cache_grouped(dtype), groups = grouped ? c->groups : 1, gsize = grouped ? c->gsize : d;
    float part[4 * CHUNK]; /* group formats: one group's dot products, or its weights */
    int t;
    if (dtype == CACHE_INT8 && c->integer) { /* one group: the whole row, in attend_int8_vnni.c */
        const int8_chunk rows = {l->k.data, l->v.data, c->slots, c->len, d, c->k_scale, c->k_zero, c->v_scale, c->v_zero};
        int8_attend_vnni(&rows, q, GH, k_factor, v_factor, part_max, part_sum, out);
        return;
    }
    if ((dtype == CACHE_FP8_E4M3 || dtype == CACHE_FP8_E5M2) && c->tables) { /* in attend_fp8_vbmi.c */
        const fp8_chunk rows = {l->k.data, l->v.data, c->slots, c->len, d, dtype == CACHE_FP8_E4M3};
        fp8_attend_vbmi(&rows, q, GH, k_factor, v_factor, part_max, part_sum, out);
        return;
    }
    for (int g = 0; g < groups; g++) {
        const int lo = g * gsize, hi = lo + gsize < d ? lo + gsize : d;
        float *dots = grouped ? part : scores;
        if (packed)
            key_pass(l, dtype, c, q, lo, hi, g, dots, 1, GH, TBP);
        else
            key_pass(l, dtype, c, q, lo, hi, g, dots, 0, GH, TB);
        if (!grouped) break;
        load_group(l, c, g);
        for (int h = 0; h < GH; h++) { /* scores (+)= scale_t dot + zero_t sum(q_g), 8 tokens at a time */
            float qsum = 0.0f;
            if (packed) { /* eight lanes at a time (a group is whole words): the scalar sum's latency was 5% of int4's attention */
                __m256 lanes = _mm256_setzero_ps();
                for (int i = lo; i < hi; i += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(q + h * d + i));
                qsum = hsum(lanes);
            } else { /* int8 keeps its summation order: its tests sit near an fp16 rounding of the next layer's scales */
                for (int i = lo; i < hi; i++) qsum += q[h * d + i];
            }
            const __m256 qs = _mm256_set1_ps(qsum);
            float *sh = scores + h * CHUNK, *ph = part + h * CHUNK;
            for (t = 0; t < c->len; t += 8) { /* the buffers run to a multiple of 8 (CHUNK): the tail is ignored */
                __m256 dot = _mm256_fmadd_ps(_mm256_loadu_ps(ph + t), _mm256_loadu_ps(c->k_scale + t),
                                             _mm256_mul_ps(_mm256_loadu_ps(c->k_zero + t), qs));
                if (g) dot = _mm256_add_ps(dot, _mm256_loadu_ps(sh + t));
                _mm256_storeu_ps(sh + t, dot);
            }
        }
    }
    const __m256 kf = _mm256_set1_ps(k_factor);
    for (int h = 0; h < GH; h++) { /* each head's softmax partials, exp'd in place */
        float *sh = scores + h * CHUNK;
        for (t = 0; t < c->len; t += 8) _mm256_storeu_ps(sh + t, _mm256_mul_ps(_mm256_loadu_ps(sh + t), kf));
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
        for (; t % 8; t++) sh[t] = 0.0f; /* pad the last vector for the group formats' passes below */
        part_max[h] = top, part_sum[h] = total;
    }
    float offset[4];
    for (int g = 0; g < groups; g++) {
        const int lo = g * gsize, hi = lo + gsize < d ? lo + gsize : d;
        const float *w = scores;
        for (int h = 0; h < GH; h++) offset[h] = 0.0f;
        if (grouped) { /* the weights' share of the zeros, then the scales folded into the weights */
            if (groups > 1) load_group(l, c, g); /* one group: still loaded from the key pass */
            for (int h = 0; h < GH; h++) {
                __m256 share = _mm256_setzero_ps();
                for (t = 0; t < c->len; t += 8) {
                    const __m256 p = _mm256_loadu_ps(scores + h * CHUNK + t);
                    share = _mm256_fmadd_ps(p, _mm256_loadu_ps(c->v_zero + t), share);
                    _mm256_storeu_ps(part + h * CHUNK + t, _mm256_mul_ps(p, _mm256_loadu_ps(c->v_scale + t)));
                }
                offset[h] = hsum(share);
            }
            w = part;
        }
        int i = lo;
        if (packed) {
            /* planes a pass: NV vectors of accumulators per head, two for three and four heads (AVX2's 16
             * registers also hold the weights, the word, a plane and the mask); whole words where they fit */
            const int P = 8 / cache_code_bits(dtype), W = 8 * P, V = GH == 1 ? 8 : GH == 2 ? 4 : 2;
            if (V >= P) {
                for (; i + (V / P) * W <= hi; i += (V / P) * W)
                    packed_value_sums(&l->v, dtype, c, w, i, V / P, 0, P, offset, v_factor, out, GH);
                for (; i < hi; i += W) packed_value_sums(&l->v, dtype, c, w, i, 1, 0, P, offset, v_factor, out, GH);
            } else {
                for (; i < hi; i += W)
                    for (int k0 = 0; k0 < P; k0 += V)
                        packed_value_sums(&l->v, dtype, c, w, i, 1, k0, V, offset, v_factor, out, GH);
            }
            continue;
        }
        for (; i + 8 * NV <= hi; i += 8 * NV) value_sums(&l->v, dtype, c, w, i, offset, v_factor, out, GH, NV);
        for (; i < hi; i += 8) value_sums(&l->v, dtype, c, w, i, offset, v_factor, out, GH, 1);
    }
}

/* Attention is split into units of (row, KV head, chunk of CHUNK tokens), so two threads stay
 * busy however few rows or KV heads there are. A unit leaves, per query head of its group, the
 * chunk's softmax partials: its largest score, the sum of exp(score - largest) and the
 * exp-weighted sum of values; `combine_heads` merges the chunks, as flash-decoding does. The
 * chunk's rows are looked up in the row's block table once (chunks need not align with
 * blocks); the query heads then go over them in packs of up to four, so each key and value
 * is read and widened (dequantised, for fp8 and the group formats) once per pack, not once per head: that
 * widening costs more than fp16's, and paid per head it ate the narrow formats' saving in
 * bytes. Inlined once per cache format (attend_unit), so the loops carry no format test. */
static inline __attribute__((always_inline)) void attend_chunk(const llama_model *m, const llama_layer *l,
                                                              const paged_view *v, int unit, const float *qkv,
                                                              int width, scratch *s, const int dtype) {
    const int d = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, bs = v->block_size;
    const int L = s->layout, window = s->layout_window[L];
    const int r = s->unit_row[L][unit], pos = v->positions[r], chunks = layout_chunks(s, L, pos);
    const int local = unit - s->unit_first[L][r], kvh = local / chunks;
    const int sunk = sink_chunks(pos, window, s->layout_sinks[L]), at_chunk = local % chunks;
    int start, end;
    if (at_chunk < sunk) { /* a chunk of the sinks the window has left behind */
        const int stop = sink_end(pos, window, s->layout_sinks[L]);
        start = at_chunk * CHUNK;
        end = (at_chunk + 1) * CHUNK < stop ? (at_chunk + 1) * CHUNK : stop;
    } else {
        const int first = first_seen(pos, window), ch = first / CHUNK + at_chunk - sunk;
        start = ch * CHUNK > first ? ch * CHUNK : first;
        end = (ch + 1) * CHUNK <= pos + 1 ? (ch + 1) * CHUNK : pos + 1;
    }
    const int32_t *table = v->tables + (size_t)r * v->max_blocks;
    chunk_rows c;
    c.len = end - start, c.d = d;
    c.gsize = cache_grouped(dtype) && m->group_size < d ? m->group_size : d;
    c.groups = (d + c.gsize - 1) / c.gsize;
    c.integer = dtype == CACHE_INT8 && c.groups == 1 && d % 64 == 0 && d <= INT8_DOT_MAX_HEAD_DIM &&
                kvlab_x8_isa() == X8_ISA_AVX512_VNNI;
    c.packed = packed_rows(dtype, d, c.gsize);
    c.tables = (dtype == CACHE_FP8_E4M3 || dtype == CACHE_FP8_E5M2) && d % 64 == 0 && d <= FP8_DOT_MAX_HEAD_DIM &&
             kvlab_x8_isa() == X8_ISA_AVX512_VNNI && fp8_vbmi_usable();
    for (int t = start, at = 0; t < end;) { /* block by block: a division per token cost 6% of attention */
        const size_t base = ((size_t)table[t / bs] * hkv + kvh) * bs;
        const int offset = t % bs, run = bs - offset < end - t ? bs - offset : end - t;
        for (int u = 0; u < run; u++) c.slots[at++] = base + offset + u;
        if (cache_grouped(dtype)) { /* the run's scales and zeros (first and last line), wanted after the key dots */
            const uint16_t *meta[4] = {l->k.scale, l->k.zero, l->v.scale, l->v.zero};
            for (int f = 0; f < 4; f++) {
                _mm_prefetch((const char *)(meta[f] + (base + offset) * c.groups), _MM_HINT_T0);
                _mm_prefetch((const char *)(meta[f] + (base + offset + run) * c.groups - 1), _MM_HINT_T0);
            }
        }
        t += run;
    }
    if ((dtype == CACHE_INT4 || dtype == CACHE_INT2) && c.packed)
        for (int t = 0; t < c.len; t++) c.at[t] = c.slots[t] * row_bytes(dtype, d);
    for (int t = 0; t < PREFETCH && t < c.len; t++) { /* the first rows; the key loop asks for the rest ahead */
        prefetch_row(&l->k, dtype, c.slots[t], d, c.groups);
        prefetch_row(&l->v, dtype, c.slots[t], d, c.groups);
    }
    if (c.integer) load_group(l, &c, 0); /* the rows' scales and zeros, once for every pack of query heads */
    const float scale = m->query_scale > 0.0f ? m->query_scale : 1.0f / sqrtf((float)d);
    const float k_factor = fp8_factor(&l->k, dtype, kvh) * scale, v_factor = fp8_factor(&l->v, dtype, kvh);
    /* the group's query heads, adjacent (packed rows: each in packed_order, layer_step permuted them) */
    const float *q = qkv + (size_t)r * width + (size_t)kvh * group * d;
    for (int h = 0; h < group;) {
        const int pack = group - h < 4 ? group - h : 4;
        const size_t at = (size_t)unit * group + h;
        float *scores = s->scores + at * CHUNK, *out = s->part_out + at * d;
        const float *qh = q + (size_t)h * d;
        float *top = s->part_max + at, *sum = s->part_sum + at;
        FOR_HEAD_PACK(pack, attend_heads, l, dtype, &c, qh, scores, k_factor, v_factor, top, sum, out)
        h += pack;
    }
}

static void attend_unit(const llama_model *m, const llama_layer *l, const paged_view *v, int unit, const float *qkv,
                        int width, scratch *s) {
    switch (m->cache_dtype) {
    case CACHE_F32: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_F32); break;
    case CACHE_F16: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_F16); break;
    case CACHE_BF16: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_BF16); break;
    case CACHE_FP8_E4M3: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_FP8_E4M3); break;
    case CACHE_FP8_E5M2: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_FP8_E5M2); break;
    case CACHE_INT8: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_INT8); break;
    case CACHE_INT4: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_INT4); break;
    default: attend_chunk(m, l, v, unit, qkv, width, s, CACHE_INT2); break;
    }
}

/* One head's `chunks` softmax partials (largest score, sum of exp, exp-weighted values of `width`
 * channels), at partial indices first, first + stride, ..., merged into out, as flash-decoding does. */
static void merge_partials(const scratch *s, size_t first, size_t stride, int chunks, int width, float *out) {
    float top = -INFINITY, total = 0.0f;
    for (int c = 0; c < chunks; c++) top = fmaxf(top, s->part_max[first + (size_t)c * stride]);
    for (int i = 0; i < width; i++) out[i] = 0.0f;
    for (int c = 0; c < chunks; c++) {
        const size_t at = first + (size_t)c * stride;
        const float weight = expf(s->part_max[at] - top);
        total += weight * s->part_sum[at];
        for (int i = 0; i < width; i++) out[i] += weight * s->part_out[at * width + i];
    }
    for (int i = 0; i < width; i++) out[i] /= total;
}

/* Query head h of row r: merge its chunks' partials into softmax(q k / sqrt(d)) v. */
static void combine_heads(const llama_model *m, const paged_view *v, int r, int h, const scratch *s, float *out) {
    const int L = s->layout, d = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv;
    const int chunks = layout_chunks(s, L, v->positions[r]), kvh = h / group, j = h % group;
    const size_t first = ((size_t)s->unit_first[L][r] + (size_t)kvh * chunks) * group + j; /* unit (r, kvh, 0), head j */
    merge_partials(s, first, group, chunks, d, out);
}

/* y [rows, width] = x W^T for W stacked from parts, each writing its own columns. */
static void stack_gemm(const qstack *w, int rows, const scratch *s, float *y, int width) {
    for (int i = 0, at = 0; i < w->parts; at += w->part[i].n, i++)
        qmatrix_gemm(&w->part[i], rows, &s->qa, y + at, width, 0);
}

/* x[r] += rms_norm(sub[r]) w for every row: a sub-block's output post-normed into the residual (Gemma). */
static void add_post_normed(float *x, float *sub, const float *w, int rows, int dim, float eps) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *yr = sub + (size_t)r * dim, *xr = x + (size_t)r * dim;
        rms_norm(yr, w, dim, eps, yr);
        for (int i = 0; i < dim; i++) xr[i] += yr[i];
    }
}

/* The layout (MAX_LAYOUTS) of a layer's window and sinks: every thread finds the same one. */
static int layout_of(const scratch *s, int window, int sinks) {
    for (int L = 0; L < s->layouts; L++)
        if (s->layout_window[L] == window && s->layout_sinks[L] == sinks) return L;
    return 0; /* unreachable: llama_paged_step made one per window */
}

/* MLA layers' attention: in its own file, using the helpers above. */
#include "mla_attend.h"

/* KIVI pools' stores and attention: in their own file, using the helpers above. */
#include "kivi_attend.h"

/* Attention units per row and chunk: one per KV head, or one for every head of an MLA model
 * (its heads all read one latent row: mla_attend.h). */
static inline int unit_heads(const llama_model *m) { return m->kv_lora_rank > 0 ? 1 : m->n_kv_heads; }

/* One row's query and key heads (qkv's layout) RMS-normed where the layer norms them, then the first
 * `rotated` of them (queries, then keys) rotated at the row's position `pos`. */
static void norm_rotate_heads(const llama_model *m, const llama_layer *l, float *heads, int pos, int rotated) {
    const int d = m->head_dim, hq = m->n_heads, hkv = m->n_kv_heads;
    if (l->q_norm)
        for (int h = 0; h < hq; h++) rms_norm(heads + h * d, l->q_norm, d, m->eps, heads + h * d);
    if (l->k_norm)
        for (int h = hq; h < hq + hkv; h++) rms_norm(heads + h * d, l->k_norm, d, m->eps, heads + h * d);
    const float *cos = l->rope_cos + (size_t)pos * d, *sin = l->rope_sin + (size_t)pos * d;
    for (int h = 0; h < rotated; h++) rope(heads + h * d, cos, sin, d, m->rope_interleaved);
}

/* KVQuant layers' writes and attention: in their own file, using the helpers above. */
#include "kvquant_attend.h"

/* A GQA layer's attention for every row from its projected heads s->qkv [rows, (n_heads + 2 n_kv_heads)
 * head_dim] (q/k norms and RoPE applied here, in place): each row's K and V into its block, then
 * s->att [rows, n_heads head_dim] receives the heads' outputs. The fused step's and
 * llama_paged_attend's (whose caller made the projections) one copy. */
static void gqa_attend_rows(const llama_model *m, const llama_layer *l, const paged_view *v, scratch *s) {
    const int rows = v->rows, d = m->head_dim, hq = m->n_heads, hkv = m->n_kv_heads, bs = v->block_size;
    const int width = (hq + 2 * hkv) * d;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) { /* q/k norms and RoPE at the row's own position, then its K and V into its block */
        const int pos = v->positions[r];
        float *heads = s->qkv + (size_t)r * width;
        norm_rotate_heads(m, l, heads, pos, hq + hkv);
        if (packed_rows(m->cache_dtype, d, m->group_size)) /* the order attention reads them in */
            for (int h = 0; h < hq; h++) packed_permute(heads + h * d, m->cache_dtype, d);
        if (cache_kivi(m->cache_dtype)) continue; /* stored below, once every row of a sequence has its K/V */
        const int32_t block = v->tables[(size_t)r * v->max_blocks + pos / bs];
        for (int h = 0; h < hkv; h++) {
            const size_t slot = ((size_t)block * hkv + h) * bs + pos % bs;
            store_row(&l->k, m->cache_dtype, slot, h, heads + (hq + h) * d, d, m->group_size);
            store_row(&l->v, m->cache_dtype, slot, h, heads + (hq + hkv + h) * d, d, m->group_size);
        }
    }
    const int kivi = cache_kivi(m->cache_dtype);
    if (kivi) kivi_store_layer(m, l, v, s, width);
    const int units = s->unit_first[s->layout][rows];
    /* dynamic: units differ in length (each row's last chunk is partly filled), and a thread
     * the OS has descheduled on a shared machine should not hold back a fixed share of them */
#pragma omp for schedule(dynamic, 1)
    for (int unit = 0; unit < units; unit++)
        if (kivi)
            kivi_attend_unit(m, l, v, unit, s->qkv, width, s);
        else
            attend_unit(m, l, v, unit, s->qkv, width, s);
#pragma omp for schedule(static)
    for (int rh = 0; rh < rows * hq; rh++)
        combine_heads(m, v, rh / hq, rh % hq, s, s->att + (size_t)rh * d);
}

/* A GQA layer's attention for every row: its input norm and QKV product on the blocks, then gqa_attend_rows. */
static void gqa_attend_layer(const llama_model *m, const llama_layer *l, const paged_view *v, const float *x,
                             scratch *s) {
    norm_quantize(x, l->attn_norm, v->rows, m->dim, m->eps, s->normed, s);
    stack_gemm(&l->qkv, v->rows, s, s->qkv, (m->n_heads + 2 * m->n_kv_heads) * m->head_dim);
    gqa_attend_rows(m, l, v, s);
}

/* Layer l's view and scratch, in the calling thread's own copies: its KV group's tables, its window's layout. */
static void layer_locals(const llama_layer *l, const paged_view *view, const scratch *shared, paged_view *lv,
                         scratch *ls) {
    *lv = *view;
    lv->tables = view->block_tables + (size_t)l->group * view->rows * view->max_blocks;
    *ls = *shared;
    ls->layout = layout_of(shared, l->window, l->sinks);
}

static void layer_step(const llama_model *m, const llama_layer *l, const paged_view *view, float *x,
                       const scratch *shared) {
    const int rows = view->rows, d = m->head_dim, hq = m->n_heads;
    paged_view lv;
    scratch ls;
    layer_locals(l, view, shared, &lv, &ls);
    const paged_view *v = &lv;
    scratch *s = &ls;
    if (l->attention == ATTN_MLA)
        mla_attend_layer(m, l, v, x, s);
    else if (m->kvq)
        kvq_attend_layer(m, l, v, x, s);
    else
        gqa_attend_layer(m, l, v, x, s);
    quantize_act(s->att, (size_t)rows * hq * d, &s->qa);
    if (l->post_attn_norm) {
        qmatrix_gemm(&l->o, rows, &s->qa, s->sub, m->dim, 0);
        add_post_normed(x, s->sub, l->post_attn_norm, rows, m->dim, m->eps);
    } else {
        qmatrix_gemm(&l->o, rows, &s->qa, x, m->dim, 1); /* the residual add is the accumulate */
    }
    norm_quantize(x, l->mlp_norm, rows, m->dim, m->eps, s->normed, s);
    stack_gemm(&l->gate_up, rows, s, s->gate_up, 2 * m->hidden);
    const int pieces = (m->hidden + SWIGLU_PIECE - 1) / SWIGLU_PIECE; /* the gate shared out in pieces of each row */
#pragma omp for schedule(static)
    for (int rp = 0; rp < rows * pieces; rp++) {
        const int r = rp / pieces, lo = rp % pieces * SWIGLU_PIECE;
        const int hi = lo + SWIGLU_PIECE < m->hidden ? lo + SWIGLU_PIECE : m->hidden;
        const float *gate = s->gate_up + (size_t)r * 2 * m->hidden, *up = gate + m->hidden;
        float *a = s->act + (size_t)r * m->hidden;
        if (m->activation == ACT_GEGLU)
            geglu(gate + lo, up + lo, a + lo, hi - lo);
        else
            swiglu(gate + lo, up + lo, a + lo, hi - lo);
        const long first = ((long)r * m->hidden + lo) / QK; /* the piece's blocks, quantised by the same thread */
        quantize_blocks(s->act, first, first + (hi - lo) / QK, &s->qa);
    }
    if (l->post_mlp_norm) {
        qmatrix_gemm(&l->down, rows, &s->qa, s->sub, m->dim, 0);
        add_post_normed(x, s->sub, l->post_mlp_norm, rows, m->dim, m->eps);
    } else {
        qmatrix_gemm(&l->down, rows, &s->qa, x, m->dim, 1);
    }
}

kvlab_arena *kvlab_arena_new(void) { return calloc(1, sizeof(kvlab_arena)); }

void kvlab_arena_free(kvlab_arena *a) {
    if (a) free(a->base), free(a);
}

#define ALIGN 64 /* each carved buffer starts on its own cache line, so threads never share one */

static size_t aligned(size_t bytes) { return (bytes + ALIGN - 1) / ALIGN * ALIGN; }

/* At least `bytes` of the arena, grown by half again when short: contexts grow a token at a
 * time, and growing by exactly what is needed would reallocate every CHUNK tokens. */
static void *arena_reserve(kvlab_arena *a, size_t bytes) {
    if (bytes > a->capacity) {
        const size_t grown = aligned(bytes + bytes / 2);
        void *base = aligned_alloc(ALIGN, grown);
        if (!base) return NULL;
        free(a->base);
        a->base = base, a->capacity = grown;
    }
    return a->base;
}

/* Lay the step's buffers for `rows` rows and `units` attention units out from `base`; with
 * base NULL only count the bytes. */
static size_t carve(const llama_model *m, int rows, int units, int all_units, char *base, scratch *s) {
    const int widest = m->hidden > m->dim ? m->hidden : m->dim;
    const int attn_width = m->n_heads * m->head_dim > widest ? m->n_heads * m->head_dim : widest;
    const size_t chunk_heads = (size_t)units * (m->n_heads / unit_heads(m)); /* (unit, query head) pairs */
    const int mla = m->kv_lora_rank > 0, rank = m->kv_lora_rank;
    const int unit_out = mla && rank > m->head_dim ? rank : m->head_dim; /* a (unit, head)'s partial output */
    const size_t qkv_width = mla ? (size_t)mla_qkv_width(m) : (size_t)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    const size_t sizes[] = {
        (size_t)rows * m->dim * sizeof(float),
        (size_t)rows * qkv_width * sizeof(float),
        (size_t)rows * m->n_heads * m->head_dim * sizeof(float),
        (size_t)rows * 2 * m->hidden * sizeof(float),
        (size_t)rows * m->hidden * sizeof(float),
        chunk_heads * CHUNK * sizeof(float),
        chunk_heads * sizeof(float),
        chunk_heads * sizeof(float),
        chunk_heads * unit_out * sizeof(float),
        (size_t)rows * m->dim * sizeof(float),
        mla ? (size_t)rows * m->n_heads * rank * sizeof(float) : 0,
        mla ? (size_t)rows * m->n_heads * mla_query_width(m) * sizeof(float) : 0,
        mla ? (size_t)omp_get_max_threads() * MLA_SUB * mla_row_width(m) * sizeof(float) : 0,
        m->kvq ? (size_t)units * sizeof(int) : 0,
        (size_t)rows * attn_width * sizeof(int16_t),
        (size_t)rows * (attn_width / QK) * sizeof(float),
        (size_t)rows * (attn_width / QK) * sizeof(float),
        (size_t)rows * attn_width,
        (size_t)rows * (attn_width / QK) * sizeof(float),
        (size_t)rows * (attn_width / QK) * sizeof(float),
        ((size_t)MAX_LAYOUTS * (rows + 1) + all_units) * sizeof(int),
    };

    void **slots[] = {(void **)&s->normed, (void **)&s->qkv, (void **)&s->att, (void **)&s->gate_up,
                      (void **)&s->act, (void **)&s->scores, (void **)&s->part_max, (void **)&s->part_sum,
                      (void **)&s->part_out, (void **)&s->sub, (void **)&s->lat, (void **)&s->mq, (void **)&s->mla_rows,
                      (void **)&s->kvq_off,
                      (void **)&s->qa.q, (void **)&s->qa.d,
                      (void **)&s->qa.s, (void **)&s->qa.q8, (void **)&s->qa.d8, (void **)&s->qa.e8,
                      (void **)&s->unit_table};
    size_t at = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (base) *slots[i] = base + at;
        at += aligned(sizes[i]);
    }
    return at;
}

/* An MLA model's descriptor (mla_attend.h), checked before any step: 0, or -4 for one the step
 * cannot run. Every layer attends alike: all MLA (kv_lora_rank > 0) or none. */
static int check_mla(const llama_model *m) {
    const int mla = m->kv_lora_rank != 0;
    for (int i = 0; i < m->n_layers; i++) {
        const llama_layer *l = &m->layers[i];
        if (l->attention != ATTN_GQA && l->attention != ATTN_MLA) return -4;
        if ((l->attention == ATTN_MLA) != mla) return -4;
        if (mla && (l->window || !l->w_uv || !l->k.data || (m->qk_nope_dim > 0) != (l->w_uk != NULL) || l->q_norm ||
                    l->k_norm || l->qkv.parts < 2))
            return -4;
    }
    if (!mla) return 0;
    int qkv_rows = 0;
    for (int p = 0; p < m->layers[0].qkv.parts; p++) qkv_rows += m->layers[0].qkv.part[p].n;
    if (m->kv_lora_rank < 0 || m->kv_lora_rank % 8 || m->qk_rope_dim < 8 || m->qk_rope_dim % 8 || m->qk_nope_dim < 0 ||
        m->head_dim % 8 || m->cache_dtype > CACHE_FP8_E5M2 || qkv_rows != mla_qkv_width(m) ||
        m->layers[0].o.k != m->n_heads * m->head_dim)
        return -4;
    return 0;
}

/* The checks that keep a bad argument from writing outside the cache: 0 or the error code. Each
 * row's table of each KV group must hold a block for every position its layers may read (a
 * windowed group's entries before the window may be anything: they are released). */
static int check_step(const llama_model *m, int rows, const int32_t *positions, const int32_t *block_tables,
                      int max_blocks, int block_size, int num_blocks) {
    if (rows < 1 || max_blocks < 1 || block_size < 1 || m->n_groups < 1) return -2;
    if (m->n_heads % m->n_kv_heads || m->n_heads / m->n_kv_heads > MAX_GROUP) return -3;
    if ((m->cache_dtype == CACHE_KVQUANT) != (m->kvq != NULL)) return -4;
    if (m->kvq) {
        const int status = kvq_check_step(m, rows, positions);
        if (status) return status;
    }
    if (m->cache_dtype < CACHE_F32 || m->cache_dtype > CACHE_KIVI2 || m->head_dim % 8 ||
        (cache_grouped(m->cache_dtype) && (m->group_size < 1 || (m->group_size < m->head_dim && m->group_size % 8))) ||
        (m->activation != ACT_SWIGLU && m->activation != ACT_GEGLU))
        return -4;
    for (int i = 0; i < m->n_layers; i++) {
        const llama_layer *l = &m->layers[i];
        if (l->group < 0 || l->group >= m->n_groups || l->window < 0 || l->sinks < 0) return -2;
        if (l->sinks && (!l->window || l->attention != ATTN_GQA || cache_kivi(m->cache_dtype) || m->kvq)) return -4;
    }
    const int status = cache_kivi(m->cache_dtype) ? check_kivi(m, rows, positions, block_size) : check_mla(m);
    if (status) return status;
    for (int i = 0; i < m->n_layers; i++) {
        const int g = m->layers[i].group, window = m->layers[i].window;
        for (int r = 0; r < rows; r++) {
            const int pos = positions[r];
            if (pos < 0 || pos >= m->rope_len || pos / block_size >= max_blocks) return -2;
            const int32_t *table = block_tables + ((size_t)g * rows + r) * max_blocks;
            for (int b = first_seen(pos, window) / block_size; b <= pos / block_size; b++)
                if (table[b] < 0 || table[b] >= num_blocks) return -2;
            for (int b = 0; b * block_size < sink_end(pos, window, m->layers[i].sinks); b++)
                if (table[b] < 0 || table[b] >= num_blocks) return -2;
        }
    }
    return 0;
}

/* The step's scratch for `rows` rows at `positions`: one attention layout per distinct window of
 * m's layers, the arena carved for the widest, each layout's units per row. 0, -1 (no memory) or
 * -4 (more windows than MAX_LAYOUTS). */
static int step_scratch(const llama_model *m, int rows, const int32_t *positions, kvlab_arena *arena, scratch *out) {
    scratch s;
    s.layouts = 0; /* one attention layout per distinct window of the model's layers */
    for (int i = 0; i < m->n_layers; i++) {
        int L = 0;
        while (L < s.layouts && (s.layout_window[L] != m->layers[i].window || s.layout_sinks[L] != m->layers[i].sinks)) L++;
        if (L == s.layouts) {
            if (s.layouts == MAX_LAYOUTS) return -4;
            s.layout_window[s.layouts] = m->layers[i].window;
            s.layout_sinks[s.layouts++] = m->layers[i].sinks;
        }
    }
    int units = 0, all_units = 0; /* the widest layout's units (scratch is per layer), and all layouts' */
    for (int L = 0; L < s.layouts; L++) {
        int n = 0;
        for (int r = 0; r < rows; r++) n += unit_heads(m) * layout_chunks(&s, L, positions[r]);
        units = n > units ? n : units;
        all_units += n;
    }
    char *base = arena_reserve(arena, carve(m, rows, units, all_units, NULL, &s));
    if (!base) return -1;
    carve(m, rows, units, all_units, base, &s);
    for (int L = 0, used = 0; L < s.layouts; L++) {
        s.unit_first[L] = s.unit_table + (size_t)L * (rows + 1);
        s.unit_row[L] = s.unit_table + (size_t)MAX_LAYOUTS * (rows + 1) + used;
        s.unit_first[L][0] = 0;
        for (int r = 0; r < rows; r++) {
            s.unit_first[L][r + 1] = s.unit_first[L][r] + unit_heads(m) * layout_chunks(&s, L, positions[r]);
            for (int u = s.unit_first[L][r]; u < s.unit_first[L][r + 1]; u++) s.unit_row[L][u] = r;
        }
        used += s.unit_first[L][rows];
    }
    s.layout = 0;
    *out = s;
    return 0;
}

/* Advance `rows` rows by one token each: row r's token sits at positions[r]; its blocks in KV
 * group g are block_tables[(g * rows + r) * max_blocks ..] (entries past positions[r] /
 * block_size, and before a windowed layer's window, are not read), each
 * of `block_size` tokens, in caches of `num_blocks` blocks. x [rows, dim] holds the new tokens'
 * embeddings on entry (it is the residual stream, overwritten), logits [rows, vocab] receive
 * the next-token scores, and each layer's cache gains row r's K/V at its position. Returns 0;
 * -1 when scratch memory cannot be had; -2 when a position, block or table is outside what
 * the model and cache hold; -3 when the heads do not group (at most MAX_GROUP query heads per
 * KV head); -4 for a cache format or group size this step cannot run. Rows must not
 * share a (block, offset): each writes its own token. */
int llama_paged_step(const llama_model *m, int rows, const int32_t *positions, const int32_t *block_tables,
                     int max_blocks, int block_size, int num_blocks, float *x, const int32_t *logit_rows, int n_logits,
                     float *logits, float *hidden, kvlab_arena *arena);

int llama_paged_decode_step(const llama_model *m, int rows, const int32_t *positions, const int32_t *block_tables,
                            int max_blocks, int block_size, int num_blocks, float *x, float *logits,
                            kvlab_arena *arena) {
    return llama_paged_step(m, rows, positions, block_tables, max_blocks, block_size, num_blocks, x, NULL, rows,
                            logits, NULL, arena);
}

/* llama_paged_decode_step with logits for some rows only: logit_rows [n_logits], ascending
 * (NULL: every row, n_logits = rows), logits [n_logits, vocab]. A prompt fed as rows needs
 * the next-token scores of its last row alone, and the LM head is a fifth of SmolLM2's
 * weights: 128 rows of a prompt would spend as much on scores nobody reads as on the layers.
 * hidden [rows, dim] (NULL: not wanted) receives every row's final hidden state, the residual
 * stream after the final norm (the vector the LM head reads, in fp32, before it is quantised):
 * the features an EAGLE draft head (kvlab.nn.eagle) drafts from. */
int llama_paged_step(const llama_model *m, int rows, const int32_t *positions, const int32_t *block_tables,
                     int max_blocks, int block_size, int num_blocks, float *x, const int32_t *logit_rows, int n_logits,
                     float *logits, float *hidden, kvlab_arena *arena) {
    const int status = check_step(m, rows, positions, block_tables, max_blocks, block_size, num_blocks);
    if (status) return status;
    if (n_logits < 0 || n_logits > rows || (!logit_rows && n_logits != rows && n_logits != 0)) return -2;
    for (int i = 0; logit_rows && i < n_logits; i++)
        if (logit_rows[i] < (i ? logit_rows[i - 1] + 1 : 0) || logit_rows[i] >= rows) return -2;
    scratch s;
    const int prepared = step_scratch(m, rows, positions, arena, &s);
    if (prepared) return prepared;
    const paged_view view = {rows, max_blocks, block_size, positions, block_tables, block_tables};
#pragma omp parallel
    {
        for (int i = 0; i < m->n_layers; i++) layer_step(m, &m->layers[i], &view, x, &s);
        if (hidden) { /* every row's, before the rows that want scores move to the front */
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++)
                rms_norm(x + (size_t)r * m->dim, m->final_norm, m->dim, m->eps, hidden + (size_t)r * m->dim);
        }
        if (logit_rows) { /* the rows that want scores to the front, in order (row i <= logit_rows[i]) */
#pragma omp single
            for (int i = 0; i < n_logits; i++)
                if (logit_rows[i] != i)
                    memcpy(x + (size_t)i * m->dim, x + (size_t)logit_rows[i] * m->dim, m->dim * sizeof(float));
        }
        if (n_logits > 0) {
            norm_quantize(x, m->final_norm, n_logits, m->dim, m->eps, s.normed, &s);
            qmatrix_gemm(&m->lm_head, n_logits, &s.qa, logits, m->vocab, 0);
        }
    }
    return 0;
}

/* One GQA layer's attention for a step's rows, the projections being the caller's (kvlab.nn.hybrid_step
 * multiplies them in a library where a batch of rows runs faster there): qkv [rows, (n_heads + 2
 * n_kv_heads) head_dim] holds each row's projected query, key and value heads (q/k norms and RoPE
 * are applied here, in place), row r's K/V go into layer `layer`'s cache at positions[r] through
 * the cache's codecs, and att [rows, n_heads head_dim] receives the attended heads: what the fused
 * step does between its QKV and output products (gqa_attend_rows, one copy). Arguments and returns
 * as llama_paged_step's, checked for this layer alone; -4 also for an MLA layer. */
int llama_paged_attend(const llama_model *m, int layer, int rows, const int32_t *positions,
                       const int32_t *block_tables, int max_blocks, int block_size, int num_blocks, float *qkv,
                       float *att, kvlab_arena *arena) {
    if (layer < 0 || layer >= m->n_layers) return -2;
    llama_model one = *m; /* the layer alone: its checks, its window's layout */
    one.n_layers = 1, one.layers = m->layers + layer;
    if (one.layers->attention != ATTN_GQA || m->kv_lora_rank || m->kvq || cache_kivi(m->cache_dtype))
        return -4; /* KVQuant and KIVI write in their own code, with each row's seat */
    int status = check_step(&one, rows, positions, block_tables, max_blocks, block_size, num_blocks);
    if (status) return status;
    scratch s;
    status = step_scratch(&one, rows, positions, arena, &s);
    if (status) return status;
    s.qkv = qkv, s.att = att;
    const paged_view view = {rows, max_blocks, block_size, positions, block_tables, block_tables};
#pragma omp parallel
    {
        paged_view lv;
        scratch ls;
        layer_locals(one.layers, &view, &s, &lv, &ls);
        gqa_attend_rows(&one, one.layers, &lv, &ls);
    }
    return 0;
}

/* Test hooks: the stores' quantisers alone, so tests can hold them to PyTorch's byte for byte. */
void kvlab_fp8_encode(int e4m3, const float *x, uint8_t *out, size_t n) {
    size_t i = 0; /* eight at a time as store_row does, the tail one by one */
    for (; i + 8 <= n; i += 8) _mm_storel_epi64((__m128i *)(out + i), fp8_encode8(_mm256_loadu_ps(x + i), e4m3));
    for (; i < n; i++) out[i] = fp8_encode(x[i], e4m3);
}

void kvlab_group_quantize(const float *x, int rows, int d, int gsize, int bits, uint8_t *codes, uint16_t *scale,
                          uint16_t *zero) {
    const int groups = (d + gsize - 1) / gsize;
    const size_t row = (size_t)(d * bits + 7) / 8;
    for (int r = 0; r < rows; r++)
        group_quantize_row(x + (size_t)r * d, d, gsize, bits, codes + (size_t)r * row, scale + (size_t)r * groups,
                           zero + (size_t)r * groups);
}
