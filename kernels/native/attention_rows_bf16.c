/* decode_attention_bf16's AVX512-BF16 path (head size 64 or 128, block sizes that are multiples of 16): the
 * plan's prompt chunks of at least PROMPT_TILE_MIN_ROWS rows go to prompt_row_tiles.c in tiles of 16 query
 * rows; every other row (decodes, short chunks) takes the per-row path below. Both compute
 * attention_order.h's arithmetic, so that a row's output does not depend on which of them took it.
 *
 * Per row, each (sequence, KV head) is one work item: its G query heads read the K and V rows once, in place
 * in the cache pages (no gather into a padded copy, no padding to the longest sequence):
 * - q.k with 16 keys in the lanes of a vector: 4 chunks of 16 keys transposed at a time into pairs along the
 *   head dimension (kt), then the bf16 dot-product instruction with each query pair broadcast, G x 4
 *   independent accumulators;
 * - softmax over 16 keys at a time (exp16), the numerators rounded to bfloat16;
 * - P . V over pairs of consecutive keys, V's two rows interleaved in registers, the probabilities' pair
 *   broadcast: no widening of V to float32.
 * Work items are claimed from a shared counter, one ahead, so that each thread prefetches its next item's
 * scattered pages while it computes the current one. The threads are torch's own OpenMP runtime's (see
 * decode_attention.c). Every row's result depends only on its own inputs, never on the rest of the step.
 */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_order.h"
#include "kv_formats.h"
#include "vexp.h"

#define PROMPT_TILE_MIN_ROWS 8 /* prompt chunks of at least this many rows go through prompt_row_tiles.c */
#define KEY_CHUNKS 4           /* chunks of 16 keys whose scores are computed together */

/* The cache row of slot k of KV head h's K (kv 0) or V (kv 1) in a sequence's pages (kv_formats.h's rows). */
static inline int64_t cache_row(const int32_t *seq_pages, int k, int kv, int h, int num_kv_heads, int block_size) {
    return (((int64_t)seq_pages[k / block_size] * 2 + kv) * num_kv_heads + h) * block_size + k % block_size;
}

/* One (sequence, KV head)'s K and V rows toward L2: issued one item ahead, so that the scattered
 * pages' misses overlap with the work on the item before. */
static inline void prefetch_item(const void *cache, int64_t row_bytes, const int32_t *seq_pages, int len, int h,
                                 int num_kv_heads, int block_size) {
    for (int t0 = 0; t0 < len; t0 += block_size) {
        const char *k_page = (const char *)cache + cache_row(seq_pages, t0, 0, h, num_kv_heads, block_size) * row_bytes;
        const char *v_page = (const char *)cache + cache_row(seq_pages, t0, 1, h, num_kv_heads, block_size) * row_bytes;
        const int64_t bytes = (len - t0 < block_size ? len - t0 : block_size) * row_bytes;
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(k_page + line, _MM_HINT_T1);
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(v_page + line, _MM_HINT_T1);
    }
}

/* Keys [t, t + 16) (one page's, block_size a multiple of 16; the first at cache row k) transposed: kt[i] lane
 * j = pair i of key t + j; an int8 cache's row scales into ks[0, 16). Keys past len are still inside the page:
 * their lanes hold any bits and are never used. */
static inline __attribute__((always_inline)) void transpose_keys(const int DIM, const int KIND, const void *cache,
                                                                 int64_t k, uint32_t *kt, float *ks) {
    for (int b = 0; b < DIM / 2; b += 16) {
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) r[i] = (__m512)kv_load32(KIND, DIM, cache, k + i, 2 * b);
        transpose16(r);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) _mm512_store_ps((float *)kt + (b + i) * 16, r[i]);
    }
    if (KIND == KV_INT8) memcpy(ks, kv_int8_scale(cache, k, DIM), sizeof(float) * 16); /* k: a group's first row */
}

/* Step 1 for HP query heads (q0: the first, DIM apart) over C transposed chunks of kt: scores at s (head g's
 * at s + g * stride, chunk c's 16 keys at + 16 c); an int8 cache's: times the keys' row scales ks first.
 * HP, C and KIND constants at each call: HP * C accumulators. */
static inline __attribute__((always_inline)) void score_chunks(const int DIM, const int HP, const int C,
                                                               const int KIND, const uint32_t *kt, const float *ks,
                                                               const uint16_t *q0, __m512 vscale, float *s,
                                                               int stride) {
    const int NP = DIM / 2;
    const uint32_t *qp = (const uint32_t *)q0;
    __m512 acc[4][KEY_CHUNKS];
#pragma GCC unroll 4
    for (int g = 0; g < HP; g++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    for (int i = 0; i < NP; i++) {
        __m512bh kv[KEY_CHUNKS];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) kv[c] = (__m512bh)_mm512_load_si512(kt + (c * NP + i) * 16);
#pragma GCC unroll 4
        for (int g = 0; g < HP; g++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[g * NP + i]);
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], qb, kv[c]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < HP; g++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const __m512 a = KIND == KV_INT8 ? _mm512_mul_ps(acc[g][c], _mm512_loadu_ps(ks + 16 * c)) : acc[g][c];
            _mm512_store_ps(s + g * stride + 16 * c, _mm512_mul_ps(a, vscale));
        }
}

/* Steps 2-5 for one query head: its scores s[0, len) -> bfloat16 numerators p[0, round_up(len, 16)) (0 past
 * len; an int8 cache's times the V rows' scales vs, 0 past len); returns 1 / sum. */
static inline float softmax_row(const float *s, const float *vs, uint16_t *p, int len) {
    __m512 max = _mm512_set1_ps(-3.0e38f);
    for (int t = 0; t < len; t += 16) {
        const __mmask16 in = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        max = _mm512_mask_max_ps(max, in, max, _mm512_load_ps(s + t));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(max));
    __m512 partial = _mm512_setzero_ps();
    for (int t = 0; t < len; t += 16) {
        const __mmask16 in = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_maskz_load_ps(in, s + t), m)));
        partial = _mm512_add_ps(partial, e);
        const __m512 numerator = vs ? _mm512_mul_ps(e, _mm512_load_ps(vs + t)) : e;
        _mm256_store_si256((__m256i *)(p + t), (__m256i)_mm512_cvtneps_pbh(numerator));
    }
    const float sum = sum_tree16_lanes(partial);
    return sum > 0.0f ? 1.0f / sum : 0.0f;
}

/* Steps 6-7 for HP query heads (their numerators at p, stride apart; out0: the first head's output) over
 * output columns [c0, c0 + CW): HP * CW / 16 accumulators. */
static inline __attribute__((always_inline)) void weighted_v(
    const int DIM, const int HP, const int CW, const int KIND, const void *cache, const int32_t *seq_pages, int len,
    int h, int num_kv_heads, int block_size, const uint16_t *p, int stride, const float *inv, int c0, uint16_t *out0) {
    const int NV = CW / 16;
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int g = 0; g < HP; g++)
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++) acc[g][j] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < len; t0 += block_size) {
        int64_t v = cache_row(seq_pages, t0, 1, h, num_kv_heads, block_size);
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int i = 0; i < n; i += 2, v += 2) {
            const int odd = i + 1 < n; /* the pair's second key exists (block_size is even: same page) */
            __m512i pairs[8];
#pragma GCC unroll 4
            for (int j = 0; j < CW / 32; j++)
                pair_rows(kv_load32(KIND, DIM, cache, v, c0 + 32 * j),
                          odd ? kv_load32(KIND, DIM, cache, v + 1, c0 + 32 * j) : _mm512_setzero_si512(),
                          &pairs[2 * j], &pairs[2 * j + 1]);
#pragma GCC unroll 4
            for (int g = 0; g < HP; g++) {
                uint32_t pp;
                memcpy(&pp, p + g * stride + t0 + i, sizeof pp);
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp);
#pragma GCC unroll 8
                for (int j = 0; j < NV; j++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], pb, (__m512bh)pairs[j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < HP; g++) {
        const __m512 scale = _mm512_set1_ps(inv[g]);
#pragma GCC unroll 8
        for (int j = 0; j < NV; j++)
            _mm256_storeu_si256((__m256i *)(out0 + (int64_t)g * DIM + c0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][j], scale)));
    }
}

/* One (sequence, KV head), its group's query heads with HP at a time (HP, DIM, KIND constants at each call).
 * Scratch: s group * stride floats, p group * stride bfloat16 (stride = round_up(len, 16)), kt
 * KEY_CHUNKS * DIM / 2 * 16 uint32, ks KEY_CHUNKS * 16 floats, vs stride floats, all 64-byte aligned. */
static inline __attribute__((always_inline)) void attend(
    const int DIM, const int HP, const int KIND, const uint16_t *q0, const void *cache, const int32_t *seq_pages,
    int len, int h, int num_kv_heads, int block_size, int group, float scale, float *s, uint16_t *p, uint32_t *kt,
    float *ks, float *vs, uint16_t *out0) {
    const int stride = (len + 15) / 16 * 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t = 0; t < len; t += 16 * KEY_CHUNKS) {
        const int chunks = (len - t + 15) / 16 < KEY_CHUNKS ? (len - t + 15) / 16 : KEY_CHUNKS;
        for (int c = 0; c < chunks; c++)
            transpose_keys(DIM, KIND, cache, cache_row(seq_pages, t + 16 * c, 0, h, num_kv_heads, block_size),
                           kt + c * (DIM / 2) * 16, ks + 16 * c);
        for (int g = 0; g < group; g += HP) {
            if (chunks == KEY_CHUNKS)
                score_chunks(DIM, HP, KEY_CHUNKS, KIND, kt, ks, q0 + (int64_t)g * DIM, vscale, s + g * stride + t,
                             stride);
            else
                for (int c = 0; c < chunks; c++)
                    score_chunks(DIM, HP, 1, KIND, kt + c * (DIM / 2) * 16, ks + 16 * c, q0 + (int64_t)g * DIM,
                                 vscale, s + g * stride + t + 16 * c, stride);
        }
    }
    if (KIND == KV_INT8) {
        for (int t0 = 0; t0 < len; t0 += block_size) { /* a page at a time: its rows are consecutive */
            const int64_t row = cache_row(seq_pages, t0, 1, h, num_kv_heads, block_size);
            for (int i = 0; i < block_size && t0 + i < len; i += 16) /* a group's 16 scales at a time */
                memcpy(vs + t0 + i, kv_int8_scale(cache, row + i, DIM), sizeof(float) * 16);
        }
        for (int k = len; k < stride; k++) vs[k] = 0.0f; /* past len: what the groups held there */
    }
    float inv[16];
    for (int g = 0; g < group; g++)
        inv[g] = softmax_row(s + g * stride, KIND == KV_INT8 ? vs : NULL, p + g * stride, len);
    const int CW = HP * DIM / 16 <= 16 ? DIM : 64; /* at most 16 accumulators */
    for (int g = 0; g < group; g += HP)
        for (int c0 = 0; c0 < DIM; c0 += CW)
            weighted_v(DIM, HP, CW, KIND, cache, seq_pages, len, h, num_kv_heads, block_size, p + g * stride, stride,
                       inv + g, c0, out0 + (int64_t)g * DIM);
}

int prompt_row_tiles_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const void *cache,
                          const int32_t *pages, int max_pages, const int32_t *kv_lens, uint16_t *out,
                          int64_t out_row_stride, int num_kv_heads, int group, int head_dim, int block_size,
                          float scale, const int *groups, int num_groups, int kv_kind);

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

/* Prompt chunks through the tiles (with `tiles`); the rows left to the per-row path into rest (the caller frees
 * it), or NULL for all of them (no chunk, or the tiles could not allocate). */
static int *tile_prompt_chunks(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const void *cache,
                               const int32_t *pages, int max_pages, const int32_t *kv_lens, uint16_t *out,
                               int64_t out_row_stride, int num_seqs, int num_kv_heads, int group, int head_dim,
                               int block_size, float scale, int kv_kind, int *num_rest) {
    *num_rest = num_seqs;
    if (num_seqs < PROMPT_TILE_MIN_ROWS) return NULL;
    int *groups = malloc(sizeof(int) * 2 * (size_t)(num_seqs / PROMPT_TILE_MIN_ROWS));
    const int num_groups = groups ? find_prompt_groups(pages, max_pages, num_seqs, groups) : 0;
    int *rest = num_groups ? malloc(sizeof(int) * (size_t)num_seqs) : NULL;
    if (rest && prompt_row_tiles_bf16(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out, out_row_stride,
                                      num_kv_heads, group, head_dim, block_size, scale, groups, num_groups,
                                      kv_kind) == 0) {
        *num_rest = 0;
        for (int i = 0, gi = 0; i < num_seqs; i++) {
            if (gi < num_groups && i >= groups[2 * gi] + groups[2 * gi + 1]) gi++;
            if (gi < num_groups && i >= groups[2 * gi]) continue;
            rest[(*num_rest)++] = i;
        }
    } else {
        free(rest);
        rest = NULL;
    }
    free(groups);
    return rest;
}

/* decode_attention_bf16's arguments (group: query heads per KV head, at most 16); `tiles` 0 keeps every row on
 * the per-row path (the same bits: benchmarks/cpu_kernels.py compares their speed); kv_kind: the cache holds
 * e4m3 (kv_kind.h), else bfloat16. Returns 0, or -2 when scratch cannot be allocated. */
int attention_rows_avx512_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const void *cache,
                               const int32_t *pages, int max_pages, const int32_t *kv_lens, uint16_t *out,
                               int64_t out_row_stride, int num_seqs, int num_kv_heads, int group, int head_dim,
                               int block_size, float scale, int tiles, int kv_kind) {
    int num_rest = num_seqs;
    int *rest = tiles ? tile_prompt_chunks(q, q_row_stride, q_rows, cache, pages, max_pages, kv_lens, out,
                                           out_row_stride, num_seqs, num_kv_heads, group, head_dim, block_size, scale,
                                           kv_kind, &num_rest)
                      : NULL;
    int max_len = 0;
    for (int r = 0; r < num_rest; r++) {
        const int b = rest ? rest[r] : r;
        max_len = kv_lens[b] > max_len ? kv_lens[b] : max_len;
    }
    const size_t slots = (size_t)group * (size_t)((max_len + 15) / 16 * 16);
    const size_t score_bytes = (sizeof(float) * slots + 63) / 64 * 64, p_bytes = (2 * slots + 63) / 64 * 64;
    const size_t kt_bytes = sizeof(uint32_t) * KEY_CHUNKS * (size_t)head_dim / 2 * 16;
    const size_t ks_bytes = sizeof(float) * KEY_CHUNKS * 16;
    const size_t vs_bytes = (sizeof(float) * (size_t)((max_len + 15) / 16 * 16) + 63) / 64 * 64;
    const int hp = heads_together(group);
    const int64_t row_bytes = kv_row_bytes(kv_kind, head_dim);
    int failed = 0, next_item = 0;
#pragma omp parallel
    {
        char *scratch = aligned_alloc(64, score_bytes + p_bytes + kt_bytes + ks_bytes + vs_bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        float *s = (float *)scratch;
        uint16_t *p = (uint16_t *)(scratch + score_bytes);
        uint32_t *kt = (uint32_t *)(scratch + score_bytes + p_bytes);
        float *ks = (float *)(scratch + score_bytes + p_bytes + kt_bytes);
        float *vs = (float *)(scratch + score_bytes + p_bytes + kt_bytes + ks_bytes);
        const int items = num_rest * num_kv_heads;
#define ROW_OF(item) (rest ? rest[(item) / num_kv_heads] : (item) / num_kv_heads)
        int item = scratch ? __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED) : items;
        if (item < items)
            prefetch_item(cache, row_bytes, pages + (int64_t)ROW_OF(item) * max_pages, kv_lens[ROW_OF(item)],
                          item % num_kv_heads, num_kv_heads, block_size);
        while (item < items) {
            const int b = ROW_OF(item), h = item % num_kv_heads;
            const int next = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED);
            if (next < items)
                prefetch_item(cache, row_bytes, pages + (int64_t)ROW_OF(next) * max_pages, kv_lens[ROW_OF(next)],
                              next % num_kv_heads, num_kv_heads, block_size);
            const uint16_t *q0 = q + q_rows[b] * q_row_stride + (int64_t)h * group * head_dim;
            uint16_t *out0 = out + q_rows[b] * out_row_stride + (int64_t)h * group * head_dim;
            const int32_t *seq_pages = pages + (int64_t)b * max_pages;
#define ATTEND_KIND(DIM, HP, KIND) attend(DIM, HP, KIND, q0, cache, seq_pages, kv_lens[b], h, num_kv_heads, \
                                          block_size, group, scale, s, p, kt, ks, vs, out0)
#define ATTEND(DIM, HP)                                                                                          \
    do {                                                                                                         \
        if (kv_kind == KV_FP8) ATTEND_KIND(DIM, HP, KV_FP8);                                                     \
        else if (kv_kind == KV_INT8) ATTEND_KIND(DIM, HP, KV_INT8);                                              \
        else ATTEND_KIND(DIM, HP, KV_BF16);                                                                      \
    } while (0)
            if (head_dim == 64) {
                if (hp == 4) ATTEND(64, 4); else if (hp == 3) ATTEND(64, 3); else if (hp == 2) ATTEND(64, 2);
                else ATTEND(64, 1);
            } else {
                if (hp == 4) ATTEND(128, 4); else if (hp == 3) ATTEND(128, 3); else if (hp == 2) ATTEND(128, 2);
                else ATTEND(128, 1);
            }
#undef ATTEND
#undef ATTEND_KIND
            item = next;
        }
#undef ROW_OF
        free(scratch);
    }
    free(rest);
    return failed ? -2 : 0;
}
#endif
