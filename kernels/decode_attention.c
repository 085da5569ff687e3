/* ldqa CPU kernel: exact softmax attention of one new token (decode) over a KV cache, with GQA.
 *
 * Shapes (fp32):
 *   q    (H, d)                      the token's queries, contiguous
 *   k, v (KV, L, d) with row stride d and head stride `hs` (a slice of the KV cache (1, KV, capacity, d):
 *                                    hs = capacity * d), d contiguous
 *   mask (L,) uint8 or NULL          1 = may attend (shared by every head); NULL = attend to all
 *   bias (L,) float or NULL          added to every head's score of key j (`ldqa_decode_attention_biased`:
 *                                    position debiasing's per-passage log weights, attention/debias.py)
 *   out  (H, d)
 * Query head h reads KV head h / (H / KV). Scores are q.k * scale (+ bias), softmax in fp32, rows with no
 * allowed key give zeros (as the torch reference, kernels/reference.attention).
 *
 * Each key and value row is read once for all the g = H / KV query heads that share it (GQA): the cost is
 * reading L * d * 8 bytes per KV head. Two parallel loops (OpenMP, `threads`): the scores over keys, then
 * the weighted sum of values, each thread a slice of d; the softmax in between is serial and vectorized
 * (exp256 below). For g = 1..8 the loops are compiled per g (`G`): the g score sums of a key and the
 * g x CW output values of a slice of CW dims stay in registers for the whole pass over the keys (the
 * generic loop, any g <= 16, keeps them in memory and its softmax is serial: ~3x slower at g = 4, d = 256).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

#define MAX_GROUP 16 /* query heads per KV head */

/* e^x for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, 2^n built in
 * the exponent bits); within ~2 ulp of expf over [-87, 88]; below -87 it gives 0 (softmax weights only ever
 * take x <= 0) */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, x), x, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* 2^n: n in [-126, 127] after the clamp */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* s (L, g) -> softmax weights per query head (column), in place; inv[r] = 1 / the sum of column r's
 * exps (0 for a column of -inf: its weights become 0). Serial. */
static void softmax_columns(float *s, int64_t L, int64_t g, float *inv) {
    for (int64_t r = 0; r < g; r++) {
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; j++) mx = s[j * g + r] > mx ? s[j * g + r] : mx;
        if (mx == -INFINITY) { /* nothing to attend to: zeros */
            for (int64_t j = 0; j < L; j++) s[j * g + r] = 0.0f;
            inv[r] = 0.0f;
            continue;
        }
        float sum = 0.0f;
        if (g == 1) { /* contiguous column: 8 at a time */
            const __m256 m8 = _mm256_set1_ps(mx);
            __m256 acc = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= L; j += 8) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
                _mm256_storeu_ps(s + j, e);
                acc = _mm256_add_ps(acc, e);
            }
            sum = hsum256(acc);
            for (; j < L; j++) sum += s[j] = expf(s[j] - mx);
        } else {
            for (int64_t j = 0; j < L; j++) sum += s[j * g + r] = expf(s[j * g + r] - mx);
        }
        inv[r] = 1.0f / sum;
    }
}

/* Tiled single pass for g = G query heads per KV head (G = 1..8; d a multiple of 8 * NV): the keys are cut
 * into chunks of CHUNK, each one partial result (its (G, d) sums, running max and sum), the threads taking
 * contiguous runs of chunks; within a chunk, tiles of TILE keys; per tile, the scores of its keys (two keys at a time: 2G
 * independent FMA chains; the tile's value rows are prefetched meanwhile), stored head-major (s[r * TILE +
 * j]: each head's TILE scores contiguous, so the exps and sums run 8 keys at a time for any G), their exps
 * against the running max (online softmax: the running sums are rescaled when the max grows), then the
 * weighted sum of the tile's value rows into the chunk's (G, d) sums, slices of 8 * NV dims held in
 * registers over the tile. The chunks' partial results are merged in order by their log-sum-exp
 * (flash-decoding, Dao et al. 2023): as the chunks do not depend on the thread count, neither does the
 * output, bit for bit (one thread computes the same chunks one after another). Reading K and V cold from memory (decode: every weight of a step passes through the
 * caches between two visits of a layer's KV) is most of the time, and the hardware prefetcher alone fetched
 * them at ~8 GB/s: the score loop asks for the key rows K_AHEAD ahead and for the tile's value rows.
 * Measured (g = 4, d = 256, one thread, K/V cold, C harness): L = 512 ~90 us and L = 1416 ~240 us per call,
 * against ~140 / ~320 for two parallel loops with a serial softmax. */
#define TILE 32    /* keys per tile: their value rows (32 KB at d = 256) fit in L1; a multiple of 8 */
#define CHUNK 256  /* keys per partial result (a multiple of TILE): the partials do not depend on the threads */
#define K_AHEAD 32 /* key rows ahead that the score loop asks into L1 (a prefetch past the end never faults) */
/* The vector operations of the tiled pass per width W: 256 (AVX2, 8 floats) and 512 (AVX-512, 16 floats) */
#define VT_256 __m256
#define LANES_256 8
#define VLOAD_256 _mm256_loadu_ps
#define VSTORE_256 _mm256_storeu_ps
#define VFMA_256 _mm256_fmadd_ps
#define VMUL_256 _mm256_mul_ps
#define VSET1_256 _mm256_set1_ps
#define VZERO_256 _mm256_setzero_ps
#define VHSUM_256 hsum256
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define HAVE_TILED512 1
/* the sum of a zmm's 16 floats */
static inline float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#define VT_512 __m512
#define LANES_512 16
#define VLOAD_512 _mm512_loadu_ps
#define VSTORE_512 _mm512_storeu_ps
#define VFMA_512 _mm512_fmadd_ps
#define VMUL_512 _mm512_mul_ps
#define VSET1_512 _mm512_set1_ps
#define VZERO_512 _mm512_setzero_ps
#define VHSUM_512 hsum512
#endif

#define ATTEND_TILED(NAME, G, NV, W)                                                                                   \
    static void NAME(const float *qh, const float *kh, const float *vh, int64_t L, int64_t d,                          \
                     const uint8_t *mask, const float *bias, float scale, float *part, int64_t nch, int nt) {          \
        _Pragma("omp parallel for schedule(static) num_threads(nt)")                                                   \
        for (int64_t ch = 0; ch < nch; ch++) {                                                                         \
            const int64_t j0 = ch * CHUNK, j1 = j0 + CHUNK < L ? j0 + CHUNK : L;                                       \
            float *acc = part + ch * (G * d + 2 * G), *mx = acc + G * d, *sum = mx + G;                                \
            for (int64_t i = 0; i < G * d; i++) acc[i] = 0.0f;                                                         \
            for (int r = 0; r < G; r++) mx[r] = -INFINITY, sum[r] = 0.0f;                                              \
            float s[G * TILE] __attribute__((aligned(32)));                                                            \
            for (int64_t a = j0; a < j1; a += TILE) {                                                                  \
                const int64_t nk = j1 - a < TILE ? j1 - a : TILE;                                                      \
                for (int64_t p = 0; p < nk; p += 2) {                                                                  \
                    const float *k0 = kh + (a + p) * d, *k1 = p + 1 < nk ? k0 + d : k0;                                \
                    VT_##W a0[G], a1[G];                                                                               \
                    for (int r = 0; r < G; r++) a0[r] = a1[r] = VZERO_##W();                                           \
                    for (int64_t i = 0; i < d; i += LANES_##W) {                                                       \
                        for (int o = 0; o < 2 * LANES_##W; o += 16) { /* the lines of 2 key / value rows */            \
                            _mm_prefetch((const char *)(k0 + K_AHEAD * d + 2 * i + o), _MM_HINT_T0);                   \
                            _mm_prefetch((const char *)(vh + (a + p) * d + 2 * i + o), _MM_HINT_T0);                   \
                        }                                                                                              \
                        const VT_##W x0 = VLOAD_##W(k0 + i), x1 = VLOAD_##W(k1 + i);                                   \
                        for (int r = 0; r < G; r++) {                                                                  \
                            const VT_##W q8 = VLOAD_##W(qh + r * d + i);                                               \
                            a0[r] = VFMA_##W(q8, x0, a0[r]);                                                           \
                            a1[r] = VFMA_##W(q8, x1, a1[r]);                                                           \
                        }                                                                                              \
                    }                                                                                                  \
                    for (int r = 0; r < G; r++) {                                                                      \
                        s[r * TILE + p] = mask && !mask[a + p] ? -INFINITY                                             \
                                          : VHSUM_##W(a0[r]) * scale + (bias ? bias[a + p] : 0.0f);                    \
                        if (p + 1 < nk)                                                                                \
                            s[r * TILE + p + 1] = mask && !mask[a + p + 1] ? -INFINITY                                 \
                                                  : VHSUM_##W(a1[r]) * scale + (bias ? bias[a + p + 1] : 0.0f);        \
                    }                                                                                                  \
                }                                                                                                      \
                for (int r = 0; r < G; r++)                                                                            \
                    for (int64_t j = nk; j < TILE; j++) s[r * TILE + j] = -INFINITY;                                   \
                /* online softmax: the new running max per head; the old sums rescaled by exp(old - new) */            \
                float alpha[G];                                                                                        \
                int any = 0, grow = 0;                                                                                 \
                for (int r = 0; r < G; r++) {                                                                          \
                    float m = mx[r];                                                                                   \
                    for (int64_t j = 0; j < nk; j++) m = s[r * TILE + j] > m ? s[r * TILE + j] : m;                    \
                    alpha[r] = m == mx[r] ? 1.0f : (mx[r] == -INFINITY ? 0.0f : expf(mx[r] - m));                      \
                    grow |= m != mx[r];                                                                                \
                    any |= m != -INFINITY;                                                                             \
                    mx[r] = m;                                                                                         \
                }                                                                                                      \
                if (!any) continue; /* every key so far masked */                                                      \
                for (int r = 0; r < G; r++) {                                                                          \
                    const __m256 mv = _mm256_set1_ps(mx[r] == -INFINITY ? 0.0f : mx[r]);                               \
                    __m256 tot = _mm256_setzero_ps();                                                                  \
                    for (int64_t i = r * TILE; i < (r + 1) * TILE; i += 8) {                                           \
                        const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(s + i), mv));                             \
                        _mm256_store_ps(s + i, e);                                                                     \
                        tot = _mm256_add_ps(tot, e);                                                                   \
                    }                                                                                                  \
                    sum[r] = sum[r] * alpha[r] + hsum256(tot);                                                         \
                }                                                                                                      \
                for (int64_t c = 0; c < d; c += LANES_##W * NV) {                                                      \
                    VT_##W o[G][NV];                                                                                   \
                    for (int r = 0; r < G; r++) {                                                                      \
                        const VT_##W f = VSET1_##W(alpha[r]);                                                          \
                        for (int u = 0; u < NV; u++) {                                                                 \
                            o[r][u] = VLOAD_##W(acc + r * d + c + LANES_##W * u);                                      \
                            if (grow) o[r][u] = VMUL_##W(o[r][u], f);                                                  \
                        }                                                                                              \
                    }                                                                                                  \
                    const float *vc = vh + a * d + c;                                                                  \
                    for (int64_t j = 0; j < nk; j++) {                                                                 \
                        if (mask && !mask[a + j]) continue;                                                            \
                        VT_##W v8[NV];                                                                                 \
                        for (int u = 0; u < NV; u++) v8[u] = VLOAD_##W(vc + j * d + LANES_##W * u);                    \
                        for (int r = 0; r < G; r++) {                                                                  \
                            const VT_##W w = VSET1_##W(s[r * TILE + j]);                                               \
                            for (int u = 0; u < NV; u++) o[r][u] = VFMA_##W(w, v8[u], o[r][u]);                        \
                        }                                                                                              \
                    }                                                                                                  \
                    for (int r = 0; r < G; r++)                                                                        \
                        for (int u = 0; u < NV; u++) VSTORE_##W(acc + r * d + c + LANES_##W * u, o[r][u]);             \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
    }

/* NV: value slices of one vector held per head over a tile (G * NV accumulators in registers) */
#define ATTEND_G(G, NV) ATTEND_TILED(attend_##G, G, NV, 256)
ATTEND_G(1, 4)
ATTEND_G(2, 4)
ATTEND_G(3, 4)
ATTEND_G(4, 4)
ATTEND_G(5, 2)
ATTEND_G(6, 2)
ATTEND_G(7, 2)
ATTEND_G(8, 2)
#define TILED_NV(g) ((g) <= 4 ? 4 : 2)

#ifdef HAVE_TILED512
/* The same pass on 16-float vectors (zmm: 32 registers, so G = 5, 6 keep 4 slices too). Measured on a Zen 5
 * machine (full-width 512-bit units; `bench_decode_attention`, one thread, K/V cold): Qwen2.5 1.5B's layer
 * (12 / 2 heads, d 128) 106 -> 86 us at 1,416 keys and 762 -> 666 us at 8,192; the 0.5B's (14 / 2, d 64)
 * 71 -> 58 and 404 -> 340 us; from L2 (512 keys) 36 -> 26 us. At two threads the pass reads memory about as
 * fast either way. The score sums are added in another order (16 lanes): fp32 rounding only. */
#define ATTEND512_G(G, NV) ATTEND_TILED(attend512_##G, G, NV, 512)
ATTEND512_G(1, 4)
ATTEND512_G(2, 4)
ATTEND512_G(3, 4)
ATTEND512_G(4, 4)
ATTEND512_G(5, 4)
ATTEND512_G(6, 4)
ATTEND512_G(7, 2)
ATTEND512_G(8, 2)
#define TILED512_NV(g) ((g) <= 6 ? 4 : 2)
#endif

/* out (g, d) = the merge of np partial results (acc (g, d), max (g,), sum (g,) each, as attend_G leaves
 * them), in their order, by their log-sum-exp; a head with no allowed key anywhere gets zeros */
static void merge_parts(const float *part, int64_t np, int64_t g, int64_t d, float *out) {
    const int64_t stride = g * d + 2 * g;
    for (int64_t r = 0; r < g; r++) {
        float m = -INFINITY, tot = 0.0f;
        for (int64_t t = 0; t < np; t++) m = part[t * stride + g * d + r] > m ? part[t * stride + g * d + r] : m;
        float *o = out + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
        for (int64_t t = 0; t < np; t++) {
            const float mt = part[t * stride + g * d + r], w = mt == -INFINITY ? 0.0f : expf(mt - m);
            tot += w * part[t * stride + g * d + g + r];
            for (int64_t i = 0; i < d; i++) o[i] += w * part[t * stride + r * d + i];
        }
        const float inv = m == -INFINITY ? 0.0f : 1.0f / tot;
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
}

/* any g <= MAX_GROUP: sums in memory */
static void scores_any(const float *qh, const float *kh, int64_t L, int64_t d, int64_t g, const uint8_t *mask,
                       const float *bias, float scale, float *s, int threads) {
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
        for (int64_t r = 0; r < g; r++) s[j * g + r] = hsum256(acc[r]) * scale + (bias ? bias[j] : 0.0f);
    }
}

static void values_any(const float *s, const float *vh, int64_t L, int64_t d, int64_t g, const uint8_t *mask,
                       const float *inv, float *oh, int threads) {
    const int64_t nv = d / 8;
    const int nt = threads < 1 ? 1 : (threads > nv ? (int)nv : threads);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int t = 0; t < nt; t++) {
        const int64_t c0 = 8 * (nv * t / nt), c1 = 8 * (nv * (t + 1) / nt);
        for (int64_t r = 0; r < g; r++)
            for (int64_t i = c0; i < c1; i++) oh[r * d + i] = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            if (mask && !mask[j]) continue;
            const float *vj = vh + j * d;
            for (int64_t r = 0; r < g; r++) {
                const __m256 w8 = _mm256_set1_ps(s[j * g + r]);
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

int ldqa_decode_attention_biased(const float *q, const float *k, const float *v, int64_t H, int64_t KV, int64_t L,
                                 int64_t d, int64_t hs, const uint8_t *mask, const float *bias, float scale,
                                 float *out, int threads) {
    if (KV <= 0 || H % KV || H / KV > MAX_GROUP || d % 8) return 1;
    const int64_t g = H / KV;
    /* the tiled pass (g <= 8) takes d in slices of 8 * TILED_NV(g) dims; at most one thread per chunk */
    if (g <= 8 && d % (8 * TILED_NV(g)) == 0) {
        const int64_t nch = L > CHUNK ? (L + CHUNK - 1) / CHUNK : 1;
        int nt = threads < 1 ? 1 : threads;
        if (nt > nch) nt = (int)nch;
        float *part = malloc(nch * (g * d + 2 * g) * sizeof(float));
        if (!part) return 2;
        /* the pass compiled for this g: 16-float vectors where built and d takes their slices */
        typedef void (*attend_fn)(const float *, const float *, const float *, int64_t, int64_t, const uint8_t *,
                                  const float *, float, float *, int64_t, int);
        static const attend_fn tiled[8] = {attend_1, attend_2, attend_3, attend_4,
                                           attend_5, attend_6, attend_7, attend_8};
        attend_fn attend = tiled[g - 1];
#ifdef HAVE_TILED512
        static const attend_fn tiled512[8] = {attend512_1, attend512_2, attend512_3, attend512_4,
                                              attend512_5, attend512_6, attend512_7, attend512_8};
        if (d % (16 * TILED512_NV(g)) == 0) attend = tiled512[g - 1];
#endif
        for (int64_t kvh = 0; kvh < KV; kvh++) {
            attend(q + kvh * g * d, k + kvh * hs, v + kvh * hs, L, d, mask, bias, scale, part, nch, nt);
            merge_parts(part, nch, g, d, out + kvh * g * d);
        }
        free(part);
        return 0;
    }
    float *s = malloc((L > 0 ? L : 1) * g * sizeof(float)); /* (L, g): scores, then weights */
    if (!s) return 2;
    for (int64_t kvh = 0; kvh < KV; kvh++) {
        const float *kh = k + kvh * hs, *vh = v + kvh * hs, *qh = q + kvh * g * d;
        float inv[MAX_GROUP];
        scores_any(qh, kh, L, d, g, mask, bias, scale, s, threads);
        softmax_columns(s, L, g, inv);
        values_any(s, vh, L, d, g, mask, inv, out + kvh * g * d, threads);
    }
    free(s);
    return 0;
}

int ldqa_decode_attention(const float *q, const float *k, const float *v, int64_t H, int64_t KV, int64_t L,
                          int64_t d, int64_t hs, const uint8_t *mask, float scale, float *out, int threads) {
    return ldqa_decode_attention_biased(q, k, v, H, KV, L, d, hs, mask, NULL, scale, out, threads);
}
