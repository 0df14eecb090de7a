/* The KV cache's fp8 element (config `kv_cache_dtype: fp8`): float8 e4m3fn, the format of torch's
 * float8_e4m3fn and of FlashInfer's fp8 caches (sign, 4 exponent bits with bias 7, 3 mantissa bits; no
 * infinities, 0x7F and 0xFF are NaN, 448 the largest value), unscaled.
 *
 * Writing rounds a bfloat16 value to the nearest e4m3 value (ties to even) and saturates at +-448, as torch's
 * conversion does, so the C write and torch's write of the same K/V give the same bytes. Reading widens e4m3
 * back to bfloat16 exactly (every e4m3 value is a bfloat16 value), so the attention kernels run their one
 * arithmetic (attention_order.h) on the widened rows: an fp8 cache gives the bits of a bfloat16 cache that
 * holds the same values. Integer operations only: the library is compiled with -ffast-math.
 */
#ifndef HETERO_KV_FP8_H
#define HETERO_KV_FP8_H

#include <stdint.h>

#define FP8_E4M3_MAX_CODE 0x7E /* 448 */
#define FP8_E4M3_NAN 0x7F

/* One bfloat16 value (its bits) -> e4m3fn bits. */
static inline uint8_t bf16_to_fp8_e4m3(uint16_t x) {
    const uint8_t sign = (uint8_t)((x >> 8) & 0x80);
    const uint32_t a = x & 0x7FFFu;
    if (a > 0x7F80u) return sign | FP8_E4M3_NAN;
    const uint32_t e = a >> 7;           /* bfloat16's biased exponent */
    if (e >= 121) {                      /* |x| >= 2^-6: e4m3's normal range; 7 mantissa bits rounded to 3 */
        const uint32_t r = (a + 0x7u + ((a >> 4) & 1u)) >> 4;
        const uint32_t code = r - (120u << 3);  /* the exponent rebiased from 127 to 7 */
        return sign | (uint8_t)(code > FP8_E4M3_MAX_CODE ? FP8_E4M3_MAX_CODE : code);
    }
    if (e == 0) return sign;             /* zero and bfloat16's subnormals (below 2^-126) */
    /* e4m3's subnormals: m * 2^-9, m = |x| * 2^9 rounded to even; |x| = mant * 2^(e - 134). Rounding up
     * to m = 8 gives 2^-6, which is code 8 too. */
    const uint32_t mant = 0x80u | (a & 0x7Fu), shift = 125 - e;
    if (shift > 9) return sign;          /* below 2^-10: rounds to 0 */
    uint32_t m = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (m & 1u))) m++;
    return sign | (uint8_t)m;
}

/* n bfloat16 values -> e4m3fn. */
static inline void bf16_row_to_fp8_e4m3(const uint16_t *src, uint8_t *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_fp8_e4m3(src[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 32 e4m3fn values -> 32 bfloat16 values, exactly. */
static inline __m512i fp8x32_to_bf16(__m256i b) {
    /* bfloat16 of m * 2^-9 for the subnormal codes m = 0 .. 7 (the rest of the table is never indexed). */
    static const uint16_t subnormal[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
    const __m512i x = _mm512_cvtepu8_epi16(b);
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7F));
    /* Normal codes: exponent e -> e + 120, the mantissa's 3 bits on top of bfloat16's 7. */
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      _mm512_loadu_si512(subnormal));
    v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(FP8_E4M3_NAN)),
                              _mm512_set1_epi16(0x7FC0));
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

/* 32 consecutive K/V elements of a cache, starting at element e: bfloat16 as stored, or e4m3 widened (FP8 a
 * constant at each call). */
static inline __attribute__((always_inline)) __m512i kv_load32(const int FP8, const void *cache, int64_t e) {
    return FP8 ? fp8x32_to_bf16(_mm256_loadu_si256((const __m256i *)((const uint8_t *)cache + e)))
               : _mm512_loadu_si512((const uint16_t *)cache + e);
}
#endif

#endif
