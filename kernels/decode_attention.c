/* ldqa CPU kernel: exact softmax attention of one new token (decode) over a KV cache, with GQA.
 *
 * Shapes (fp32):
 *   q    (H, d)                      the token's queries, contiguous
 *   k, v (KV, L, d) with row stride d and head stride `hs` (a slice of the KV cache (1, KV, capacity, d):
 *                                    hs = capacity * d), d contiguous
 *   mask (L,) uint8 or NULL          1 = may attend (shared by every head); NULL = attend to all
 *   out  (H, d)
 * Query head h reads KV head h / (H / KV). Scores are q.k * scale, softmax in fp32, rows with no allowed
 * key give zeros (as the torch reference, kernels/reference.attention).
 *
 * Each key and value row is read once for all the query heads that share it (GQA): the cost is reading
 * L * d * 8 bytes per KV head. Two parallel loops (OpenMP, `threads`): scores over keys, then the
 * weighted sum of values, each thread a slice of d over all value rows (its output slice stays in L1); the
 * softmax in between is serial (L exps per query head).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define MAX_GROUP 16 /* query heads per KV head */


int ldqa_decode_attention(const float *q, const float *k, const float *v, int64_t H, int64_t KV, int64_t L,
                          int64_t d, int64_t hs, const uint8_t *mask, float scale, float *out, int threads) {
    if (KV <= 0 || H % KV || H / KV > MAX_GROUP || d % 8) return 1;
    const int64_t g = H / KV;
    float *s = malloc((L > 0 ? L : 1) * g * sizeof(float)); /* (L, g): scores, then weights */
    if (!s) return 2;
    for (int64_t kvh = 0; kvh < KV; kvh++) {
        const float *kh = k + kvh * hs, *vh = v + kvh * hs, *qh = q + kvh * g * d;
        float *oh = out + kvh * g * d;
        /* scores: one pass over the keys, every query head of the group at once */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t j = 0; j < L; j++) {
            if (mask && !mask[j]) {
                for (int64_t r = 0; r < g; r++) s[j * g + r] = -INFINITY;
                continue;
            }
            const float *kj = kh + j * d;
            __m256 acc[MAX_GROUP];
            for (int64_t r = 0; r < g; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) {
                const __m256 kv8 = _mm256_loadu_ps(kj + i);
                for (int64_t r = 0; r < g; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + r * d + i), kv8, acc[r]);
            }
            for (int64_t r = 0; r < g; r++) s[j * g + r] = hsum256(acc[r]) * scale;
        }
        /* softmax per query head (serial: L exps per head) */
        float inv[MAX_GROUP];
        for (int64_t r = 0; r < g; r++) {
            float mx = -INFINITY;
            for (int64_t j = 0; j < L; j++) mx = s[j * g + r] > mx ? s[j * g + r] : mx;
            if (mx == -INFINITY) { /* nothing to attend to: zeros */
                for (int64_t j = 0; j < L; j++) s[j * g + r] = 0.0f;
                inv[r] = 0.0f;
                continue;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                const float e = expf(s[j * g + r] - mx);
                s[j * g + r] = e;
                sum += e;
            }
            inv[r] = 1.0f / sum;
        }
        /* out = weights . values: thread t sums a slice of d over every value row (rows read in order) */
        const int64_t nv = d / 8;
        const int nt = threads < 1 ? 1 : (threads > nv ? (int)nv : threads);
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int t = 0; t < nt; t++) {
            const int64_t c0 = 8 * (nv * t / nt), c1 = 8 * (nv * (t + 1) / nt);
            for (int64_t r = 0; r < g; r++)
                for (int64_t i = c0; i < c1; i++) oh[r * d + i] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                const float *vj = vh + j * d;
                for (int64_t r = 0; r < g; r++) {
                    const float w = s[j * g + r];
                    if (w == 0.0f) continue; /* masked (or underflowed) keys add nothing */
                    const __m256 w8 = _mm256_set1_ps(w);
                    float *o = oh + r * d;
                    for (int64_t i = c0; i < c1; i += 8)
                        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w8, _mm256_loadu_ps(vj + i), _mm256_loadu_ps(o + i)));
                }
            }
            for (int64_t r = 0; r < g; r++) {
                const __m256 s8 = _mm256_set1_ps(inv[r]);
                for (int64_t i = c0; i < c1; i += 8)
                    _mm256_storeu_ps(oh + r * d + i, _mm256_mul_ps(_mm256_loadu_ps(oh + r * d + i), s8));
            }
        }
    }
    free(s);
    return 0;
}
