/* Prompt rows of a decode_attention_bf16 plan in tiles of 16 query rows, on CPUs with AVX512-BF16
 * (attention_rows_bf16.c hands over its groups: consecutive plan rows, at least PROMPT_TILE_MIN_ROWS, that share
 * one page table, i.e. a prompt chunk; decode rows stay on its per-row path).
 *
 * The per-row path puts 16 keys of one query row in the lanes of a vector; here the 16 lanes are 16 query rows
 * of one head instead (the tile), so that each key and value is read once per tile, not once per row:
 * - q.k: the tile's q, transposed once into pairs of bfloat16 along the head dimension, times each key's pair
 *   broadcast from the cache page (the bf16 dot-product instruction, float32 accumulation): two instructions
 *   per (row, key) at head size 64, no cross-lane sums; K is read in place, never copied;
 * - softmax per lane over the keys each row sees (its own kv_len: causal, any cached prefix);
 * - P . V with the same instruction: V re-laid once per (group, KV head) into pairs of consecutive keys;
 *   the output tile transposed back to rows once per 16 columns.
 * An fp8 or int8 cache (kv_formats.h) is widened to bfloat16 as V is re-laid, and K is widened once per (group,
 * KV head) into a buffer that the tiles read instead of the pages; an int8 cache's row scales are gathered
 * beside them.
 * Two passes (all scores of a tile, then P . V): no online rescaling.
 *
 * Each lane runs attention_order.h's arithmetic, step for step, as the per-row path does: a row's result is
 * the same bits in a tile, in a shorter chunk or as a decode, and never depends on the other rows of its tile
 * or of the step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "attention_order.h"
#include "kv_formats.h"
#include "vexp.h"

#define TILE 16 /* query rows per tile: the lanes of a float32 vector */

typedef struct {
    int first, rows;   /* plan rows [first, first + rows) */
    int keys;          /* the largest kv_len among them */
    int64_t v_offset;  /* this group's re-laid V in the shared buffer, uint32 units (KV head h: + h * pairs * D) */
    int64_t k_offset;  /* fp8, int8: this group's widened K, bfloat16 units (KV head h: + h * key_rows(keys) * D) */
    int64_t s_offset;  /* int8: this group's K and V row scales, floats (KV head h: K + h * 2 * key_rows(keys), V
                        * key_rows(keys) further; 0 past keys) */
} tile_group;

/* The K rows widened per (group, KV head): whole runs of 16 keys (the tiles read up to KB <= 16 keys past the
 * last, inside its page). */
static inline int64_t key_rows(int keys) { return (keys + 15) / 16 * 16; }

/* The cache row of slot k of KV head h's K (kv 0) or V (kv 1) in a page table (kv_formats.h's rows). */
static inline int64_t cache_row(const int32_t *pages, int k, int kv, int h, int num_kv_heads, int block_size) {
    return (((int64_t)pages[k / block_size] * 2 + kv) * num_kv_heads + h) * block_size + k % block_size;
}

/* 32 columns of a cache row as bfloat16, whichever the kind (kv_load32's constant kinds). */
static inline __m512i load32(int kind, int head_dim, const void *cache, int64_t row, int d) {
    return kind == KV_FP8 ? kv_load32(KV_FP8, head_dim, cache, row, d)
           : kind == KV_INT8 ? kv_load32(KV_INT8, head_dim, cache, row, d)
                             : kv_load32(KV_BF16, head_dim, cache, row, d);
}

/* KV head h's V rows [0, keys) of a page table -> pairs [ceil(keys / 2)][D] of uint32 (V[2p][d] | V[2p+1][d] << 16);
 * a missing odd key is 0 (the slot past the last written one may hold any bits, NaN included). */
static void relayout_v(const void *cache, int kind, const int32_t *pages, int keys, int h, int num_kv_heads,
                       int block_size, int head_dim, uint32_t *vt) {
    for (int p = 0; p < (keys + 1) / 2; p++) {
        const int k0 = 2 * p, k1 = k0 + 1;
        const int64_t e = cache_row(pages, k0, 1, h, num_kv_heads, block_size);
        const int64_t o = k1 < keys ? cache_row(pages, k1, 1, h, num_kv_heads, block_size) : -1;
        uint32_t *dst = vt + (int64_t)p * head_dim;
        for (int d = 0; d < head_dim; d += 32) {
            __m512i lo, hi;
            pair_rows(load32(kind, head_dim, cache, e, d),
                      o >= 0 ? load32(kind, head_dim, cache, o, d) : _mm512_setzero_si512(), &lo, &hi);
            _mm512_storeu_si512(dst + d, lo);
            _mm512_storeu_si512(dst + d + 16, hi);
        }
    }
}

/* An fp8 or int8 cache's K rows [0, key_rows(keys)) of KV head h -> bfloat16 rows [key_rows][D] at kb; an int8
 * cache's K and V row scales [0, keys) into ks and vs (0 up to key_rows(keys)). */
static void widen_k(const void *cache, int kind, const int32_t *pages, int keys, int h, int num_kv_heads,
                    int block_size, int head_dim, uint16_t *kb, float *ks, float *vs) {
    for (int k0 = 0; k0 < key_rows(keys); k0 += 16) { /* 16 keys of one page (block_size a multiple of 16) */
        const int64_t k_row = cache_row(pages, k0, 0, h, num_kv_heads, block_size);
        const int64_t v_row = cache_row(pages, k0, 1, h, num_kv_heads, block_size);
        for (int i = 0; i < 16; i++) {
            const int k = k0 + i;
            for (int d = 0; d < head_dim; d += 32)
                _mm512_storeu_si512(kb + (int64_t)k * head_dim + d, load32(kind, head_dim, cache, k_row + i, d));
            if (kind == KV_INT8) {
                ks[k] = k < keys ? kv_row_scale(cache, k_row + i, head_dim) : 0.0f;
                vs[k] = k < keys ? kv_row_scale(cache, v_row + i, head_dim) : 0.0f;
            }
        }
    }
}

/* One tile: rows [r0, r0 + m) (m <= 16) of a group, for the HP query heads head0 .. head0 + HP - 1 of one KV head
 * (they read the same K and V, so each broadcast key or value pair feeds HP products). DIM and HP are constants at
 * each call; KB keys (q.k) and KB output columns (P . V) at a time, HP * KB accumulators. K from the bfloat16
 * cache's pages, or from kb (an fp8 or int8 cache's rows widened by widen_k) where it is not NULL; ks, vs: an
 * int8 cache's K and V row scales (else NULL). Per-thread scratch:
 * qt HP * DIM / 2 * 16 uint32, s HP * 16 * round_up(keys, 16) floats, p HP * 16 * ceil(keys / 2) uint32,
 * ot 16 * DIM floats. */
static inline __attribute__((always_inline)) void tile(
    const int DIM, const int HP, const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const uint16_t *cache,
    const uint16_t *kb, const float *ks, const float *vs, const int32_t *seq_pages, const int32_t *kv_lens,
    uint16_t *out, int64_t out_row_stride, int num_kv_heads,
    int block_size, float scale, int r0, int m, int h, int head0, const uint32_t *vt, uint32_t *qt, float *s,
    uint32_t *p, float *ot) {
    const int NP = DIM / 2, KB = HP == 1 ? 16 : HP == 2 ? 8 : HP == 3 ? 8 : 4;
    const int64_t run = (int64_t)block_size * DIM;
    /* Each lane's kv_len (0 past m: those lanes see no key) and the tile's largest. */
    int lens_arr[TILE];
    int keys = 0;
    for (int l = 0; l < TILE; l++) {
        lens_arr[l] = l < m ? kv_lens[r0 + l] : 0;
        keys = lens_arr[l] > keys ? lens_arr[l] : keys;
    }
    const __m512i lens = _mm512_loadu_si512(lens_arr);
    const int64_t key_slots = (keys + 15) / 16 * 16, pairs = (keys + 1) / 2;
    /* q transposed: qt[head][pair][lane], 16 pairs at a time. */
    for (int g = 0; g < HP; g++)
        for (int j0 = 0; j0 < NP; j0 += 16) {
            __m512 r[16];
            for (int l = 0; l < TILE; l++)
                r[l] = l < m ? _mm512_loadu_ps(q + q_rows[r0 + l] * q_row_stride + (int64_t)(head0 + g) * DIM + 2 * j0)
                             : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_store_ps((float *)qt + (g * NP + j0 + j) * TILE, r[j]);
        }
    /* Scores s[head][key][lane], KB keys of one page's run (block_size is a multiple of 16) at a time. */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int k0 = 0; k0 < keys; k0 += KB) {
        const uint16_t *k_at = kb ? kb + (int64_t)k0 * DIM
                                  : cache + ((int64_t)seq_pages[k0 / block_size] * 2 * num_kv_heads + h) * run
                                        + (int64_t)(k0 % block_size) * DIM;
        const uint32_t *kp = (const uint32_t *)k_at;
        __m512 acc[4][16];
#pragma GCC unroll 4
        for (int g = 0; g < HP; g++)
#pragma GCC unroll 16
            for (int j = 0; j < KB; j++) acc[g][j] = _mm512_setzero_ps();
        for (int i = 0; i < NP; i++) {
            __m512bh qv[4];
#pragma GCC unroll 4
            for (int g = 0; g < HP; g++) qv[g] = (__m512bh)_mm512_load_si512(qt + (g * NP + i) * TILE);
#pragma GCC unroll 16
            for (int j = 0; j < KB; j++) {
                const __m512bh kv = (__m512bh)_mm512_set1_epi32((int)kp[j * NP + i]);
#pragma GCC unroll 4
                for (int g = 0; g < HP; g++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qv[g], kv);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < HP; g++)
#pragma GCC unroll 16
            for (int j = 0; j < KB; j++) {
                const __m512 a = ks ? _mm512_mul_ps(acc[g][j], _mm512_set1_ps(ks[k0 + j])) : acc[g][j];
                _mm512_store_ps(s + (g * key_slots + k0 + j) * TILE, _mm512_mul_ps(a, vscale));
            }
    }
    /* Softmax per (head, lane) over the lane's keys [0, lens): the maximum, then the numerators (summed in
     * float32, kept as bfloat16 pairs of consecutive keys, 0 where a lane does not see the key). */
    static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512(pair_idx);
    __m512 inv[4];
    int min_len = keys; /* keys [0, min_len) are seen by every lane of the tile: no masks there */
    for (int l = 0; l < m; l++) min_len = lens_arr[l] < min_len ? lens_arr[l] : min_len;
    for (int g = 0; g < HP; g++) {
        const float *sg = s + g * key_slots * TILE;
        __m512 max = _mm512_set1_ps(-3.0e38f);
        int k = 0;
        for (; k < min_len; k++) max = _mm512_max_ps(max, _mm512_load_ps(sg + (int64_t)k * TILE));
        for (; k < keys; k++) {
            const __mmask16 sees = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(k));
            max = _mm512_mask_max_ps(max, sees, max, _mm512_load_ps(sg + (int64_t)k * TILE));
        }
        /* attention_order.h's step 4: partial j of a lane sums its keys j, j + 16, ... */
        __m512 partial[16];
        for (int j = 0; j < 16; j++) partial[j] = _mm512_setzero_ps();
        int k0 = 0;
        for (; k0 + 16 <= min_len; k0 += 16)
#pragma GCC unroll 8
            for (int j = 0; j < 16; j += 2) {
                const __m512 e0 = exp16(_mm512_sub_ps(_mm512_load_ps(sg + (int64_t)(k0 + j) * TILE), max));
                const __m512 e1 = exp16(_mm512_sub_ps(_mm512_load_ps(sg + (int64_t)(k0 + j + 1) * TILE), max));
                partial[j] = _mm512_add_ps(partial[j], e0);
                partial[j + 1] = _mm512_add_ps(partial[j + 1], e1);
                const __m512 n0 = vs ? _mm512_mul_ps(e0, _mm512_set1_ps(vs[k0 + j])) : e0;
                const __m512 n1 = vs ? _mm512_mul_ps(e1, _mm512_set1_ps(vs[k0 + j + 1])) : e1;
                _mm512_store_si512(p + (g * pairs + (k0 + j) / 2) * TILE,
                                   _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(n1, n0)));
            }
        for (; k0 < keys; k0 += 16)
#pragma GCC unroll 8
            for (int j = 0; j < 16; j += 2) {
                const int k = k0 + j;
                const __mmask16 sees0 = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(k));
                const __mmask16 sees1 = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(k + 1));
                const __m512 e0 = _mm512_maskz_mov_ps(sees0, exp16(_mm512_sub_ps(_mm512_maskz_load_ps(sees0, sg + (int64_t)k * TILE), max)));
                const __m512 e1 = _mm512_maskz_mov_ps(sees1, exp16(_mm512_sub_ps(_mm512_maskz_load_ps(sees1, sg + (int64_t)(k + 1) * TILE), max)));
                partial[j] = _mm512_add_ps(partial[j], e0);
                partial[j + 1] = _mm512_add_ps(partial[j + 1], e1);
                const __m512 n0 = vs ? _mm512_mul_ps(e0, _mm512_set1_ps(vs[k])) : e0; /* vs: 0 past keys */
                const __m512 n1 = vs ? _mm512_mul_ps(e1, _mm512_set1_ps(vs[k + 1])) : e1;
                if (k < keys)
                    _mm512_store_si512(p + (g * pairs + k / 2) * TILE,
                                       _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(n1, n0)));
            }
        inv[g] = _mm512_maskz_div_ps(_mm512_cmpgt_epi32_mask(lens, _mm512_setzero_si512()), _mm512_set1_ps(1.0f),
                                     sum_tree16(partial));
    }
    /* P . V, KB output columns of every head at a time, into ot[head][column][lane]; then each lane's rows out. */
    for (int c0 = 0; c0 < DIM; c0 += KB) {
        __m512 acc[4][16];
#pragma GCC unroll 4
        for (int g = 0; g < HP; g++)
#pragma GCC unroll 16
            for (int j = 0; j < KB; j++) acc[g][j] = _mm512_setzero_ps();
        for (int i = 0; i < pairs; i++) {
            __m512bh pv[4];
#pragma GCC unroll 4
            for (int g = 0; g < HP; g++) pv[g] = (__m512bh)_mm512_load_si512(p + (g * pairs + i) * TILE);
            const uint32_t *vrow = vt + (int64_t)i * DIM + c0;
#pragma GCC unroll 16
            for (int j = 0; j < KB; j++) {
                const __m512bh vv = (__m512bh)_mm512_set1_epi32((int)vrow[j]);
#pragma GCC unroll 4
                for (int g = 0; g < HP; g++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], pv[g], vv);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < HP; g++)
#pragma GCC unroll 16
            for (int j = 0; j < KB; j++) _mm512_store_ps(ot + ((int64_t)g * DIM + c0 + j) * TILE, _mm512_mul_ps(acc[g][j], inv[g]));
    }
    for (int g = 0; g < HP; g++)
        for (int c0 = 0; c0 < DIM; c0 += 16) {
            __m512 r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps(ot + ((int64_t)g * DIM + c0 + j) * TILE);
            transpose16(r);
            for (int l = 0; l < m; l++)
                _mm256_storeu_si256((__m256i *)(out + q_rows[r0 + l] * out_row_stride + (int64_t)(head0 + g) * DIM + c0),
                                    (__m256i)_mm512_cvtneps_pbh(r[l]));
        }
}

/* groups: [first, rows] pairs of plan rows (each group's rows share one page table: pages row `first`).
 * The other arguments as attention_rows_avx512_bf16's; head_dim 64 or 128, block_size a multiple of 16.
 * Returns 0, or -2 when a buffer cannot be allocated (nothing written then). */
int prompt_row_tiles_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows, const void *cache,
                          const int32_t *pages, int max_pages, const int32_t *kv_lens, uint16_t *out,
                          int64_t out_row_stride, int num_kv_heads, int group, int head_dim, int block_size,
                          float scale, const int *groups, int num_groups, int kv_kind) {
    if (num_groups <= 0) return 0;
    const int num_heads = num_kv_heads * group, hp = heads_together(group);
    tile_group *g = malloc(sizeof(tile_group) * (size_t)num_groups);
    if (!g) return -2;
    int64_t v_total = 0, k_total = 0, s_total = 0, max_keys = 0, items = 0;
    for (int i = 0; i < num_groups; i++) {
        g[i].first = groups[2 * i];
        g[i].rows = groups[2 * i + 1];
        g[i].keys = 0;
        for (int r = g[i].first; r < g[i].first + g[i].rows; r++) g[i].keys = kv_lens[r] > g[i].keys ? kv_lens[r] : g[i].keys;
        g[i].v_offset = v_total;
        v_total += (int64_t)num_kv_heads * ((g[i].keys + 1) / 2) * head_dim;
        g[i].k_offset = k_total;
        k_total += kv_kind != KV_BF16 ? (int64_t)num_kv_heads * key_rows(g[i].keys) * head_dim : 0;
        g[i].s_offset = s_total;
        s_total += kv_kind == KV_INT8 ? (int64_t)num_kv_heads * 2 * key_rows(g[i].keys) : 0;
        max_keys = g[i].keys > max_keys ? g[i].keys : max_keys;
        items += (int64_t)(num_heads / hp) * ((g[i].rows + TILE - 1) / TILE);
    }
    /* Work items (group, first of hp heads, tile), the tiles with the most keys first: the last ones to finish are small. */
    int32_t *work = malloc(sizeof(int32_t) * 3 * (size_t)items);
    uint32_t *vt = aligned_alloc(64, sizeof(uint32_t) * (size_t)((v_total + 15) / 16 * 16 + 16));
    uint16_t *kb = kv_kind != KV_BF16 ? aligned_alloc(64, sizeof(uint16_t) * (size_t)((k_total + 31) / 32 * 32)) : NULL;
    float *scales = kv_kind == KV_INT8 ? malloc(sizeof(float) * (size_t)s_total) : NULL;
    if (!work || !vt || (kv_kind != KV_BF16 && !kb) || (kv_kind == KV_INT8 && !scales)) {
        free(g), free(work), free(vt), free(kb), free(scales);
        return -2;
    }
    int max_tiles = 0;
    for (int i = 0; i < num_groups; i++) max_tiles = (g[i].rows + TILE - 1) / TILE > max_tiles ? (g[i].rows + TILE - 1) / TILE : max_tiles;
    int64_t n = 0;
    for (int t = max_tiles - 1; t >= 0; t--)
        for (int i = 0; i < num_groups; i++)
            if (t * TILE < g[i].rows)
                for (int head = 0; head < num_heads; head += hp) {
                    work[3 * n] = i, work[3 * n + 1] = head, work[3 * n + 2] = t;
                    n++;
                }
    const int64_t key_slots = (max_keys + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel
    {
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(hp * TILE * key_slots));
        uint32_t *p = aligned_alloc(64, sizeof(uint32_t) * (size_t)(hp * TILE * (key_slots / 2 + 1)));
        uint32_t *qt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(hp * TILE * head_dim / 2));
        float *ot = aligned_alloc(64, sizeof(float) * (size_t)(hp * TILE * head_dim));
        if (!s || !p || !qt || !ot) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (int i = 0; i < num_groups; i++)
            for (int h = 0; h < num_kv_heads; h++) {
                const int32_t *group_pages = pages + (int64_t)g[i].first * max_pages;
                relayout_v(cache, kv_kind, group_pages, g[i].keys, h, num_kv_heads, block_size, head_dim,
                           vt + g[i].v_offset + (int64_t)h * ((g[i].keys + 1) / 2) * head_dim);
                if (kv_kind != KV_BF16) {
                    float *ks = scales ? scales + g[i].s_offset + (int64_t)h * 2 * key_rows(g[i].keys) : NULL;
                    widen_k(cache, kv_kind, group_pages, g[i].keys, h, num_kv_heads, block_size, head_dim,
                            kb + g[i].k_offset + (int64_t)h * key_rows(g[i].keys) * head_dim, ks,
                            ks ? ks + key_rows(g[i].keys) : NULL);
                }
            }
        /* (the implicit barrier: every group's V, and an fp8 cache's K, is re-laid before any tile reads it) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n; w++) {
            if (failed) continue;
            const tile_group *gi = &g[work[3 * w]];
            const int head = work[3 * w + 1], t = work[3 * w + 2];
            const int r0 = gi->first + t * TILE, m = gi->rows - t * TILE < TILE ? gi->rows - t * TILE : TILE;
            const int32_t *seq_pages = pages + (int64_t)gi->first * max_pages;
            const uint32_t *v_head = vt + gi->v_offset + (int64_t)(head / group) * ((gi->keys + 1) / 2) * head_dim;
            const uint16_t *k_head = kb ? kb + gi->k_offset + (int64_t)(head / group) * key_rows(gi->keys) * head_dim : NULL;
            const float *ks = scales ? scales + gi->s_offset + (int64_t)(head / group) * 2 * key_rows(gi->keys) : NULL;
            const float *vs = ks ? ks + key_rows(gi->keys) : NULL;
#define TILE_CALL(DIM, HP) tile(DIM, HP, q, q_row_stride, q_rows, (const uint16_t *)cache, k_head, ks, vs, seq_pages, kv_lens, out, out_row_stride, \
                                 num_kv_heads, block_size, scale, r0, m, head / group, head, v_head, qt, s, p, ot)
            if (head_dim == 64) {
                if (hp == 4) TILE_CALL(64, 4); else if (hp == 3) TILE_CALL(64, 3); else if (hp == 2) TILE_CALL(64, 2);
                else TILE_CALL(64, 1);
            } else {
                if (hp == 4) TILE_CALL(128, 4); else if (hp == 3) TILE_CALL(128, 3); else if (hp == 2) TILE_CALL(128, 2);
                else TILE_CALL(128, 1);
            }
#undef TILE_CALL
        }
        free(s), free(p), free(qt), free(ot);
    }
    free(g), free(work), free(vt), free(kb), free(scales);
    return failed ? -2 : 0;
}
#endif
