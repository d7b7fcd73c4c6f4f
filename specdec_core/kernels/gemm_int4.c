/*
 * Draft-model matrix multiply with 4-bit weights and int8 activations:
 *   y[m, n] = sx[m] * sum_g sw[n, g] * (sum_{k in group g} xq[m, k] * wq[n, k]) + b[n]
 *   x: bf16 [M, K], quantized here per row (symmetric, xq in [-127, 127], sx[m] = max|x[m]| / 127);
 *   wq in [-7, 7], in groups of G = 32 along k, each group with its own scale sw[n, g] (fp16);
 *   b: bf16 [N] or NULL; y: bf16 [M, N].
 *
 * Why: a draft step reads every weight once, so its cost is the draft's bytes. At 4 bits and an fp16 scale per
 * 32 weights a weight costs 0.5625 bytes instead of int8's 1. With a scale per group of 32 (as llama.cpp's Q4_0
 * groups them) the draft keeps its guesses: its acceptance barely moves from bf16's or int8's, and fp16 scales
 * rather than fp32 barely move its agreement with the target while reading fewer bytes in one stream a row
 * (docs/engine.md has the figures). Only ever used for drafting: the draft's precision moves the acceptance rate, never the
 * target's output.
 *
 * Layout: output rows in panels of 8 (N a multiple of 8). A panel is K / 64 blocks of 288 bytes, block h covering
 * k in [64h, 64h + 64) for its 8 rows: 256 bytes of nibbles, then 32 of scales (group 2h's eight fp16 scales, one a
 * row, then group 2h + 1's). The nibbles are 8 vectors of 32 bytes; vector j's byte 4r + t holds wq[64h + 4j + t] + 8
 * of the panel's row r in its low nibble and wq[64h + 32 + 4j + t] + 8 in its high one. A panel is one sequential
 * stream.
 * Products: a 32-bit lane of a weight vector holds four consecutive weights of one row, so `vpmaddubsw` against the
 * four matching xq broadcast to every lane, then `vpmaddwd` by ones, leaves in lane r row r's sum over those four:
 * eight rows advance together with one broadcast of x, and no lane sums are left to add across the vector at the
 * end. The eight products of a group add up in int16 before widening (each pair at most 2 * 15 * 127, eight at most
 * 30480: exact). The stored nibbles are wq + 8 (unsigned, at most 15); a group's sum less 8 * (its 32 xq summed),
 * precomputed once a call, is exactly that of wq times xq. Each group's sum is scaled by its row's scale and added
 * into fp32 lanes, in group order. A row's result goes through the same operations whatever M is (the batch never
 * changes a draft).
 * Why the panels: the kernel was bound by its instructions, not by memory. With one output row a pass (the layout
 * before) each group of 32 weights cost every input row five vector operations and a sum across the lanes at the
 * end; here 32 weights of 8 rows cost each input row about as many. The demo draft's step measured faster this way on
 * AVX2 at one token and more so at two to four (docs/engine.md has the figures).
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

#define G 32             /* weights per group (one scale) */
#define PANEL 8          /* output rows a pass */
#define BLOCK (PANEL * 36) /* bytes per panel and two groups: 256 of nibbles, 16 fp16 scales */
#define MB4 4            /* input rows per pass over a panel: their int16 sums and fp32 accumulators fill the registers */
#define PREFETCH4 2048   /* bytes ahead in the weight stream */

#ifndef __F16C__
static inline float half_to_float(uint16_t h) { /* IEEE binary16 -> fp32, exactly */
    int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float f = exponent == 0 ? ldexpf((float)mantissa, -24)
            : exponent == 31 ? (mantissa ? NAN : INFINITY)
            : ldexpf((float)(mantissa | 0x400), exponent - 25);
    return h & 0x8000 ? -f : f;
}
#endif

/* The eight fp16 scales at p (one a row of the panel) as fp32 lanes. */
static inline __m256 eight_scales(const uint8_t *p) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[PANEL];
    for (int r = 0; r < PANEL; r++) f[r] = half_to_float((uint16_t)(p[2 * r] | p[2 * r + 1] << 8));
    return _mm256_loadu_ps(f);
#endif
}

static inline __m256i broadcast4(const int8_t *p) { /* four int8 values into every 32-bit lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* One group (half h of the block at k: the low nibbles for h = 0, the high ones for h = 1) of a panel against ROWS
 * input rows, into acc: xs holds the rows' xq (K apart), xo their groups' offsets 8 * sum(xq) (K / G apart). */
#define GROUP4(ROWS, h)                                                                                 \
    {                                                                                                   \
        __m256i sums[ROWS];                                                                             \
        _Pragma("GCC unroll 8")                                                                         \
        for (int j = 0; j < 8; j++) {                                                                   \
            __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 32 * j));                     \
            __m256i wv = _mm256_and_si256(h ? _mm256_srli_epi16(packed, 4) : packed, low); /* wq + 8 */ \
            _Pragma("GCC unroll 4")                                                                     \
            for (int i = 0; i < ROWS; i++) {                                                            \
                __m256i p = _mm256_maddubs_epi16(wv, broadcast4(xs + i * K + k + h * G + 4 * j));       \
                sums[i] = j ? _mm256_add_epi16(sums[i], p) : p;                                         \
            }                                                                                           \
        }                                                                                               \
        __m256 scale = eight_scales(block + 8 * 32 + h * 2 * PANEL);                                    \
        _Pragma("GCC unroll 4")                                                                         \
        for (int i = 0; i < ROWS; i++) {                                                                \
            __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(sums[i], ones),                            \
                                           _mm256_set1_epi32(xo[i * (K / G) + k / G + h]));             \
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i]);                           \
        }                                                                                               \
    }

/* Panel p (output rows 8p .. 8p + 7) against ROWS input rows. */
#define DEFINE_PANEL4(ROWS)                                                                             \
    static void panel4_##ROWS(const int8_t *xs, const int32_t *xo, const float *sx, const uint8_t *w4,  \
                              const uint16_t *b, uint16_t *y, int64_t N, int64_t K, int64_t p) {        \
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);                       \
        __m256 acc[ROWS];                                                                               \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();                                    \
        const uint8_t *block = w4 + p * (K / (2 * G)) * BLOCK;                                          \
        for (int64_t k = 0; k < K; k += 2 * G, block += BLOCK) {                                        \
            for (int line = 0; line < BLOCK; line += 64)                                                \
                _mm_prefetch((const char *)block + PREFETCH4 + line, _MM_HINT_T0);                      \
            GROUP4(ROWS, 0)                                                                             \
            GROUP4(ROWS, 1)                                                                             \
        }                                                                                               \
        for (int i = 0; i < ROWS; i++) {                                                                \
            float lanes[PANEL];                                                                         \
            _mm256_storeu_ps(lanes, acc[i]);                                                            \
            for (int r = 0; r < PANEL; r++) {                                                           \
                float sum = lanes[r] * sx[i];                                                           \
                if (b) sum += bf16_to_float(b[PANEL * p + r]);                                          \
                y[i * N + PANEL * p + r] = float_to_bf16(sum);                                          \
            }                                                                                           \
        }                                                                                               \
    }

DEFINE_PANEL4(1)
DEFINE_PANEL4(2)
DEFINE_PANEL4(3)
DEFINE_PANEL4(4)

typedef void (*panel4_fn)(const int8_t *, const int32_t *, const float *, const uint8_t *, const uint16_t *,
                          uint16_t *, int64_t, int64_t, int64_t);

/* xo [M, K / G]: 8 * (the group's 32 xq summed), what the unsigned nibbles' offset adds to each group's sum. */
static int32_t *nibble_offsets(const int8_t *xs, int64_t M, int64_t K) {
    int32_t *xo = malloc(sizeof(int32_t) * (size_t)(M * K / G > 0 ? M * K / G : 1));
    if (xo == NULL) return NULL;
    for (int64_t g = 0; g < M * K / G; g++) {
        int32_t sum = 0;
        for (int t = 0; t < G; t++) sum += xs[g * G + t];
        xo[g] = 8 * sum;
    }
    return xo;
}

/* in_features must be a multiple of this: a step reads two groups. */
int specdec_int4_k_multiple(void) { return 2 * G; }

/* out_features must be a multiple of this: rows come in panels. */
int specdec_int4_row_multiple(void) { return PANEL; }

int specdec_gemm_w4a8(const uint16_t *x, const uint8_t *w4, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int nthreads) {
    static const panel4_fn panels[MB4 + 1] = {0, panel4_1, panel4_2, panel4_3, panel4_4};
    if (M <= 0) return 0;
    int8_t *xs;
    float *sx;
    if (quantize_rows_sign_abs(x, M, K, &xs, &sx)) return ENOMEM; /* |xq| (after xq) unused here */
    int32_t *xo = nibble_offsets(xs, M, K);
    if (xo == NULL) {
        free(xs);
        free(sx);
        return ENOMEM;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t m0 = 0; m0 < M; m0 += MB4) {
            int64_t rows = M - m0 < MB4 ? M - m0 : MB4;
            panels[rows](xs + m0 * K, xo + m0 * (K / G), sx + m0, w4, b, y + m0 * N, N, K, p);
        }
    free(xo);
    free(xs);
    free(sx);
    return 0;
}
