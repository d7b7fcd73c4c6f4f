/*
 * Draft-model matrix multiply with int8 weights *and* int8 activations (VNNI):
 *   y[m, n] = sx[m] * sw[n] * (sum_k xq[m, k] * wq[n, k]) + b[n]
 *   x: bf16 [M, K], quantized here per row (symmetric, xq in [-127, 127], sx[m] = max|x[m]| / 127);
 *   wq: int8 [N, K] with per-row scales sw [N] and row sums wsum [N]; b: bf16 [N] or NULL; y: bf16 [M, N].
 *
 * Why: a bf16 or int8-weight kernel on a CPU without native bf16 spends more time widening weights to fp32
 * than reading them, so a draft step stays compute-bound. One `vpdpbusd` multiplies 64 byte pairs and sums
 * them in groups of four into 16 int32 lanes, with no widening: the step becomes bound by memory again, at one
 * byte per weight. Only ever used for drafting: the draft's precision moves the acceptance rate, never the
 * target's output.
 *
 * `vpdpbusd` multiplies *unsigned* by signed bytes, so x is stored as xq + 128 and the excess 128 * wsum[n]
 * is subtracted at the end (integer arithmetic, so exact). Per lane the sum stays below 2^31 for K < 2^16.
 *
 * Requires AVX-512 VNNI (`specdec_has_vnni`), or a build for AVX2 (below); `specdec_has_int8` says which
 * builds have it. K a multiple of 64 and N a multiple of NB (the caller checks). Returns 0; ENOMEM when the
 * quantized inputs cannot be allocated, ENOSYS when built for AVX-512 without VNNI (y unwritten).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define NB 8         /* weight rows per block */
#define MB 6         /* input rows per pass over the weights */
#define KB 64        /* k values per step */
/* Bytes ahead in the weight row being read. AVX2 reads one row at a time (below): on a 2-core AVX2 CPU (the demo
 * draft's layers and LM head, one token) 1024 was the best of 512, 1024, 2048 and 6144. */
#ifndef PREFETCH
#if defined(__AVX512VNNI__)
#define PREFETCH 512
#else
#define PREFETCH 1024
#endif
#endif

#ifdef __AVX512VNNI__

int specdec_has_vnni(void) { return 1; }

/* Row i of x as unsigned bytes xq + 128 into xu [K], and its scale. */
static float quantize_row(const uint16_t *x, uint8_t *xu, int64_t K) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(bf16_to_float(x[k])));
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int64_t k = 0; k < K; k++) xu[k] = (uint8_t)(lrintf(bf16_to_float(x[k]) / scale) + 128);
    return scale;
}

#define DEFINE_BLOCK(NR, ROWS)                                                                          \
    static void block_##ROWS(const uint8_t *xu, const float *sx, const int8_t *w, const float *sw,     \
                             const int32_t *wsum, const uint16_t *b, uint16_t *y, int64_t N, int64_t K,  \
                             int64_t n0) {                                                              \
        __m512i acc[NR][ROWS];                                                                          \
        for (int j = 0; j < NR; j++)                                                                    \
            for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_setzero_si512();                          \
        for (int64_t k = 0; k < K; k += KB) {                                                           \
            __m512i xv[ROWS];                                                                           \
            for (int i = 0; i < ROWS; i++) xv[i] = _mm512_loadu_si512((const void *)(xu + i * K + k)); \
            _Pragma("GCC unroll 8") /* fully: the accumulators must live in registers */               \
            for (int j = 0; j < NR; j++) {                                                              \
                const int8_t *row = w + (n0 + j) * K + k;                                               \
                _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);                                \
                __m512i wv = _mm512_loadu_si512((const void *)row);                                     \
                _Pragma("GCC unroll 8")                                                                 \
                for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], xv[i], wv);   \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++)                                                                  \
            for (int j = 0; j < NR; j++) {                                                              \
                int64_t dot = _mm512_reduce_add_epi32(acc[j][i]) - 128 * (int64_t)wsum[n0 + j];         \
                float sum = (float)dot * sx[i] * sw[n0 + j];                                            \
                if (b) sum += bf16_to_float(b[n0 + j]);                                                 \
                y[i * N + n0 + j] = float_to_bf16(sum);                                                 \
            }                                                                                           \
    }

/* One input row (a draft step): nothing to share between weight rows, so each is read whole, one after the other,
 * as one sequential stream. The same operations per row as the blocks above: the results agree bit for bit. */
static void block_1(const uint8_t *xu, const float *sx, const int8_t *w, const float *sw, const int32_t *wsum,
                    const uint16_t *b, uint16_t *y, int64_t N, int64_t K, int64_t n0) {
    (void)N;
    for (int j = 0; j < NB; j++) {
        const int8_t *row = w + (n0 + j) * K;
        __m512i acc = _mm512_setzero_si512();
        for (int64_t k = 0; k < K; k += KB) {
            _mm_prefetch((const char *)(row + k) + PREFETCH, _MM_HINT_T0);
            acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512((const void *)(xu + k)),
                                      _mm512_loadu_si512((const void *)(row + k)));
        }
        int64_t dot = _mm512_reduce_add_epi32(acc) - 128 * (int64_t)wsum[n0 + j];
        float sum = (float)dot * sx[0] * sw[n0 + j];
        if (b) sum += bf16_to_float(b[n0 + j]);
        y[n0 + j] = float_to_bf16(sum);
    }
}
DEFINE_BLOCK(8, 2)
DEFINE_BLOCK(8, 3)
DEFINE_BLOCK(4, 4)
DEFINE_BLOCK(4, 5)
DEFINE_BLOCK(4, 6)

typedef void (*block_fn)(const uint8_t *, const float *, const int8_t *, const float *, const int32_t *,
                         const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

int specdec_gemm_w8a8(const uint16_t *x, const int8_t *w, const float *sw, const int32_t *wsum,
                      const uint16_t *b, uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    static const block_fn blocks[MB + 1] = {0, block_1, block_2, block_3, block_4, block_5, block_6};
    if (M <= 0) return 0;
    /* A size that would wrap around is a failed allocation; a size of 0 (K = 0) may return NULL, so ask for 64. */
    if ((uint64_t)M > SIZE_MAX / sizeof(float) || (K > 0 && (uint64_t)M > SIZE_MAX / (uint64_t)K)) return ENOMEM;
    size_t bytes = (size_t)M * (size_t)K; /* a multiple of 64, as aligned_alloc needs: K % 64 == 0 */
    uint8_t *xu = aligned_alloc(64, bytes > 0 ? bytes : 64);
    float *sx = malloc((size_t)M * sizeof(float));
    if (xu == NULL || sx == NULL) {
        free(xu);
        free(sx);
        return ENOMEM;
    }
    for (int64_t m = 0; m < M; m++) sx[m] = quantize_row(x + m * K, xu + m * K, K);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB)
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int64_t rows = M - m0 < MB ? M - m0 : MB;
            block_fn fn = blocks[rows];
            const uint8_t *xm = xu + m0 * K;
            uint16_t *ym = y + m0 * N;
            fn(xm, sx + m0, w, sw, wsum, b, ym, N, K, n0);
            if (rows > 3) fn(xm, sx + m0, w, sw, wsum, b, ym, N, K, n0 + 4); /* 4-row blocks: two halves */
        }
    free(xu);
    free(sx);
    return 0;
}

#elif defined(SPECDEC_AVX2)

#include "int8_rows.h" /* quantize_rows_sign_abs: x as xq and |xq| */

/* AVX2 has no VNNI: `vpmaddubsw` multiplies unsigned by signed bytes and adds adjacent pairs into saturating
 * int16, then `vpmaddwd` by ones sums those pairs into int32. With x stored as xq + 128 a pair could reach
 * 2 * 255 * 127 and saturate, so instead |xq| is the unsigned operand and w takes x's sign (`vpsignb`): each
 * pair is then at most 2 * 127 * 127 < 2^15, and the sum is exact. Four instructions per 32 products instead of
 * one, but a draft step is bound by reading the weights, and int8 weights are half of bf16's bytes. */

int specdec_has_vnni(void) { return 0; }

/* Weight row n against ROWS input rows. One weight row at a time, for every count of input rows: reading 8 rows
 * side by side (a row of a small draft is a few kilobytes) kept AVX2's memory reads well below a plain sequential
 * read; one row is a single sequential stream, which reaches it, and is no slower for 2 to 5 rows. The sums are
 * integers, so how rows are grouped never changes a result. */
#define DEFINE_BLOCK(ROWS)                                                                              \
    static void block_##ROWS(const int8_t *xs, const uint8_t *xa, const float *sx, const int8_t *w,    \
                             const float *sw, const uint16_t *b, uint16_t *y, int64_t N, int64_t K,     \
                             int64_t n) {                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                                      \
        __m256i acc[ROWS];                                                                              \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_si256();                                 \
        for (int64_t k = 0; k < K; k += 32) {                                                           \
            const int8_t *row = w + n * K + k;                                                          \
            _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);                                    \
            __m256i wv = _mm256_loadu_si256((const __m256i *)row);                                      \
            _Pragma("GCC unroll 8") /* fully: the accumulators must live in registers */               \
            for (int i = 0; i < ROWS; i++) {                                                            \
                __m256i xsv = _mm256_loadu_si256((const __m256i *)(xs + i * K + k));                    \
                __m256i xav = _mm256_loadu_si256((const __m256i *)(xa + i * K + k));                    \
                __m256i pairs = _mm256_maddubs_epi16(xav, _mm256_sign_epi8(wv, xsv));                   \
                acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));                      \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++) {                                                                \
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[i]), _mm256_extracti128_si256(acc[i], 1)); \
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));                                           \
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));                                           \
            float sum = (float)_mm_cvtsi128_si32(s) * sx[i] * sw[n];                                    \
            if (b) sum += bf16_to_float(b[n]);                                                          \
            y[i * N + n] = float_to_bf16(sum);                                                          \
        }                                                                                               \
    }

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
DEFINE_BLOCK(5)
DEFINE_BLOCK(6)

typedef void (*block_fn)(const int8_t *, const uint8_t *, const float *, const int8_t *, const float *,
                         const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);

int specdec_gemm_w8a8(const uint16_t *x, const int8_t *w, const float *sw, const int32_t *wsum,
                      const uint16_t *b, uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    static const block_fn blocks[MB + 1] = {0, block_1, block_2, block_3, block_4, block_5, block_6};
    (void)wsum; /* no excess to subtract: x is never offset here */
    if (M <= 0) return 0;
    int8_t *xs;
    float *sx;
    if (quantize_rows_sign_abs(x, M, K, &xs, &sx)) return ENOMEM;
    const uint8_t *xa = (const uint8_t *)xs + (size_t)M * (size_t)K;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int64_t rows = M - m0 < MB ? M - m0 : MB;
            blocks[rows](xs + m0 * K, xa + m0 * K, sx + m0, w, sw, b, y + m0 * N, N, K, n);
        }
    free(xs);
    free(sx);
    return 0;
}

#else

int specdec_has_vnni(void) { return 0; }

int specdec_gemm_w8a8(const uint16_t *x, const int8_t *w, const float *sw, const int32_t *wsum,
                      const uint16_t *b, uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    (void)x, (void)w, (void)sw, (void)wsum, (void)b, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
    return ENOSYS;
}

#endif

/* 1 when this build has an int8 kernel (AVX-512 VNNI, or AVX2's multiply-add of bytes). */
int specdec_has_int8(void) {
#if defined(__AVX512VNNI__) || defined(SPECDEC_AVX2)
    return 1;
#else
    return 0;
#endif
}
