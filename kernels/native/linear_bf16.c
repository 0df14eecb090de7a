/* bfloat16 linear layers (x @ W^T + bias) for CPUs with AVX512-BF16 and no AMX (gpu_worker/cpu/packed_linear.py).
 *
 * oneDNN's kernels for these CPUs leave much of the bf16 dot-product unit idle at the row counts of
 * decoding (1-64 rows). Here the weight is re-laid out once at load into panels of NR = 48 output
 * features whose K values come in pairs, [N/48][K/2][48][2], so one 64-byte load holds one K pair
 * for 16 outputs: `vdpbf16ps` multiplies it by a broadcast pair of an input row and adds both
 * products into 16 float32 sums. A tile of up to 8 rows x 48 outputs keeps its 24 accumulators in
 * registers over the whole K; the panels are spread over torch's OpenMP threads.
 *
 * Measured on an AMD EPYC with avx512_bf16 (2 cores), SmolLM2-135M's products, against oneDNN's
 * prepacked weights (benchmarks/cpu_kernels.py): 1.39x at 1 row (the weights stream at 47 against
 * 34 GB/s), 1.27x at 32 rows, 1.15x at 64, 1.04-1.39x at 1,024. On AMX CPUs oneDNN's tile kernels
 * are several times faster: the caller keeps them.
 *
 * Every output row is computed alone, in the same order whatever the other rows: a row's result
 * does not depend on the batch. Float32 accumulation, one round-to-nearest-even to bfloat16.
 *
 * At 9-64 rows (2-8 tiles a panel) the first tile of a panel reads it from memory and the others from L2;
 * those others prefetch the next panel's lines between them, so that the weights stream while they compute
 * instead of stalling each first tile (whose demand is more than the bus gives at decoding's row counts):
 * one forward's products 0.89x the time at 16 rows, 0.97x at 32, unchanged at 1 and 64+ (A/B of the two
 * builds in one process, AMD EPYC avx512_bf16).
 *
 * linear_bf16_side also issues one prefetch per K pair of each tile from a list of cache lines that the
 * next memory-bound kernel will read (the next layer's K/V pages: side_prefetch.h, llama_layers.c).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#endif

#define NR 48 /* output features per panel: three 16-float accumulators per row */
#define MR 8  /* rows per tile */
#define STREAM_MAX_TILES 8 /* tiles per panel up to which the others prefetch the next panel (panel_stream_at) */

#include "side_prefetch.h"

/* 1 when this build has the kernel (the CPU has AVX512-BF16), else 0: the other functions do nothing. */
int linear_bf16_supported(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

/* bfloat16 elements of the packed form of an [n, k] weight: n rounded up to NR, k to even. */
int64_t linear_bf16_packed_elements(int n, int k) {
    return (int64_t)((n + NR - 1) / NR) * NR * (int64_t)((k + 1) / 2) * 2;
}

/* w [n, k] row-major -> wp [n/NR][k/2][NR][2], zero-padded in both dimensions. */
void linear_bf16_pack(const uint16_t *w, int n, int k, uint16_t *wp) {
    const int panels = (n + NR - 1) / NR, k2s = (k + 1) / 2;
    memset(wp, 0, sizeof(uint16_t) * (size_t)linear_bf16_packed_elements(n, k));
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int k2 = 0; k2 < k2s; k2++)
            for (int j = 0; j < NR && p * NR + j < n; j++) {
                const uint16_t *src = w + (int64_t)(p * NR + j) * k + 2 * k2;
                uint16_t *dst = wp + (((int64_t)p * k2s + k2) * NR + j) * 2;
                dst[0] = src[0];
                dst[1] = 2 * k2 + 1 < k ? src[1] : 0;
            }
}

#ifdef HAVE_AVX512_BF16
/* The stream of a panel's weights from memory: which lines of the next panel a tile prefetches. */
typedef struct {
    const char *next;  /* the first line this tile prefetches */
    int64_t left;      /* how many */
    int per_pair;      /* lines per K pair */
    int ahead;         /* 1: also this panel's own lines 16 pairs ahead (its first tile: not yet in L2) */
} panel_stream;

/* rows (a constant at each call, inlined) x one panel of NR outputs; `cols`: how many of the NR exist. */
static inline __attribute__((always_inline)) void tile(const int rows, const uint16_t *a, int64_t lda,
                                                        const uint16_t *panel, const uint16_t *bias, void *c,
                                                        int64_t ldc, int k, int cols, side_cursor side,
                                                        const int streaming, panel_stream stream, const int f32_out) {
    __m512 acc[MR][3];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 3; j++) acc[m][j] = _mm512_setzero_ps();
    const int pairs = k / 2;
#pragma GCC unroll 4
    for (int k2 = 0; k2 < pairs; k2++) {
        const uint16_t *wk = panel + (int64_t)k2 * NR * 2;
        if (!streaming || stream.ahead) {  /* streaming: a constant at each call, so one of these loops is gone */
            const char *ahead = (const char *)(wk + 16 * NR * 2);  /* 16 pairs on: 3 KB, 3 lines per pair */
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
        }
        if (streaming)
            for (int i = 0; i < stream.per_pair && stream.left > 0; i++, stream.left--, stream.next += 64)
                _mm_prefetch(stream.next, _MM_HINT_T1);
        side_cursor_next(&side);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            int32_t pair;
            memcpy(&pair, a + m * lda + 2 * k2, sizeof pair);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, w1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], x, w2);
        }
    }
    if (k & 1) {  /* the last K value alone: its pair's second half is zero in the weight and here */
        const uint16_t *wk = panel + (int64_t)pairs * NR * 2;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
        for (int m = 0; m < rows; m++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int32_t)a[m * lda + k - 1]);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, w1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], x, w2);
        }
    }
    __m512 b[3];
    __mmask16 keep[3];
    for (int j = 0; j < 3; j++) {
        const int valid = cols - 16 * j < 0 ? 0 : cols - 16 * j > 16 ? 16 : cols - 16 * j;
        keep[j] = (__mmask16)((1u << valid) - 1u);
        b[j] = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep[j], bias + 16 * j)), 16))
                    : _mm512_setzero_ps();
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 3; j++) {
            const __m512 sum = _mm512_add_ps(acc[m][j], b[j]);
            if (f32_out)  /* the float32 sums themselves: what the bfloat16 output rounds */
                _mm512_mask_storeu_ps((float *)c + m * ldc + 16 * j, keep[j], sum);
            else
                _mm256_mask_storeu_epi16((uint16_t *)c + m * ldc + 16 * j, keep[j], (__m256i)_mm512_cvtneps_pbh(sum));
        }
}

/* Tile ti of a panel's tiles_per_panel: the first reads the panel from memory, prefetching 16 K pairs ahead;
 * where there are more, the others read it from L2 and prefetch the next panel's lines between them
 * instead, so that the weights stream from memory while the L2-fed tiles compute rather than stalling the
 * first tile of every panel (at decoding's 16-64 rows that tile's demand is more than the bus gives). */
static inline panel_stream panel_stream_at(const uint16_t *wp, int64_t panel_elements, int panels, int p, int ti,
                                           int tiles_per_panel, int pairs) {
    panel_stream s = {NULL, 0, 0, 1};
    /* ti == tiles_per_panel: there is no last partial tile. */
    if (ti == 0 || ti >= tiles_per_panel || p + 1 >= panels || pairs <= 0)
        return s;
    const int64_t lines = (panel_elements * (int64_t)sizeof(uint16_t) + 63) / 64, shares = tiles_per_panel - 1;
    const int64_t first = lines * (ti - 1) / shares, last = lines * ti / shares;
    s.next = (const char *)(wp + (p + 1) * panel_elements) + first * 64;
    s.left = last - first;
    s.per_pair = (int)((s.left + pairs - 1) / pairs);
    s.ahead = 0;
    return s;
}

#endif

/* How many side prefetches linear_bf16_side can issue for these sizes: one per K pair of each tile. */
int64_t linear_bf16_pairs(int rows, int n, int k) {
    return (int64_t)((n + NR - 1) / NR) * ((rows + MR - 1) / MR) * (k / 2);
}

#ifdef HAVE_AVX512_BF16
/* Panel p of a product (see linear_bf16_side), its outputs bfloat16 or, with f32_out, float32. f32_out is a
 * constant at each call (inlined into each function's own OpenMP loop), so each has its own compiled loop. */
static inline __attribute__((always_inline)) void product_panel(
    int p, const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, void *c, int64_t ldc, int rows,
    int n, int k, const side_prefetch *side, const int f32_out) {
    const int panels = (n + NR - 1) / NR;
    const int64_t panel_elements = (int64_t)((k + 1) / 2) * NR * 2;
    const int tiles_per_panel = (rows + MR - 1) / MR;
    const int64_t tiles = (int64_t)panels * tiles_per_panel;
    const int streaming = tiles_per_panel <= STREAM_MAX_TILES;
    const panel_stream no_stream = {NULL, 0, 0, 1};
    const int64_t out_size = f32_out ? (int64_t)sizeof(float) : (int64_t)sizeof(uint16_t);  /* bytes per output */
    const uint16_t *panel = wp + p * panel_elements;
    const uint16_t *pb = bias ? bias + p * NR : NULL;
    char *cp = (char *)c + (int64_t)p * NR * out_size;
    const int cols = n - p * NR < NR ? n - p * NR : NR;
    int m = 0;
    int64_t t = (int64_t)p * tiles_per_panel;
    for (; m + MR <= rows; m += MR, t++) {
        const side_cursor sc = side_cursor_at(side, t, tiles);
        if (streaming)
            tile(MR, a + m * lda, lda, panel, pb, cp + m * ldc * out_size, ldc, k, cols, sc, 1,
                 panel_stream_at(wp, panel_elements, panels, p, m / MR, tiles_per_panel, k / 2), f32_out);
        else
            tile(MR, a + m * lda, lda, panel, pb, cp + m * ldc * out_size, ldc, k, cols, sc, 0, no_stream, f32_out);
    }
    const uint16_t *am = a + m * lda;
    char *cm = cp + m * ldc * out_size;
    const side_cursor sc = side_cursor_at(side, t, tiles);
    const panel_stream ps = streaming ? panel_stream_at(wp, panel_elements, panels, p, m / MR, tiles_per_panel, k / 2)
                                      : no_stream;
    switch (rows - m) {  /* the last rows, with a tile of their own size (no_stream: as before the streaming) */
        case 7: tile(7, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        case 6: tile(6, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        case 5: tile(5, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        case 4: tile(4, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        case 3: tile(3, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        case 2: tile(2, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        case 1: tile(1, am, lda, panel, pb, cm, ldc, k, cols, sc, 1, ps, f32_out); break;
        default: break;
    }
}
#endif

/* c[m, :n] = a[m, :k] @ W^T (+ bias) for m < rows, while prefetching `side`'s cache lines (or none: NULL),
 * spread one per K pair over the tiles. a: rows lda apart; wp: linear_bf16_pack's output; bias: [n] or
 * NULL; c: rows ldc apart. */
void linear_bf16_side(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c,
                      int64_t ldc, int rows, int n, int k, const side_prefetch *side) {
#ifdef HAVE_AVX512_BF16
#pragma omp parallel for schedule(static) if ((int64_t)rows * n * k >= 65536)
    for (int p = 0; p < (n + NR - 1) / NR; p++) product_panel(p, a, lda, wp, bias, c, ldc, rows, n, k, side, 0);
#else
    (void)a, (void)lda, (void)wp, (void)bias, (void)c, (void)ldc, (void)rows, (void)n, (void)k, (void)side;
#endif
}

/* c[m, :n] = a[m, :k] @ W^T (+ bias) for m < rows (linear_bf16_side with nothing to prefetch). */
void linear_bf16(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c,
                 int64_t ldc, int rows, int n, int k) {
    linear_bf16_side(a, lda, wp, bias, c, ldc, rows, n, k, NULL);
}

/* c[m, :n] = a[m, :k] @ W^T (+ bias) in float32 (c: rows ldc floats apart): the sums that linear_bf16 rounds to
 * bfloat16, for outputs read in float32 anyway (the LM head's logits: no rounding, no conversion pass). */
void linear_bf16_f32(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, float *c, int64_t ldc,
                     int rows, int n, int k) {
#ifdef HAVE_AVX512_BF16
#pragma omp parallel for schedule(static) if ((int64_t)rows * n * k >= 65536)
    for (int p = 0; p < (n + NR - 1) / NR; p++) product_panel(p, a, lda, wp, bias, c, ldc, rows, n, k, NULL, 1);
#else
    (void)a, (void)lda, (void)wp, (void)bias, (void)c, (void)ldc, (void)rows, (void)n, (void)k;
#endif
}
