/*
 * Attention of a few new query rows per sequence over a slot-based bf16 KV cache, on the CPU.
 *
 * out[b, t, h] = sum_s softmax_s(scale * q[b, t, h] . k[slot_b, h / G, s]) v[slot_b, h / G, s],
 * over the keys s <= starts[b] + t (the prefix and the new tokens up to this one); G = H / Hkv (grouped-query).
 *
 * Why not torch's SDPA: in bf16 on CPUs without native bf16 it is slowest exactly where decoding lives (one
 * query row over a long cache), and its result for a row depends on how many rows are computed together. Here each (row, head) is computed in fp32 by one fixed sequence of operations,
 * so a token's attention output is bit for bit the same in plain decoding and in verification.
 *
 * The query rows that read the same KV head (the G heads of a group, for each of the T new tokens) are taken
 * together, up to TILE at a time: the keys and values are read in blocks of KB, each block widened to fp32 once
 * into a small scratch that stays in L1, and then used by every row of the tile. A verify of T tokens thus reads
 * and widens the cache once, as decoding does, instead of once per few rows. Each row takes KB keys at a time:
 * KB independent dot products (no chain of dependent multiply-adds a key), summed across their lanes together
 * (`sum_each`, one transposed reduction instead of one per key). Which rows share a tile changes only which loads
 * they share, never the operations a row's result goes through.
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
#include <string.h>

#include "bf16.h"

#define MAX_D 256
#define KB 8     /* keys per block: one 8-lane vector of scores per row */
#define TILE 32  /* query rows per tile at most: their scores (TILE x keys) stay in L2 */

/* Lane j of the result: the sum of a[j]'s lanes, for j < 8, each by the same tree ((0+1)+(2+3))+((4+5)+(6+7))
 * over 8 lanes (an AVX-512 accumulator first adds its upper 8 lanes onto its lower). */
static inline __m256 sum_each(const vec_t a[KB]) {
    __m256 h[KB];
    for (int j = 0; j < KB; j++) {
#ifdef SPECDEC_AVX512
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
#else
        h[j] = a[j];
#endif
    }
    __m256 p01 = _mm256_hadd_ps(h[0], h[1]), p23 = _mm256_hadd_ps(h[2], h[3]);
    __m256 p45 = _mm256_hadd_ps(h[4], h[5]), p67 = _mm256_hadd_ps(h[6], h[7]);
    __m256 q03 = _mm256_hadd_ps(p01, p23), q47 = _mm256_hadd_ps(p45, p67); /* halves of a0..a3, a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(q03, q47, 0x20), _mm256_permute2f128_ps(q03, q47, 0x31));
}

/* Keys (or values) [s0, s0 + n) of one head, widened into f [KB, D]; rows n..KB-1 zero. */
static void widen_block(const uint16_t *src, float *f, int64_t s0, int n, int64_t D) {
    for (int j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d += VEC) vec_store(f + j * D + d, vec_load_bf16(src + (s0 + j) * D + d));
    if (n < KB) memset(f + n * D, 0, sizeof(float) * (size_t)(KB - n) * (size_t)D);
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

/* acc[d..] += sum_{j < m} p[j] * vf[j, d..] for NV vectors of d, key by key (a row's sum over s is in key order). */
#define DEFINE_ADD_VALUES(NV)                                                                           \
    static void add_values_##NV(float *acc, const float *p, const float *vf, int m, int64_t D) {       \
        for (int64_t d = 0; d < D; d += (NV) * VEC) {                                                   \
            vec_t a[NV];                                                                                \
            for (int c = 0; c < (NV); c++) a[c] = vec_load(acc + d + c * VEC);                          \
            for (int j = 0; j < m; j++) {                                                               \
                vec_t pj = vec_set1(p[j]);                                                              \
                _Pragma("GCC unroll 8")                                                                 \
                for (int c = 0; c < (NV); c++) a[c] = vec_fmadd(pj, vec_load(vf + j * D + d + c * VEC), a[c]); \
            }                                                                                           \
            for (int c = 0; c < (NV); c++) vec_store(acc + d + c * VEC, a[c]);                          \
        }                                                                                               \
    }
DEFINE_ADD_VALUES(8)
DEFINE_ADD_VALUES(4)
DEFINE_ADD_VALUES(2)
DEFINE_ADD_VALUES(1)

/* Keys in the block from s0: KB, or what is left of `n` below it. */
static inline int block_keys(int64_t n, int64_t s0) { return n - s0 < KB ? (int)(n - s0) : KB; }

/* The values pass of `attend_tile` with add_values_NV: KB keys at a time, added into each row's sums. */
#define VALUES_PASS(NV)                                                                                 \
    for (int64_t s0 = 0; s0 < most; s0 += KB) {                                                         \
        widen_block(v, w->block, s0, block_keys(most, s0), D);                                          \
        for (int r = 0; r < rows; r++)                                                                  \
            add_values_##NV(w->acc + r * D, w->scores + r * w->stride + s0, w->block, block_keys(n_keys[r], s0), D); \
    }

/* Per-thread scratch: the tile's queries qf [TILE, D], its output sums acc [TILE, D], its scores
 * [TILE, stride], one block of widened keys or values [KB, D]. */
typedef struct {
    float *qf, *acc, *scores, *block;
    int64_t stride;
} scratch_t;

/* One tile: `rows` query rows of one KV head, row r reading keys [0, n_keys[r]). */
static void attend_tile(const scratch_t *w, const uint16_t *k, const uint16_t *v, uint16_t *const *out,
                        const int64_t *n_keys, int rows, int64_t D, float scale) {
    int64_t most = 0;
    for (int r = 0; r < rows; r++) most = n_keys[r] > most ? n_keys[r] : most;
    /* Scores, KB keys at a time for every row. Keys past a row's own count are scored and never read. */
    for (int64_t s0 = 0; s0 < most; s0 += KB) {
        widen_block(k, w->block, s0, block_keys(most, s0), D);
        for (int r = 0; r < rows; r++) {
            vec_t a[KB];
            for (int j = 0; j < KB; j++) a[j] = vec_zero();
            for (int64_t d = 0; d < D; d += VEC) {
                vec_t qv = vec_load(w->qf + r * D + d);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < KB; j++) a[j] = vec_fmadd(qv, vec_load(w->block + j * D + d), a[j]);
            }
            _mm256_storeu_ps(w->scores + r * w->stride + s0, _mm256_mul_ps(sum_each(a), _mm256_set1_ps(scale)));
        }
    }
    float sums[TILE];
    for (int r = 0; r < rows; r++) sums[r] = softmax_row(w->scores + r * w->stride, n_keys[r]);
    /* Values, in key order; the widest add_values that D allows (fewer passes over a row's sums). */
    memset(w->acc, 0, sizeof(float) * (size_t)rows * (size_t)D);
    if (D % (8 * VEC) == 0) VALUES_PASS(8)
    else if (D % (4 * VEC) == 0) VALUES_PASS(4)
    else if (D % (2 * VEC) == 0) VALUES_PASS(2)
    else VALUES_PASS(1)
    for (int r = 0; r < rows; r++) {
        vec_t total = vec_set1(sums[r]);
        float tmp[VEC];
        for (int64_t d = 0; d < D; d += VEC) {
            vec_store(tmp, vec_div(vec_load(w->acc + r * D + d), total));
            for (int i = 0; i < VEC; i++) out[r][d + i] = float_to_bf16(tmp[i]);
        }
    }
}

int specdec_attention_max_head_dim(void) { return MAX_D; }

int specdec_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *slots,
                           const int64_t *starts, uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                           int64_t D, int64_t capacity, float scale, int nthreads) {
    if (D > MAX_D) return EINVAL; /* the caller checks `specdec_attention_max_head_dim` */
    /* Scores rows hold whole blocks of keys; a size that would wrap around is a failed allocation. */
    if ((uint64_t)capacity > SIZE_MAX / sizeof(float) / TILE - KB) return ENOMEM;
    int64_t stride = (capacity + KB - 1) / KB * KB;
    int64_t group = H / Hkv, per_head = T * group;
    /* Tiles of at most TILE rows, evenly filled, and enough of them to give every thread work (down to one row
     * a tile, as on a many-core CPU decoding one sequence). */
    int64_t tiles = (per_head + TILE - 1) / TILE;
    while (B * Hkv * tiles < nthreads && tiles < per_head) tiles++;
    int64_t base = per_head / tiles, extra = per_head % tiles;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* Scratch per thread. A thread whose allocation fails still takes part in the work-sharing loop (every
         * thread of the team must reach it) but skips its tiles; the caller gets ENOMEM, never a NULL write. */
        scratch_t w = {aligned_alloc(64, sizeof(float) * TILE * MAX_D), aligned_alloc(64, sizeof(float) * TILE * MAX_D),
                       malloc(sizeof(float) * TILE * (size_t)stride), aligned_alloc(64, sizeof(float) * KB * MAX_D),
                       stride};
        int ok = w.qf != NULL && w.acc != NULL && w.scores != NULL && w.block != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t kvh = 0; kvh < Hkv; kvh++)
                for (int64_t tile = 0; tile < tiles; tile++) {
                    if (!ok) continue;
                    /* rows j = t * group + g of this head: query head kvh * group + g of new token t */
                    int64_t rows = base + (tile < extra), first = tile * base + (tile < extra ? tile : extra);
                    uint16_t *outs[TILE];
                    int64_t n_keys[TILE];
                    for (int r = 0; r < rows; r++) {
                        int64_t t = (first + r) / group, h = kvh * group + (first + r) % group;
                        int64_t row = ((b * T + t) * H + h) * D;
                        for (int64_t d = 0; d < D; d += VEC) vec_store(w.qf + r * D + d, vec_load_bf16(q + row + d));
                        outs[r] = out + row;
                        n_keys[r] = starts[b] + t + 1;
                    }
                    int64_t kv = (slots[b] * Hkv + kvh) * capacity * D;
                    attend_tile(&w, kc + kv, vc + kv, outs, n_keys, (int)rows, D, scale);
                }
        free(w.qf);
        free(w.acc);
        free(w.scores);
        free(w.block);
    }
    return failed ? ENOMEM : 0;
}
