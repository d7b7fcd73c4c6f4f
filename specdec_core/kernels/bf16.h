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
#error "the CPU kernels need AVX-512 (F, BW) or AVX2 with FMA (library.py does not build them elsewhere)"
#endif

/*
 * exp(x) for every lane, within 2 ulp of expf over the range where expf is a normal float; NaN stays NaN.
 * The usual reduction: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so that n ln2 is exact), a degree-6
 * polynomial for e^r (the coefficients of Cephes' expf), then 2^n put into the exponent. x is first clamped to
 * [-87.3, 88.3], where 2^n stays a normal float: e^x below the clamp comes out near 1e-38 instead of 0 and above it
 * near 2e38 instead of inf, harmless for the callers (softmax weights of at most 1, sigmoid).
 */
#ifdef SPECDEC_AVX512
#define vec_min _mm512_min_ps
#define vec_max _mm512_max_ps
#define vec_mul _mm512_mul_ps
#define vec_add _mm512_add_ps
#define vec_sub _mm512_sub_ps
#define vec_fnmadd _mm512_fnmadd_ps
#define vec_round(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vec_pow2i(n) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#else
#define vec_min _mm256_min_ps
#define vec_max _mm256_max_ps
#define vec_mul _mm256_mul_ps
#define vec_add _mm256_add_ps
#define vec_sub _mm256_sub_ps
#define vec_fnmadd _mm256_fnmadd_ps
#define vec_round(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vec_pow2i(n) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#endif

static inline vec_t vec_exp(vec_t x) {
    /* min/max return their second operand when either is NaN: x goes second, so NaN passes through. */
    x = vec_min(vec_set1(88.3f), vec_max(vec_set1(-87.3f), x));
    vec_t n = vec_round(vec_mul(x, vec_set1(1.44269504088896341f))); /* round(x / ln2) */
    vec_t r = vec_fnmadd(n, vec_set1(0.693359375f), x);                /* x - n ln2, in two exact steps */
    r = vec_fnmadd(n, vec_set1(-2.12194440e-4f), r);
    vec_t p = vec_set1(1.9875691500e-4f);
    p = vec_fmadd(p, r, vec_set1(1.3981999507e-3f));
    p = vec_fmadd(p, r, vec_set1(8.3334519073e-3f));
    p = vec_fmadd(p, r, vec_set1(4.1665795894e-2f));
    p = vec_fmadd(p, r, vec_set1(1.6666665459e-1f));
    p = vec_fmadd(p, r, vec_set1(5.0000001201e-1f));
    vec_t e = vec_add(vec_fmadd(p, vec_mul(r, r), r), vec_set1(1.0f)); /* e^r */
    return vec_mul(e, vec_pow2i(n));
}

/* VEC lanes rounded to bf16 as `float_to_bf16` does (to nearest even, NaN kept NaN) and stored at p. */
static inline void vec_store_bf16(uint16_t *p, vec_t v) {
#ifdef SPECDEC_AVX512
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
#else
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i h = _mm256_blendv_epi8(rounded, quiet, nan); /* each lane < 2^16: packing saturates nothing */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
#endif
}

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
