/* kv_fp8.h's conversions over arrays, for the tests (every bfloat16 and every e4m3 value against torch's). */
#include <stdint.h>

#include "kv_fp8.h"

void kv_fp8_from_bf16(const uint16_t *src, uint8_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_fp8_e4m3(src[i]);
}

/* n a multiple of 32. Returns 0, or -1 where the attention kernels' widening (AVX512-BW) is not compiled in. */
int kv_fp8_to_bf16(const uint8_t *src, uint16_t *dst, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t i = 0; i + 32 <= n; i += 32) _mm512_storeu_si512(dst + i, kv_load32(1, src, i));
    return 0;
#else
    (void)src, (void)dst, (void)n;
    return -1;
#endif
}
