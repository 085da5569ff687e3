/* ldqa CPU kernel: y = x W^T with W in GGUF's Q8_0 layout (int8 values, one fp16 scale per block of 32
 * input channels) and x in fp32, rounded to int16 per block of 32 inside the kernel.
 *
 * Shapes (row-major, contiguous):
 *   x  (M, K) float32          M rows (tokens), K input channels, K % 32 == 0
 *   qw (N, K) int8             N output channels
 *   d  (N, K / 32) uint16      fp16 bit patterns: w[n, k] = d[n, k / 32] * qw[n, k]
 *   y  (M, N) float32
 *
 * Per block of 32: the int8 weights are widened to int16 and multiplied with the int16 activations
 * (exact integer sums; the rounded activations live in a scratch buffer of the call), converted to fp32
 * once and scaled by d_w * d_x in one FMA:
 *   one row of x at a time (decode, and the rows left over below): the AVX2 loop, two ymm halves per
 *     block (_mm256_cvtepi8_epi16, _mm256_madd_epi16; 7 instructions per block), two accumulators (even /
 *     odd blocks) per output;
 *   with AVX-512 (__AVX512F__ and __AVX512BW__), rows of x MT = 4 at a time: one block is one zmm
 *     (_mm512_cvtepi8_epi16, _mm512_madd_epi16, cvt, FMA: 4 instructions per block and row), widened once
 *     for the 4 rows.
 * Both give the same integer block sums; the 4-row tile sums them in fp32 in another order (16 lanes, one
 * accumulator per row): fp32 rounding. One row is bit for bit what it was before the tile existed.
 * Measured on a Zen 4 machine (its 512-bit units run a zmm op as two 256-bit halves): for
 * one row of x a zmm loop took the same time as the AVX2 one (~0.8 ns per block from L1; a decode row is
 * bound by reading the weights, where only the prefetch below helps), so decode keeps the AVX2 loop; for
 * M >= 4 the 4-row tile takes ~0.8x the time. Output channels are read one weight row after another:
 * interleaving 4 weight rows (to share the activation loads) ran ~3x slower from memory.
 * Parallel over output channels (OpenMP, `threads` threads; torch's libgomp is already loaded in the
 * process, so the pool is the one torch's own ops use). For M > 1 a weight row is read from memory once and
 * from L1 for the other rows of x.
 *
 * Built and loaded by cpu_linear.py (cc -O3 -march=native -fopenmp); its torch reference is
 * cpu_linear.linear_q8_0_reference.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gguf_blocks.h"
#include "simd.h"

#define QK 32


/* x (M, K) fp32 -> xq (M, K) int16 and xd (M, K / 32) fp32 with x ~= xd * xq per block of 32, and
 * xs (M, K / 32) int32, the sum of each block's xq (for the block formats with an offset) */
static void quantize_x(const float *x, int64_t M, int64_t K, int16_t *xq, float *xd, int32_t *xs) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < M * nb; i++) {
        const float *xb = x + i * QK;
        const float amax = amax_floats(xb, QK);
        const float dx = amax / 32767.0f, inv = amax > 0 ? 32767.0f / amax : 0.0f;
        xd[i] = dx;
        /* x * inv rounded to nearest, ties to even (the default MXCSR rounding: lrintf's), |values| <= 32767 */
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < QK; j += 16) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), vinv));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8), vinv));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
            _mm256_storeu_si256((__m256i *)(xq + i * QK + j), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
        }
        xs[i] = hsum256_epi32(sum);
    }
}

/* an activation block of 256 whose largest |x| is over this many times its RMS is read at int16 per 32 by
 * the K types (gguf_blocks.h, `precise`): 256 Gaussian values reach about 3 */
#define OUTLIER_RATIO 12.0f

/* x (M, K) fp32 -> the K types' activations (as ggml's Q8_K): x8 (M, K) int8 and xd (M, K / 256) fp32 with
 * x ~= xd * x8 per block of 256 (xd = amax / 127, nearest, ties to even), bs (M, K / 16) int32, the sum of
 * each 16 of x8, and precise (M, K / 256): 1 where the block's amax > OUTLIER_RATIO * its RMS; x8q (M, K)
 * the same bytes with the 32-blocks of each 256 in the order 0 2 1 3 4 6 5 7 (the order of Q4_K's nibbles
 * in two 64-byte loads: gguf_blocks.h), b32 (M, K / 32) the sum of each 32 of x8 */
static void quantize_xk(const float *x, int64_t M, int64_t K, int8_t *x8, float *xd, int32_t *bs,
                        uint8_t *precise, int8_t *x8q, int32_t *b32) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* packs' lane interleave undone */
    for (int64_t i = 0; i < M * K / 256; i++) {
        const float *xb = x + i * 256;
        __m256 vmax = _mm256_setzero_ps(), vss = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8) {
            const __m256 v = _mm256_loadu_ps(xb + j);
            vmax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), vmax);
            vss = _mm256_fmadd_ps(v, v, vss);
        }
        const float amax = hmax256(vmax), ss = hsum256(vss);
        precise[i] = amax * amax > OUTLIER_RATIO * OUTLIER_RATIO * (ss / 256.0f);
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        xd[i] = amax / 127.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int j = 0; j < 256; j += 32) {
            __m256i q[4];
            for (int t = 0; t < 4; t++) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * t), vinv));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(x8 + i * 256 + j), _mm256_permutevar8x32_epi32(bytes, order));
            bs[i * 16 + j / 16] = hsum256_epi32(_mm256_add_epi32(q[0], q[1]));
            bs[i * 16 + j / 16 + 1] = hsum256_epi32(_mm256_add_epi32(q[2], q[3]));
        }
        for (int g = 0; g < 8; g++) {
            b32[i * 8 + g] = bs[i * 16 + 2 * g] + bs[i * 16 + 2 * g + 1];
            /* sub-block g of 32 goes to place (g & 4) | (g & 1) << 1 | (g & 2) >> 1: order 0 2 1 3 4 6 5 7 */
            memcpy(x8q + i * 256 + 32 * ((g & 4) | (g & 1) << 1 | (g & 2) >> 1), x8 + i * 256 + 32 * g, 32);
        }
    }
}

/* sum over one block of 32: int8 weights (already widened to two int16 vectors) . int16 activations */
static inline __m256 block_dot(__m256i w0, __m256i w1, const int16_t *xq) {
    const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq));
    const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)); /* |sum| <= 4 * 127 * 32767 < 2^24: exact */
}

/* combined scales of one weight row against one activation row: c[b] = d_w[b] * d_x[b], b < nb */
static inline void row_scales(const uint16_t *dw, const float *dx, int64_t nb, float *c) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(c + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dw + b))),
                                              _mm256_loadu_ps(dx + b)));
    for (; b < nb; b++) c[b] = _cvtsh_ss(dw[b]) * dx[b];
}

static inline __m256 block_dot256(const int8_t *w, const int16_t *xq) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
    return block_dot(w0, w1, xq);
}

/* Software prefetch: every 64-byte line of weights is asked into L2 (_MM_HINT_T1) PF_AHEAD bytes before
 * it is read, once per weight row (by the first row of x), for K <= PF_MAX_K. A prefetch past the end of
 * the weights is harmless (it never faults). Measured on a Zen 4 machine, one thread, M = 1, against
 * no prefetch: ~0.86-0.95x the time for K = 640-2048 (Gemma 3 270M's matrices and LM head),
 * but 1.0-1.2x for K = 2560-4096, where the hardware prefetcher alone keeps up with memory. (K = 6912
 * and 10240 measured 0.8x and 0.5-0.6x with it; left to the hardware too until measured on a quiet
 * machine: one cut-off, never slower than without.)
 * -DPF_AHEAD=0 makes it a no-op (prefetching the line being read) for comparisons. */
#ifndef PF_AHEAD
#define PF_AHEAD 16384
#endif
#define PF_MAX_K 2048

/* one activation row against one weight row: two accumulators (even / odd blocks) hide the FMA latency;
 * pf: prefetch the weights PF_AHEAD bytes ahead (on the first row of x that reads this weight row) */
static inline float row_dot(const int8_t *wn, const int16_t *xr, const float *c, int64_t nb, int pf) {
    __m256 acc_e = _mm256_setzero_ps(), acc_o = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        if (pf) _mm_prefetch((const char *)(wn + b * QK + PF_AHEAD), _MM_HINT_T1);
        acc_e = _mm256_fmadd_ps(block_dot256(wn + b * QK, xr + b * QK), _mm256_broadcast_ss(c + b), acc_e);
        acc_o = _mm256_fmadd_ps(block_dot256(wn + (b + 1) * QK, xr + (b + 1) * QK), _mm256_broadcast_ss(c + b + 1), acc_o);
    }
    if (b < nb) acc_e = _mm256_fmadd_ps(block_dot256(wn + b * QK, xr + b * QK), _mm256_broadcast_ss(c + b), acc_e);
    return hsum256(_mm256_add_ps(acc_e, acc_o));
}

#define MAX_BLOCKS 2048 /* K <= 65536 input channels */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MT 4 /* rows of x per pass over a weight row (M >= 4) */

/* the block's 32 int8 weights at w, widened to 32 int16 (one zmm) */
static inline __m512i widen512(const int8_t *w) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
}

/* acc + (block sum of wb . the 32 int16 activations at xb, as 16 exact int32 pair sums in fp32) * c */
static inline __m512 block_fma512(__m512i wb, const int16_t *xb, float c, __m512 acc) {
    const __m512i p = _mm512_madd_epi16(wb, _mm512_loadu_si512((const void *)xb)); /* |lane| <= 2 * 127 * 32767 */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(c), acc);
}

/* MT activation rows xr (MT, K) against one weight row wn (K,): each block is widened once for the MT
 * rows; c (MT, nb) the combined scales; y[j] = row j's dot product */
static inline void rows_dot512(const int8_t *wn, const int16_t *xr, int64_t K, const float *c, int64_t nb, int pf,
                               float *y) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (pf && !(b & 1)) _mm_prefetch((const char *)(wn + b * QK + PF_AHEAD), _MM_HINT_T1); /* per 64 bytes */
        const __m512i wb = widen512(wn + b * QK); /* (32,) int16 */
        a0 = block_fma512(wb, xr + b * QK, c[b], a0);
        a1 = block_fma512(wb, xr + K + b * QK, c[nb + b], a1);
        a2 = block_fma512(wb, xr + 2 * K + b * QK, c[2 * nb + b], a2);
        a3 = block_fma512(wb, xr + 3 * K + b * QK, c[3 * nb + b], a3);
    }
    y[0] = _mm512_reduce_add_ps(a0);
    y[1] = _mm512_reduce_add_ps(a1);
    y[2] = _mm512_reduce_add_ps(a2);
    y[3] = _mm512_reduce_add_ps(a3);
}

/* y[:, n] for one output channel n: its weight row wn (K,) and scales dn (nb,) against every row of x;
 * pf: prefetch ahead of wn; c: room for (MT, nb) combined scales */
static inline void channel512(const int8_t *wn, const uint16_t *dn, const int16_t *xq, const float *xd, int64_t M,
                              int64_t K, int64_t N, int pf, float *c, float *yn) {
    const int64_t nb = K / QK;
    int64_t m = 0;
    for (; m + MT <= M; m += MT) {
        float out[MT];
        for (int j = 0; j < MT; j++) row_scales(dn, xd + (m + j) * nb, nb, c + j * nb);
        rows_dot512(wn, xq + m * K, K, c, nb, pf && m == 0, out);
        for (int j = 0; j < MT; j++) yn[(m + j) * N] = out[j];
    }
    for (; m < M; m++) {
        row_scales(dn, xd + m * nb, nb, c);
        yn[m * N] = row_dot(wn, xq + m * K, c, nb, pf && m == 0); /* the AVX2 loop: as fast for one row */
    }
}
#endif

/* A weight matrix of N rows of K weights for `mats_linear`: type T_Q8_0 is Q8_0 in our split layout (w: int8
 * (N, K), d: fp16 bits (N, K / 32)); the other types of gguf_blocks.h are ggml's blocks as shipped (w: (N, row
 * bytes) uint8, d unused). Shared with Python (cpu_linear.Mat). */
typedef struct {
    int64_t type;
    const void *w;
    const uint16_t *d;
    int64_t n;
} ldqa_mat;

#define MAX_MATS 4

/* y (M, sum of n) = x (M, K) [W_0 | W_1 | ...]^T for nm <= MAX_MATS matrices of K input channels: the
 * columns of matrix i follow those of matrix i - 1 (q | k | v, gate | up). x is rounded to int16 once;
 * one parallel loop (OpenMP, `threads`) over all the output channels. Returns 0, 1 for a K or type that
 * does not fit (K a multiple of 32, of 256 for the K types, at most 65536), 2 for no memory. */
static int mats_linear(const ldqa_mat *mats, int nm, const float *x, int64_t M, int64_t K, float *y, int threads) {
    if (nm < 1 || nm > MAX_MATS || K % QK || K / QK > MAX_BLOCKS) return 1;
    const int64_t nb = K / QK, nsb = K / 256;
    int64_t start[MAX_MATS + 1], row_bytes[MAX_MATS];
    gguf_row_fn fn[MAX_MATS];
    gguf_rowk_fn fnk[MAX_MATS];
    int any_k = 0, all_k = 1;
    start[0] = 0;
    for (int i = 0; i < nm; i++) {
        fn[i] = gguf_row(mats[i].type);
        fnk[i] = gguf_rowk(mats[i].type);
        any_k |= fnk[i] != NULL;
        all_k &= fnk[i] != NULL;
        row_bytes[i] = gguf_row_bytes(mats[i].type, K);
        if (!row_bytes[i] || (mats[i].type == T_Q8_0 && !mats[i].d) || (mats[i].type != T_Q8_0 && !fn[i] && !fnk[i]))
            return 1;
        start[i + 1] = start[i] + mats[i].n;
    }
    const int64_t N = start[nm];
    int16_t *xq = malloc(M * K * sizeof(int16_t));
    float *xd = malloc(M * nb * sizeof(float));
    int32_t *xs = malloc(M * nb * sizeof(int32_t));
    /* the K types' int8 activations (only when a K-type matrix is in the call; K % 256 == 0 then) */
    int8_t *x8 = any_k ? malloc(M * K) : NULL;
    float *xd8 = any_k ? malloc(M * nsb * sizeof(float)) : NULL;
    int32_t *bs = any_k ? malloc(M * (K / 16) * sizeof(int32_t)) : NULL;
    uint8_t *precise = any_k ? malloc(M * nsb) : NULL;
    int8_t *x8q = any_k ? malloc(M * K) : NULL;
    int32_t *b32 = any_k ? malloc(M * (K / 32) * sizeof(int32_t)) : NULL;
    if (!xq || !xd || !xs || (any_k && (!x8 || !xd8 || !bs || !precise || !x8q || !b32))) {
        free(x8q);
        free(b32);
        free(precise);
        free(xq);
        free(xd);
        free(xs);
        free(x8);
        free(xd8);
        free(bs);
        return 2;
    }
    if (any_k && M == 1) {
        quantize_xk(x, M, K, x8, xd8, bs, precise, x8q, b32);
        if (all_k) { /* the int16 form only where a super-block reads it */
            for (int64_t s = 0; s < nsb; s++)
                if (precise[s]) quantize_x(x + 256 * s, 1, 256, xq + 256 * s, xd + 8 * s, xs + 8 * s);
        } else {
            quantize_x(x, M, K, xq, xd, xs);
        }
    } else {
        quantize_x(x, M, K, xq, xd, xs);
        if (any_k) memset(precise, 1, M * nsb); /* several rows (a short prefill, a question segment): int16 */
    }
    const int pf = K <= PF_MAX_K;
    /* decode (one row of x) through a K-type matrix: whole runs of rows per call (`gguf_rowsk`) */
    const kx_t a1 = {x8, xd8, bs, precise, xq, xd, xs, x8q, b32};
#pragma omp parallel num_threads(threads)
    {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        float c[MT * MAX_BLOCKS]; /* (MT, nb): combined scales of one weight row against MT rows of x */
#else
        float c[MAX_BLOCKS]; /* (nb,): combined scales of one weight row against one row of x */
#endif
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        /* this thread's output channels: one contiguous share of the N, as `schedule(static)` deals them */
        const int64_t share = (N + nt - 1) / nt, r0 = t * share < N ? t * share : N,
                      r1 = r0 + share < N ? r0 + share : N;
        for (int i = 0; i < nm; i++) {
            const int64_t lo = r0 > start[i] ? r0 : start[i], hi = r1 < start[i + 1] ? r1 : start[i + 1];
            if (lo >= hi) continue;
            if (M == 1 && fnk[i]) {
                gguf_rowsk(mats[i].type)((const uint8_t *)mats[i].w + (lo - start[i]) * row_bytes[i], row_bytes[i],
                                         hi - lo, &a1, nsb, y + lo);
                continue;
            }
            for (int64_t r = lo; r < hi; r++) {
                const int64_t n = r - start[i];
                const uint8_t *wn = (const uint8_t *)mats[i].w + n * row_bytes[i];
                float *yn = y + r;
                if (fnk[i]) {
                    for (int64_t m = 0; m < M; m++) {
                        const kx_t a = {x8 + m * K, xd8 + m * nsb, bs + m * (K / 16), precise + m * nsb,
                                        xq + m * K, xd + m * nb, xs + m * nb, x8q + m * K, b32 + m * (K / 32)};
                        yn[m * N] = fnk[i](wn, &a, nsb);
                    }
                    continue;
                }
                if (fn[i]) {
                    for (int64_t m = 0; m < M; m++) yn[m * N] = fn[i](wn, xq + m * K, xd + m * nb, xs + m * nb, nb);
                    continue;
                }
                const uint16_t *dn = mats[i].d + n * nb;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                channel512((const int8_t *)wn, dn, xq, xd, M, K, N, pf, c, yn);
#else
                for (int64_t m = 0; m < M; m++) {
                    row_scales(dn, xd + m * nb, nb, c);
                    yn[m * N] = row_dot((const int8_t *)wn, xq + m * K, c, nb, pf && m == 0);
                }
#endif
            }
        }
    }
    free(xq);
    free(xd);
    free(xs);
    free(x8);
    free(xd8);
    free(bs);
    free(precise);
    free(x8q);
    free(b32);
    return 0;
}

/* y (M, N) = x (M, K) W^T with W = (qw (N, K) int8, d (N, K / 32) fp16 bits), on `threads` threads.
 * Returns 0, 1 for a K that is not a multiple of 32 or above 65536, 2 for no memory. */
int ldqa_q8_0_linear(const float *x, int64_t M, int64_t K, const int8_t *qw, const uint16_t *d, int64_t N,
                     float *y, int threads) {
    const ldqa_mat w = {T_Q8_0, qw, d, N};
    return mats_linear(&w, 1, x, M, K, y, threads);
}

/* y (M, sum of n) = x (M, K) [W_0 | ... ]^T for nm matrices `mats` (see ldqa_mat), on `threads` threads.
 * Returns 0, 1 for a K or type that does not fit, 2 for no memory. */
int ldqa_mats_linear(const ldqa_mat *mats, int nm, const float *x, int64_t M, int64_t K, float *y, int threads) {
    return mats_linear(mats, nm, x, M, K, y, threads);
}

/* out (rows, K) fp32 = the weights of `rows` rows of ggml type `type` (K per row, rows of gguf_row_bytes
 * bytes one after the other), in parallel over rows. Returns 0, 1 for a type or K it does not read. */
int ldqa_gguf_dequantize(int64_t type, const uint8_t *w, int64_t rows, int64_t K, float *out, int threads) {
    const int64_t rb = gguf_row_bytes(type, K);
    if (!rb || type == T_Q8_0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) gguf_dequantize_row(type, w + r * rb, K, out + r * K);
    return 0;
}

/* fp32 -> bf16 bits, rounded to nearest even; NaN -> 0x7FC0: torch's `.to(torch.bfloat16)` bit for bit */
static inline uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_rne(x[i]);
}

/* out (rows, K) bf16 bits = ldqa_gguf_dequantize's fp32 values rounded to bf16 (as torch rounds them), one
 * row at a time through a per-thread fp32 row: a prefill's bf16 GEMM weight in one pass over the blocks, with
 * no (rows, K) fp32 copy written and read back. Q8_0 here is the split layout (qw (rows, K) int8 at `w`,
 * fp16 scales (rows, K / 32) at `d`); the other types read `w` as shipped and ignore `d`. Returns 0, 1 for a
 * type or K it does not read, 2 for no memory. */
int ldqa_dequantize_bf16(int64_t type, const uint8_t *w, const uint16_t *d, int64_t rows, int64_t K,
                         uint16_t *out, int threads) {
    const int64_t rb = type == T_Q8_0 ? K : gguf_row_bytes(type, K);
    if (!rb || K % QK) return 1;
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        float *row = malloc(K * sizeof(float));
        if (!row) {
#pragma omp atomic write
            rc = 2;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue;
            if (type == T_Q8_0) {
                const int8_t *q = (const int8_t *)w + r * K;
                const uint16_t *dr = d + r * (K / QK);
                for (int64_t b = 0; b < K / QK; b++) {
                    const float s = _cvtsh_ss(dr[b]);
                    for (int l = 0; l < QK; l++) row[b * QK + l] = (float)q[b * QK + l] * s;
                }
            } else {
                gguf_dequantize_row(type, w + r * rb, K, row);
            }
            to_bf16(row, K, out + r * K);
        }
        free(row);
    }
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Fused decode halves of one decoder layer (one token, batch 1): everything of a layer but attention
 * itself, so a decode step makes two calls per layer instead of ~100 small torch ops. Attention stays in
 * torch (attention/model.py), where the KV cache, masks and the global layers' hooks live.
 * Norm weights are passed as the multipliers the model uses: (1 + w) for Gemma, w for the others.
 * Torch references: the model's own modules (RMSNorm, QLinear, apply_rope, MLP); tests compare both.
 */
/* out = x / sqrt(mean(x^2) + eps) * w over n values (out may be x); sum of squares in double */
static void rms_norm(const float *x, int64_t n, const float *w, float eps, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * r) * w[i];
}

/* RoPE, rotate_half layout: dims i and i + d/2 rotate together; cos, sin (d,) with equal halves */
static void rope(float *x, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* x (hidden,) -> out = [q (n_heads*d) | k (n_kv*d) | v (n_kv*d)]: RMSNorm, the q, k, v projections (qkv: 3
 * matrices of `hidden` input channels, in one parallel loop; + bias when given), per-head q/k RMSNorm when
 * given (Qwen3, Gemma 3), RoPE on q and k. Returns 0, 1 for a bad K or type, 2 for no memory. */
int ldqa_decode_attn_in(const float *x, int64_t hidden, const float *norm_w, float eps, const ldqa_mat *qkv,
                        const float *bias, int64_t n_heads, int64_t n_kv, int64_t d, const float *qnorm_w,
                        const float *knorm_w, const float *cos, const float *sin, float *out, int threads) {
    float *h = malloc(hidden * sizeof(float));
    if (!h) return 2;
    rms_norm(x, hidden, norm_w, eps, h);
    const int64_t n = (n_heads + 2 * n_kv) * d;
    const int rc = mats_linear(qkv, 3, h, 1, hidden, out, threads);
    free(h);
    if (rc) return rc;
    if (bias)
        for (int64_t i = 0; i < n; i++) out[i] += bias[i];
    float *q = out, *k = out + n_heads * d;
    for (int64_t j = 0; j < n_heads; j++) {
        if (qnorm_w) rms_norm(q + j * d, d, qnorm_w, eps, q + j * d);
        rope(q + j * d, d, cos, sin);
    }
    for (int64_t j = 0; j < n_kv; j++) {
        if (knorm_w) rms_norm(k + j * d, d, knorm_w, eps, k + j * d);
        rope(k + j * d, d, cos, sin);
    }
    return 0;
}

/* the layer after attention: o = attn Wo^T; Gemma (sandwich norms): x += norm(o); h = norm(x);
 * x += norm(down(act(gate(h)) * up(h))); the others (attn_norm_w, ff_out_norm_w NULL): x += o;
 * h = norm(x); x += down(act(gate(h)) * up(h)). gu: the gate and up matrices (one parallel loop). act: 0
 * SiLU, 1 GELU (tanh approximation). x_out (hidden,) may not alias x. Returns 0, 1 for a bad K or type, 2
 * for no memory. */
int ldqa_decode_attn_out(const float *x, const float *attn, int64_t hidden, int64_t attn_dim, const ldqa_mat *wo,
                         const float *attn_norm_w, const float *ff_norm_w, const float *ff_out_norm_w, float eps,
                         const ldqa_mat *gu_w, int64_t inter, int act, const ldqa_mat *wd, float *x_out,
                         int threads) {
    float *o = malloc(hidden * sizeof(float)), *h = malloc(hidden * sizeof(float));
    float *gu = malloc(2 * inter * sizeof(float));
    int rc = 2;
    if (!o || !h || !gu) goto done;
    if ((rc = mats_linear(wo, 1, attn, 1, attn_dim, o, threads))) goto done;
    if (attn_norm_w) rms_norm(o, hidden, attn_norm_w, eps, o);
    for (int64_t i = 0; i < hidden; i++) x_out[i] = x[i] + o[i];
    rms_norm(x_out, hidden, ff_norm_w, eps, h);
    if ((rc = mats_linear(gu_w, 2, h, 1, hidden, gu, threads))) goto done;
    for (int64_t i = 0; i < inter; i++) {
        const float g = gu[i];
        float a;
        if (act == 1) {
            const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
            a = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
        } else {
            a = g / (1.0f + expf(-g));
        }
        gu[i] = a * gu[inter + i];
    }
    if ((rc = mats_linear(wd, 1, gu, 1, inter, o, threads))) goto done;
    if (ff_out_norm_w) rms_norm(o, hidden, ff_out_norm_w, eps, o);
    for (int64_t i = 0; i < hidden; i++) x_out[i] += o[i];
done:
    free(o);
    free(h);
    free(gu);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * A whole decode step's decoder layers in one call (one token of one sequence, batch 1): per layer
 * ldqa_decode_attn_in, the new k and v written into the layer's KV cache at `slot`, ldqa_decode_attention
 * over cache slots [lo, slot] (no mask: the caller checked that every one of them may be attended; the
 * layer's attn_bias added to the scores where it has one), and
 * ldqa_decode_attn_out. The same calls, in the same order, as the per-layer path (quant.FusedDecode +
 * Attention.attend), so the same numbers bit for bit; what it removes is Python between them (~0.1 ms a
 * layer). Shared with Python (cpu_linear.StackLayer). */
typedef struct {
    const float *norm_w;      /* input RMSNorm multiplier (hidden,) */
    const ldqa_mat *qkv;      /* 3 matrices */
    const float *bias;        /* (n_heads + 2 n_kv) * d or NULL */
    const float *qnorm_w;     /* (d,) or NULL */
    const float *knorm_w;     /* (d,) or NULL */
    const ldqa_mat *wo;
    const float *attn_norm_w; /* or NULL */
    const float *ff_norm_w;
    const float *ff_out_norm_w; /* or NULL */
    const ldqa_mat *gu;       /* 2 matrices */
    int64_t inter;
    int64_t act;
    const ldqa_mat *wd;
    float *k_cache;           /* (n_kv, cap, d): this layer's keys */
    float *v_cache;           /* (n_kv, cap, d) */
    const float *cos;         /* (d,) RoPE at the token's position, this layer's base */
    const float *sin;
    int64_t lo;               /* first cache slot attended */
    const float *attn_bias;   /* (slot + 1,) added to the scores of cache slot j, or NULL (position debiasing) */
} ldqa_layer;

int ldqa_decode_attention_biased(const float *q, const float *k, const float *v, int64_t H, int64_t KV, int64_t L,
                                 int64_t d, int64_t hs, const uint8_t *mask, const float *bias, float scale,
                                 float *out, int threads);

/* x (hidden,) in place: the token's hidden state entering layer 0 -> leaving the last layer. cap: the
 * caches' capacity (slots per KV head), slot < cap: where this token's k, v go, lo <= slot per layer.
 * Returns 0, 1 for a bad K / type / slot, 2 for no memory. */
int ldqa_decode_stack(const ldqa_layer *layers, int64_t n_layers, float *x, int64_t hidden, int64_t n_heads,
                      int64_t n_kv, int64_t d, float eps, int64_t cap, int64_t slot, float scale, int threads) {
    if (slot < 0 || slot >= cap) return 1;
    const int64_t nq = n_heads * d, nkv = n_kv * d;
    float *qkv = malloc((nq + 2 * nkv) * sizeof(float)), *attn = malloc(nq * sizeof(float));
    float *y = malloc(hidden * sizeof(float));
    int rc = 2;
    if (!qkv || !attn || !y) goto done;
    for (int64_t i = 0; i < n_layers; i++) {
        const ldqa_layer *l = layers + i;
        if (l->lo < 0 || l->lo > slot) { rc = 1; goto done; }
        if ((rc = ldqa_decode_attn_in(x, hidden, l->norm_w, eps, l->qkv, l->bias, n_heads, n_kv, d, l->qnorm_w,
                                      l->knorm_w, l->cos, l->sin, qkv, threads)))
            goto done;
        for (int64_t h = 0; h < n_kv; h++) {
            memcpy(l->k_cache + (h * cap + slot) * d, qkv + nq + h * d, d * sizeof(float));
            memcpy(l->v_cache + (h * cap + slot) * d, qkv + nq + nkv + h * d, d * sizeof(float));
        }
        if ((rc = ldqa_decode_attention_biased(qkv, l->k_cache + l->lo * d, l->v_cache + l->lo * d, n_heads, n_kv,
                                               slot + 1 - l->lo, d, cap * d, NULL,
                                               l->attn_bias ? l->attn_bias + l->lo : NULL, scale, attn, threads)))
            goto done;
        if ((rc = ldqa_decode_attn_out(x, attn, hidden, nq, l->wo, l->attn_norm_w, l->ff_norm_w, l->ff_out_norm_w,
                                       eps, l->gu, l->inter, (int)l->act, l->wd, y, threads)))
            goto done;
        memcpy(x, y, hidden * sizeof(float));
    }
    rc = 0;
done:
    free(qkv);
    free(attn);
    free(y);
    return rc;
}

/* the index of the largest of x[0 .. n) (the first one on ties; n >= 1, no NaN: the caller checks the
 * logits are finite): greedy decoding's pick, 8 lanes at a time */
int64_t ldqa_argmax(const float *x, int64_t n) {
    int64_t i = 0, best = 0;
    float m = x[0];
    if (n >= 16) {
        __m256 mv = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        for (; i < n; i++) m = x[i] > m ? x[i] : m;
        const __m256 target = _mm256_set1_ps(m);
        for (i = 0; i + 8 <= n; i += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
            if (hit) return i + __builtin_ctz(hit);
        }
        for (; i < n; i++)
            if (x[i] == m) return i;
        return best;
    }
    for (i = 1; i < n; i++)
        if (x[i] > m) m = x[i], best = i;
    return best;
}
