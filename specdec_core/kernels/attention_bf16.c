/*
 * Attention of a few new query rows per sequence over a slot-based bf16 KV cache, on the CPU.
 *
 * out[b, t, h] = sum_s softmax_s(scale * q[b, t, h] . k[slot_b, h / G, s]) v[slot_b, h / G, s],
 * over the keys s <= starts[b] + t (the prefix and the new tokens up to this one); G = H / Hkv (grouped-query).
 *
 * Why not torch's SDPA: in bf16 on CPUs without native bf16 it is slowest exactly where decoding lives (one
 * query row: about 0.5 ms per layer at 200 keys, 4 ms at 1000), and its result for a row depends on how many
 * rows are computed together. Here each (row, head) is computed alone, in fp32, in a fixed order, so a token's
 * attention output is bit for bit the same in plain decoding and in verification.
 *
 * Layouts: q, out [B, T, H, D] bf16 contiguous; kc, vc [num_slots, Hkv, capacity, D] bf16. D % 16 == 0.
 * Vectors of `VEC` fp32 lanes (16 with AVX-512, 8 with AVX2: `bf16.h`).
 * Returns 0, or ENOMEM when a thread cannot allocate its scores (out is then partly unwritten).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_D 256

static void attend_one(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t n_keys,
                       int64_t D, float scale, float *scores) {
    vec_t qv[MAX_D / VEC];
    for (int64_t d = 0; d < D; d += VEC) qv[d / VEC] = vec_load_bf16(q + d);
    float max = -INFINITY;
    for (int64_t s = 0; s < n_keys; s++) {
        vec_t acc = vec_zero();
        for (int64_t d = 0; d < D; d += VEC) acc = vec_fmadd(qv[d / VEC], vec_load_bf16(k + s * D + d), acc);
        float score = vec_sum(acc) * scale;
        scores[s] = score;
        if (score > max) max = score;
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < n_keys; s++) {
        scores[s] = expf(scores[s] - max);
        sum += scores[s];
    }
    vec_t acc[MAX_D / VEC];
    for (int64_t d = 0; d < D; d += VEC) acc[d / VEC] = vec_zero();
    for (int64_t s = 0; s < n_keys; s++) {
        vec_t p = vec_set1(scores[s]);
        for (int64_t d = 0; d < D; d += VEC) acc[d / VEC] = vec_fmadd(p, vec_load_bf16(v + s * D + d), acc[d / VEC]);
    }
    float tmp[VEC];
    for (int64_t d = 0; d < D; d += VEC) {
        vec_store(tmp, vec_div(acc[d / VEC], vec_set1(sum)));
        for (int i = 0; i < VEC; i++) out[d + i] = float_to_bf16(tmp[i]);
    }
}

int specdec_attention_max_head_dim(void) { return MAX_D; }

int specdec_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *slots,
                           const int64_t *starts, uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                           int64_t D, int64_t capacity, float scale, int nthreads) {
    if ((uint64_t)capacity > SIZE_MAX / sizeof(float)) return ENOMEM; /* the scratch size would wrap around */
    int64_t group = H / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* Scratch per thread. A thread whose allocation fails still takes part in the work-sharing loop (every
         * thread of the team must reach it) but skips its rows; the caller gets ENOMEM, never a NULL write. */
        float *scores = malloc(sizeof(float) * (size_t)(capacity > 0 ? capacity : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t h = 0; h < H; h++) {
                    if (scores == NULL) continue;
                    int64_t kv = (slots[b] * Hkv + h / group) * capacity * D;
                    int64_t row = ((b * T + t) * H + h) * D;
                    attend_one(q + row, kc + kv, vc + kv, out + row, starts[b] + t + 1, D, scale, scores);
                }
        free(scores);
    }
    return failed ? ENOMEM : 0;
}
