/* The one arithmetic of a query row's attention on AVX512-BF16 CPUs, shared by the per-row path
 * (attention_rows_bf16.c: keys in the lanes of a vector) and the prompt tiles (prompt_row_tiles.c: query
 * rows in the lanes), so that a row's output is the same bits whichever path computes it (config
 * `deterministic`, issue 38). For one query row q and its keys 0 .. len - 1:
 *
 * 1. score s_k = (q . k_k) * scale: the bf16 dot-product instruction over the head dimension's bf16 pairs
 *    (q[2i], q[2i+1]) x (k[2i], k[2i+1]), i = 0 .. D/2 - 1 in order, one float32 accumulator from 0; an int8
 *    cache's k_k is its row's integers (kv_formats.h) and the score ((q . k_k) * s_k) * scale, s_k its scale;
 * 2. m = the largest s_k (exact in any order);
 * 3. e_k = exp16(s_k - m) (vexp.h, lane-wise);
 * 4. sum = 16 partial sums, partial j = e_j + e_(j+16) + e_(j+32) + ... in key order from 0, then
 *    sum_tree16's fixed tree over the 16 partials;
 * 5. P_k = e_k rounded to bfloat16 (round to nearest even); an int8 cache's: e_k * (V row k's scale), rounded;
 * 6. out[d] = the bf16 dot-product instruction over pairs of consecutive keys (P_2i, P_2i+1) x
 *    (V_2i[d], V_2i+1[d]), i in order, one float32 accumulator from 0 (a missing odd key: P = 0, V = 0);
 * 7. out[d] * (1 / sum), rounded to bfloat16 (nearest even).
 *
 * The files that include this header are compiled without reassociation, reciprocal approximations or
 * contraction into FMAs (kernels/native/lib.py: STRICT_FLAGS), so that the compiler keeps this order too.
 */
#ifndef HETERO_ATTENTION_ORDER_H
#define HETERO_ATTENTION_ORDER_H

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

/* Query heads of one KV head computed together by either path: the most of 4, 3, 2 that divides the group
 * (more heads per broadcast key or value keep more accumulators busy). */
static inline int heads_together(int group) { return group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1; }

/* Step 4's tree on 16 vectors (lane-wise: the tiles, partial j of lane r in x[j]); x is overwritten. */
static inline __m512 sum_tree16(__m512 x[16]) {
    for (int j = 0; j < 8; j++) x[j] = _mm512_add_ps(x[j], x[j + 8]);
    for (int j = 0; j < 4; j++) x[j] = _mm512_add_ps(x[j], x[j + 4]);
    for (int j = 0; j < 2; j++) x[j] = _mm512_add_ps(x[j], x[j + 2]);
    return _mm512_add_ps(x[0], x[1]);
}

/* The same tree over the 16 lanes of one vector (the per-row path: partial j in lane j). Addition is
 * commutative bit for bit, so lane j + lane (j XOR 8) is sum_tree16's x[j] + x[j + 8] for j < 8. */
static inline float sum_tree16_lanes(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));  /* lane j + lane j ^ 8 */
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));  /* j + j ^ 4 */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));        /* j + j ^ 2 */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));        /* j + j ^ 1 */
    return _mm512_cvtss_f32(v);
}

/* r[i] lane j -> r[j] lane i: 16 x 16 float32 (or any 32-bit lanes), in 64 shuffles. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: u[4i + c] holds column 4 * lane + c of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD);
    }
}

/* Two keys' V rows (32 columns each) -> step 6's pairs: lane d of the first result (V_2i[d], V_2i+1[d]) for
 * columns 0-15, of the second for 16-31. */
static inline void pair_rows(__m512i even, __m512i odd, __m512i *lo, __m512i *hi) {
    static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i l = _mm512_loadu_si512(lo_idx);
    *lo = _mm512_permutex2var_epi16(even, l, odd);
    *hi = _mm512_permutex2var_epi16(even, _mm512_add_epi16(l, _mm512_set1_epi16(16)), odd);
}
#endif

#endif
