/* Paged decode attention for the CPU, bfloat16 KV cache in the HND layout (kernels/cache_ops.py).
 *
 * Each row of the plan is one query token over its sequence's first kv_len tokens: a decode, or a row of a
 * prompt chunk. On AVX512-BF16 CPUs, prompt chunks of at least PROMPT_TILE_MIN_ROWS rows go to
 * prompt_row_tiles.c (16 rows per vector instead of one: 2.3x these per-row loops on a prefill step of
 * SmolLM2's shapes); what follows is the per-row path, which every other row takes.
 *
 * Per row, each (sequence, KV head) reads its K and V rows once, in place
 * in the cache pages (no gather into a padded copy, no padding to the longest sequence), for all
 * G query heads of that KV head; scores, softmax and the weighted sum of V stay in float32. The
 * work items are spread over the OpenMP threads of torch's own runtime: this library is loaded
 * after torch, so its libgomp.so.1 dependency resolves to the copy torch already loaded.
 *
 * Every sequence's result depends only on its own inputs, never on the rest of the batch (which rows form a
 * tiled chunk depends on the sequence's own chunk only).
 *
 * Two implementations of the same function:
 * - plain C loops written for the compiler to vectorize (-O3 -march=native -ffast-math, at compile
 *   only: kernels/native/lib.py), for any head size and block size;
 * - on CPUs with AVX512-BF16 (chosen at compile time by -march=native), head size 64 or 128 and
 *   block sizes that are multiples of 16: q.k with the bf16 dot-product instruction (float32
 *   accumulation, 16 keys at a time, their sums by one transpose-and-add tree), and each V row
 *   widened to float32 once for all G query heads: in registers, added straight into every head's
 *   sums, where those fit in registers too (G <= 4 at head size 64, G <= 2 at 128: 12% less time on
 *   SmolLM2's shapes with warm caches), else 16 rows at a time through a buffer; each thread
 *   prefetches its next item's scattered pages. 2.1x the plain loops on SmolLM2's shapes (9/3 heads
 *   of 64, batch 32, ~150 cached tokens, a cold cache: benchmarks/cpu_kernels.py) on an AMD EPYC
 *   with avx512_bf16. Only the order of the float32 additions differs.
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
#define V_REGS_MAX_GROUP 4 /* query heads per KV head whose V sums weighted_v_in_registers keeps in registers */
#define PROMPT_TILE_MIN_ROWS 8 /* prompt chunks of at least this many rows go through prompt_row_tiles.c */

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
/* Lane i of the result is the sum of a[i]'s 16 lanes: a transpose-and-add tree, 45 instructions
 * for 16 sums where 16 separate horizontal reductions take about 130. */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)  /* pairs of vectors: per 128-bit lane, two partial sums of each */
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) {  /* per 128-bit lane, one partial sum of each of 4 vectors */
        __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
        c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; k++)  /* the four 128-bit lanes added pairwise, then once more */
        d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One (sequence, KV head)'s K and V rows toward L2: issued one item ahead, so that the scattered
 * pages' misses overlap with the work on the item before. */
static inline void prefetch_item(const uint16_t *cache, const int32_t *seq_pages, int len, int h, int num_kv_heads,
                                 int block_size, int head_dim) {
    const int64_t run = (int64_t)block_size * head_dim;
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const int64_t page = seq_pages[t0 / block_size];
        const char *k_page = (const char *)(cache + (page * 2 * num_kv_heads + h) * run);
        const char *v_page = (const char *)(cache + ((page * 2 + 1) * num_kv_heads + h) * run);
        const int bytes = (len - t0 < block_size ? len - t0 : block_size) * head_dim * 2;
        for (int line = 0; line < bytes; line += 64) _mm_prefetch(k_page + line, _MM_HINT_T1);
        for (int line = 0; line < bytes; line += 64) _mm_prefetch(v_page + line, _MM_HINT_T1);
    }
}

/* One query head's NV float32 vectors of V sums, divided by its softmax sum, to bfloat16 at o. */
static inline __attribute__((always_inline)) void store_head(const int NV, const __m512 *acc, float inv_sum,
                                                             uint16_t *o) {
    const __m512 inv = _mm512_set1_ps(inv_sum);
    for (int j = 0; j < NV; j++) {
        float tmp[16];
        _mm512_storeu_ps(tmp, _mm512_mul_ps(acc[j], inv));
        for (int d = 0; d < 16; d++) o[16 * j + d] = f32_to_bf16(tmp[d]);
    }
}

/* The weighted sum of V for G query heads whose G * DIM / 16 float32 accumulators fit in registers (G and
 * DIM constants at each call): each V row is widened once, in registers, and added into every head's sums.
 * The same additions in the same order as weighted_v_through_memory. */
static inline __attribute__((always_inline)) void weighted_v_in_registers(
    const int G, const int DIM, const uint16_t *cache, const int32_t *seq_pages, int len, int h, int num_kv_heads,
    int block_size, const float *scores, int stride, const float *inv_sum, uint16_t *out0) {
    enum { MAX_NV = 8 };
    const int NV = DIM / 16;
    const int64_t run = (int64_t)block_size * DIM;
    __m512 acc[V_REGS_MAX_GROUP][MAX_NV];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++) acc[g][j] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const uint16_t *v = cache + (((int64_t)seq_pages[t0 / block_size] * 2 + 1) * num_kv_heads + h) * run;
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int i = 0; i < n; i++, v += DIM) {
            __m512 row[MAX_NV];
#pragma GCC unroll 8
            for (int j = 0; j < NV; j++) row[j] = bf16x16_to_f32(v + 16 * j);
#pragma GCC unroll 4
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * stride + t0 + i]);
#pragma GCC unroll 8
                for (int j = 0; j < NV; j++) acc[g][j] = _mm512_fmadd_ps(p, row[j], acc[g][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) store_head(NV, acc[g], inv_sum[g], out0 + (int64_t)g * DIM);
}

/* The weighted sum of V for any number of query heads: 16 rows widened to float32 once into `wide`, then each
 * head's accumulators over them; the result, divided by each head's sum, to out0. */
static inline __attribute__((always_inline)) void weighted_v_through_memory(
    const int DIM, const uint16_t *cache, const int32_t *seq_pages, int len, int h, int num_kv_heads, int block_size,
    int group, const float *scores, int stride, const float *inv_sum, float *wide, uint16_t *out0) {
    const int NV = DIM / 16;
    const int64_t run = (int64_t)block_size * DIM;
    __m512 acc[MAX_GROUP][8];
    for (int g = 0; g < group; g++)
        for (int j = 0; j < NV; j++) acc[g][j] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const uint16_t *v_page = cache + (((int64_t)seq_pages[t0 / block_size] * 2 + 1) * num_kv_heads + h) * run;
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int c0 = 0; c0 < n; c0 += 16) {
            const int m = n - c0 < 16 ? n - c0 : 16;  /* only rows below len: others may hold any bits */
            for (int i = 0; i < m; i++)
#pragma GCC unroll 8
                for (int j = 0; j < NV; j++)
                    _mm512_store_ps(wide + i * DIM + 16 * j, bf16x16_to_f32(v_page + (int64_t)(c0 + i) * DIM + 16 * j));
            for (int g = 0; g < group; g++) {
                const float *p = scores + g * stride + t0 + c0;
                __m512 r[8];
#pragma GCC unroll 8
                for (int j = 0; j < NV; j++) r[j] = acc[g][j];
                for (int i = 0; i < m; i++) {
                    const __m512 pi = _mm512_set1_ps(p[i]);
#pragma GCC unroll 8
                    for (int j = 0; j < NV; j++) r[j] = _mm512_fmadd_ps(pi, _mm512_load_ps(wide + i * DIM + 16 * j), r[j]);
                }
#pragma GCC unroll 8
                for (int j = 0; j < NV; j++) acc[g][j] = r[j];
            }
        }
    }
    for (int g = 0; g < group; g++) store_head(NV, acc[g], inv_sum[g], out0 + (int64_t)g * DIM);
}

/* One (sequence, KV head): its G query heads (q0, G rows of DIM) over the len cached tokens, into
 * out0. DIM is a constant at each call (inlined), so the loops unroll and accumulators stay in
 * registers. scores: G * round_up(len, 16) floats; wide: 16 * DIM floats, 64-byte aligned. */
static inline __attribute__((always_inline)) void attend(
    const int DIM, const uint16_t *q0, const uint16_t *cache, const int32_t *seq_pages, int len, int h,
    int num_kv_heads, int block_size, int group, float scale, float *scores, float *wide, uint16_t *out0) {
    const int NQ = DIM / 32;  /* bf16 vectors per q row */
    const int64_t run = (int64_t)block_size * DIM;
    const int stride = (len + 15) / 16 * 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    /* Scores, 16 keys at a time, for every query head while those keys are in L1. Keys of the last
     * chunk past len are still inside the page (block_size is a multiple of 16): their lanes are
     * computed and never read. The pages are scattered, so the hardware prefetcher cannot see the
     * next one coming: the next chunk's keys and this chunk's values are prefetched by hand. */
    __m512bh qv[MAX_GROUP][4];
    for (int g = 0; g < group; g++)
        for (int j = 0; j < NQ; j++) qv[g][j] = (__m512bh)_mm512_loadu_si512(q0 + (int64_t)g * DIM + 32 * j);
    const int chunk_bytes = 16 * DIM * 2;
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const int64_t page = seq_pages[t0 / block_size];
        const uint16_t *k_page = cache + (page * 2 * num_kv_heads + h) * run;
        const uint16_t *v_page = cache + ((page * 2 + 1) * num_kv_heads + h) * run;
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int c0 = 0; c0 < n; c0 += 16) {
            const int next = c0 + 16 < n ? -1 : t0 + block_size;  /* the next chunk is on another page */
            const char *next_keys = (const char *)(next < 0 ? k_page + (int64_t)(c0 + 16) * DIM
                                    : next < len ? cache + ((int64_t)seq_pages[next / block_size] * 2 * num_kv_heads + h) * run
                                    : NULL);
            const char *values = (const char *)(v_page + (int64_t)c0 * DIM);
            for (int line = 0; line < chunk_bytes; line += 64) {
                if (next_keys) _mm_prefetch(next_keys + line, _MM_HINT_T0);
                _mm_prefetch(values + line, _MM_HINT_T1);
            }
            for (int g = 0; g < group; g++) {
                __m512 dots[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    const uint16_t *k = k_page + (int64_t)(c0 + i) * DIM;
                    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 4
                    for (int j = 0; j < NQ; j++)
                        acc = _mm512_dpbf16_ps(acc, qv[g][j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
                    dots[i] = acc;
                }
                _mm512_storeu_ps(scores + g * stride + t0 + c0, _mm512_mul_ps(sum16(dots), vscale));
            }
        }
    }
    float inv_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *s = scores + g * stride;
        float m = -FLT_MAX, sum = 0.0f;
        for (int t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int t = 0; t < len; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        inv_sum[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    /* Weighted sum of V, divided by each head's sum, into out0. */
    if (DIM == 64 && group == 1)
        weighted_v_in_registers(1, DIM, cache, seq_pages, len, h, num_kv_heads, block_size, scores, stride, inv_sum, out0);
    else if (DIM == 64 && group == 2)
        weighted_v_in_registers(2, DIM, cache, seq_pages, len, h, num_kv_heads, block_size, scores, stride, inv_sum, out0);
    else if (DIM == 64 && group == 3)
        weighted_v_in_registers(3, DIM, cache, seq_pages, len, h, num_kv_heads, block_size, scores, stride, inv_sum, out0);
    else if (DIM == 64 && group == 4)
        weighted_v_in_registers(4, DIM, cache, seq_pages, len, h, num_kv_heads, block_size, scores, stride, inv_sum, out0);
    else if (DIM == 128 && group == 1)
        weighted_v_in_registers(1, DIM, cache, seq_pages, len, h, num_kv_heads, block_size, scores, stride, inv_sum, out0);
    else if (DIM == 128 && group == 2)
        weighted_v_in_registers(2, DIM, cache, seq_pages, len, h, num_kv_heads, block_size, scores, stride, inv_sum, out0);
    else
        weighted_v_through_memory(DIM, cache, seq_pages, len, h, num_kv_heads, block_size, group, scores, stride, inv_sum,
                                  wide, out0);
}

int prompt_row_tiles_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const uint16_t *cache,
                          const int32_t *pages, int max_pages, const int32_t *kv_lens, uint16_t *out,
                          int64_t out_row_stride, int num_kv_heads, int group, int head_dim, int block_size,
                          float scale, const int *groups, int num_groups);

/* The plan's prompt chunks: runs of at least PROMPT_TILE_MIN_ROWS consecutive rows with the same page table, as
 * [first, rows] pairs into groups (room for num_seqs / PROMPT_TILE_MIN_ROWS); returns how many. */
static int find_prompt_groups(const int32_t *pages, int max_pages, int num_seqs, int *groups) {
    int count = 0;
    for (int i = 0; i < num_seqs;) {
        int j = i + 1;
        while (j < num_seqs && !memcmp(pages + (int64_t)j * max_pages, pages + (int64_t)i * max_pages,
                                       sizeof(int32_t) * (size_t)max_pages))
            j++;
        if (j - i >= PROMPT_TILE_MIN_ROWS) {
            groups[2 * count] = i;
            groups[2 * count + 1] = j - i;
            count++;
        }
        i = j;
    }
    return count;
}

static int decode_attention_avx512_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                                        const uint16_t *cache, const int32_t *pages, int max_pages,
                                        const int32_t *kv_lens, uint16_t *out, int64_t out_row_stride, int num_seqs,
                                        int num_kv_heads, int group, int head_dim, int block_size, float scale,
                                        int tiles) {
    /* Prompt chunks go through prompt_row_tiles.c (with `tiles`); every other row (decodes, short chunks, all of them if the
     * tiles cannot allocate) through the loop below, listed in `rest` (NULL: every row). */
    int *rest = NULL, num_rest = num_seqs;
    if (tiles && num_seqs >= PROMPT_TILE_MIN_ROWS) {
        int *groups = malloc(sizeof(int) * 2 * (size_t)(num_seqs / PROMPT_TILE_MIN_ROWS));
        const int num_groups = groups ? find_prompt_groups(pages, max_pages, num_seqs, groups) : 0;
        rest = num_groups ? malloc(sizeof(int) * (size_t)num_seqs) : NULL;
        if (rest && prompt_row_tiles_bf16(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out,
                                          out_row_stride, num_kv_heads, group, head_dim, block_size, scale, groups,
                                          num_groups) == 0) {
            num_rest = 0;
            for (int i = 0, gi = 0; i < num_seqs; i++) {
                if (gi < num_groups && i >= groups[2 * gi] + groups[2 * gi + 1]) gi++;
                if (gi < num_groups && i >= groups[2 * gi]) continue;
                rest[num_rest++] = i;
            }
        } else {
            free(rest);
            rest = NULL;
        }
        free(groups);
    }
    int max_len = 0;
    for (int r = 0; r < num_rest; r++) {
        const int b = rest ? rest[r] : r;
        max_len = kv_lens[b] > max_len ? kv_lens[b] : max_len;
    }
    const size_t score_floats = (size_t)group * (size_t)((max_len + 15) / 16 * 16);
    int failed = 0, next_item = 0;
#pragma omp parallel
    {
        /* scores, then the 64-byte aligned rows of widened V */
        float *scores = aligned_alloc(64, sizeof(float) * ((score_floats + 15) / 16 * 16 + 16 * (size_t)head_dim));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        float *wide = scores + (score_floats + 15) / 16 * 16;
        /* Items claimed one ahead from a shared counter: a thread prefetches the item it will take next while
         * it computes the current one, and a thread slowed down (another process on its core) takes fewer. */
        const int items = num_rest * num_kv_heads;
#define ROW_OF(item) (rest ? rest[(item) / num_kv_heads] : (item) / num_kv_heads)
        int item = scores ? __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED) : items;
        if (item < items)
            prefetch_item(cache, pages + (int64_t)ROW_OF(item) * max_pages, kv_lens[ROW_OF(item)],
                          item % num_kv_heads, num_kv_heads, block_size, head_dim);
        while (item < items) {
            const int b = ROW_OF(item), h = item % num_kv_heads;
            const int next = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);
            if (next < items)
                prefetch_item(cache, pages + (int64_t)ROW_OF(next) * max_pages, kv_lens[ROW_OF(next)],
                              next % num_kv_heads, num_kv_heads, block_size, head_dim);
            const uint16_t *q0 = q + q_rows[b] * q_row_stride + (int64_t)h * group * head_dim;
            uint16_t *out0 = out + q_rows[b] * out_row_stride + (int64_t)h * group * head_dim;
            const int32_t *seq_pages = pages + (int64_t)b * max_pages;
            if (head_dim == 64)
                attend(64, q0, cache, seq_pages, kv_lens[b], h, num_kv_heads, block_size, group, scale, scores, wide, out0);
            else
                attend(128, q0, cache, seq_pages, kv_lens[b], h, num_kv_heads, block_size, group, scale, scores, wide, out0);
            item = next;
        }
#undef ROW_OF
        free(scores);
    }
    free(rest);
    return failed ? -2 : 0;
}
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

static int decode_attention_dispatch(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                                     const uint16_t *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                                     uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                                     int num_kv_heads, int head_dim, int block_size, float scale, int tiles) {
#ifdef HAVE_AVX512_BF16
    const int group = num_qo_heads / num_kv_heads;
    if (decode_attention_bf16_vectorized(head_dim, block_size) && group <= MAX_GROUP
        && group * num_kv_heads == num_qo_heads)
        return decode_attention_avx512_bf16(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out,
                                            out_row_stride, num_seqs, num_kv_heads, group, head_dim, block_size,
                                            scale, tiles);
#else
    (void)tiles;
#endif
    return decode_attention_bf16_generic(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out,
                                         out_row_stride, num_seqs, num_qo_heads, num_kv_heads, head_dim,
                                         block_size, scale);
}

/* The kernel: the AVX512-BF16 path where it applies (prompt chunks in tiles), else the plain loops. Same
 * arguments as above. */
int decode_attention_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                          const uint16_t *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                          uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                          int num_kv_heads, int head_dim, int block_size, float scale) {
    return decode_attention_dispatch(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out, out_row_stride,
                                     num_seqs, num_qo_heads, num_kv_heads, head_dim, block_size, scale, 1);
}

/* The same with every row on the per-row path, tiles or not (benchmarks/cpu_kernels.py compares the two). */
int decode_attention_bf16_rows(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                               const uint16_t *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                               uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale) {
    return decode_attention_dispatch(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out, out_row_stride,
                                     num_seqs, num_qo_heads, num_kv_heads, head_dim, block_size, scale, 0);
}
