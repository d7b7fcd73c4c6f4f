/*
 * Row-wise bf16 operations of a decoder layer, fused: each replaces several torch ops (and their dispatch cost,
 * which dominates at one or a few rows). Every row is computed alone in fp32, so the result for a row does not
 * depend on the rest of the batch.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* y = weight * bf16(x * rsqrt(mean(x^2) + eps)), as Llama-family RMSNorm rounds: normalise in fp32, scale in bf16. */
void specdec_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t dim,
                           float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float v = bf16_to_float(xr[i]);
            sum += v * v;
        }
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * scale));
            y[r * dim + i] = float_to_bf16(bf16_to_float(weight[i]) * normed);
        }
    }
}

/*
 * Rotary embedding in place on x [rows, heads, head_dim] (rotate-half convention): for i < head_dim / 2,
 * (a, b) = (x[i], x[i + half]) becomes (a cos - b sin, b cos + a sin) with angle positions[row] * inv_freq[i].
 */
void specdec_rope_bf16(uint16_t *x, const int64_t *positions, const float *inv_freq, int64_t rows, int64_t heads,
                       int64_t head_dim) {
    int64_t half = head_dim / 2;
    float cosv[256], sinv[256];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < half; i++) {
            float angle = (float)positions[r] * inv_freq[i];
            cosv[i] = cosf(angle);
            sinv[i] = sinf(angle);
        }
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + (r * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float a = bf16_to_float(v[i]), b = bf16_to_float(v[i + half]);
                v[i] = float_to_bf16(a * cosv[i] - b * sinv[i]);
                v[i + half] = float_to_bf16(b * cosv[i] + a * sinv[i]);
            }
        }
    }
}

/*
 * y[r] = silu(gate[r]) * up[r] for rows of a fused gate/up projection: gu is [rows, 2 * width], each row its
 * `width` gate values then its `width` up values; y is [rows, width]. Vectorised (`vec_exp`) and split over
 * `nthreads`: done one value at a time with expf it costs a wide verify a noticeable share of the target's matrix
 * multiplies. A row's last width % VEC values go through the same vector code, padded.
 */
static inline vec_t silu_mul(vec_t g, vec_t u) {
    return vec_mul(vec_div(g, vec_add(vec_set1(1.0f), vec_exp(vec_sub(vec_zero(), g)))), u);
}

void specdec_silu_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t rows, int64_t width, int nthreads) {
    int64_t chunks = (width + VEC - 1) / VEC;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * width >= 4096)
    for (int64_t c = 0; c < rows * chunks; c++) {
        int64_t r = c / chunks, i = (c % chunks) * VEC, n = width - i < VEC ? width - i : VEC;
        const uint16_t *gate = gu + r * 2 * width + i, *up = gate + width;
        if (n == VEC) {
            vec_store_bf16(y + r * width + i, silu_mul(vec_load_bf16(gate), vec_load_bf16(up)));
            continue;
        }
        uint16_t g[VEC] = {0}, u[VEC] = {0}, out[VEC];
        for (int64_t j = 0; j < n; j++) g[j] = gate[j], u[j] = up[j];
        vec_store_bf16(out, silu_mul(vec_load_bf16(g), vec_load_bf16(u)));
        for (int64_t j = 0; j < n; j++) y[r * width + i + j] = out[j];
    }
}

/* out[i] = exp(x[i]) by `vec_exp`, the exponential of softmax and silu: exported so tests can hold it to libm's. */
void specdec_exp_f32(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += VEC) {
        float in[VEC] = {0}, res[VEC];
        for (int64_t j = 0; j < VEC && i + j < n; j++) in[j] = x[i + j];
        vec_store(res, vec_exp(vec_load(in)));
        for (int64_t j = 0; j < VEC && i + j < n; j++) out[i + j] = res[j];
    }
}

/*
 * The two ends of an int8 GEMM call of many rows through fbgemm (`fbgemm_rows.py`), one pass each instead of
 * several torch ops. span: each bf16 row of x [rows, dim] divided by its largest magnitude (1 for a zero row),
 * followed by +1 and -1, into out [rows, dim + 2] fp32; the divisors into peak [rows]. finish: y [rows, n] fp32
 * times its row's peak, plus bias (bf16 [n] or NULL), rounded into out [rows, n] bf16.
 */
void specdec_rows_span(const uint16_t *x, float *out, float *peak, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        float *o = out + r * (dim + 2);
        float top = 0.0f;
        for (int64_t i = 0; i < dim; i++) top = fmaxf(top, fabsf(bf16_to_float(xr[i])));
        peak[r] = top > 0.0f ? top : 1.0f;
        for (int64_t i = 0; i < dim; i++) o[i] = bf16_to_float(xr[i]) / peak[r];
        o[dim] = 1.0f;
        o[dim + 1] = -1.0f;
    }
}

void specdec_rows_finish(const float *y, const float *peak, const uint16_t *bias, uint16_t *out, int64_t rows,
                         int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) {
            float v = y[r * n + j] * peak[r];
            if (bias) v += bf16_to_float(bias[j]);
            out[r * n + j] = float_to_bf16(v);
        }
}
