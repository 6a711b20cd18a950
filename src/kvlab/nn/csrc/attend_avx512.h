/* AVX-512 helpers shared by the attention units that run on dot-product instructions
 * (attend_int8_vnni.c, attend_fp8_bf16.c). Each includes this after its own `#pragma GCC
 * target`, so these inline functions compile for that file's instruction sets and never leak
 * AVX-512 into code that runs on AVX2-only machines.
 */
#ifndef KVLAB_ATTEND_AVX512_H
#define KVLAB_ATTEND_AVX512_H

#include <immintrin.h>

#include "llama_decode.h"

static inline __mmask16 live_lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* out[L] = [a.L, b.L, c.L, d.L]: a 4 x 4 transpose of the four vectors' 128-bit lanes. */
static inline void transpose_lanes(__m512i a, __m512i b, __m512i c, __m512i d, __m512i out[4]) {
    const __m512i ab0 = _mm512_shuffle_i32x4(a, b, 0x44), ab1 = _mm512_shuffle_i32x4(a, b, 0xEE);
    const __m512i cd0 = _mm512_shuffle_i32x4(c, d, 0x44), cd1 = _mm512_shuffle_i32x4(c, d, 0xEE);
    out[0] = _mm512_shuffle_i32x4(ab0, cd0, 0x88), out[1] = _mm512_shuffle_i32x4(ab0, cd0, 0xDD);
    out[2] = _mm512_shuffle_i32x4(ab1, cd1, 0x88), out[3] = _mm512_shuffle_i32x4(ab1, cd1, 0xDD);
}

/* r[u] dword c -> r[c] dword u for 16 rows of 16 dwords. */
static inline __attribute__((always_inline)) void transpose_dwords(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) { /* lane L: [r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]] and dwords 2, 3 */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + k] lane L: dword 4L + k of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) { /* dword 4L + k of all rows: lane L of u[k], u[4 + k], u[8 + k], u[12 + k] */
        __m512i out[4];
        transpose_lanes(u[k], u[4 + k], u[8 + k], u[12 + k], out);
        for (int L = 0; L < 4; L++) r[4 * L + k] = out[L];
    }
}

/* e^x for x <= 0, sixteen lanes: exp8's reduction and polynomial, 2^n applied by vscalefps. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2 in two parts, for precision */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p;
    EXP_REDUCED(p, r, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps);
    return _mm512_scalef_ps(p, n);
}

#endif
