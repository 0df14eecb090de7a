/* What the AMX kernels of this directory share: whether this compiler builds them (HAVE_AMX_BUILD: x86-64,
 * GCC 11+ or clang; the kernels carry target attributes, so the library still builds for CPUs without AMX
 * and `linear_amx_supported` says at run time whether they may run). */
#ifndef HETERO_AMX_H
#define HETERO_AMX_H

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#include <immintrin.h>
#define HAVE_AMX_BUILD 1
#endif

#endif
