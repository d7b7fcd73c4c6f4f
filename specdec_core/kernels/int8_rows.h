/* Activations quantized to int8 per row, for the draft kernels that multiply with `vpmaddubsw` (unsigned by signed
 * bytes): AVX2's int8 kernel (`gemm_int8.c`) and the int4 kernel (`gemm_int4.c`). A row x of K bf16 values becomes
 * xq = round(x / sx), sx = max|x| / 127, stored twice: signed (xq) and as magnitudes (|xq|), so that a product
 * |xq| * (w with xq's sign) never saturates the instruction's int16 pairs. */
#ifndef SPECDEC_INT8_ROWS_H
#define SPECDEC_INT8_ROWS_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* Row x [K] into xs [K] (xq) and xa [K] (|xq|); returns its scale. */
static float quantize_row_sign_abs(const uint16_t *x, int8_t *xs, uint8_t *xa, int64_t K) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(bf16_to_float(x[k])));
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int64_t k = 0; k < K; k++) {
        long q = lrintf(bf16_to_float(x[k]) / scale);
        xs[k] = (int8_t)q;
        xa[k] = (uint8_t)(q < 0 ? -q : q);
    }
    return scale;
}

/* x [M, K] quantized: *xs [M, K] xq, followed in the same allocation by [M, K] |xq| (at *xs + M * K), and *sx [M]
 * the rows' scales; the caller frees both. K a multiple of 32. Returns 0, or ENOMEM (nothing left allocated). */
static int quantize_rows_sign_abs(const uint16_t *x, int64_t M, int64_t K, int8_t **xs, float **sx) {
    if ((uint64_t)M > SIZE_MAX / sizeof(float) || (K > 0 && (uint64_t)M > SIZE_MAX / 2 / (uint64_t)K)) return ENOMEM;
    size_t bytes = (size_t)M * (size_t)K; /* 2 * bytes is a multiple of 64, as aligned_alloc needs */
    *xs = aligned_alloc(64, bytes > 0 ? 2 * bytes : 64);
    *sx = malloc((size_t)M * sizeof(float));
    if (*xs == NULL || *sx == NULL) {
        free(*xs);
        free(*sx);
        return ENOMEM;
    }
    uint8_t *xa = (uint8_t *)*xs + bytes;
    for (int64_t m = 0; m < M; m++) (*sx)[m] = quantize_row_sign_abs(x + m * K, *xs + m * K, xa + m * K, K);
    return 0;
}

#endif
