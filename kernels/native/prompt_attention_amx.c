/* Causal attention of one prompt chunk on AMX tiles, bfloat16 on the CPU (kernels/torch_attention.py:
 * `TorchPagedAttention.apart_prompts`): n query rows, the last n of a sequence of kv_len tokens whose K/V are
 * all in the paged cache already (a cached prefix, earlier chunks, and this chunk's own rows, written
 * before attention runs); query row i sits at position kv_len - n + i and sees keys 0 .. that position.
 *
 * The C decode kernel computes a prompt row as a decode (about 94 GFLOP/s on 2 Xeon cores) and torch's
 * bfloat16 SDPA reaches about 100-400 (small per-head products, a flash loop per 32-row block). Here:
 * - K and V of each KV head are gathered from their pages once per call into the B-tile layout TDPBF16PS
 *   takes (row r: the pair 2r, 2r+1 along the product's K dimension), K transposed: keys become the output
 *   columns;
 * - per query head and block of 16 query rows, the scores against every key up to the block's last row
 *   are one row of S tiles (float32, kept in a per-thread buffer: 16 x kv_len floats, in L2),
 *   then an exact softmax per row (float32, masked past the row's position), P rounded to bfloat16 like
 *   SDPA's flash kernel does, then P . V accumulated in four C tiles per 64 output columns, normalised
 *   by the row's sum and rounded once to bfloat16.
 * Two passes instead of flash's online rescaling: the scores of a block are all known before P . V, so the
 * output tiles never leave the tile registers until the end.
 *
 * Sizes: head_dim a multiple of 64, num_heads a multiple of num_kv_heads, 0 < n <= kv_len, pages in the
 * cache (the caller checks; the layer cache is [blocks, 2 (K, V), num_kv_heads, block_size, head_dim]).
 * Returns 0, or -1 when a scratch buffer cannot be allocated (the caller then takes another path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "vexp.h"

#define Q_ROWS 16 /* query rows per block: one A tile */

#ifdef HAVE_AMX_BUILD
static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* Key `key`'s K (v = 0) or V (v = 1) row of KV head h in the paged layer cache. */
static inline const uint16_t *cache_row(const uint16_t *cache, const int32_t *pages, int block_size, int num_kv_heads,
                                        int head_dim, int h, int v, int key) {
    const int64_t page = pages[key / block_size];
    return cache + ((page * 2 + v) * num_kv_heads + h) * block_size * (int64_t)head_dim
           + (int64_t)(key % block_size) * head_dim;
}

/* K of KV head h -> kt[h][n32 / 16 key blocks][head_dim / 32 chunks][16 pairs][16 keys] (uint32 pairs);
 * V -> vt[h][n32 / 32 key chunks][head_dim / 16 column blocks][16 key pairs][16 columns]. Keys past n: 0. */
static void relayout_kv(const uint16_t *cache, const int32_t *pages, int block_size, int n, int n32,
                        int num_kv_heads, int head_dim, uint32_t *kt, uint32_t *vt) {
    const int pairs = head_dim / 2;
#pragma omp parallel for schedule(static) collapse(2)
    for (int h = 0; h < num_kv_heads; h++)
        for (int kc = 0; kc < n32 / 32; kc++) {
            for (int kb = 2 * kc; kb < 2 * kc + 2; kb++) {
                uint32_t *dst = kt + ((int64_t)h * (n32 / 16) + kb) * 16 * pairs;
                for (int j = 0; j < 16; j++) {
                    const int key = kb * 16 + j;
                    uint32_t row[512];
                    if (key < n)
                        memcpy(row, cache_row(cache, pages, block_size, num_kv_heads, head_dim, h, 0, key),
                               sizeof(uint16_t) * head_dim);
                    else
                        memset(row, 0, sizeof(uint16_t) * head_dim);
                    for (int p = 0; p < pairs; p++) dst[(p / 16) * 256 + (p % 16) * 16 + j] = row[p];
                }
            }
            uint32_t *vdst = vt + ((int64_t)h * (n32 / 32) + kc) * 16 * head_dim;
            for (int r = 0; r < 16; r++) {
                const int even = kc * 32 + 2 * r, odd = even + 1;
                const uint16_t *ve = even < n ? cache_row(cache, pages, block_size, num_kv_heads, head_dim, h, 1, even)
                                              : NULL;
                const uint16_t *vo = odd < n ? cache_row(cache, pages, block_size, num_kv_heads, head_dim, h, 1, odd)
                                             : NULL;
                for (int c = 0; c < head_dim; c++) {
                    const uint32_t lo = ve ? ve[c] : 0, hi = vo ? vo[c] : 0;
                    vdst[(c / 16) * 256 + r * 16 + c % 16] = lo | hi << 16;
                }
            }
        }
}

/* One row's softmax numerators exp((s - max) * scale) over keys [0, valid) of s (float32), as bfloat16 into p,
 * zeros up to width (a multiple of 16); returns 1 / their float32 sum. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static float softmax_row(const float *s, int valid,
                                                                                      int width, float scale,
                                                                                      uint16_t *p) {
    __m512 max = _mm512_set1_ps(-__builtin_inff());
    for (int j = 0; j < valid; j += 16) {
        const __mmask16 m = valid - j >= 16 ? 0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        max = _mm512_mask_max_ps(max, m, max, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(max)), vscale = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    int j = 0;
    for (; j < valid; j += 16) {
        const __mmask16 m = valid - j >= 16 ? 0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top), vscale);
        const __m512 e = _mm512_maskz_mov_ps(m, exp16(x));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    memset(p + j, 0, sizeof(uint16_t) * (width - j));
    return 1.0f / _mm512_reduce_add_ps(sum);
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) int prompt_attention_amx(
    const uint16_t *q_rows, int64_t ldq, const uint16_t *cache, const int32_t *pages, int block_size, int kv_len,
    int n, int num_heads, int num_kv_heads, int head_dim, float scale, uint16_t *out, int64_t ldo) {
    if (n <= 0) return 0;
    const int n32 = (int)round_up(kv_len, 32), group = num_heads / num_kv_heads, chunks = head_dim / 32;
    const int first = kv_len - n; /* query row i's position: first + i */
    const int q_blocks = (n + Q_ROWS - 1) / Q_ROWS;
    uint32_t *kt = aligned_alloc(64, (size_t)num_kv_heads * n32 * head_dim * 2);
    uint32_t *vt = aligned_alloc(64, (size_t)num_kv_heads * n32 * head_dim * 2);
    if (!kt || !vt) {
        free(kt);
        free(vt);
        return -1;
    }
    relayout_kv(cache, pages, block_size, kv_len, n32, num_kv_heads, head_dim, kt, vt);
    int failed = 0;
#pragma omp parallel
    {
        float *s = aligned_alloc(64, sizeof(float) * Q_ROWS * n32);
        uint16_t *p = aligned_alloc(64, sizeof(uint16_t) * Q_ROWS * n32);
        uint16_t *q = aligned_alloc(64, sizeof(uint16_t) * Q_ROWS * head_dim);
        float o[Q_ROWS * 64] __attribute__((aligned(64)));
        float inv_sum[Q_ROWS];
        if (!s || !p || !q) {
#pragma omp atomic write
            failed = 1;
        } else
            amx_configure((const int[8]){16, 16, 16, 16, 16, 16, 16, 16});
        /* Every thread meets this loop (a worksharing loop must be reached by all); a thread whose
         * buffers failed takes no item. Largest blocks (the chunk's end) first: they take the longest. */
#pragma omp for schedule(dynamic)
        for (int item = 0; item < num_heads * q_blocks; item++) {
            if (!s || !p || !q) continue;
            const int head = item / q_blocks, qb = q_blocks - 1 - item % q_blocks, kv = head / group;
            const int q0 = qb * Q_ROWS, rows = n - q0 < Q_ROWS ? n - q0 : Q_ROWS;
            const int keys = (int)round_up(first + q0 + rows, 32);
            for (int i = 0; i < Q_ROWS; i++) {
                if (i < rows)
                    memcpy(q + i * head_dim, q_rows + (q0 + i) * ldq + (int64_t)head * head_dim,
                           sizeof(uint16_t) * head_dim);
                else
                    memset(q + i * head_dim, 0, sizeof(uint16_t) * head_dim);
            }
            const uint32_t *k_head = kt + (int64_t)kv * (n32 / 16) * 16 * (head_dim / 2);
            for (int kb = 0; kb < keys / 16; kb++) {
                _tile_zero(0);
                for (int c = 0; c < chunks; c++) {
                    _tile_loadd(1, q + c * 32, head_dim * 2);
                    _tile_loadd(2, k_head + ((int64_t)kb * chunks + c) * 256, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, s + kb * 16, keys * 4);
            }
            for (int i = 0; i < Q_ROWS; i++) {
                if (i < rows)
                    inv_sum[i] = softmax_row(s + i * keys, first + q0 + i + 1, keys, scale, p + i * keys);
                else
                    memset(p + i * keys, 0, sizeof(uint16_t) * keys);
            }
            const uint32_t *v_head = vt + (int64_t)kv * (n32 / 32) * 16 * head_dim;
            for (int half = 0; half < head_dim / 64; half++) {
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                for (int kc = 0; kc < keys / 32; kc++) {
                    const uint32_t *v_blocks = v_head + ((int64_t)kc * (head_dim / 16) + half * 4) * 256;
                    _tile_loadd(1, p + kc * 32, keys * 2);
                    _tile_loadd(2, v_blocks, 64);
                    _tile_dpbf16ps(4, 1, 2);
                    _tile_loadd(3, v_blocks + 256, 64);
                    _tile_dpbf16ps(5, 1, 3);
                    _tile_loadd(2, v_blocks + 512, 64);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_loadd(3, v_blocks + 768, 64);
                    _tile_dpbf16ps(7, 1, 3);
                }
                _tile_stored(4, o, 256);
                _tile_stored(5, o + 16, 256);
                _tile_stored(6, o + 32, 256);
                _tile_stored(7, o + 48, 256);
                for (int i = 0; i < rows; i++) {
                    uint16_t *dst = out + (q0 + i) * ldo + (int64_t)head * head_dim + half * 64;
                    const __m512 norm = _mm512_set1_ps(inv_sum[i]);
                    for (int c = 0; c < 64; c += 32) {
                        const __m512 lo = _mm512_mul_ps(_mm512_load_ps(o + i * 64 + c), norm);
                        const __m512 hi = _mm512_mul_ps(_mm512_load_ps(o + i * 64 + c + 16), norm);
                        _mm512_storeu_si512((void *)(dst + c), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                    }
                }
            }
        }
        if (s && p && q) _tile_release();
        free(s);
        free(p);
        free(q);
    }
    free(kt);
    free(vt);
    return failed ? -1 : 0;
}
#else
int prompt_attention_amx(const uint16_t *q_rows, int64_t ldq, const uint16_t *cache, const int32_t *pages,
                         int block_size, int kv_len, int n, int num_heads, int num_kv_heads, int head_dim, float scale,
                         uint16_t *out, int64_t ldo) {
    (void)q_rows, (void)ldq, (void)cache, (void)pages, (void)block_size, (void)kv_len, (void)n, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)scale, (void)out, (void)ldo;
    return -1;
}
#endif
