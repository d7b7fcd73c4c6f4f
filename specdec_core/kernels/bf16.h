/* bf16 <-> fp32 conversions and the fp32 vector the CPU kernels compute in, shared by the kernels.
 *
 * The kernels are built for one of two instruction sets, chosen by what the compiling CPU has (-march=native):
 * AVX-512 (F and BW; 16 fp32 lanes) or AVX2 with FMA (8 lanes: most AMD EPYC before Zen 4, Intel before
 * Skylake-SP). `vec_t` and the `vec_*` operations below are the one vocabulary both builds share; a kernel's
 * code is the same for both, only the lane count differs. Within one build every row is still computed by one
 * fixed sequence of operations, so a row's result never depends on the batch it is in.
 */
#ifndef SPECDEC_BF16_H
#define SPECDEC_BF16_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SPECDEC_AVX512 1
typedef __m512 vec_t;
#define VEC 16 /* fp32 lanes */

/* VEC bf16 values widened to fp32 (exact: bf16 is the top half of an fp32). */
static inline vec_t vec_load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_set1 _mm512_set1_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_div _mm512_div_ps
#define vec_store _mm512_storeu_ps
#define vec_sum _mm512_reduce_add_ps

#elif defined(__AVX2__) && defined(__FMA__)
#define SPECDEC_AVX2 1
typedef __m256 vec_t;
#define VEC 8

static inline vec_t vec_load_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_set1 _mm256_set1_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_div _mm256_div_ps
#define vec_store _mm256_storeu_ps

/* The lanes' sum, always added in the same order. */
static inline float vec_sum(vec_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* lanes i + (i + 4) */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        /* + (i + 2) */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));                                         /* + (i + 1) */
    return _mm_cvtss_f32(s);
}

#else
#error "the CPU kernels need AVX-512 (F, BW) or AVX2 with FMA (cpu.py does not build them elsewhere)"
#endif

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* Round to nearest even, as torch does when it casts fp32 to bf16 (NaN kept NaN). */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#endif
