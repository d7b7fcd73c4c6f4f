/*
 * y[m, n] = sum_k x[m, k] * w[n, k] + b[n]
 *   x: bf16 [M, K]; w: bf16 [N, K] (nn.Linear layout); b: bf16 [N] or NULL; y: bf16 [M, N].
 *   Products and sums in fp32.
 *
 * Small-M matrix multiply for CPU decoding and verification. Decoding reads every weight once per token, so
 * it is bound by memory bandwidth; verifying k+1 tokens should cost about the same, as long as each weight is
 * loaded and widened once and then used for all M rows. Generic GEMM paths on CPUs without native bf16 redo
 * that work per row, so their cost grows linearly with M. Here a block of NB weight rows is streamed once
 * per block of up to MB input rows (MB = 6 covers a verify of k + 1 <= 6 tokens in one pass), with all the
 * block's accumulators in registers.
 *
 * Past a few rows the multiply-adds, not memory, set the cost. With native bf16 (AVX512-BF16, built in when
 * the compiling CPU has it) each VDPBF16PS does 32 exact bf16 products into 16 fp32 lanes, so a dozen rows cost little
 * more than one. Without it, weights are widened to
 * fp32: a bf16 weight vector of 32 values with two cheap ops and no shuffle (the even elements are the
 * 32-bit lanes shifted left by 16, the odd ones the lanes with their low half cleared), and x, widened once
 * per call, is stored de-interleaved the same way to match.
 *
 * Each output row is computed with the same sequence of operations whatever M is: a row's result does not
 * depend on which other rows share the call (plain decoding and verification agree bit for bit).
 *
 * With AVX2 and FMA instead of AVX-512 (`bf16.h`) the same fp32 path runs on 8-lane vectors: 16 weights widened
 * per load, and fewer weight rows per block as the input rows grow, so that the accumulators fit in AVX2's 16
 * vector registers. torch's bf16 GEMM there costs about a row's time per row; this kernel keeps a verify of
 * several rows near the cost of one, as on AVX-512.
 *
 * Requires AVX-512F/BW or AVX2 and FMA; K must be a multiple of 32 and N a multiple of NB (the caller checks).
 * Returns 0, or ENOMEM when the fp32 path cannot allocate its widened inputs (y is then unwritten).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define NB 8               /* weight rows per block */
#define MB 6               /* input rows per pass over the weights */
#define KV 32              /* k values per step: 32 bf16 weights, one 512-bit load (two 256-bit ones on AVX2) */
/* How far ahead in each weight row to prefetch. A verify block on AVX2 streams only two weight rows at a time
 * and spends many cycles on each line, so a short distance leaves it waiting on memory (the longer distance was
 * measured faster at every width, alternating with the short one). The AVX-512 builds keep the distance they were
 * measured with. */
#ifndef PREFETCH_BYTES /* SPECDEC_KERNEL_CFLAGS=-DPREFETCH_BYTES=512 reproduces the old distance, side by side */
#ifdef SPECDEC_AVX2
#define PREFETCH_BYTES 6144
#else
#define PREFETCH_BYTES 512
#endif
#endif

#if defined(SPECDEC_AVX512) && !defined(__AVX512BF16__)
/* 32 bf16 values as (even, odd) fp32 vectors. */
static inline void widen_bf16(const uint16_t *p, __m512 *even, __m512 *odd) {
    __m512i v = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
#define WIDEN_LANES 32 /* bf16 values per widening load */
#elif defined(SPECDEC_AVX2)
/* 16 bf16 values as (even, odd) fp32 vectors of 8. */
static inline void widen_bf16(const uint16_t *p, __m256 *even, __m256 *odd) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
#define WIDEN_LANES 16
#endif

#ifndef __AVX512BF16__
/* x [rows, K] bf16 -> xf [rows, K] fp32, each group of WIDEN_LANES stored as its even then its odd values. */
static void widen_inputs(const uint16_t *x, float *xf, int64_t rows, int64_t K) {
    for (int64_t i = 0; i < rows * K; i += WIDEN_LANES) {
        vec_t even, odd;
        widen_bf16(x + i, &even, &odd);
        vec_store(xf + i, even);
        vec_store(xf + i + VEC, odd);
    }
}
#endif

/* One k step of a block of NR weight rows x ROWS input rows: acc[j][i] += w[n0 + j, k:k+32] . x[i, k:k+32]. */
#ifdef __AVX512BF16__
/* Native bf16 (AVX512-BF16): one VDPBF16PS multiplies 32 bf16 pairs exactly and adds each adjacent pair of
 * products into an fp32 lane, twice the multiply-adds of an fp32 FMA and no widening. x stays bf16, so the
 * weight vector and the input vector line up element for element. Each input row is loaded once per k step and
 * used for all NR weight rows held in registers: a verify of several rows is bound by compute, and this halves
 * it. */
typedef uint16_t xrow_t;
#define K_STEP(NR, ROWS)                                                                                \
    {                                                                                                   \
        __m512bh wv[NR];                                                                                \
        _Pragma("GCC unroll 8")                                                                         \
        for (int j = 0; j < NR; j++) {                                                                  \
            const uint16_t *row = w + (n0 + j) * K + k;                                                 \
            _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T0);                              \
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)row);                                    \
        }                                                                                               \
        _Pragma("GCC unroll 8")                                                                         \
        for (int i = 0; i < ROWS; i++) {                                                                \
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));                  \
            _Pragma("GCC unroll 8")                                                                     \
            for (int j = 0; j < NR; j++) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], xv, wv[j]);            \
        }                                                                                               \
    }
#else
/* Inputs widened to fp32 (and de-interleaved) once per call; each weight vector widened once per k step (in
 * KV / WIDEN_LANES loads: one with AVX-512, two with AVX2). */
typedef float xrow_t;
#define K_STEP(NR, ROWS)                                                                                \
    {                                                                                                   \
        _Pragma("GCC unroll 8") /* fully: the accumulators must live in registers */                    \
        for (int j = 0; j < NR; j++)                                                                    \
            _mm_prefetch((const char *)(w + (n0 + j) * K + k) + PREFETCH_BYTES, _MM_HINT_T0);           \
        _Pragma("GCC unroll 2")                                                                         \
        for (int h = 0; h < KV; h += WIDEN_LANES) {                                                     \
            _Pragma("GCC unroll 8")                                                                     \
            for (int j = 0; j < NR; j++) {                                                              \
                vec_t we, wo;                                                                           \
                widen_bf16(w + (n0 + j) * K + k + h, &we, &wo);                                         \
                _Pragma("GCC unroll 8")                                                                 \
                for (int i = 0; i < ROWS; i++) {                                                        \
                    const float *xr = x + i * K + k + h;                                                \
                    acc[j][i] = vec_fmadd(load_x(xr), we, acc[j][i]);                              \
                    acc[j][i] = vec_fmadd(load_x(xr + VEC), wo, acc[j][i]);                        \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }
#ifdef SPECDEC_AVX512
#define load_x _mm512_loadu_ps
#else
#define load_x _mm256_loadu_ps
#endif
#endif

/* One block: NR weight rows x ROWS input rows, full K, all accumulators in registers. */
#define DEFINE_BLOCK(NR, ROWS)                                                                          \
    static void block_##NR##_##ROWS(const xrow_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,  \
                                    int64_t N, int64_t K, int64_t n0) {                                 \
        vec_t acc[NR][ROWS];                                                                            \
        for (int j = 0; j < NR; j++)                                                                    \
            for (int i = 0; i < ROWS; i++) acc[j][i] = vec_zero();                                      \
        for (int64_t k = 0; k < K; k += KV) K_STEP(NR, ROWS)                                            \
        for (int i = 0; i < ROWS; i++)                                                                  \
            for (int j = 0; j < NR; j++) {                                                              \
                float sum = vec_sum(acc[j][i]);                                                         \
                if (b) sum += bf16_to_float(b[n0 + j]);                                                 \
                y[i * N + n0 + j] = float_to_bf16(sum);                                                 \
            }                                                                                           \
    }

typedef void (*block_fn)(const xrow_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                         int64_t);

/* The block for each count of input rows, and how many weight rows it covers (a block of NB runs it NB / nr
 * times). The accumulators (and, with native bf16, the weight vectors) must fit in the vector registers: 32
 * with AVX-512, 16 with AVX2. */
struct block {
    block_fn fn;
    int nr;
};

#if defined(__AVX512BF16__)
DEFINE_BLOCK(8, 1)
DEFINE_BLOCK(8, 2)
DEFINE_BLOCK(4, 3)
DEFINE_BLOCK(4, 4)
DEFINE_BLOCK(4, 5)
DEFINE_BLOCK(4, 6)
static const struct block blocks[MB + 1] = {
    {0, NB}, {block_8_1, 8}, {block_8_2, 8}, {block_4_3, 4}, {block_4_4, 4}, {block_4_5, 4}, {block_4_6, 4}};
#elif defined(SPECDEC_AVX512)
DEFINE_BLOCK(8, 1)
DEFINE_BLOCK(8, 2)
DEFINE_BLOCK(8, 3)
DEFINE_BLOCK(4, 4)
DEFINE_BLOCK(4, 5)
DEFINE_BLOCK(4, 6)
static const struct block blocks[MB + 1] = {
    {0, NB}, {block_8_1, 8}, {block_8_2, 8}, {block_8_3, 8}, {block_4_4, 4}, {block_4_5, 4}, {block_4_6, 4}};
#else /* AVX2: at most 12 accumulators, beside the two halves of a widened weight vector. From 2 input rows up a
       * block streams two weight rows: measured faster than four a block for verifies of 2 and 3 tokens, logits
       * identical (`benchmarks/kernels/kernel_ab.py`). */
DEFINE_BLOCK(8, 1)
DEFINE_BLOCK(2, 2)
DEFINE_BLOCK(2, 3)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(2, 5)
DEFINE_BLOCK(2, 6)
static const struct block blocks[MB + 1] = {
    {0, NB}, {block_8_1, 8}, {block_2_2, 2}, {block_2_3, 2}, {block_2_4, 2}, {block_2_5, 2}, {block_2_6, 2}};
#endif

int specdec_block_rows(void) { return NB; }

int specdec_k_multiple(void) { return KV; }

/* Walks N in blocks of NB and, inside each, M in blocks of MB: a weight block is read from memory once and
 * from cache for the remaining row blocks. */
int specdec_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int nthreads) {
    if (M <= 0) return 0;
#ifdef __AVX512BF16__
    const xrow_t *xs = x;
#else
    /* A size that would wrap around is a failed allocation; a size of 0 (K = 0) may return NULL, so ask for 64. */
    if (K > 0 && (uint64_t)M > SIZE_MAX / sizeof(float) / (uint64_t)K) return ENOMEM;
    size_t bytes = (size_t)M * (size_t)K * sizeof(float); /* a multiple of 64, as aligned_alloc needs: K % 32 == 0 */
    float *xf = aligned_alloc(64, bytes > 0 ? bytes : 64);
    if (xf == NULL) return ENOMEM;
    widen_inputs(x, xf, M, K);
    const xrow_t *xs = xf;
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB)
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int64_t rows = M - m0 < MB ? M - m0 : MB;
            const xrow_t *xm = xs + m0 * K;
            uint16_t *ym = y + m0 * N;
            struct block blk = blocks[rows];
            for (int j = 0; j < NB; j += blk.nr) blk.fn(xm, w, b, ym, N, K, n0 + j);
        }
#ifndef __AVX512BF16__
    free(xf);
#endif
    return 0;
}

/* 1 when the library was built to use native bf16 dot products. */
int specdec_has_native_bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* 1 when the library was built for AVX-512, 0 for AVX2. */
int specdec_has_avx512(void) {
#ifdef SPECDEC_AVX512
    return 1;
#else
    return 0;
#endif
}
