/* Run-time checks of what the CPU and OS offer, shared by every file that picks an AVX-512 path. */
#ifndef KVLAB_CPU_FEATURES_H
#define KVLAB_CPU_FEATURES_H

/* Whether the CPU has AVX-512 F, BW and VL and the OS saves the registers they use (XCR0: SSE,
 * AVX, opmask and both halves of the upper ZMM state); the callers add the extensions they use. */
static inline int avx512_usable(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xE6) == 0xE6;
}

#endif
