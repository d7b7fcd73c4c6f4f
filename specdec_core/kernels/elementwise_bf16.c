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
 * `width` gate values then its `width` up values; y is [rows, width].
 */
void specdec_silu_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gu + r * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i++) {
            float g = bf16_to_float(gate[i]);
            y[r * width + i] = float_to_bf16(g / (1.0f + expf(-g)) * bf16_to_float(up[i]));
        }
    }
}
