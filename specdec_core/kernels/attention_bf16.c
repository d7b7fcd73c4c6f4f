/*
 * Attention of a few new query rows per sequence over a slot-based bf16 KV cache, on the CPU.
 *
 * out[b, t, h] = sum_s softmax_s(scale * q[b, t, h] . k[slot_b, h / G, s]) v[slot_b, h / G, s],
 * over the keys s <= starts[b] + t (the prefix and the new tokens up to this one); G = H / Hkv (grouped-query).
 *
 * Why not torch's SDPA: in bf16 on CPUs without native bf16 it is slowest exactly where decoding lives (one
 * query row: about 0.5 ms per layer at 200 keys, 4 ms at 1000), and its result for a row depends on how many
 * rows are computed together. Here each (row, head) is computed in fp32 by one fixed sequence of operations,
 * so a token's attention output is bit for bit the same in plain decoding and in verification.
 *
 * The query rows that read the same KV head (the G heads of a group, for each of the T new tokens) are taken
 * up to ROWS at a time: each key and value vector is loaded and widened once for all of them instead of once
 * per row. That changes which rows share a load, never the operations a row's result goes through.
 *
 * Layouts: q, out [B, T, H, D] bf16 contiguous; kc, vc [num_slots, Hkv, capacity, D] bf16. D % 16 == 0.
 * Vectors of `VEC` fp32 lanes (16 with AVX-512, 8 with AVX2: `bf16.h`).
 * Returns 0, ENOMEM when a thread cannot allocate its scratch (out is then partly unwritten), or EINVAL when D
 * exceeds MAX_D.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_D 256
#define ROWS 6  /* query rows per tile: their accumulators (ROWS x 2 vectors) stay in AVX2's 16 registers */

/* The values' pass for one chunk of NV vectors of d (at offset d) over all the tile's rows. */
#define VALUES(NV)                                                                                      \
    {                                                                                                   \
        vec_t acc[ROWS][NV];                                                                            \
        for (int r = 0; r < ROWS; r++)                                                                  \
            for (int c = 0; c < NV; c++) acc[r][c] = vec_zero();                                        \
        for (int64_t s = 0; s < most; s++) {                                                            \
            vec_t vv[NV];                                                                               \
            for (int c = 0; c < NV; c++) vv[c] = vec_load_bf16(v + s * D + d + c * VEC);                \
            _Pragma("GCC unroll 8")                                                                     \
            for (int r = 0; r < ROWS; r++)                                                              \
                if (r < rows && s < n_keys[r]) {                                                        \
                    vec_t p = vec_set1(scores[r * capacity + s]);                                       \
                    for (int c = 0; c < NV; c++) acc[r][c] = vec_fmadd(p, vv[c], acc[r][c]);            \
                }                                                                                       \
        }                                                                                               \
        float tmp[NV * VEC];                                                                            \
        for (int r = 0; r < rows; r++) {                                                                \
            for (int c = 0; c < NV; c++) vec_store(tmp + c * VEC, vec_div(acc[r][c], vec_set1(sums[r])));\
            for (int i = 0; i < NV * VEC; i++) out[r][d + i] = float_to_bf16(tmp[i]);                   \
        }                                                                                               \
    }

/* row[s] = exp(row[s] - max) for s < n, in place; returns their sum. Vectorised (`vec_exp`): one expf per key
 * and row cost a verify of 17 tokens about as much as the score and value passes. The sum is taken lane-wise and
 * then across lanes, in a fixed order for a given n (the row's own key count), so a token gets the same bits
 * however many rows share the call. */
static float softmax_row(float *row, int64_t n) {
    int64_t full = n - n % VEC;
    vec_t most = vec_set1(-INFINITY);
    for (int64_t s = 0; s < full; s += VEC) most = vec_max(vec_load(row + s), most);
    float lanes[VEC], max = -INFINITY;
    vec_store(lanes, most);
    for (int s = 0; s < VEC; s++) max = lanes[s] > max ? lanes[s] : max;
    for (int64_t s = full; s < n; s++) max = row[s] > max ? row[s] : max;
    vec_t m = vec_set1(max), total = vec_zero();
    for (int64_t s = 0; s < full; s += VEC) {
        vec_t e = vec_exp(vec_sub(vec_load(row + s), m));
        vec_store(row + s, e);
        total = vec_add(total, e);
    }
    if (full < n) { /* the last n % VEC keys, padded with the max (e^0) and their lanes left out of the sum */
        float tail[VEC];
        for (int64_t s = 0; s < VEC; s++) tail[s] = full + s < n ? row[full + s] : max;
        vec_store(tail, vec_exp(vec_sub(vec_load(tail), m)));
        for (int64_t s = 0; s < VEC; s++) tail[s] = full + s < n ? tail[s] : 0.0f;
        total = vec_add(total, vec_load(tail));
        for (int64_t s = full; s < n; s++) row[s] = tail[s - full];
    }
    return vec_sum(total);
}

/* One tile: `rows` query rows of one KV head, row r reading keys [0, n_keys[r]). qf [ROWS, D] fp32 (the rows'
 * queries, widened); scores [ROWS, capacity] scratch; out[r] the row's output. */
static void attend_tile(const float *qf, const uint16_t *k, const uint16_t *v, uint16_t *const *out,
                        const int64_t *n_keys, int rows, int64_t D, int64_t capacity, float scale, float *scores) {
    int64_t most = 0;
    for (int r = 0; r < rows; r++) most = n_keys[r] > most ? n_keys[r] : most;
    /* Scores: for each key, its vector widened once, then each row's dot product in d order. */
    for (int64_t s = 0; s < most; s++) {
        vec_t acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = vec_zero();
        for (int64_t d = 0; d < D; d += VEC) {
            vec_t kv = vec_load_bf16(k + s * D + d);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < ROWS; r++)
                if (r < rows) acc[r] = vec_fmadd(vec_load(qf + r * D + d), kv, acc[r]);
        }
        for (int r = 0; r < rows; r++)
            if (s < n_keys[r]) scores[r * capacity + s] = vec_sum(acc[r]) * scale;
    }
    float sums[ROWS];
    for (int r = 0; r < rows; r++) sums[r] = softmax_row(scores + r * capacity, n_keys[r]);
    /* Values: NV vectors of d at a time, each value vector widened once for every row still reading it. */
    if (D % (2 * VEC) == 0)
        for (int64_t d = 0; d < D; d += 2 * VEC) VALUES(2)
    else
        for (int64_t d = 0; d < D; d += VEC) VALUES(1)
}

int specdec_attention_max_head_dim(void) { return MAX_D; }

int specdec_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *slots,
                           const int64_t *starts, uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                           int64_t D, int64_t capacity, float scale, int nthreads) {
    if (D > MAX_D) return EINVAL; /* the caller checks `specdec_attention_max_head_dim` */
    if ((uint64_t)capacity > SIZE_MAX / sizeof(float) / ROWS) return ENOMEM; /* the scratch size would wrap around */
    int64_t group = H / Hkv, per_head = T * group;
    /* Tiles of at most ROWS rows, evenly filled, and enough of them to give every thread work (down to one row
     * a tile, as on a many-core CPU decoding one sequence). */
    int64_t tiles = (per_head + ROWS - 1) / ROWS;
    while (B * Hkv * tiles < nthreads && tiles < per_head) tiles++;
    int64_t base = per_head / tiles, extra = per_head % tiles;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* Scratch per thread. A thread whose allocation fails still takes part in the work-sharing loop (every
         * thread of the team must reach it) but skips its tiles; the caller gets ENOMEM, never a NULL write. */
        float *scores = malloc(sizeof(float) * ROWS * (size_t)(capacity > 0 ? capacity : 1));
        float *qf = aligned_alloc(64, sizeof(float) * ROWS * MAX_D);
        if (scores == NULL || qf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t kvh = 0; kvh < Hkv; kvh++)
                for (int64_t tile = 0; tile < tiles; tile++) {
                    if (scores == NULL || qf == NULL) continue;
                    /* rows j = t * group + g of this head: query head kvh * group + g of new token t */
                    int64_t rows = base + (tile < extra), first = tile * base + (tile < extra ? tile : extra);
                    uint16_t *outs[ROWS];
                    int64_t n_keys[ROWS];
                    for (int r = 0; r < rows; r++) {
                        int64_t t = (first + r) / group, h = kvh * group + (first + r) % group;
                        int64_t row = ((b * T + t) * H + h) * D;
                        for (int64_t d = 0; d < D; d += VEC) vec_store(qf + r * D + d, vec_load_bf16(q + row + d));
                        outs[r] = out + row;
                        n_keys[r] = starts[b] + t + 1;
                    }
                    int64_t kv = (slots[b] * Hkv + kvh) * capacity * D;
                    attend_tile(qf, kc + kv, vc + kv, outs, n_keys, (int)rows, D, capacity, scale, scores);
                }
        free(scores);
        free(qf);
    }
    return failed ? ENOMEM : 0;
}
