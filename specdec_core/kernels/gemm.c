/*
 * y[m, n] = s[n] * sum_k x[m, k] * w[n, k] + b[n]
 *   x: bf16 [M, K]; w: [N, K] (nn.Linear layout), bf16 or int8; s: fp32 [N] for int8 (per-row symmetric
 *   quantization), absent for bf16; b: bf16 [N] or NULL; y: bf16 [M, N]. Products and sums in fp32.
 *
 * Small-M matrix multiply for CPU decoding and verification. Decoding reads every weight once per token, so
 * it is bound by memory bandwidth; verifying k+1 tokens should cost about the same, as long as each weight is
 * loaded and widened once and then used for all M rows. Generic GEMM paths on CPUs without native bf16 redo
 * that work per row, so their cost grows linearly with M. Here a block of NB weight rows is streamed once
 * per MB input rows, with NB * MB accumulators in registers.
 *
 * int8 weights are for draft models only: the draft's precision changes how often it is right, never what the
 * target emits, and one byte per weight makes a memory-bound draft step about twice as cheap.
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
#define PREFETCH_BYTES 512 /* ahead in each weight row: measured best of 256/512/1024 */

static inline __m512 load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* One block: NB weight rows x ROWS input rows, full K; `scale` may be NULL (bf16 weights). */
#define DEFINE_BLOCK(NAME, WTYPE, LOAD_W, ROWS)                                                         \
    static void NAME##_##ROWS(const uint16_t *x, const WTYPE *w, const float *scale, const uint16_t *b, \
                              uint16_t *y, int64_t N, int64_t K, int64_t n0) {                          \
        __m512 acc[NB][ROWS];                                                                           \
        for (int j = 0; j < NB; j++)                                                                    \
            for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_setzero_ps();                             \
        for (int64_t k = 0; k < K; k += 16) {                                                           \
            __m512 xv[ROWS];                                                                            \
            for (int i = 0; i < ROWS; i++) xv[i] = load_bf16(x + i * K + k);                           \
            for (int j = 0; j < NB; j++) {                                                              \
                const WTYPE *row = w + (n0 + j) * K + k;                                                \
                _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T0);                          \
                __m512 wv = LOAD_W(row);                                                                \
                for (int i = 0; i < ROWS; i++) acc[j][i] = _mm512_fmadd_ps(xv[i], wv, acc[j][i]);       \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++)                                                                  \
            for (int j = 0; j < NB; j++) {                                                              \
                float sum = _mm512_reduce_add_ps(acc[j][i]);                                            \
                if (scale) sum *= scale[n0 + j];                                                        \
                if (b) sum += bf16_to_float(b[n0 + j]);                                                 \
                y[i * N + n0 + j] = float_to_bf16(sum);                                                 \
            }                                                                                           \
    }

/* The blocks for 1..MB rows and the entry that walks N in blocks of NB, M in blocks of MB. */
#define DEFINE_GEMM(NAME, WTYPE, LOAD_W)                                                                \
    DEFINE_BLOCK(NAME, WTYPE, LOAD_W, 1)                                                                \
    DEFINE_BLOCK(NAME, WTYPE, LOAD_W, 2)                                                                \
    DEFINE_BLOCK(NAME, WTYPE, LOAD_W, 3)                                                                \
    static void NAME(const uint16_t *x, const WTYPE *w, const float *scale, const uint16_t *b, uint16_t *y, \
                     int64_t M, int64_t N, int64_t K, int nthreads) {                                   \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                              \
        for (int64_t n0 = 0; n0 < N; n0 += NB) {                                                        \
            for (int64_t m0 = 0; m0 < M; m0 += MB) {                                                    \
                int64_t rows = M - m0 < MB ? M - m0 : MB;                                               \
                const uint16_t *xm = x + m0 * K;                                                        \
                uint16_t *ym = y + m0 * N;                                                              \
                if (rows == 3)                                                                          \
                    NAME##_3(xm, w, scale, b, ym, N, K, n0);                                            \
                else if (rows == 2)                                                                     \
                    NAME##_2(xm, w, scale, b, ym, N, K, n0);                                            \
                else                                                                                    \
                    NAME##_1(xm, w, scale, b, ym, N, K, n0);                                            \
            }                                                                                           \
        }                                                                                               \
    }

DEFINE_GEMM(gemm_w_bf16, uint16_t, load_bf16)
DEFINE_GEMM(gemm_w_int8, int8_t, load_i8)

int specdec_block_rows(void) { return NB; }

void specdec_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                       int64_t N, int64_t K, int nthreads) {
    gemm_w_bf16(x, w, NULL, b, y, M, N, K, nthreads);
}

void specdec_gemm_int8(const uint16_t *x, const int8_t *w, const float *scale, const uint16_t *b, uint16_t *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
    gemm_w_int8(x, w, scale, b, y, M, N, K, nthreads);
}
