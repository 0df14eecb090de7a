/* What the AMX kernels of this directory share: whether this compiler builds them (HAVE_AMX_BUILD: x86-64,
 * GCC 11+ or clang; the kernels carry target attributes, so the library still builds for CPUs without AMX
 * and `linear_amx_supported` says at run time whether they may run). */
#ifndef HETERO_AMX_H
#define HETERO_AMX_H

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define HAVE_AMX_BUILD 1

/* Configure tiles 0-7 (palette 1) with rows[t] rows of 64 bytes each (0: tile unused). */
__attribute__((target("amx-tile"))) static inline void amx_configure(const int rows[8]) {
    struct __attribute__((packed)) {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
