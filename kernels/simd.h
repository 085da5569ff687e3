/* Helpers shared by ldqa's CPU kernels (q8_0.c, decode_attention.c); compiled into each as static inline. */
#ifndef LDQA_SIMD_H
#define LDQA_SIMD_H
#include <immintrin.h>

/* the sum of a vector's 8 floats */
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

#endif
