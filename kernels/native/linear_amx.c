/* bfloat16 linear layers (x @ W^T + bias) on AMX tiles, for the row counts of decoding (gpu_worker/cpu/packed_linear.py).
 *
 * oneDNN's AMX kernels stream a decode step's weights at about 15 GB/s on a 2-core Xeon, well under what
 * the memory gives one core's sequential reads. Here the weight is re-laid out once at load into blocks of
 * 32 outputs x 32 K values, each two B tiles of 16 outputs (row r: K pair 2r, 2r+1 of each output, the
 * layout TDPBF16PS takes), in the order the kernel reads them, so each thread streams its outputs' weights
 * from one contiguous run, prefetched a few KB ahead. Per block of up to 32 rows, four float32 C tiles
 * (2 row tiles x 2 output tiles) accumulate over K; the A tiles are the input rows read in place.
 * SmolLM2-135M's products on that Xeon (benchmarks/cpu_kernels.py): 1.4x oneDNN's prepacked weights at
 * 1-32 rows, 1.1x at 64, 1.0x at 128, 0.85x at 256: the caller keeps oneDNN above `native_linear.AMX_MAX_ROWS`.
 *
 * Sizes: n and k multiples of 32 (the caller checks). Every output row is computed alone, in the same
 * order whatever the other rows, float32 sums, one round-to-nearest-even to bfloat16 (bias added first).
 */
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"

#ifdef HAVE_AMX_BUILD
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PREFETCH_BYTES 8192 /* how far ahead of the B tiles in use the weights are prefetched */
#endif

/* 1 when the CPU has AMX-BF16 and the kernel granted this process the tile state, else 0. */
int linear_amx_supported(void) {
#ifdef HAVE_AMX_BUILD
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    const unsigned int amx_bf16 = 1u << 22, amx_tile = 1u << 24;
    if ((edx & (amx_bf16 | amx_tile)) != (amx_bf16 | amx_tile)) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* w [n, k] row-major -> [n/32][k/32][2 output tiles][16 K pairs][16 outputs][2]. */
void linear_amx_pack(const uint16_t *w, int n, int k, uint16_t *wp) {
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < n / 32; nb++) {
        uint16_t *dst = wp + (int64_t)nb * 32 * k;
        for (int kb = 0; kb < k; kb += 32)
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < 16; r++)
                    for (int j = 0; j < 16; j++) {
                        const uint16_t *src = w + (int64_t)(nb * 32 + half * 16 + j) * k + kb + 2 * r;
                        *dst++ = src[0];
                        *dst++ = src[1];
                    }
    }
}

#ifdef HAVE_AMX_BUILD
/* Tiles 0-3: C (row tile 0 x output tiles 0, 1; row tile 1 x 0, 1); 4, 5: A (row tiles); 6, 7: B. */
static void configure_tiles(int rows0, int rows1) {
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    amx_configure(rows);
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))
void linear_amx(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c, int64_t ldc,
                int rows, int n, int k) {
#pragma omp parallel if (rows > 0)
    {
        float sums[4][16 * 16] __attribute__((aligned(64)));
        int tiles_rows0 = -1, tiles_rows1 = -1;
#pragma omp for schedule(static)
        for (int nb = 0; nb < n / 32; nb++) {
            const uint16_t *block = wp + (int64_t)nb * 32 * k;
            const __m512 bias0 = bias ? bf16x16_to_f32(bias + nb * 32) : _mm512_setzero_ps();
            const __m512 bias1 = bias ? bf16x16_to_f32(bias + nb * 32 + 16) : _mm512_setzero_ps();
            for (int mb = 0; mb < rows; mb += 32) {
                const int left = rows - mb;
                const int rows0 = left < 16 ? left : 16, rows1 = left <= 16 ? 0 : (left < 32 ? left - 16 : 16);
                if (rows0 != tiles_rows0 || rows1 != tiles_rows1) {
                    configure_tiles(rows0, rows1);
                    tiles_rows0 = rows0, tiles_rows1 = rows1;
                }
                _tile_zero(0);
                _tile_zero(1);
                if (rows1) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                const uint16_t *a_rows = a + (int64_t)mb * lda;
                for (int kb = 0; kb < k; kb += 32) {
                    const uint16_t *b = block + (int64_t)kb * 32;
                    const char *ahead = (const char *)b + PREFETCH_BYTES;
                    for (int line = 0; line < 2048; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
                    _tile_loadd(6, b, 64);
                    _tile_loadd(7, b + 512, 64);
                    _tile_loadd(4, a_rows + kb, lda * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (rows1) {
                        _tile_loadd(5, a_rows + 16 * lda + kb, lda * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64);
                _tile_stored(1, sums[1], 64);
                if (rows1) {
                    _tile_stored(2, sums[2], 64);
                    _tile_stored(3, sums[3], 64);
                }
                for (int half = 0; half < 2; half++)
                    for (int i = 0; i < (half ? rows1 : rows0); i++) {
                        const __m512 lo = _mm512_add_ps(_mm512_load_ps(&sums[2 * half][i * 16]), bias0);
                        const __m512 hi = _mm512_add_ps(_mm512_load_ps(&sums[2 * half + 1][i * 16]), bias1);
                        _mm512_storeu_si512((void *)(c + (int64_t)(mb + 16 * half + i) * ldc + nb * 32),
                                            (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                    }
            }
        }
        _tile_release();
    }
}
#else
void linear_amx(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c, int64_t ldc,
                int rows, int n, int k) {
    (void)a, (void)lda, (void)wp, (void)bias, (void)c, (void)ldc, (void)rows, (void)n, (void)k;
}
#endif
