/* Linear layers straight from GGUF's block formats on CPUs with AVX512-VNNI (issue 39): y = x @ W^T (+ bias), W
 * [n, k] in Q4_0, Q4_1 or Q8_0 blocks of 32 weights along k, x bfloat16.
 *
 * Every format is held as w = d * u + m per block, u unsigned (4 bits: Q4_0's q with m = -8 d, Q4_1's q and m;
 * 8 bits: Q8_0's q + 128 with m = -128 d), so one integer product serves all three:
 * - each row of x is quantized per block of 32 to int16 (xq, dx = max|x| / 32767, round to nearest even) with
 *   sx = dx * sum(xq): int8 activations (llama.cpp's Q8_1, twice the products per instruction) cost the
 *   default model's greedy outputs their agreement with float32 (55% of tokens before the first divergence
 *   against bfloat16's 92%; int16: 90%);
 * - per block, sum(w * x) = d * dx * sum(u * xq) + m * sx, the integer sum by vpdpwssd (int16 pairs), exact in
 *   int32;
 * - 16 output rows of W sit in the 16 lanes of a vector (linear_gguf_pack's tiles): a pair of xq is broadcast
 *   and multiplied into 16 rows at once, no cross-lane sums; the float32 sum of a lane adds the blocks in k
 *   order.
 * A tile (16 rows, one block) keeps GGUF's bytes per weight: 16 x 16 bytes of nibbles (or 16 x 32 of bytes)
 * then 16 fp16 d and 16 fp16 m: 320 bytes where GGUF has 16 x 20 (Q4_1), 16 x 18 (Q4_0: 1.11x, m is new) or
 * 16 x 34 (Q8_0: 1.06x). Row tiles of W stream from memory once per call, rows of x up to MR at a time
 * reuse each unpacked tile. It is fast where memory bounds the product (a few rows); from 16 rows up it is
 * slower than the bfloat16 kernel (docs/performance.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_VNNI 1
#endif

#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define QK 32 /* weights per block */
#define NR 16 /* output rows per tile: the lanes of a vector */
#define MR 8  /* rows of x per pass over a row tile */
#define XQ_MAX 32767.0f /* the activations' int16 range */

static int weight_bits(int type) { return type == GGML_Q8_0 ? 8 : 4; }
static int gguf_block_bytes(int type) { return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : 34; }

/* Bytes of one tile (NR rows x one block): the unsigned weights, then NR fp16 d and NR fp16 m. */
static int64_t tile_bytes(int type) { return (int64_t)NR * QK * weight_bits(type) / 8 + 4 * NR; }

/* Whether these kernels run here (1) and take this type and shape: k a multiple of 32, n of 16. */
int linear_gguf_supported(int type, int n, int k) {
#ifdef HAVE_VNNI
    return (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0) && n > 0 && k > 0 && n % NR == 0
           && k % QK == 0;
#else
    (void)type, (void)n, (void)k;
    return 0;
#endif
}

int64_t linear_gguf_packed_bytes(int type, int n, int k) { return (int64_t)(n / NR) * (k / QK) * tile_bytes(type); }

#ifdef HAVE_VNNI
static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static uint16_t float_to_half(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

/* Where a 4-bit tile keeps row i's weight 2j + odd: its byte within the tile and the nibble's shift in it. */
static void nibble_at(int j, int i, int odd, int *byte, int *shift) {
    const int q = j / 4, t = j % 4, bit = 16 * odd + 4 * t; /* within row i's 32-bit word of group q */
    *byte = 64 * q + 4 * i + bit / 8;
    *shift = bit % 8;
}

/* One GGUF block -> its 32 unsigned weights and (d, m) as fp16 bits. */
static void unpack_block(const uint8_t *block, int type, uint8_t u[QK], uint16_t *d, uint16_t *m) {
    memcpy(d, block, 2);
    const float df = half_to_float(*d);
    if (type == GGML_Q8_0) {
        for (int j = 0; j < QK; j++) u[j] = (uint8_t)((int)(int8_t)block[2 + j] + 128);
        *m = float_to_half(-128.0f * df); /* a power-of-two multiple: exact unless it overflows fp16 */
        return;
    }
    const uint8_t *qs = block + (type == GGML_Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; j++) {
        u[j] = qs[j] & 0x0F;
        u[j + QK / 2] = qs[j] >> 4;
    }
    if (type == GGML_Q4_1)
        memcpy(m, block + 2, 2);
    else
        *m = float_to_half(-8.0f * df);
}
#endif

/* GGUF's [n][k / 32] blocks (rows in order) -> the tiles [n / 16][k / 32] the kernel reads. A tile holds its
 * weights by pair j (weights 2j and 2j + 1) then row i. 8-bit ones: two bytes per (j, i). 4-bit ones: four pairs
 * j = 4q + t in one 32-bit word per (q, i), 2j's nibble at bit 4t and 2j + 1's at bit 16 + 4t, so that one shift
 * and one mask of a 64-byte load give pair j's 16 rows as int16 pairs (a widening shuffle per pair cost 8-13% of
 * the product at 16-64 rows). nibble_at gives a nibble's place. Returns 0, or -1 when the kernels do not take
 * the type or shape (nothing written). */
int linear_gguf_pack(const uint8_t *src, int type, int n, int k, uint8_t *dst) {
#ifdef HAVE_VNNI
    if (!linear_gguf_supported(type, n, k)) return -1;
    const int nb = k / QK, bits = weight_bits(type);
    const int64_t per = tile_bytes(type), weight_bytes = per - 4 * NR;
    if (bits == 4) memset(dst, 0, (size_t)linear_gguf_packed_bytes(type, n, k)); /* nibbles are or-ed in */
#pragma omp parallel for schedule(static)
    for (int g = 0; g < n / NR; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *tile = dst + ((int64_t)g * nb + b) * per;
            uint16_t dm[2 * NR];
            for (int i = 0; i < NR; i++) {
                uint8_t u[QK];
                unpack_block(src + ((int64_t)(g * NR + i) * nb + b) * gguf_block_bytes(type), type, u, &dm[i], &dm[NR + i]);
                for (int j = 0; j < QK / 2; j++) { /* pair j: weights 2j and 2j + 1 */
                    if (bits == 8) {
                        tile[32 * j + 2 * i] = u[2 * j];
                        tile[32 * j + 2 * i + 1] = u[2 * j + 1];
                    } else {
                        int byte, shift;
                        nibble_at(j, i, 0, &byte, &shift);
                        tile[byte] |= (uint8_t)(u[2 * j] << shift);
                        nibble_at(j, i, 1, &byte, &shift);
                        tile[byte] |= (uint8_t)(u[2 * j + 1] << shift);
                    }
                }
            }
            memcpy(tile + weight_bytes, dm, sizeof dm);
        }
    return 0;
#else
    (void)src, (void)type, (void)n, (void)k, (void)dst;
    return -1;
#endif
}

/* Rows ids[0 .. count) of a packed [n, k] weight, dequantized to bfloat16 into out [count, k] (an embedding
 * lookup from the blocks: d * u + m in float32, rounded to nearest even, as gguf's dequantizer and a conversion
 * give). Returns 0, or -1 for a type or shape the kernels do not take or an id outside [0, n). */
int linear_gguf_rows(const uint8_t *wp, int type, int n, int k, const int64_t *ids, int count, uint16_t *out) {
#ifdef HAVE_VNNI
    if (!linear_gguf_supported(type, n, k)) return -1;
    for (int r = 0; r < count; r++)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    const int nb = k / QK, bits = weight_bits(type);
    const int64_t per = tile_bytes(type), weight_bytes = per - 4 * NR;
#pragma omp parallel for schedule(static) if ((int64_t)count * k >= 65536)
    for (int r = 0; r < count; r++) {
        const int64_t g = ids[r] / NR, i = ids[r] % NR;
        for (int b = 0; b < nb; b++) {
            const uint8_t *tile = wp + (g * nb + b) * per;
            uint16_t dh, mh;
            memcpy(&dh, tile + weight_bytes + 2 * i, 2), memcpy(&mh, tile + weight_bytes + 2 * (NR + i), 2);
            const float d = half_to_float(dh), m = half_to_float(mh);
            for (int j = 0; j < QK / 2; j++) {
                int u0, u1;
                if (bits == 8) {
                    u0 = tile[32 * j + 2 * i], u1 = tile[32 * j + 2 * i + 1];
                } else {
                    int byte, shift;
                    nibble_at(j, (int)i, 0, &byte, &shift);
                    u0 = tile[byte] >> shift & 0x0F;
                    nibble_at(j, (int)i, 1, &byte, &shift);
                    u1 = tile[byte] >> shift & 0x0F;
                }
                out[(int64_t)r * k + QK * b + 2 * j] = f32_to_bf16(d * (float)u0 + m);
                out[(int64_t)r * k + QK * b + 2 * j + 1] = f32_to_bf16(d * (float)u1 + m);
            }
        }
    }
    return 0;
#else
    (void)wp, (void)type, (void)n, (void)k, (void)ids, (void)count, (void)out;
    return -1;
#endif
}

#ifdef HAVE_VNNI
/* Row r of x (bfloat16, k values) -> xq[k] int16, dx[k / 32], sx[k / 32] (see the top of the file). */
static void quantize_row(const uint16_t *x, int k, int16_t *xq, float *dx, float *sx) {
    for (int b = 0; b < k / QK; b++) {
        const __m512 lo = bf16x16_to_f32(x + QK * b), hi = bf16x16_to_f32(x + QK * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = amax / XQ_MAX, inv = amax > 0.0f ? XQ_MAX / amax : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(xq + QK * b), _mm512_cvtsepi32_epi16(qlo));
        _mm256_storeu_si256((__m256i *)(xq + QK * b + 16), _mm512_cvtsepi32_epi16(qhi));
        dx[b] = scale;
        sx[b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}

/* Rows [r0, r0 + R) of the output (R <= MR, a constant at each call) for row tile g: acc over the k blocks. */
static inline __attribute__((always_inline)) void tile_rows(
    const int R, const int BITS, const uint8_t *tiles, int nb, int64_t per, const int16_t *xq, const float *dx,
    const float *sx, int k, int r0, int g, const uint16_t *bias, void *c, int64_t ldc, int f32_out) {
    __m512 acc[MR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    const int64_t weight_bytes = per - 4 * NR;
    for (int b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + ((int64_t)g * nb + b) * per;
        __m512i isum[MR];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < QK / 2; j++) {
            /* lane i: row i's weights 2j, 2j + 1 as two int16 */
            __m512i w;
            if (BITS == 4) {
                const __m512i words = _mm512_loadu_si512((const void *)(tile + 64 * (j / 4))); /* nibble_at's */
                w = _mm512_and_si512(_mm512_srli_epi32(words, 4 * (j % 4)), nibbles);
            } else {
                w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(tile + 32 * j)));
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, xq + (int64_t)(r0 + r) * k + QK * b + 2 * j, 4);
                isum[r] = _mm512_dpwssd_epi32(isum[r], w, _mm512_set1_epi32(pair));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + weight_bytes)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + weight_bytes + 2 * NR)));
        for (int r = 0; r < R; r++) {
            const int64_t row = (int64_t)(r0 + r) * (k / QK) + b;
            const __m512 sum = _mm512_cvtepi32_ps(isum[r]);
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(dx[row])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[row]), acc[r]);
        }
    }
    /* widened in place, not by bf16.h's bf16x16_to_f32: that call in this always-inline tile cost 14% at 32 rows */
    const __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + NR * g))), 16))
                           : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        const __m512 y = _mm512_add_ps(acc[r], bv);
        if (f32_out)
            _mm512_storeu_ps((float *)c + (int64_t)(r0 + r) * ldc + NR * g, y);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)c + (int64_t)(r0 + r) * ldc + NR * g), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

static void row_tile(int type, const uint8_t *tiles, int nb, const int16_t *xq, const float *dx, const float *sx,
                     int rows, int k, int g, const uint16_t *bias, void *c, int64_t ldc, int f32_out) {
    const int64_t per = tile_bytes(type);
    int r0 = 0;
#define TILE_ROWS(R) \
    (weight_bits(type) == 4 ? tile_rows(R, 4, tiles, nb, per, xq, dx, sx, k, r0, g, bias, c, ldc, f32_out) \
                            : tile_rows(R, 8, tiles, nb, per, xq, dx, sx, k, r0, g, bias, c, ldc, f32_out))
    for (; r0 + MR <= rows; r0 += MR) TILE_ROWS(MR);
    switch (rows - r0) {
        case 7: TILE_ROWS(7); break;
        case 6: TILE_ROWS(6); break;
        case 5: TILE_ROWS(5); break;
        case 4: TILE_ROWS(4); break;
        case 3: TILE_ROWS(3); break;
        case 2: TILE_ROWS(2); break;
        case 1: TILE_ROWS(1); break;
        default: break;
    }
#undef TILE_ROWS
}
#endif

/* c[rows, :n] = a[rows, :k] @ W^T (+ bias): a bfloat16 rows lda apart; wp: linear_gguf_pack's tiles of `type`;
 * bias: [n] bfloat16 or NULL; c: rows ldc apart, bfloat16, or float32 with f32_out. Returns 0, -1 for a type or
 * shape the kernels do not take, -2 when the quantized rows cannot be allocated. */
int linear_gguf(const uint16_t *a, int64_t lda, const uint8_t *wp, int type, const uint16_t *bias, void *c,
                int64_t ldc, int rows, int n, int k, int f32_out) {
#ifdef HAVE_VNNI
    if (!linear_gguf_supported(type, n, k)) return -1;
    if (rows <= 0) return 0;
    const int nb = k / QK;
    /* The quantized rows: on the stack for a few rows (a decode step's product: no allocation, and quantized
     * before the threads start, no barrier between), else allocated and quantized by the threads. */
    enum { STACK_VALUES = 8192 };
    int16_t xq_stack[STACK_VALUES];
    float scales_stack[2 * STACK_VALUES / QK];
    const int small = (int64_t)rows * k <= STACK_VALUES;
    int16_t *xq = small ? xq_stack : malloc(sizeof(int16_t) * (size_t)rows * (size_t)k);
    float *dx = small ? scales_stack : malloc(sizeof(float) * 2 * (size_t)rows * (size_t)nb);
    if (!xq || !dx) {
        if (!small) free(xq), free(dx);
        return -2;
    }
    float *sx = dx + (size_t)rows * nb;
    if (small)
        for (int r = 0; r < rows; r++)
            quantize_row(a + (int64_t)r * lda, k, xq + (int64_t)r * k, dx + (int64_t)r * nb, sx + (int64_t)r * nb);
#pragma omp parallel if ((int64_t)rows * n * k >= 65536)
    {
        if (!small) {
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++)
                quantize_row(a + (int64_t)r * lda, k, xq + (int64_t)r * k, dx + (int64_t)r * nb, sx + (int64_t)r * nb);
        }
#pragma omp for schedule(static)
        for (int g = 0; g < n / NR; g++) row_tile(type, wp, nb, xq, dx, sx, rows, k, g, bias, c, ldc, f32_out);
    }
    if (!small) free(xq), free(dx);
    return 0;
#else
    (void)a, (void)lda, (void)wp, (void)type, (void)bias, (void)c, (void)ldc, (void)rows, (void)n, (void)k, (void)f32_out;
    return -1;
#endif
}
