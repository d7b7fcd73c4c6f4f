/*
 * y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] + b[n]    x: bf16 [M, K], w: int8 [N, K] (per-row symmetric
 *                                                        quantization), scale: fp32 [N], b: bf16 [N] or NULL
 *
 * For draft models only: the draft's precision changes how often it is right, never what the target emits.
 * Decoding is memory-bound, so one byte per weight instead of two makes a draft step about twice as cheap.
 * Same blocking as gemm_bf16.c: NB weight rows streamed once per MB input rows.
 */
#include <stdint.h>

#include "bf16.h"

#define NB 8
#define MB 3
#define PREFETCH 512 /* bytes ahead in each weight row */

static inline __m512 load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#define DEFINE_BLOCK(ROWS)                                                                              \
    static void i8_block_##ROWS(const uint16_t *x, const int8_t *w, const float *scale, const uint16_t *b, \
                                uint16_t *y, int64_t N, int64_t K, int64_t n0) {                        \
        __m512 acc[NB][ROWS];                                                                           \
        for (int j = 0; j < NB; j++)                                                                    \
            for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_setzero_ps();                             \
        for (int64_t k = 0; k < K; k += 16) {                                                           \
            __m512 xv[ROWS];                                                                            \
            for (int i = 0; i < ROWS; i++) xv[i] = load_bf16(x + i * K + k);                           \
            for (int j = 0; j < NB; j++) {                                                              \
                _mm_prefetch((const char *)(w + (n0 + j) * K + k + PREFETCH), _MM_HINT_T0);             \
                __m512 wv = load_i8(w + (n0 + j) * K + k);                                              \
                for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_fmadd_ps(xv[i], wv, acc[j][i]);       \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++)                                                                  \
            for (int j = 0; j < NB; j++) {                                                              \
                float sum = _mm512_reduce_add_ps(acc[j][i]) * scale[n0 + j];                            \
                if (b) sum += bf16_to_float(b[n0 + j]);                                                 \
                y[i * N + n0 + j] = float_to_bf16(sum);                                                 \
            }                                                                                           \
    }

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
DEFINE_BLOCK(3)

void specdec_gemm_int8(const uint16_t *x, const int8_t *w, const float *scale, const uint16_t *b, uint16_t *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int64_t rows = M - m0 < MB ? M - m0 : MB;
            const uint16_t *xm = x + m0 * K;
            uint16_t *ym = y + m0 * N;
            if (rows == 3)
                i8_block_3(xm, w, scale, b, ym, N, K, n0);
            else if (rows == 2)
                i8_block_2(xm, w, scale, b, ym, N, K, n0);
            else
                i8_block_1(xm, w, scale, b, ym, N, K, n0);
        }
    }
}
