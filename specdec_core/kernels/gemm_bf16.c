/*
 * y[m, n] = sum_k x[m, k] * w[n, k] + b[n]    x: bf16 [M, K], w: bf16 [N, K] (nn.Linear layout), b: bf16 [N]
 *                                            or NULL, y: bf16 [M, N]; products and sums in fp32
 *
 * Small-M matrix multiply for CPU decoding and verification. Decoding reads every weight once per token, so
 * it is bound by memory bandwidth; verifying k+1 tokens should cost about the same, as long as each weight is
 * loaded and widened once and then used for all M rows. Generic GEMM paths on CPUs without native bf16 redo
 * that work per row, so their cost grows linearly with M. Here a block of NB weight rows is streamed once
 * per MB input rows, with NB * MB accumulators in registers.
 *
 * Each output row is computed with the same sequence of operations whatever M is: a row's result does not
 * depend on which other rows share the call (plain decoding and verification agree bit for bit).
 *
 * Requires AVX-512F; K must be a multiple of 16 and N a multiple of NB (the caller checks).
 */
#include <stdint.h>

#include "bf16.h"

#define NB 8 /* weight rows per block */
#define MB 3 /* input rows per block: NB * MB accumulators + MB inputs + 1 weight fit in 32 registers */
#define PREFETCH 256 /* weights prefetched this many elements ahead in each row: measured best of 128/256/512 */

#define DEFINE_BLOCK(ROWS)                                                                              \
    static void block_##ROWS(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,      \
                             int64_t N, int64_t K, int64_t n0) {                                        \
        __m512 acc[NB][ROWS];                                                                           \
        for (int j = 0; j < NB; j++)                                                                    \
            for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_setzero_ps();                             \
        for (int64_t k = 0; k < K; k += 16) {                                                           \
            __m512 xv[ROWS];                                                                            \
            for (int i = 0; i < ROWS; i++) xv[i] = load_bf16(x + i * K + k);                           \
            for (int j = 0; j < NB; j++) {                                                              \
                _mm_prefetch((const char *)(w + (n0 + j) * K + k + PREFETCH), _MM_HINT_T0);             \
                __m512 wv = load_bf16(w + (n0 + j) * K + k);                                            \
                for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_fmadd_ps(xv[i], wv, acc[j][i]);       \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++)                                                                  \
            for (int j = 0; j < NB; j++) {                                                              \
                float sum = _mm512_reduce_add_ps(acc[j][i]);                                            \
                if (b) sum += bf16_to_float(b[n0 + j]);                                                 \
                y[i * N + n0 + j] = float_to_bf16(sum);                                                 \
            }                                                                                           \
    }

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)

int specdec_block_rows(void) { return NB; }

void specdec_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                       int64_t N, int64_t K, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int64_t rows = M - m0 < MB ? M - m0 : MB;
            const uint16_t *xm = x + m0 * K;
            uint16_t *ym = y + m0 * N;
            if (rows == 3)
                block_3(xm, w, b, ym, N, K, n0);
            else if (rows == 2)
                block_2(xm, w, b, ym, N, K, n0);
            else
                block_1(xm, w, b, ym, N, K, n0);
        }
    }
}
