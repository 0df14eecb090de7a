/* LoRA deltas of one linear product for a step's rows (issue 41; gpu_worker/lora_slots.py), as Punica's
 * SGMV computes them: row i, served by the adapter in slot s = row_slot[i] (0: the base model, nothing to
 * add), gets y[i] += Bt_s^T (A_s x[i]), with A_s [rank, in] and Bt_s [rank, out] (B transposed, scaling
 * folded in), both float32, at the adapter's own rank. Each slot's pointers come from tables indexed by slot
 * (a null A: the slot leaves this product alone).
 *
 * Row invariance: a row's delta is computed by the same instructions in the same order whatever else is in
 * the step (how many rows, which adapters): the shrink keeps 16 float32 accumulators over `in` and adds them
 * in a fixed order, the expand accumulates rank by rank into a float32 row, and only then is the row added
 * to y, once (rounded to bfloat16 for bfloat16 rows). Compiled with the strict flags (lib.py): the compiler
 * may not reassociate these sums; fmaf is explicit, so every path fuses the same products.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 16
#define PARALLEL_MIN_WORK (1 << 15) /* rows * (in + out) * rank below this: one thread (the fork costs more) */

static int64_t work_of(int rows, int in, int out, const int32_t *ranks, int num_slots) {
    int max_rank = 0;
    for (int s = 0; s < num_slots; s++) max_rank = ranks[s] > max_rank ? ranks[s] : max_rank;
    return (int64_t)rows * (in + out) * max_rank;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define TILE 8 /* rows of one adapter done together: each weight vector loaded once for all of them */

/* h[t][r] = A_r . xf[t] for all TILE rows of the tile (rows past the adapter's: zeros, their h unused), two ranks
 * at a time: each (row, rank) keeps 16 lanes over `in`, then _mm512_reduce_add_ps (a fixed order). An odd last
 * rank is paired with itself. */
static void shrink_tile(const float *xf, int in, const float *a, int rank, float *h) {
    const __mmask16 tail = (__mmask16)((1u << (in % 16)) - 1);
    for (int r = 0; r < rank; r += 2) {
        const float *a0 = a + (int64_t)r * in, *a1 = r + 1 < rank ? a0 + in : a0;
        __m512 c0[TILE], c1[TILE];
        for (int t = 0; t < TILE; t++) c0[t] = c1[t] = _mm512_setzero_ps();
        int k = 0;
        for (; k + 16 <= in; k += 16) {
            const __m512 w0 = _mm512_loadu_ps(a0 + k), w1 = _mm512_loadu_ps(a1 + k);
            for (int t = 0; t < TILE; t++) {
                const __m512 xv = _mm512_loadu_ps(xf + (int64_t)t * in + k);
                c0[t] = _mm512_fmadd_ps(xv, w0, c0[t]);
                c1[t] = _mm512_fmadd_ps(xv, w1, c1[t]);
            }
        }
        if (k < in) {
            const __m512 w0 = _mm512_maskz_loadu_ps(tail, a0 + k), w1 = _mm512_maskz_loadu_ps(tail, a1 + k);
            for (int t = 0; t < TILE; t++) {
                const __m512 xv = _mm512_maskz_loadu_ps(tail, xf + (int64_t)t * in + k);
                c0[t] = _mm512_fmadd_ps(xv, w0, c0[t]);
                c1[t] = _mm512_fmadd_ps(xv, w1, c1[t]);
            }
        }
        for (int t = 0; t < TILE; t++) {
            h[t * 1024 + r] = _mm512_reduce_add_ps(c0[t]);
            if (r + 1 < rank) h[t * 1024 + r + 1] = _mm512_reduce_add_ps(c1[t]);
        }
    }
}

static inline __mmask16 first_lanes(int count) {
    return count >= 16 ? (__mmask16)0xFFFF : count > 0 ? (__mmask16)((1u << count) - 1) : (__mmask16)0;
}

/* The adapters' rows grouped by slot (order[0..count)), and where each tile of at most TILE rows of one slot
 * starts (tiles[0..num_tiles)); the rows of slot 0 and of slots this product lacks are left out. Returns
 * num_tiles and sets *count. */
static int group_tiles(int rows, const int32_t *row_slot, const int64_t *a_ptrs, int num_slots, int *order,
                       int *tiles, int *count) {
    int num_tiles = 0;
    *count = 0;
    for (int s = 1; s < num_slots; s++) {
        if (a_ptrs[s] == 0) continue;
        const int first = *count;
        for (int i = 0; i < rows; i++)
            if (row_slot[i] == s) order[(*count)++] = i;
        for (int t = first; t < *count; t += TILE) tiles[num_tiles++] = t;
    }
    return num_tiles;
}

/* out[t][o] = sum over r (in order) of h[t][r] * bt[r][o], 32 columns at a time; then y[t] += out[t] for the
 * tile's n rows. */
#define EXPAND_TILE(NAME, T, ADD16)                                                                            \
    static void NAME(const float *h, const float *bt, int rank, int out, int n, T *const *y) {               \
        for (int o = 0; o < out; o += 32) {                                                                    \
            const __mmask16 m0 = first_lanes(out - o), m1 = first_lanes(out - o - 16);                         \
            __m512 c0[TILE], c1[TILE];                                                                         \
            for (int t = 0; t < TILE; t++) c0[t] = c1[t] = _mm512_setzero_ps();                               \
            for (int r = 0; r < rank; r++) {                                                                   \
                const float *row = bt + (int64_t)r * out + o;                                                  \
                const __m512 w0 = _mm512_maskz_loadu_ps(m0, row), w1 = _mm512_maskz_loadu_ps(m1, row + 16);    \
                for (int t = 0; t < TILE; t++) {                                                               \
                    const __m512 hb = _mm512_set1_ps(h[t * 1024 + r]);                                         \
                    c0[t] = _mm512_fmadd_ps(hb, w0, c0[t]);                                                    \
                    c1[t] = _mm512_fmadd_ps(hb, w1, c1[t]);                                                    \
                }                                                                                              \
            }                                                                                                  \
            for (int t = 0; t < n; t++) {                                                                      \
                ADD16(y[t] + o, c0[t], m0);                                                                    \
                if (m1) ADD16(y[t] + o + 16, c1[t], m1);                                                       \
            }                                                                                                  \
        }                                                                                                      \
    }

static inline void add16_f32(float *y, __m512 v, __mmask16 m) {
    _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), v));
}
static inline void add16_bf16(uint16_t *y, __m512 v, __mmask16 m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* y + v rounded to bfloat16 as f32_to_bf16 rounds (to nearest even), 16 at a time. */
    const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y)), 16));
    __m512i u = _mm512_castps_si512(_mm512_add_ps(f, v));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#else
    float tmp[16];
    _mm512_storeu_ps(tmp, v);
    const int count = __builtin_popcount((unsigned)m);
    for (int l = 0; l < count; l++) y[l] = f32_to_bf16(bf16_to_f32(y[l]) + tmp[l]);
#endif
}

/* A row widened to float32 for the shrink. */
static inline void row_f32_f32(const float *x, int in, float *xf) {
    for (int k = 0; k < in; k++) xf[k] = x[k];
}
static inline void row_f32_bf16(const uint16_t *x, int in, float *xf) {
    int k = 0;
    for (; k + 16 <= in; k += 16) _mm512_storeu_ps(xf + k, bf16x16_to_f32(x + k));
    for (; k < in; k++) xf[k] = bf16_to_f32(x[k]);
}
EXPAND_TILE(expand_tile_f32, float, add16_f32)
EXPAND_TILE(expand_tile_bf16, uint16_t, add16_bf16)
#endif

/* x [rows, in] (row stride x_stride), y [rows, out] (row stride y_stride); a_ptrs / bt_ptrs / ranks: per slot
 * (num_slots of them, slot 0 unused). Returns 0, -1 when an adapter's rank is over 1024 (nothing added), -2
 * when out of memory. With AVX512 the rows of one adapter go in tiles of TILE (each row's arithmetic the same
 * in any tile), else one at a time. */
#if defined(__AVX512F__)
#define LORA_ADD(NAME, T, LOAD, STORE, EXPAND, WIDEN)                                                          \
    int NAME(const T *x, int64_t x_stride, T *y, int64_t y_stride, int rows, const int32_t *row_slot,         \
             const int64_t *a_ptrs, const int64_t *bt_ptrs, const int32_t *ranks, int num_slots, int in,      \
             int out) {                                                                                         \
        for (int s = 0; s < num_slots; s++)                                                                    \
            if (ranks[s] > 1024) return -1;                                                                    \
        int *order = malloc(sizeof(int) * (size_t)(rows + 1));                                                 \
        int *tiles = malloc(sizeof(int) * (size_t)(rows + 1));                                                 \
        if (order == NULL || tiles == NULL) { free(order); free(tiles); return -2; }                           \
        int count;                                                                                             \
        const int num_tiles = group_tiles(rows, row_slot, a_ptrs, num_slots, order, tiles, &count);            \
        int failed = 0;                                                                                        \
        _Pragma("omp parallel if (work_of(count, in, out, ranks, num_slots) >= PARALLEL_MIN_WORK)")             \
        {                                                                                                      \
            float *xf = malloc(sizeof(float) * (size_t)in * TILE);                                             \
            float *h = malloc(sizeof(float) * 1024 * TILE);                                                    \
            if (xf == NULL || h == NULL) {                                                                     \
                _Pragma("omp atomic write") failed = 1;                                                       \
            }                                                                                                  \
            _Pragma("omp for schedule(static)")                                                               \
            for (int j = 0; j < num_tiles; j++) {                                                              \
                if (xf == NULL || h == NULL) continue;                                                         \
                const int start = tiles[j];                                                                    \
                const int s = row_slot[order[start]];                                                          \
                int n = 0;                                                                                     \
                T *yt[TILE];                                                                                   \
                while (n < TILE && start + n < count && row_slot[order[start + n]] == s) {                     \
                    const int i = order[start + n];                                                            \
                    WIDEN(x + (int64_t)i * x_stride, in, xf + (int64_t)n * in);                                \
                    yt[n++] = y + (int64_t)i * y_stride;                                                       \
                }                                                                                              \
                if (n < TILE) memset(xf + (int64_t)n * in, 0, sizeof(float) * (size_t)in * (TILE - n));       \
                shrink_tile(xf, in, (const float *)(intptr_t)a_ptrs[s], ranks[s], h);                          \
                EXPAND(h, (const float *)(intptr_t)bt_ptrs[s], ranks[s], out, n, yt);                          \
            }                                                                                                  \
            free(xf);                                                                                          \
            free(h);                                                                                           \
        }                                                                                                      \
        free(order);                                                                                           \
        free(tiles);                                                                                           \
        return failed ? -2 : 0;                                                                                \
    }
#else
static float shrink_row(const float *x, const float *a, int in) {
    float acc[LANES] = {0};
    int k = 0;
    for (; k + LANES <= in; k += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(x[k + l], a[k + l], acc[l]);
    for (int l = 0; k < in; k++, l++) acc[l] = fmaf(x[k], a[k], acc[l]);
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += acc[l];
    return sum;
}

/* buf[0..out) = sum over r of h[r] * bt[r][.] */
static void expand_row(const float *h, const float *bt, int rank, int out, float *buf) {
    for (int o = 0; o < out; o++) buf[o] = 0.0f;
    for (int r = 0; r < rank; r++) {
        const float *row = bt + (int64_t)r * out;
        const float hr = h[r];
        for (int o = 0; o < out; o++) buf[o] = fmaf(hr, row[o], buf[o]);
    }
}

#define LORA_ADD(NAME, T, LOAD, STORE, EXPAND, WIDEN)                                                          \
    int NAME(const T *x, int64_t x_stride, T *y, int64_t y_stride, int rows, const int32_t *row_slot,         \
             const int64_t *a_ptrs, const int64_t *bt_ptrs, const int32_t *ranks, int num_slots, int in,      \
             int out) {                                                                                         \
        for (int s = 0; s < num_slots; s++)                                                                    \
            if (ranks[s] > 1024) return -1;                                                                    \
        int failed = 0;                                                                                        \
        _Pragma("omp parallel if (work_of(rows, in, out, ranks, num_slots) >= PARALLEL_MIN_WORK)")              \
        {                                                                                                      \
            float h[1024];                                                                                     \
            float *xf = malloc(sizeof(float) * (size_t)in);                                                    \
            float *buf = malloc(sizeof(float) * (size_t)out);                                                  \
            if (xf == NULL || buf == NULL) {                                                                   \
                _Pragma("omp atomic write") failed = 1;                                                       \
            }                                                                                                  \
            _Pragma("omp for schedule(static)")                                                               \
            for (int i = 0; i < rows; i++) {                                                                   \
                const int s = row_slot[i];                                                                     \
                if (xf == NULL || buf == NULL || s <= 0 || s >= num_slots || a_ptrs[s] == 0) continue;         \
                const float *a = (const float *)(intptr_t)a_ptrs[s];                                           \
                const float *bt = (const float *)(intptr_t)bt_ptrs[s];                                         \
                const T *xi = x + (int64_t)i * x_stride;                                                       \
                for (int k = 0; k < in; k++) xf[k] = LOAD(xi[k]);                                              \
                for (int r = 0; r < ranks[s]; r++) h[r] = shrink_row(xf, a + (int64_t)r * in, in);            \
                expand_row(h, bt, ranks[s], out, buf);                                                         \
                T *yi = y + (int64_t)i * y_stride;                                                             \
                for (int o = 0; o < out; o++) yi[o] = STORE(LOAD(yi[o]) + buf[o]);                             \
            }                                                                                                  \
            free(xf);                                                                                          \
            free(buf);                                                                                         \
        }                                                                                                      \
        return failed ? -2 : 0;                                                                                \
    }

#endif

#define F32_LOAD(v) (v)
#define F32_STORE(v) (v)
#if defined(__AVX512F__)
LORA_ADD(lora_add_f32, float, F32_LOAD, F32_STORE, expand_tile_f32, row_f32_f32)
LORA_ADD(lora_add_bf16, uint16_t, bf16_to_f32, f32_to_bf16, expand_tile_bf16, row_f32_bf16)
#else
LORA_ADD(lora_add_f32, float, F32_LOAD, F32_STORE, unused, unused)
LORA_ADD(lora_add_bf16, uint16_t, bf16_to_f32, f32_to_bf16, unused, unused)
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 rows with bfloat16 weights (a bfloat16 model on AVX512-BF16): vdpbf16ps takes two products a lane,
 * twice the float32 kernel's. A [rank, in] bfloat16; Bt as pairs of ranks, [ceil(rank / 2)][out][2] bfloat16
 * (the second of an odd rank's last pair zero); the shrink's sums are rounded to bfloat16 for the expand. The
 * same per-row arithmetic in any tile, as above. */
static void shrink_tile_dp(const uint16_t *const *xr, int in, const uint16_t *a, int rank, float *h) {
    const __mmask32 tail = (__mmask32)((1ull << (in % 32)) - 1);
    for (int r = 0; r < rank; r += 2) {
        const uint16_t *a0 = a + (int64_t)r * in, *a1 = r + 1 < rank ? a0 + in : a0;
        __m512 c0[TILE], c1[TILE];
        for (int t = 0; t < TILE; t++) c0[t] = c1[t] = _mm512_setzero_ps();
        int k = 0;
        for (; k + 32 <= in; k += 32) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(a0 + k), w1 = (__m512bh)_mm512_loadu_si512(a1 + k);
            for (int t = 0; t < TILE; t++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[t] + k);
                c0[t] = _mm512_dpbf16_ps(c0[t], xv, w0);
                c1[t] = _mm512_dpbf16_ps(c1[t], xv, w1);
            }
        }
        if (k < in) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, a0 + k);
            const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(tail, a1 + k);
            for (int t = 0; t < TILE; t++) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr[t] + k);
                c0[t] = _mm512_dpbf16_ps(c0[t], xv, w0);
                c1[t] = _mm512_dpbf16_ps(c1[t], xv, w1);
            }
        }
        for (int t = 0; t < TILE; t++) {
            h[t * 1024 + r] = _mm512_reduce_add_ps(c0[t]);
            if (r + 1 < rank) h[t * 1024 + r + 1] = _mm512_reduce_add_ps(c1[t]);
        }
    }
}

static void expand_tile_dp(const float *h, const uint16_t *btp, int rank, int out, int n, uint16_t *const *y,
                           uint32_t *hp) {
    const int pairs = (rank + 1) / 2;
    for (int t = 0; t < TILE; t++)
        for (int p = 0; p < pairs; p++) {
            const uint32_t lo = f32_to_bf16(h[t * 1024 + 2 * p]);
            const uint32_t hi = 2 * p + 1 < rank ? f32_to_bf16(h[t * 1024 + 2 * p + 1]) : 0;
            hp[t * 512 + p] = lo | hi << 16;
        }
    for (int o = 0; o < out; o += 32) {
        const __mmask16 m0 = first_lanes(out - o), m1 = first_lanes(out - o - 16);
        __m512 c0[TILE], c1[TILE];
        for (int t = 0; t < TILE; t++) c0[t] = c1[t] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; p++) {
            const uint16_t *row = btp + ((int64_t)p * out + o) * 2;
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, row);
            const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, row + 32);
            for (int t = 0; t < TILE; t++) {
                const __m512bh hb = (__m512bh)_mm512_set1_epi32((int)hp[t * 512 + p]);
                c0[t] = _mm512_dpbf16_ps(c0[t], hb, w0);
                c1[t] = _mm512_dpbf16_ps(c1[t], hb, w1);
            }
        }
        for (int t = 0; t < n; t++) {
            add16_bf16(y[t] + o, c0[t], m0);
            if (m1) add16_bf16(y[t] + o + 16, c1[t], m1);
        }
    }
}

int lora_bf16_dp_supported(void) { return 1; }

/* As lora_add_bf16, with bfloat16 weights in the layouts above. */
int lora_add_bf16_dp(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, int rows,
                     const int32_t *row_slot, const int64_t *a_ptrs, const int64_t *bt_ptrs, const int32_t *ranks,
                     int num_slots, int in, int out) {
    for (int s = 0; s < num_slots; s++)
        if (ranks[s] > 1024) return -1;
    int *order = malloc(sizeof(int) * (size_t)(rows + 1));
    int *tiles = malloc(sizeof(int) * (size_t)(rows + 1));
    if (order == NULL || tiles == NULL) { free(order); free(tiles); return -2; }
    int count;
    const int num_tiles = group_tiles(rows, row_slot, a_ptrs, num_slots, order, tiles, &count);
    int failed = 0;
#pragma omp parallel if (work_of(count, in, out, ranks, num_slots) >= 2 * PARALLEL_MIN_WORK)
    {
        float *h = malloc(sizeof(float) * 1024 * TILE);
        uint32_t *hp = malloc(sizeof(uint32_t) * 512 * TILE);
        uint16_t *zeros = calloc((size_t)in + 32, sizeof(uint16_t));
        if (h == NULL || hp == NULL || zeros == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int j = 0; j < num_tiles; j++) {
            if (h == NULL || hp == NULL || zeros == NULL) continue;
            const int start = tiles[j];
            const int s = row_slot[order[start]];
            const uint16_t *xr[TILE];
            uint16_t *yt[TILE];
            int n = 0;
            while (n < TILE && start + n < count && row_slot[order[start + n]] == s) {
                xr[n] = x + (int64_t)order[start + n] * x_stride;
                yt[n] = y + (int64_t)order[start + n] * y_stride;
                n++;
            }
            for (int t = n; t < TILE; t++) xr[t] = zeros;
            shrink_tile_dp(xr, in, (const uint16_t *)(intptr_t)a_ptrs[s], ranks[s], h);
            expand_tile_dp(h, (const uint16_t *)(intptr_t)bt_ptrs[s], ranks[s], out, n, yt, hp);
        }
        free(h);
        free(hp);
        free(zeros);
    }
    free(order);
    free(tiles);
    return failed ? -2 : 0;
}
#else
int lora_bf16_dp_supported(void) { return 0; }
int lora_add_bf16_dp(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, int rows,
                     const int32_t *row_slot, const int64_t *a_ptrs, const int64_t *bt_ptrs, const int32_t *ranks,
                     int num_slots, int in, int out) {
    (void)x; (void)x_stride; (void)y; (void)y_stride; (void)rows; (void)row_slot; (void)a_ptrs; (void)bt_ptrs;
    (void)ranks; (void)num_slots; (void)in; (void)out;
    return -3;
}
#endif
