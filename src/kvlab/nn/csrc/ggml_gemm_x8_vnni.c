/* ggml_gemm_x8.c's products compiled for AVX-512 VNNI (Ice Lake and later Xeons, Zen 4 and
 * later): the same interleaved layout, two groups of eight outputs per 512-bit vector
 * (x16_kernel.h; 256-bit vectors for an odd last group), vpdpwssd and vpdpbusd for the
 * multiply-adds and tiles of eight rows in the 32 registers AVX-512 addresses. Only this file
 * is built for these instructions; ggml_gemm_x8.c calls it where the machine has them
 * (kvlab_x8_isa), so the library still loads on AVX2-only CPUs.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

#define X8_ENTRY x8_gemm_vnni
#define X8_TILE 8
#define X8_VNNI
#define X8_PAIRS /* two groups per 512-bit vector (x16_kernel.h) */
#include "x8_kernel.h"
