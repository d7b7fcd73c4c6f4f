/*
 * A model's decoder layers in one call, on the CPU kernels: a quantized draft's (4-bit weights, `gemm_int4.c`, or
 * int8, `gemm_int8.c`) or a bf16 model's (`gemm.c`: the target's plain decoding and verification).
 *
 * Why: a forward is a hundred or more small kernel calls, and each went through torch's module dispatch, tensor
 * allocations, views and ctypes: for a small draft that dispatch was a large share of a step, beside its matrix
 * multiplies. Here the layers run the
 * same kernels in the same order with the same roundings (`gemm.c`, `gemm_int4.c` or `gemm_int8.c`,
 * `elementwise_bf16.c`, `attention_bf16.c`; residual adds in fp32 rounded to bf16, as torch adds bf16), so a
 * row's result is bit for bit the one the module-by-module forward gives.
 *
 * Per layer, for the M = B * T rows of x [M, D] (updated in place), with W = (H + 2 Hkv) * hd:
 *   x += o(attention(rope(q), rope(k) and v written into the cache)), q | k | v = qkv(rms_norm(x));
 *   x += down(silu(gate) * up),  gate | up = gate_up(rms_norm(x)).
 * The cache: keys[l] and values[l] are [slots, Hkv, capacity, hd]; row b's T new tokens are written at
 * positions[b * T + t] of slot slots[b], and attend to the keys before them (starts[b] + t + 1 keys).
 * Returns 0, or ENOMEM when scratch memory cannot be allocated (x then holds a partial result).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

int specdec_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int nthreads);
int specdec_gemm_w4a8(const uint16_t *x, const uint8_t *w4, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int nthreads);
int specdec_gemm_w8a8(const uint16_t *x, const int8_t *w, const float *sw, const int32_t *wsum, const uint16_t *b,
                      uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads);
int specdec_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *slots,
                           const int64_t *starts, uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                           int64_t D, int64_t capacity, float scale, int nthreads);
void specdec_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t dim,
                           float eps);
void specdec_rope_bf16(uint16_t *x, const int64_t *positions, const float *inv_freq, int64_t rows, int64_t heads,
                       int64_t head_dim);
void specdec_silu_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t rows, int64_t width, int nthreads);

/* One linear layer, bias [N] or NULL. bits 4: weight is the weights and scales packed [N, K / 64 * 36]
 * (`gemm_int4.c`); bits 8: weight is int8 [N, K], with its rows' scales [N] and sums [N] (`gemm_int8.c`);
 * bits 16: weight is bf16 [N, K] (`gemm.c`). A 4-bit layer with weight8 (int8 [N, K], its scales and sums in
 * scale and row_sums) runs calls of int8_from rows or more on the int8 kernel, as `Int4CPULinear` does. */
typedef struct {
    int64_t bits;
    const void *weight;
    const float *scale;
    const int32_t *row_sums;
    const uint16_t *bias;
    const int8_t *weight8;
    int64_t int8_from;
} specdec_linear_q;

/* One decoder layer's weights (layers_quant.py's `Layer` mirrors this). */
typedef struct {
    const uint16_t *input_norm, *post_norm; /* [D] bf16 */
    specdec_linear_q qkv, o, gate_up, down;
} specdec_layer_q;

/* The model's sizes, and what its attention and norms need. */
typedef struct {
    int64_t D, H, Hkv, hd, I, capacity;
    float eps, scale; /* the norms' epsilon; attention's 1 / sqrt(hd) */
    const float *inv_freq; /* [hd / 2]: rotary frequencies */
} specdec_dims_q;

static int linear(const specdec_linear_q *w, const uint16_t *x, uint16_t *y, int64_t M, int64_t N, int64_t K,
                  int nthreads) {
    if (w->bits == 16) return specdec_gemm_bf16(x, w->weight, w->bias, y, M, N, K, nthreads);
    if (w->bits == 8) return specdec_gemm_w8a8(x, w->weight, w->scale, w->row_sums, w->bias, y, M, N, K, nthreads);
    if (w->weight8 != NULL && M >= w->int8_from)
        return specdec_gemm_w8a8(x, w->weight8, w->scale, w->row_sums, w->bias, y, M, N, K, nthreads);
    return specdec_gemm_w4a8(x, w->weight, w->bias, y, M, N, K, nthreads);
}

static void add_into(uint16_t *x, const uint16_t *y, int64_t n) { /* x = bf16(x + y), as torch adds bf16 */
    for (int64_t i = 0; i < n; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

/* q and k out of each row of qkv into dense [M, heads, hd] buffers (the rotary kernel's layout), rotated. */
static void split_rotate(const specdec_dims_q *d, const uint16_t *qkv, uint16_t *q, uint16_t *k,
                         const int64_t *positions, int64_t M) {
    int64_t wq = d->H * d->hd, wkv = d->Hkv * d->hd, w = wq + 2 * wkv;
    for (int64_t m = 0; m < M; m++) {
        memcpy(q + m * wq, qkv + m * w, sizeof(uint16_t) * (size_t)wq);
        memcpy(k + m * wkv, qkv + m * w + wq, sizeof(uint16_t) * (size_t)wkv);
    }
    specdec_rope_bf16(q, positions, d->inv_freq, M, d->H, d->hd);
    specdec_rope_bf16(k, positions, d->inv_freq, M, d->Hkv, d->hd);
}

/* Each new token's key (rotated) and value at its position in its row's slot. */
static void write_cache(const specdec_dims_q *d, uint16_t *keys, uint16_t *values, const uint16_t *k,
                        const uint16_t *qkv, const int64_t *positions, const int64_t *slots, int64_t B, int64_t T) {
    int64_t wq = d->H * d->hd, wkv = d->Hkv * d->hd, w = wq + 2 * wkv;
    size_t bytes = sizeof(uint16_t) * (size_t)d->hd;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            int64_t m = b * T + t;
            for (int64_t h = 0; h < d->Hkv; h++) {
                int64_t at = ((slots[b] * d->Hkv + h) * d->capacity + positions[m]) * d->hd;
                memcpy(keys + at, k + m * wkv + h * d->hd, bytes);
                memcpy(values + at, qkv + m * w + wq + wkv + h * d->hd, bytes);
            }
        }
}

int specdec_layers_quant(const specdec_layer_q *layers, uint16_t *const *keys, uint16_t *const *values, int64_t L,
                      const specdec_dims_q *d, uint16_t *x, const int64_t *positions, const int64_t *slots,
                      const int64_t *starts, int64_t B, int64_t T, int nthreads) {
    int64_t M = B * T, D = d->D, I = d->I;
    int64_t wq = d->H * d->hd, wkv = d->Hkv * d->hd, w = wq + 2 * wkv;
    /* scratch: normed [M, D], qkv [M, w], q [M, wq], k [M, wkv], attended [M, wq], out [M, D], gate_up [M, 2I],
     * act [M, I] */
    size_t per_row = (size_t)(D + w + wq + wkv + wq + D + 2 * I + I);
    uint16_t *scratch = malloc(sizeof(uint16_t) * per_row * (size_t)M);
    if (scratch == NULL) return ENOMEM;
    uint16_t *normed = scratch, *qkv = normed + M * D, *q = qkv + M * w, *k = q + M * wq, *attended = k + M * wkv;
    uint16_t *out = attended + M * wq, *gate_up = out + M * D, *act = gate_up + M * 2 * I;
    int status = 0;
    for (int64_t l = 0; l < L && status == 0; l++) {
        const specdec_layer_q *layer = layers + l;
        specdec_rms_norm_bf16(x, layer->input_norm, normed, M, D, d->eps);
        if ((status = linear(&layer->qkv, normed, qkv, M, w, D, nthreads))) break;
        split_rotate(d, qkv, q, k, positions, M);
        write_cache(d, keys[l], values[l], k, qkv, positions, slots, B, T);
        status = specdec_attention_bf16(q, keys[l], values[l], slots, starts, attended, B, T, d->H, d->Hkv, d->hd,
                                        d->capacity, d->scale, nthreads);
        if (status || (status = linear(&layer->o, attended, out, M, D, wq, nthreads))) break;
        add_into(x, out, M * D);
        specdec_rms_norm_bf16(x, layer->post_norm, normed, M, D, d->eps);
        if ((status = linear(&layer->gate_up, normed, gate_up, M, 2 * I, D, nthreads))) break;
        specdec_silu_mul_bf16(gate_up, act, M, I, nthreads);
        if ((status = linear(&layer->down, act, out, M, D, I, nthreads))) break;
        add_into(x, out, M * D);
    }
    free(scratch);
    return status;
}
