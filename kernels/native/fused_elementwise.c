/* Fused element-wise passes of a Llama layer for bfloat16 on the CPU (gpu_worker/model.py).
 *
 * In eager torch each of these is 2-10 separate ops, each a pass over memory and a dispatch of
 * a few microseconds: at batch 1 a SmolLM2 step spends milliseconds on them. Here each is one
 * pass, float32 inside, one bfloat16 rounding per output (round to nearest even, like torch).
 * Rows are spread over torch's OpenMP threads only when there are enough of them to pay off.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vexp.h"

#define PARALLEL_MIN_ELEMENTS 32768

/* hidden[r] += delta[r] (rounded to bfloat16, as torch's add_), then
 * out[r] = weight * bf16(hidden[r] / rms(hidden[r])). delta may be NULL (no residual add).
 * hidden, delta, out: [rows, dim] with row strides; weight [dim]. */
void add_rms_norm_bf16(uint16_t *hidden, int64_t hidden_stride, const uint16_t *delta, int64_t delta_stride,
                       const uint16_t *weight, uint16_t *out, int64_t out_stride, int64_t rows, int dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = hidden + r * hidden_stride;
        uint16_t *o = out + r * out_stride;
        float sum = 0.0f;
        if (delta) {
            const uint16_t *dl = delta + r * delta_stride;
            for (int i = 0; i < dim; i++) {
                uint16_t s = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(dl[i]));
                h[i] = s;
                float x = bf16_to_f32(s);
                sum += x * x;
            }
        } else {
            for (int i = 0; i < dim; i++) {
                float x = bf16_to_f32(h[i]);
                sum += x * x;
            }
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int i = 0; i < dim; i++) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(h[i]) * inv));
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
}

/* Rotate-half RoPE in place on the first num_heads heads of each row of x ([rows, ..., head_dim],
 * row stride x_stride, heads head_dim apart): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin with
 * cos/sin [max_positions, head_dim / 2] rows picked by positions [rows]. */
void rope_bf16(uint16_t *x, int64_t x_stride, int64_t rows, int num_heads, int head_dim, const int64_t *positions,
               const uint16_t *cos_table, const uint16_t *sin_table) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos_table + positions[r] * half;
        const uint16_t *s = sin_table + positions[r] * half;
        float cf[512], sf[512];
        for (int i = 0; i < half; i++) {
            cf[i] = bf16_to_f32(c[i]);
            sf[i] = bf16_to_f32(s[i]);
        }
        for (int h = 0; h < num_heads; h++) {
            uint16_t *x1 = x + r * x_stride + (int64_t)h * head_dim;
            uint16_t *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                x1[i] = f32_to_bf16(a * cf[i] - b * sf[i]);
                x2[i] = f32_to_bf16(b * cf[i] + a * sf[i]);
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* 16 lanes at a time: exp16 and a refined reciprocal instead of glibc's vector expf and a division (a prefill's
 * SiLU.mul was compute-bound at ~2 G elements/s on 2 Xeon cores; the 64-prompt workload's prefill spent 0.205 s
 * in it, 0.110 s with this). Relative error ~1e-6 before the one bfloat16 rounding. Returns how many leading
 * elements it did (a multiple of 16). */
static int silu_mul_row16(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = bf16x16_to_f32(g + i);
        const __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));  /* 1 + exp(-x) */
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));  /* one Newton step: ~1e-7 */
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(x, r), bf16x16_to_f32(u + i));
        _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(y));
    }
    return i;
}
#endif

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:] for gate_up [rows, 2n] (row stride gu_stride). */
void silu_mul_bf16(const uint16_t *gate_up, int64_t gu_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                   int n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * gu_stride;
        const uint16_t *u = g + n;
        uint16_t *o = out + r * out_stride;
        int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        i = silu_mul_row16(g, u, o, n);
#endif
        for (; i < n; i++) {
            float x = bf16_to_f32(g[i]);
            /* exp's argument clamped: under the build's fast-math flags an infinite exp is not honoured (a
             * gate of -200 gave NaN on AVX2 CPUs); exp(88) leaves x / (1 + e) ~ 0, as silu has it. */
            o[i] = f32_to_bf16(x / (1.0f + expf(fminf(-x, 88.0f))) * bf16_to_f32(u[i]));
        }
    }
}
