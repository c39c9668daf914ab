/* dst = op(dst, src), elementwise, for the compiled path's reducing receives (steps.c): the same results as
   the core's numpy kernels (erdma_core/protocol/reduce_ops.py), bit for bit, for the pairs offered here.
   Integers wrap as numpy's do (arithmetic on the unsigned type of the same width); floating point has sum
   and product only (numpy's minimum and maximum have their own NaN and signed-zero rules, so those stay
   with the core). Built without -ffast-math and with -ffp-contract=off: each element is one IEEE operation. */
#include <stddef.h>
#include <stdint.h>

#include "ibv.h"

#define LOOP(T, EXPR)                                    \
    do {                                                 \
        T *d = (T *)dst;                                 \
        const T *s = (const T *)src;                     \
        for (size_t i = 0; i < n; i++)                   \
            d[i] = (T)(EXPR);                            \
    } while (0)

/* the integer ops of one width: arithmetic on U (unsigned), comparisons on S (signed or not) */
#define INTEGER(S, U)                                                                     \
    switch (op) {                                                                         \
    case EV_SUM: LOOP(U, d[i] + s[i]); return 0;                                          \
    case EV_PROD: LOOP(U, (uintmax_t)d[i] * s[i]); return 0;                              \
    case EV_MIN: LOOP(S, s[i] < d[i] ? s[i] : d[i]); return 0;                            \
    case EV_MAX: LOOP(S, s[i] > d[i] ? s[i] : d[i]); return 0;                            \
    case EV_BAND: LOOP(U, d[i] & s[i]); return 0;                                         \
    case EV_BOR: LOOP(U, d[i] | s[i]); return 0;                                          \
    case EV_BXOR: LOOP(U, d[i] ^ s[i]); return 0;                                         \
    default: return -1;                                                                   \
    }

#define FLOATING(T)                                  \
    switch (op) {                                    \
    case EV_SUM: LOOP(T, d[i] + s[i]); return 0;     \
    case EV_PROD: LOOP(T, d[i] * s[i]); return 0;    \
    default: return -1;                              \
    }

int ev_reduce(void *dst, const void *src, unsigned long long nbytes, int op, int dtype) {
    size_t n = (size_t)nbytes / (size_t)ev_itemsize(dtype);
    switch (dtype) {
    case EV_INT8: INTEGER(int8_t, uint8_t)
    case EV_UINT8: INTEGER(uint8_t, uint8_t)
    case EV_INT16: INTEGER(int16_t, uint16_t)
    case EV_UINT16: INTEGER(uint16_t, uint16_t)
    case EV_INT32: INTEGER(int32_t, uint32_t)
    case EV_UINT32: INTEGER(uint32_t, uint32_t)
    case EV_INT64: INTEGER(int64_t, uint64_t)
    case EV_UINT64: INTEGER(uint64_t, uint64_t)
    case EV_FLOAT32: FLOATING(float)
    case EV_FLOAT64: FLOATING(double)
    default: return -1;
    }
}

int ev_itemsize(int dtype) {
    switch (dtype) {
    case EV_INT8: case EV_UINT8: return 1;
    case EV_INT16: case EV_UINT16: return 2;
    case EV_INT32: case EV_UINT32: case EV_FLOAT32: return 4;
    case EV_INT64: case EV_UINT64: case EV_FLOAT64: return 8;
    default: return 0;
    }
}

int ev_reducible(int op, int dtype) {
    if (!ev_itemsize(dtype) || op < EV_SUM || op > EV_BXOR)
        return 0;
    return dtype != EV_FLOAT32 && dtype != EV_FLOAT64 ? 1 : op == EV_SUM || op == EV_PROD;
}
