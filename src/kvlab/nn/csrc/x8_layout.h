/* The interleaved layout's sizes (ggml_gemm_x8.c describes it), shared by the code that builds
 * the copy and by each instruction set's kernels (x8_kernel.h). */
#ifndef KVLAB_X8_LAYOUT_H
#define KVLAB_X8_LAYOUT_H

#define X8 8        /* output rows interleaved into one vector's lanes */
#define X8_CHUNK 64 /* activation rows per unit of work: a prompt's rows stay in L2 */
#define X8_SHARE 4  /* groups (32 output rows) per unit of work */

static inline int group_bytes(int kind) { return kind == 0 || kind == 3 ? 128 : 256; } /* per group, block */
static inline int scale_sets(int kind) { return kind == 2 ? 2 : 1; }

/* The kernels' instruction sets (kvlab_x8_isa): AVX2 everywhere, and where the CPU and OS have
 * AVX-512 VNNI the same layout multiplied with vpdpwssd / vpdpbusd. */
enum { X8_ISA_AVX2 = 0, X8_ISA_AVX512_VNNI = 1 };

#endif
