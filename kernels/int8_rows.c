/* ldqa CPU kernel: the element-wise halves of the int8 prefill GEMM (attention/quant.py, `linear_int8_rows`),
 * which multiplies many rows of fp32 activations with an int8 weight through aten `_int_mm`:
 *
 *   before the GEMM  x (M, K) fp32 -> xq (M, K) int8, scale (M,) fp32    per-row symmetric int8
 *   after it         y (M, N) int32 -> out (M, N) fp32 = (y * wscale[n]) * scale[m]
 *
 * Both give torch's `quant.quantize_rows_int8` and its `y.float().mul_(w.scale).mul_(sx)` bit for bit
 * (tests/test_int8_rows.py), for finite inputs: amax = max |x| over the row, inv = (1 / amax) * 127 (torch
 * evaluates `127.0 / amax` as `amax.reciprocal() * 127`), xq = x * inv rounded to nearest, ties to even,
 * scale = amax / 127; an all-zero row gives scale 0 and xq 0. The two products of the dequantization are
 * rounded one after the other, in that order, as torch's two in-place multiplies are.
 * What they save is memory traffic: torch makes each step a pass over the whole (M, K) or (M, N) tensor
 * (float copy, abs, amax, multiply, round, cast), which for a (440, 8960) activation streams ~16 MB per
 * pass; here each row is read once from memory and worked on from L1/L2. Parallel over rows (OpenMP,
 * `threads` threads). AVX2 with an AVX-512 body where the compiler targets it; the tail of a row that is
 * not a whole vector runs the same arithmetic in scalar code.
 *
 * A third function rounds a prefill weight's rows to int8 per output channel (`quant.quantize_int8`): its
 * scale is amax / 127 rounded to bf16 (the GEMM's scales are bf16-representable), and each value is divided
 * by it, rounded to nearest even and clamped to [-127, 127], as torch's ops do.
 *
 * Built into the same library as q8_0.c (kernels/c_library.py); the torch references are the functions
 * named above, which quant.py runs where the library is unavailable.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int8_t round_i8(float v) { return (int8_t)nearbyintf(v); } /* |v| <= 127 + rounding */

/* max |x[j]| over a row of K values. */
static inline float row_amax(const float *x, int64_t K) {
    int64_t j = 0;
    float amax = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 m16 = _mm512_setzero_ps();
    for (; j + 16 <= K; j += 16) m16 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), m16);
    amax = _mm512_reduce_max_ps(m16);
#else
    __m256 m8 = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; j + 8 <= K; j += 8) m8 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m8);
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#endif
    for (; j < K; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    return amax;
}

static void quantize_row(const float *x, int64_t K, int8_t *q, float *scale) {
    const float amax = row_amax(x, K);
    const float inv = amax > 0.0f ? (1.0f / amax) * 127.0f : 0.0f;
    *scale = amax / 127.0f;
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 vi = _mm512_set1_ps(inv);
    for (; j + 16 <= K; j += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), vi),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#else
    const __m256 vi = _mm256_set1_ps(inv);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; j + 32 <= K; j += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vi),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8), vi),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 16), vi),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i d = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 24), vi),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(p, perm));
    }
#endif
    for (; j < K; j++) q[j] = round_i8(x[j] * inv);
}

/* x (M, K) fp32 -> xq (M, K) int8, scale (M,) fp32 (see the header). Returns 0. */
int ldqa_quantize_rows_int8(const float *x, int64_t M, int64_t K, int8_t *xq, float *scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, scale + m);
    return 0;
}

/* y (M, N) int32 -> out (M, N) fp32 = (y * wscale[n]) * xscale[m], each product rounded to fp32 in turn.
 * Returns 0. */
int ldqa_dequantize_int32(const int32_t *y, int64_t M, int64_t N, const float *wscale, const float *xscale,
                          float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const int32_t *ym = y + m * N;
        float *om = out + m * N;
        const float s = xscale[m];
        for (int64_t n = 0; n < N; n++) {
            const float v = (float)ym[n] * wscale[n]; /* rounded here, as torch's first multiply */
            om[n] = v * s;
        }
    }
    return 0;
}

/* fp32 -> the nearest bf16 value (ties to even), as torch's .to(torch.bfloat16) for finite values. */
static inline float bf16_round(float f) {
    union { float f; uint32_t u; } v = {f};
    v.u += 0x7FFFu + ((v.u >> 16) & 1u);
    v.u &= 0xFFFF0000u;
    return v.f;
}

/* w (M, K) fp32 rows of a weight -> q (M, K) int8, scale (M,) fp32: per row, s = bf16(amax / 127) (1 for an
 * all-zero row), q = clamp(round_even(w / s), -127, 127): `quant.quantize_int8`'s torch ops bit for bit for
 * finite w. Returns 0. */
int ldqa_quantize_weight_rows_int8(const float *w, int64_t M, int64_t K, int8_t *q, float *scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *x = w + m * K;
        int8_t *qm = q + m * K;
        const float amax = row_amax(x, K);
        const float s = amax > 0.0f ? bf16_round(amax / 127.0f) : 1.0f;
        scale[m] = s;
        int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
        for (; j + 16 <= K; j += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + j), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_max_ps(_mm512_min_ps(v, hi), lo);
            _mm_storeu_si128((__m128i *)(qm + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
        }
#endif
        for (; j < K; j++) {
            float v = nearbyintf(x[j] / s);
            qm[j] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
    }
    return 0;
}
