/* kv_formats.h's writers (compiled strictly: kernels/native/lib.py STRICT_SOURCES, so that the int8 quantizer's
 * float32 operations are the IEEE ones torch's reference in kernels/cache_ops.py does), and array forms of the
 * conversions for the tests. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kv_formats.h"

/* n bfloat16 values -> int8 q at dst and their float32 scale at scale_at (kv_formats.h's KV_INT8 row). */
static void int8_row(const uint16_t *src, int8_t *dst, float *scale_at, int n) {
    float absmax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(bf16_to_f32(src[i]));
        absmax = a > absmax ? a : absmax;
    }
    const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f, scale = absmax / 127.0f;
    for (int i = 0; i < n; i++) {
        float q = nearbyintf(bf16_to_f32(src[i]) * inv); /* ties to even (the default rounding mode) */
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        dst[i] = (int8_t)q;
    }
    memcpy(scale_at, &scale, sizeof scale);
}

void kv_write_row(int kind, const uint16_t *src, void *cache, int64_t row, int n) {
    char *dst = (char *)cache + row * kv_row_bytes(kind, n);
    if (kind == KV_BF16) {
        memcpy(dst, src, sizeof(uint16_t) * (size_t)n);
    } else if (kind == KV_FP8) {
        for (int i = 0; i < n; i++) ((uint8_t *)dst)[i] = bf16_to_fp8_e4m3(src[i]);
    } else {
        int8_row(src, (int8_t *)kv_int8_values(cache, row, n), kv_int8_scale(cache, row, n), n);
    }
}

/* rows x dim bfloat16 values -> rows rows of `kind` (KV_INT8: a multiple of 16 rows), for the tests to compare
 * with torch's. */
void kv_rows_write(int kind, const uint16_t *src, void *dst, int64_t rows, int dim) {
    for (int64_t r = 0; r < rows; r++) kv_write_row(kind, src + r * dim, dst, r, dim);
}

/* rows rows of `kind` -> their values as the attention kernels widen them (KV_INT8: the integers), rows x dim
 * bfloat16; dim a multiple of 32. Returns 0, or -1 where the kernels' widening is not compiled in. */
int kv_rows_read(int kind, const void *src, uint16_t *dst, int64_t rows, int dim) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    for (int64_t r = 0; r < rows; r++)
        for (int d = 0; d < dim; d += 32) {
            const __m512i v = kind == KV_BF16 ? kv_load32(KV_BF16, dim, src, r, d)
                              : kind == KV_FP8 ? kv_load32(KV_FP8, dim, src, r, d)
                                               : kv_load32(KV_INT8, dim, src, r, d);
            _mm512_storeu_si512(dst + r * dim + d, v);
        }
    return 0;
#else
    (void)kind, (void)src, (void)dst, (void)rows, (void)dim;
    return -1;
#endif
}
