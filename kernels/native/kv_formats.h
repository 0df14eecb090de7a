/* The KV cache's row formats (config `kv_cache_dtype`), as the C attention kernels read and write them. A cache
 * is a run of rows, one per (block, K or V, KV head, slot), in the HND order of kernels/cache_ops.py, of
 * kv_row_bytes(kind, head_dim) each:
 *
 * - KV_BF16: head_dim bfloat16 values;
 * - KV_FP8: head_dim float8 e4m3fn values (torch's float8_e4m3fn, FlashInfer's fp8 caches: sign, 4 exponent
 *   bits with bias 7, 3 mantissa bits; no infinities, 0x7F and 0xFF are NaN, 448 the largest value), unscaled.
 *   Written with torch's rounding (to nearest, ties to even, saturating at +-448); read back widened to
 *   bfloat16 exactly, so attention over it is attention over a bfloat16 cache holding the same values;
 * - KV_INT8: head_dim int8 values q and a float32 scale s per row (value = q * s): s = absmax / 127,
 *   q = round_to_even(x * (127 / absmax)). Rows are stored in groups of 16 (a block's slots are a multiple of
 *   16): the 16 rows' values, then their 16 scales, so that each row's values start 64-byte aligned at head
 *   size 64 and a group's scales are one vector. Read back as bfloat16 integers (exact); the scales enter the
 *   arithmetic (attention_order.h): a score is (q . k_int) * s_k * softmax scale, a probability
 *   numerator bf16(e_k * s_v,k).
 *
 * Conversions use integer operations, or (the int8 quantizer, kv_formats.c) strict float32 ones: the library
 * is compiled with -ffast-math.
 */
#ifndef HETERO_KV_FORMATS_H
#define HETERO_KV_FORMATS_H

#include <stdint.h>
#include <string.h>

enum { KV_BF16 = 0, KV_FP8 = 1, KV_INT8 = 2 };
#define KV_INT8_SCALE_BYTES 4
#define FP8_E4M3_MAX_CODE 0x7E /* 448 */
#define FP8_E4M3_NAN 0x7F

static inline int64_t kv_row_bytes(int kind, int head_dim) {
    return kind == KV_BF16 ? 2 * (int64_t)head_dim : kind == KV_FP8 ? head_dim : head_dim + KV_INT8_SCALE_BYTES;
}

#define KV_INT8_GROUP 16 /* KV_INT8 rows per group: their values, then their scales */

/* A KV_INT8 row's values. */
static inline char *kv_int8_values(const void *cache, int64_t row, int head_dim) {
    return (char *)cache + (row / KV_INT8_GROUP) * KV_INT8_GROUP * kv_row_bytes(KV_INT8, head_dim)
           + (row % KV_INT8_GROUP) * head_dim;
}

/* A KV_INT8 row's scale, in place (the 16 of a group are consecutive). */
static inline float *kv_int8_scale(const void *cache, int64_t row, int head_dim) {
    return (float *)((char *)cache + (row / KV_INT8_GROUP) * KV_INT8_GROUP * kv_row_bytes(KV_INT8, head_dim)
                     + KV_INT8_GROUP * head_dim) + row % KV_INT8_GROUP;
}

static inline float kv_row_scale(const void *cache, int64_t row, int head_dim) {
    float s;
    memcpy(&s, kv_int8_scale(cache, row, head_dim), sizeof s);
    return s;
}

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

/* n bfloat16 values -> row `row` of a cache of `kind` (KV_INT8: kv_formats.c's quantizer). */
void kv_write_row(int kind, const uint16_t *src, void *cache, int64_t row, int n);

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

#if defined(__AVX512BF16__)
/* 32 int8 values -> the same integers in bfloat16 (exact: |q| <= 128 needs 8 significant bits). */
static inline __m512i int8x32_to_bf16(__m256i b) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Columns [d, d + 32) of row `row` of a cache of `KIND` (a constant at each call) as 32 bfloat16 values. */
static inline __attribute__((always_inline)) __m512i kv_load32(const int KIND, const int dim, const void *cache,
                                                               int64_t row, int d) {
    const char *at = KIND == KV_INT8 ? kv_int8_values(cache, row, dim)
                                     : (const char *)cache + row * kv_row_bytes(KIND, dim);
    if (KIND == KV_BF16) return _mm512_loadu_si512((const uint16_t *)at + d);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(at + d));
    return KIND == KV_FP8 ? fp8x32_to_bf16(b) : int8x32_to_bf16(b);
}
#endif
#endif

#endif
