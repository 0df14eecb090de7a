/* Paged decode attention for the CPU, KV cache in the HND layout (kernels/cache_ops.py): bfloat16 rows, or
 * (the AVX512-BF16 path only) fp8 or int8 rows (kv_formats.h).
 *
 * Each row of the plan is one query token over its sequence's first kv_len tokens: a decode, or a row of a
 * prompt chunk. Two implementations of the same function:
 * - on CPUs with AVX512-BF16 (chosen at compile time by -march=native), head size 64 or 128 and block sizes
 *   that are multiples of 16: attention_rows_bf16.c (the per-row path) and prompt_row_tiles.c (prompt chunks
 *   in tiles of 16 rows), one arithmetic between them (attention_order.h): 2.0x the plain loops on SmolLM2's
 *   decode shapes (benchmarks/cpu_kernels.py);
 * - everywhere else, the plain C loops below, written for the compiler to vectorize (-O3 -march=native
 *   -ffast-math, at compile only: kernels/native/lib.py), for any head size and block size; every row alone.
 *
 * Per row, each (sequence, KV head) reads its K and V rows once, in place in the cache pages (no gather into a
 * padded copy, no padding to the longest sequence), for all G query heads of that KV head; scores, softmax and
 * the weighted sum of V stay in float32. The work items are spread over the OpenMP threads of torch's own
 * runtime: this library is loaded after torch, so its libgomp.so.1 dependency resolves to the copy torch
 * already loaded. Every sequence's result depends only on its own inputs, never on the rest of the batch.
 */
#include <float.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

/* q: the step's query rows, row r of sequence b at q + q_rows[b] * q_row_stride, its heads D apart.
 * cache: one layer [blocks, 2, Hkv, bs, D]. pages: [B, max_pages] page ids. kv_lens: [B].
 * out: rows like q (out_row_stride), heads D apart. Returns 0, or -1 for unsupported sizes. */
int decode_attention_bf16_generic(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                          const uint16_t *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                          uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                          int num_kv_heads, int head_dim, int block_size, float scale) {
    const int group = num_qo_heads / num_kv_heads;
    const int D = head_dim;
    if (D > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_qo_heads) return -1;
    int max_len = 0;
    for (int b = 0; b < num_seqs; b++) max_len = kv_lens[b] > max_len ? kv_lens[b] : max_len;
    const int64_t run = (int64_t)block_size * D;  /* one head's slots of one block */
    int failed = 0;

#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(max_len > 0 ? max_len : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_seqs * num_kv_heads; item++) {
            if (!scores) continue;
            const int b = item / num_kv_heads, h = item % num_kv_heads;
            const int len = kv_lens[b];
            const int32_t *seq_pages = pages + (int64_t)b * max_pages;
            float qf[MAX_GROUP][MAX_HEAD_DIM];
            float acc[MAX_GROUP][MAX_HEAD_DIM];
            float row[MAX_HEAD_DIM];
            for (int g = 0; g < group; g++) {
                const uint16_t *qh = q + q_rows[b] * q_row_stride + (int64_t)(h * group + g) * D;
                for (int d = 0; d < D; d++) qf[g][d] = bf16_to_f32(qh[d]) * scale;
                for (int d = 0; d < D; d++) acc[g][d] = 0.0f;
            }
            /* Scores: q . k for every cached token, page by page. */
            for (int t0 = 0; t0 < len; t0 += block_size) {
                const uint16_t *k = cache + ((int64_t)seq_pages[t0 / block_size] * 2 * num_kv_heads + h) * run;
                const int n = len - t0 < block_size ? len - t0 : block_size;
                for (int i = 0; i < n; i++, k += D) {
                    for (int d = 0; d < D; d++) row[d] = bf16_to_f32(k[d]);
                    for (int g = 0; g < group; g++) {
                        float s = 0.0f;
                        for (int d = 0; d < D; d++) s += qf[g][d] * row[d];
                        scores[g * len + t0 + i] = s;
                    }
                }
            }
            /* Softmax in place, per query head. */
            float inv_sum[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                float *s = scores + g * len;
                float m = -FLT_MAX, sum = 0.0f;  /* not -INFINITY: -ffast-math assumes finite values */
                for (int t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
                for (int t = 0; t < len; t++) {
                    s[t] = expf(s[t] - m);
                    sum += s[t];
                }
                inv_sum[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
            }
            /* Weighted sum of V. */
            for (int t0 = 0; t0 < len; t0 += block_size) {
                const uint16_t *v = cache + (((int64_t)seq_pages[t0 / block_size] * 2 + 1) * num_kv_heads + h) * run;
                const int n = len - t0 < block_size ? len - t0 : block_size;
                for (int i = 0; i < n; i++, v += D) {
                    for (int d = 0; d < D; d++) row[d] = bf16_to_f32(v[d]);
                    for (int g = 0; g < group; g++) {
                        const float p = scores[g * len + t0 + i];
                        for (int d = 0; d < D; d++) acc[g][d] += p * row[d];
                    }
                }
            }
            for (int g = 0; g < group; g++) {
                uint16_t *o = out + q_rows[b] * out_row_stride + (int64_t)(h * group + g) * D;
                for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[g][d] * inv_sum[g]);
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

#ifdef HAVE_AVX512_BF16
int attention_rows_avx512_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const void *cache,
                               const int32_t *pages, int max_pages, const int32_t *kv_lens, uint16_t *out,
                               int64_t out_row_stride, int num_seqs, int num_kv_heads, int group, int head_dim,
                               int block_size, float scale, int tiles, int kv_kind);
#endif

/* Whether decode_attention_bf16 takes the AVX512-BF16 path for these sizes (1) or the plain loops (0). */
int decode_attention_bf16_vectorized(int head_dim, int block_size) {
#ifdef HAVE_AVX512_BF16
    return (head_dim == 64 || head_dim == 128) && block_size % 16 == 0;
#else
    (void)head_dim, (void)block_size;
    return 0;
#endif
}

/* kv_kind: the cache's row format (kv_formats.h); fp8 and int8 only on the AVX512-BF16 path (else -3). */
static int decode_attention_dispatch(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                                     const void *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                                     uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                                     int num_kv_heads, int head_dim, int block_size, float scale, int tiles,
                                     int kv_kind) {
#ifdef HAVE_AVX512_BF16
    const int group = num_qo_heads / num_kv_heads;
    if (decode_attention_bf16_vectorized(head_dim, block_size) && group <= MAX_GROUP
        && group * num_kv_heads == num_qo_heads)
        return attention_rows_avx512_bf16(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out,
                                          out_row_stride, num_seqs, num_kv_heads, group, head_dim, block_size,
                                          scale, tiles, kv_kind);
#else
    (void)tiles;
#endif
    if (kv_kind) return -3;
    return decode_attention_bf16_generic(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out,
                                         out_row_stride, num_seqs, num_qo_heads, num_kv_heads, head_dim,
                                         block_size, scale);
}

/* The kernel: the AVX512-BF16 path where it applies (prompt chunks in tiles), else the plain loops. Same
 * arguments as above, and kv_kind: the cache's row format (kv_formats.h: 0 bfloat16, 1 fp8 e4m3, 2 int8 rows;
 * the last two on the AVX512-BF16 path only, else -3). */
int decode_attention_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                          const void *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                          uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                          int num_kv_heads, int head_dim, int block_size, float scale, int kv_kind) {
    return decode_attention_dispatch(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out, out_row_stride,
                                     num_seqs, num_qo_heads, num_kv_heads, head_dim, block_size, scale, 1, kv_kind);
}

/* The same with every row on the per-row path, tiles or not (benchmarks/cpu_kernels.py compares the two). */
int decode_attention_bf16_rows(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                               const void *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                               uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale, int kv_kind) {
    return decode_attention_dispatch(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out, out_row_stride,
                                     num_seqs, num_qo_heads, num_kv_heads, head_dim, block_size, scale, 0, kv_kind);
}
