/* bfloat16 <-> float32 for the CPU kernels of this directory. */
#ifndef HETERO_BF16_H
#define HETERO_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, like torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* 16 bfloat16 values widened to float32 (AVX512F; callers are compiled for it, or carry the target). */
__attribute__((target("avx512f"))) static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#endif
