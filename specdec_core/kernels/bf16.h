/* bf16 <-> fp32 conversions shared by the CPU kernels. */
#ifndef SPECDEC_BF16_H
#define SPECDEC_BF16_H

#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 values widened to fp32 (exact: bf16 is the top half of an fp32). */
static inline __m512 load_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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
