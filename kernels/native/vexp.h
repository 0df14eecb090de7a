/* exp(x) on 16 float32 lanes (AVX512F; callers are compiled for it, or carry the target): 2^(x log2 e) as
 * 2^round(t) times a degree-6 polynomial of 2^f, f = t - round(t) in [-1/2, 1/2], relative error about 2e-7.
 * x is clamped to [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38: no overflow to inf, no denormals); results
 * that feed a bfloat16 rounding or a softmax lose nothing to it. glibc's vector expf costs several times more. */
#ifndef HETERO_VEXP_H
#define HETERO_VEXP_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, whole);
    __m512 poly = _mm512_set1_ps(1.535336188319500e-4f);
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.339887440266574e-3f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.618437357674640e-3f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.550332471162809e-2f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.402264791363012e-1f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.931472028550421e-1f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(poly, whole);
}
#endif

#endif
