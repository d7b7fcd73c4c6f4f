/*
 * Draft-model matrix multiply with 4-bit weights and int8 activations:
 *   y[m, n] = sx[m] * sum_g sw[n, g] * (sum_{k in group g} xq[m, k] * wq[n, k]) + b[n]
 *   x: bf16 [M, K], quantized here per row (symmetric, xq in [-127, 127], sx[m] = max|x[m]| / 127);
 *   wq in [-7, 7], in groups of G = 32 along k, each group with its own scale sw[n, g] (fp16);
 *   b: bf16 [N] or NULL; y: bf16 [M, N].
 *
 * Why: a draft step reads every weight once, so its cost is the draft's bytes. At 4 bits and an fp16 scale per
 * 32 weights a weight costs 0.5625 bytes instead of int8's 1: the demo draft (0.5B) reads 279 MB a step instead of
 * 494 MB. With a scale per group of 32 (as llama.cpp's Q4_0 groups them) the draft kept its guesses: on code and
 * edit prompts its acceptance moved from 85.7% (bf16) and 86.2% (int8) to 85.2%; the scales in fp16 rather than
 * fp32 moved its top-1 agreement with the target on the sessions' later turns from 90.58% to 90.49%, and took a
 * draft step's matrix multiplies from 20 to 15.5 ms in a C harness (an eighth fewer bytes, one stream a row
 * instead of two). Only ever used for drafting: the draft's precision moves the acceptance rate, never the
 * target's output.
 *
 * Layout: row n is K / 64 blocks of 36 bytes; block h holds groups 2h and 2h + 1: 32 bytes, byte j holding
 * wq[64h + j] + 8 in its low nibble and wq[64h + 32 + j] + 8 in its high one (one 256-bit load, a shift and two
 * masks give both groups' values in order), then the two groups' scales, fp16, little-endian. Scales sit in the
 * weight stream: a row is read as one sequential stream.
 * Products: the stored nibbles wq + 8 (unsigned, at most 15) times xq by `vpmaddubsw` (pairs at most
 * 2 * 15 * 127, no saturation), fours summed by `vpmaddwd`, less 8 * (those four xq summed), precomputed once a
 * call: each group's eight int32 lane sums are exactly those of wq times xq, without unpacking the nibbles to
 * signed values or moving xq's sign onto them (`gemm_int8.c`'s `vpsignb`), two fewer operations a group. Each is
 * scaled by the group's scale and added into fp32 lanes, in group order. A row's result goes through the same
 * operations whatever M is (the batch never changes a draft).
 *
 * Written with AVX2 instructions (and F16C's conversion where the CPU has it), which CPUs with AVX-512 also run
 * (measured on AVX2 only). K a multiple of 2 G (the caller checks).
 * Returns 0, or ENOMEM when the quantized inputs cannot be allocated (y unwritten).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int8_rows.h" /* quantize_rows_sign_abs: x as xq and |xq| */

#define G 32         /* weights per group (one scale) */
#define BLOCK 36     /* bytes per two groups: 32 of nibbles, two fp16 scales */
#define MB4 6        /* input rows per pass over a weight row */
#define PREFETCH4 2048 /* bytes ahead in the weight stream (512 measured 4-7% slower over a draft step's GEMMs) */

#ifndef __F16C__
static inline float half_to_float(uint16_t h) { /* IEEE binary16 -> fp32, exactly */
    int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float f = exponent == 0 ? ldexpf((float)mantissa, -24)
            : exponent == 31 ? (mantissa ? NAN : INFINITY)
            : ldexpf((float)(mantissa | 0x400), exponent - 25);
    return h & 0x8000 ? -f : f;
}
#endif

/* The two fp16 scales at p, as the first two lanes of a vector. */
static inline __m128 two_scales(const uint8_t *p) {
#ifdef __F16C__
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
#else
    float f[4] = {half_to_float((uint16_t)(p[0] | p[1] << 8)), half_to_float((uint16_t)(p[2] | p[3] << 8)), 0, 0};
    return _mm_loadu_ps(f);
#endif
}

static inline float sum8(__m256 v) { /* the lanes' sum, always in the same order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weight row n against ROWS input rows; one weight row at a time, a single sequential stream (`gemm_int8.c`).
 * Each step reads 32 bytes, two groups: their low nibbles are the first group's 32 weights, the high ones the
 * second's. */
#define DEFINE_BLOCK4(ROWS)                                                                             \
    static void block4_##ROWS(const int8_t *xs, const int32_t *xc, const float *sx, const uint8_t *w4,  \
                              const uint16_t *b, uint16_t *y, int64_t N, int64_t K, int64_t n) {        \
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);                       \
        __m256 acc[ROWS];                                                                               \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();                                    \
        const uint8_t *block = w4 + n * (K / (2 * G)) * BLOCK;                                          \
        for (int64_t k = 0; k < K; k += 2 * G, block += BLOCK) {                                        \
            _mm_prefetch((const char *)block + PREFETCH4, _MM_HINT_T0);                                 \
            __m256i packed = _mm256_loadu_si256((const __m256i *)block);                               \
            __m256i group[2] = {_mm256_and_si256(packed, low),                                          \
                                _mm256_and_si256(_mm256_srli_epi16(packed, 4), low)}; /* wq + 8 */     \
            __m128 scales = two_scales(block + 32);                                                     \
            __m256 scale2[2] = {_mm256_broadcastss_ps(scales), _mm256_broadcastss_ps(_mm_movehdup_ps(scales))}; \
            _Pragma("GCC unroll 2")                                                                     \
            for (int h = 0; h < 2; h++) {                                                               \
                __m256 scale = scale2[h];                                                               \
                _Pragma("GCC unroll 8") /* fully: the accumulators must live in registers */           \
                for (int i = 0; i < ROWS; i++) {                                                        \
                    const int64_t at = i * K + k + h * G;                                               \
                    __m256i xsv = _mm256_loadu_si256((const __m256i *)(xs + at));                       \
                    __m256i eights = _mm256_loadu_si256((const __m256i *)(xc + at / 4));                \
                    __m256i sums = _mm256_sub_epi32(                                                    \
                        _mm256_madd_epi16(_mm256_maddubs_epi16(group[h], xsv), ones), eights);          \
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i]);                  \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++) {                                                                \
            float sum = sum8(acc[i]) * sx[i];                                                           \
            if (b) sum += bf16_to_float(b[n]);                                                          \
            y[i * N + n] = float_to_bf16(sum);                                                          \
        }                                                                                               \
    }

DEFINE_BLOCK4(1)
DEFINE_BLOCK4(2)
DEFINE_BLOCK4(3)
DEFINE_BLOCK4(4)
DEFINE_BLOCK4(5)
DEFINE_BLOCK4(6)

typedef void (*block4_fn)(const int8_t *, const int32_t *, const float *, const uint8_t *, const uint16_t *,
                          uint16_t *, int64_t, int64_t, int64_t);

/* xc [M, K / 4]: 8 * (xq[4j] + ... + xq[4j + 3]), what the unsigned nibbles' offset adds to each lane sum. */
static int32_t *nibble_offsets(const int8_t *xs, int64_t M, int64_t K) {
    int32_t *xc = aligned_alloc(64, (size_t)M * (size_t)K); /* M * K / 4 int32; M * K a multiple of 64 */
    if (xc == NULL) return NULL;
    for (int64_t j = 0; j < M * K / 4; j++) xc[j] = 8 * (xs[4 * j] + xs[4 * j + 1] + xs[4 * j + 2] + xs[4 * j + 3]);
    return xc;
}

/* in_features must be a multiple of this: a step reads two groups. */
int specdec_int4_k_multiple(void) { return 2 * G; }

int specdec_gemm_w4a8(const uint16_t *x, const uint8_t *w4, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int nthreads) {
    static const block4_fn blocks[MB4 + 1] = {0, block4_1, block4_2, block4_3, block4_4, block4_5, block4_6};
    if (M <= 0) return 0;
    int8_t *xs;
    float *sx;
    if (quantize_rows_sign_abs(x, M, K, &xs, &sx)) return ENOMEM; /* |xq| (after xq) unused here */
    int32_t *xc = nibble_offsets(xs, M, K);
    if (xc == NULL) {
        free(xs);
        free(sx);
        return ENOMEM;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += MB4) {
            int64_t rows = M - m0 < MB4 ? M - m0 : MB4;
            blocks[rows](xs + m0 * K, xc + m0 * K / 4, sx + m0, w4, b, y + m0 * N, N, K, n);
        }
    free(xc);
    free(xs);
    free(sx);
    return 0;
}
