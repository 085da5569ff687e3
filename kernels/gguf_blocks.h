/* GGUF's (ggml's) quantized blocks as shipped, read by ldqa's CPU kernel (q8_0.c): one row of a weight
 * stored in one of these block types against one row of activations rounded to int16 per block of 32
 * (xq, with scale xd and integer sum xs per block: `quantize_x` in q8_0.c).
 *
 * Block layouts (ggml's ggml-common.h; fp16 scales; w = the weight a block holds):
 *   Q4_0  18 bytes / 32:  d, qs[16]                    w = d * (q - 8),   q = 4 bits
 *   Q4_1  20 bytes / 32:  d, m, qs[16]                 w = d * q + m
 *   Q5_0  22 bytes / 32:  d, qh[4], qs[16]             w = d * (q - 16),  q = 4 bits | 1 high bit
 *   Q5_1  24 bytes / 32:  d, m, qh[4], qs[16]          w = d * q + m
 *   Q4_K 144 bytes / 256: d, dmin, scales[12], qs[128] w = d * sc_s * q - dmin * m_s, 8 sub-blocks s of 32
 *                                                      with 6-bit sc_s, m_s
 *   Q6_K 210 bytes / 256: ql[128], qh[64], scales[16] (int8), d
 *                                                      w = d * sc_s * (q - 32), q = 4 | 2 bits, 16 sub-blocks of 16
 * In the 32-blocks of Q4_0/Q4_1/Q5_0/Q5_1, byte j's low nibble is value j and its high nibble value j + 16;
 * bit j of qh is value j's fifth bit.
 *
 * Per block of 32 (Q4_0/Q4_1/Q5_0/Q5_1): the 16 bytes of nibbles are widened to int16 once and split by
 * mask and shift into values 0-15 and 16-31 (the layout of the activations), the fifth bits added as 16
 * (AVX-512VL: one lane mask per half, the 32-bit qh as stored; AVX2: through bytes), two _mm256_madd_epi16
 * with the int16 activations (exact integer sums, as for Q8_0); Q4_0/Q5_0's -8/-16 is taken off exactly as
 * 8 * xs / 16 * xs in the integer lanes; converted to fp32 once and scaled by the block's scale times xd.
 * Q4_1/Q5_1 (+ m) and Q4_K (- dmin * m_s) add offset * xd * xs. Q6_K keeps a scale per 16 (two madds).
 * Why: decode reads every weight once per token, and a Q5_0 row is 5.5 bits per weight where its Q8_0
 * rounding is 8.5. Measured for the 32-block types: the unpacking costs more than the bytes save
 * (docs/kernels.md), so they are for exactness and memory, not speed; the K types' int8 loops below are
 * for speed.
 * Torch reference: cpu_linear.linear_gguf_reference (the `gguf` package's dequantization, the same
 * activation rounding); tests/test_gguf_blocks.py compares them for every type.
 */
#ifndef LDQA_GGUF_BLOCKS_H
#define LDQA_GGUF_BLOCKS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* ggml type ids */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

/* bytes of one row of K weights in ggml type `type` (Q8_0: the int8 values only, our split layout);
 * 0 for a type this file does not read or a K that is not a multiple of the type's block */
static inline int64_t gguf_row_bytes(int64_t type, int64_t K) {
    switch (type) {
    case T_Q4_0: return K % 32 ? 0 : K / 32 * 18;
    case T_Q4_1: return K % 32 ? 0 : K / 32 * 20;
    case T_Q5_0: return K % 32 ? 0 : K / 32 * 22;
    case T_Q5_1: return K % 32 ? 0 : K / 32 * 24;
    case T_Q8_0: return K % 32 ? 0 : K;
    case T_Q4_K: return K % 256 ? 0 : K / 256 * 144;
    case T_Q6_K: return K % 256 ? 0 : K / 256 * 210;
    default: return 0;
    }
}

static inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the 32-bit word at p -> 32 bytes, byte j = 0x10 where bit j is set, else 0 (a fifth bit, in place) */
static inline __m256i fifth_bits32(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    /* byte j gets byte j / 8 of the word; OR with a mask that is 1 everywhere but bit j % 8: all ones iff set */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)w),
                                               _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                                                  0x0202020202020202, 0x0303030303030303));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* 8 int32 lane sums of 32 unsigned byte weights times 32 int16 activations: exact */
static inline __m256i dot32_u8(__m256i w, const int16_t *x) {
    const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
    const __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* acc + lanes * s */
static inline __m256 fma_lanes(__m256i lanes, float s, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(s), acc);
}

/* 16 bytes of nibbles straight to int16 lanes: *lo = the low nibbles (values 0-15), *hi = the high ones
 * (values 16-31); both in [0, 15] */
static inline void nibbles16(const uint8_t *qs, __m256i *lo, __m256i *hi) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    *lo = _mm256_and_si256(u, _mm256_set1_epi16(0x0F));
    *hi = _mm256_srli_epi16(u, 4);
}

/* 8 int32 lanes summing to sum_j v_j x_j - sub (sub in lane 0): exact; the values lo (0-15), hi (16-31) */
static inline __m256i dot32_16(__m256i lo, __m256i hi, const int16_t *x, int32_t sub) {
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                       _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
    return _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(sub)));
}

/* The 32-block formats: the block's integer dot product with x as 8 int32 lanes (the formats' own offsets
 * -8 / -16 applied exactly, as - 8 * xs / - 16 * xs) and *scale, and for Q4_1/Q5_1 *offset = m (w = scale *
 * v + m, v unsigned) */
static inline __m256i lanes_q4_0(const uint8_t *blk, const int16_t *x, int32_t xs, float *scale) {
    __m256i lo, hi;
    nibbles16(blk + 2, &lo, &hi);
    *scale = fp16_at(blk);
    return dot32_16(lo, hi, x, 8 * xs);
}
static inline __m256i lanes_q4_1(const uint8_t *blk, const int16_t *x, float *scale, float *offset) {
    __m256i lo, hi;
    nibbles16(blk + 4, &lo, &hi);
    *scale = fp16_at(blk), *offset = fp16_at(blk + 2);
    return dot32_16(lo, hi, x, 0);
}
/* Q5: the fifth bits (bit j of the 32-bit qh = value j's) added as 16: with AVX-512VL, a lane mask per half;
 * without, through bytes (fifth_bits32, as ggml's bytes_from_bits_32) */
static inline void add_fifth_bits(const uint8_t *qh, __m256i *lo, __m256i *hi) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
#if defined(__AVX512VL__) && defined(__AVX512BW__)
    *lo = _mm256_mask_add_epi16(*lo, (__mmask16)bits, *lo, _mm256_set1_epi16(16));
    *hi = _mm256_mask_add_epi16(*hi, (__mmask16)(bits >> 16), *hi, _mm256_set1_epi16(16));
#else
    const __m256i f = fifth_bits32(qh); /* 32 bytes: 0x10 or 0 */
    *lo = _mm256_or_si256(*lo, _mm256_cvtepu8_epi16(_mm256_castsi256_si128(f)));
    *hi = _mm256_or_si256(*hi, _mm256_cvtepu8_epi16(_mm256_extracti128_si256(f, 1)));
#endif
}
static inline __m256i lanes_q5_0(const uint8_t *blk, const int16_t *x, int32_t xs, float *scale) {
    __m256i lo, hi;
    nibbles16(blk + 6, &lo, &hi);
    add_fifth_bits(blk + 2, &lo, &hi);
    *scale = fp16_at(blk);
    return dot32_16(lo, hi, x, 16 * xs);
}
static inline __m256i lanes_q5_1(const uint8_t *blk, const int16_t *x, float *scale, float *offset) {
    __m256i lo, hi;
    nibbles16(blk + 8, &lo, &hi);
    add_fifth_bits(blk + 4, &lo, &hi);
    *scale = fp16_at(blk), *offset = fp16_at(blk + 2);
    return dot32_16(lo, hi, x, 0);
}

/* one row of a 32-block format against one activation row: two accumulators (even / odd blocks) */
#define ROW_32(NAME, BYTES, LANES)                                                                        \
    static float NAME(const uint8_t *w, const int16_t *xq, const float *xd, const int32_t *xs, int64_t nb) { \
        __m256 e = _mm256_setzero_ps(), o = _mm256_setzero_ps();                                           \
        float s;                                                                                           \
        int64_t b = 0;                                                                                     \
        for (; b + 2 <= nb; b += 2) {                                                                      \
            __m256i p = LANES(w + b * BYTES, xq + b * 32, xs[b], &s);                                      \
            e = fma_lanes(p, s * xd[b], e);                                                                \
            p = LANES(w + (b + 1) * BYTES, xq + (b + 1) * 32, xs[b + 1], &s);                              \
            o = fma_lanes(p, s * xd[b + 1], o);                                                            \
        }                                                                                                  \
        if (b < nb) {                                                                                      \
            const __m256i p = LANES(w + b * BYTES, xq + b * 32, xs[b], &s);                                \
            e = fma_lanes(p, s * xd[b], e);                                                                \
        }                                                                                                  \
        return hsum256(_mm256_add_ps(e, o));                                                               \
    }
/* the same with a float offset per block: offset * xd * xs, two chains (even / odd) */
#define ROW_32_OFF(NAME, BYTES, LANES)                                                                    \
    static float NAME(const uint8_t *w, const int16_t *xq, const float *xd, const int32_t *xs, int64_t nb) { \
        __m256 e = _mm256_setzero_ps(), o = _mm256_setzero_ps();                                           \
        float s, m, off_e = 0.0f, off_o = 0.0f;                                                            \
        int64_t b = 0;                                                                                     \
        for (; b + 2 <= nb; b += 2) {                                                                      \
            __m256i p = LANES(w + b * BYTES, xq + b * 32, &s, &m);                                         \
            e = fma_lanes(p, s * xd[b], e);                                                                \
            off_e += m * xd[b] * (float)xs[b];                                                             \
            p = LANES(w + (b + 1) * BYTES, xq + (b + 1) * 32, &s, &m);                                     \
            o = fma_lanes(p, s * xd[b + 1], o);                                                            \
            off_o += m * xd[b + 1] * (float)xs[b + 1];                                                     \
        }                                                                                                  \
        if (b < nb) {                                                                                      \
            const __m256i p = LANES(w + b * BYTES, xq + b * 32, &s, &m);                                   \
            e = fma_lanes(p, s * xd[b], e);                                                                \
            off_e += m * xd[b] * (float)xs[b];                                                             \
        }                                                                                                  \
        return hsum256(_mm256_add_ps(e, o)) + (off_e + off_o);                                             \
    }
ROW_32(row_q4_0, 18, lanes_q4_0)
ROW_32_OFF(row_q4_1, 20, lanes_q4_1)
ROW_32(row_q5_0, 22, lanes_q5_0)
ROW_32_OFF(row_q5_1, 24, lanes_q5_1)

/* Q4_K's 8 (scale, min) pairs of 6 bits from its 12 scale bytes (ggml's get_scale_min_k4) */
static inline void q4_k_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
}

/* Q4_K against int16 activations per 32 (the K types' precise path, `rowk_*` below: super-blocks whose
 * activations hold an outlier): per 64 weights, 32 bytes of nibbles: low nibbles are sub-block 2j, high
 * ones sub-block 2j + 1 */
static float row_q4_k(const uint8_t *w, const int16_t *xq, const float *xd, const int32_t *xs, int64_t nb) {
    __m256 e = _mm256_setzero_ps(), o = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    float off = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += 8, w += 144) {
        const float d = fp16_at(w), dmin = fp16_at(w + 2);
        uint8_t sc[8], mn[8];
        q4_k_scales(w + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const int64_t b = b0 + 2 * j;
            e = fma_lanes(dot32_u8(_mm256_and_si256(q, m4), xq + b * 32), d * sc[2 * j] * xd[b], e);
            o = fma_lanes(dot32_u8(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), xq + (b + 1) * 32),
                          d * sc[2 * j + 1] * xd[b + 1], o);
            off -= dmin * (mn[2 * j] * xd[b] * (float)xs[b] + mn[2 * j + 1] * xd[b + 1] * (float)xs[b + 1]);
        }
    }
    return hsum256(_mm256_add_ps(e, o)) + off;
}

/* Q6_K block k (0-3) of a half (128 weights): low (k < 2) or high nibbles of ql[(k & 1) * 32 ..], and bits
 * 2k, 2k + 1 of qh[0 .. 32] as bits 4-5, minus 32: 32 signed bytes */
static inline __m256i q6_k_values(__m256i ql_lo, __m256i ql_hi, __m256i qh, int k) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    const __m256i src = (k & 1) ? ql_hi : ql_lo;
    const __m256i nib = k < 2 ? _mm256_and_si256(src, m4) : _mm256_and_si256(_mm256_srli_epi16(src, 4), m4);
    const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), m3);
    return _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
}

/* Q6_K against int16 activations per 32 (the precise path): two halves of 128 weights per 256; each
 * 32-block has two sub-blocks of 16 with their own scale */
static float row_q6_k(const uint8_t *w, const int16_t *xq, const float *xd, const int32_t *xs, int64_t nb) {
    (void)xs;
    __m256 e = _mm256_setzero_ps(), o = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8, w += 210) {
        const float d = fp16_at(w + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(w + 192 + 8 * h);
            const __m256i lo = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)qh);
            for (int k = 0; k < 4; k++) {
                const int64_t b = b0 + 4 * h + k;
                const __m256i v = q6_k_values(lo, hi, bits, k);
                const int16_t *x = xq + b * 32;
                const __m256i p0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                                     _mm256_loadu_si256((const __m256i *)x));
                const __m256i p1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                                     _mm256_loadu_si256((const __m256i *)(x + 16)));
                e = fma_lanes(p0, d * sc[2 * k] * xd[b], e);
                o = fma_lanes(p1, d * sc[2 * k + 1] * xd[b], o);
            }
        }
    }
    return hsum256(_mm256_add_ps(e, o));
}

/* The K types read activations rounded to int8 with one scale per 256 (`quantize_xk` in q8_0.c, as ggml's
 * Q8_K): a byte of weight times a byte of activation (maddubs, unsigned weight x signed activation, pairs
 * summed to int16), the sub-block scales applied in integers (madd with int16 scales), and one conversion
 * to fp32 per 256 weights. bs: the int32 sum of each 16 activations (for Q4_K's mins and Q6_K's -32).
 * Why: with int16 activations per 32, every 32 weights needed their own conversion and FMA (about twice the
 * vector operations; Qwen2.5 1.5B's decode is mostly Q4_K and Q6_K bytes).
 * This is for decode (one row of activations: `mats_linear` with M = 1); calls of several rows (a short
 * prefill, a block-mode question segment) keep int16 per 32 throughout, so prompts are computed as before.
 * Except where an activation block holds an outlier (its largest |x| over OUTLIER_RATIO times its RMS, the
 * `precise` flag of the block): int8 steps of amax / 127 would blur its other values (Gemma 3's
 * activations hold such outliers; its next-token distribution moved 30x further from fp32's, KL 2.7e-3
 * against 8e-5 per decode step; 1.2e-3 with this ratio), so those super-blocks take the int16-per-32 loop
 * above. With OUTLIER_RATIO 12, ~6% of Qwen2.5's decode blocks take it (its KL ~1e-5 either way). Same result for any thread count. */

/* one activation row as the K types read it: the int8 form per 256 (x8, xd8, bs) and, for the super-blocks
 * flagged `precise`, the int16 form per 32 (xq, xd, xs: `quantize_x`) */
typedef struct {
    const int8_t *x8;
    const float *xd8;
    const int32_t *bs;
    const uint8_t *precise;
    const int16_t *xq;
    const float *xd;
    const int32_t *xs;
    const int8_t *x8q; /* x8 with the 32-blocks of each 256 in Q4_K's load order 0 2 1 3 4 6 5 7 */
    const int32_t *b32; /* the sum of each 32 of x8 */
} kx_t;

/* Q4_K's 6-bit scales and mins of a super-block as 8 bytes each (ggml's get_scale_min_k4, 4 bytes at a
 * time): a = bytes 0-3, b = 4-7, c = 8-11 of `scales[12]` */
static inline void q4_k_scales8(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint32_t s_hi = (c & 0x0f0f0f0f) | (((a >> 6) & 0x03030303) << 4);
    const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0f) | (((b >> 6) & 0x03030303) << 4);
    *sc = (uint64_t)(a & 0x3f3f3f3f) | ((uint64_t)s_hi << 32);
    *mn = (uint64_t)(b & 0x3f3f3f3f) | ((uint64_t)m_hi << 32);
}

/* int16 lane j of each 128-bit half of v (8 int16 values, the same in both halves) in every lane of the
 * low half, lane k in every lane of the high half */
static inline __m256i pick16(__m256i v, int j, int k) {
    const __m256i idx = _mm256_setr_m128i(_mm_set1_epi16((short)(2 * j | (2 * j + 1) << 8)),
                                          _mm_set1_epi16((short)(2 * k | (2 * k + 1) << 8)));
    return _mm256_shuffle_epi8(v, idx);
}

/* Q4_K's 8 mins (bytes of mn) times the super-block's 8 activation sums per 32 (b32): 8 int32 lanes */
static inline __m256i q4_k_mins(uint64_t mn, const int32_t *b32) {
    return _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)),
                              _mm256_loadu_si256((const __m256i *)b32));
}

/* Q6_K's 16 int8 scales (sc8) times the super-block's 16 activation sums per 16 (bs), pairwise added into 8
 * int32 lanes (their total is what the -32 of every weight takes off, over 32) */
static inline __m256i q6_k_offsets(__m128i sc8, const int32_t *bs) {
    return _mm256_add_epi32(
        _mm256_mullo_epi32(_mm256_cvtepi8_epi32(sc8), _mm256_loadu_si256((const __m256i *)bs)),
        _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)), _mm256_loadu_si256((const __m256i *)(bs + 8))));
}

/* Q4_K: per 64 weights, 32 bytes of nibbles: low nibbles are sub-block 2j, high ones sub-block 2j + 1;
 * w = d * sc * q - dmin * m per sub-block, so y = xd * (d * sum sc_j (q . x8)_j - dmin * sum m_j bs_j) */
__attribute__((unused)) static float rowk_q4_k(const uint8_t *w, const kx_t *a, int64_t nsb) {
    __m256 acc = _mm256_setzero_ps(), offv = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int8_t *x8 = a->x8;
    const float *xd = a->xd8;
    const int32_t *b32 = a->b32;
    float precise = 0.0f;
    for (int64_t s = 0; s < nsb; s++, w += 144, x8 += 256, b32 += 8) {
        if (a->precise[s]) {
            precise += row_q4_k(w, a->xq + 256 * s, a->xd + 8 * s, a->xs + 8 * s, 8);
            continue;
        }
        const float d = fp16_at(w) * xd[s], dmin = fp16_at(w + 2) * xd[s];
        uint64_t sc, mn;
        q4_k_scales8(w + 4, &sc, &mn);
        const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x8 + 64 * j)));
            const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x8 + 64 * j + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p0, pick16(s16, 2 * j, 2 * j)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p1, pick16(s16, 2 * j + 1, 2 * j + 1)));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d), acc);
        offv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_k_mins(mn, b32)), _mm256_set1_ps(dmin), offv);
    }
    return hsum256(acc) - hsum256(offv) + precise;
}

/* Q6_K: two halves of 128 weights per 256; value block k (0-3) of a half: low (k < 2) or high nibbles of
 * ql[(k & 1) * 32 ..] with bits 2k, 2k + 1 of qh as bits 4-5 (q in 0-63, w = d * sc * (q - 32)); 16
 * sub-blocks of 16 with int8 scales: y = xd * d * (sum sc_s (q . x8)_s - 32 sum sc_s bs_s) */
__attribute__((unused)) static float rowk_q6_k(const uint8_t *w, const kx_t *a, int64_t nsb) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    const int8_t *x8 = a->x8;
    const float *xd = a->xd8;
    const int32_t *bs = a->bs;
    float precise = 0.0f;
    for (int64_t s = 0; s < nsb; s++, w += 210, x8 += 256, bs += 16) {
        if (a->precise[s]) {
            precise += row_q6_k(w, a->xq + 256 * s, a->xd + 8 * s, a->xs + 8 * s, 8);
            continue;
        }
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192)); /* 16 int8 scales */
        const __m256i off = q6_k_offsets(sc8, bs);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * h))));
            const __m256i lo = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)qh);
            for (int k = 0; k < 4; k++) {
                const __m256i src = (k & 1) ? hi : lo;
                const __m256i nib = k < 2 ? _mm256_and_si256(src, m4) : _mm256_and_si256(_mm256_srli_epi16(src, 4), m4);
                const __m256i top = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * k)), m3);
                const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x8 + 128 * h + 32 * k)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, pick16(s16, 2 * k, 2 * k + 1)));
            }
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(off, 5));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(fp16_at(w + 208) * xd[s]), acc);
    }
    return hsum256(acc) + precise;
}

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* The same two K-type rows with 512-bit vectors (AVX-512BW + VNNI): 64 weights per instruction, the sub-block
 * scales applied by vpdpwssd (int16 pairs times int16 scales added into int32 lanes), so a super-block of
 * 256 weights is ~35 vector instructions against ~75 above. The integer sums per super-block are the
 * same; they are converted to fp32 over 16 lanes instead of 8 (fp32 rounding order only). Used where the
 * compiler targets these extensions (gguf_rowk); on a CPU whose 512-bit units run a zmm op as two halves
 * it decodes no more instructions than the 256-bit loop, and on one with full-width units it halves the
 * decode-time matrix work (docs/kernels.md). */

/* The weight bytes PF_K_AHEAD ahead of a super-block are asked into L1 as it is read (rows are contiguous,
 * so past a row's end this is the thread's next row). Measured on a Zen 5 machine (one row of Qwen2.5
 * 1.5B's gate_proj, Q4_K, cold): 1 KB ahead 1.04x the time of none, 4 KB 0.94x, 8 KB 0.92x, 16 KB 0.97x. */
#ifndef PF_K_AHEAD
#define PF_K_AHEAD 8192
#endif
static inline void prefetch_ahead(const uint8_t *w, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(w + PF_K_AHEAD + o), _MM_HINT_T0);
}

/* 32 int16 lane indices: lanes 0-15 pick a, lanes 16-31 pick b (for _mm512_permutexvar_epi16) */
static inline __m512i halves16(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

/* 32 int16 lane indices: lane i picks base + i / 8 (Q6_K: one scale per 16 weights = 8 int16 lanes) */
static inline __m512i eighths16(int base) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_setr_epi16(base, base, base, base, base, base, base, base, base + 1, base + 1,
                                                 base + 1, base + 1, base + 1, base + 1, base + 1, base + 1)),
        _mm256_setr_epi16(base + 2, base + 2, base + 2, base + 2, base + 2, base + 2, base + 2, base + 2, base + 3,
                          base + 3, base + 3, base + 3, base + 3, base + 3, base + 3, base + 3),
        1);
}

/* Q4_K: 128 bytes of nibbles per super-block = two zmm; in each, the low nibbles of bytes 0-31 / 32-63 are
 * sub-blocks 4p / 4p + 2 and the high ones 4p + 1 / 4p + 3 (p = 0, 1): the activations in that order are
 * a->x8q, four contiguous zmm per super-block */
static float rowk512_q4_k(const uint8_t *w, const kx_t *a, int64_t nsb) {
    __m512 acc = _mm512_setzero_ps();
    __m256 offv = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i i02 = halves16(0, 2), i13 = halves16(1, 3), i46 = halves16(4, 6), i57 = halves16(5, 7);
    const int8_t *xq4 = a->x8q;
    const float *xd = a->xd8;
    const int32_t *b32 = a->b32;
    float precise = 0.0f;
    for (int64_t s = 0; s < nsb; s++, w += 144, xq4 += 256, b32 += 8) {
        if (a->precise[s]) {
            precise += row_q4_k(w, a->xq + 256 * s, a->xd + 8 * s, a->xs + 8 * s, 8);
            continue;
        }
        prefetch_ahead(w, 144);
        const float d = fp16_at(w) * xd[s], dmin = fp16_at(w + 2) * xd[s];
        uint64_t sc, mn;
        q4_k_scales8(w + 4, &sc, &mn);
        const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        const __m512i q0 = _mm512_loadu_si512((const void *)(w + 16)), q1 = _mm512_loadu_si512((const void *)(w + 80));
        const __m512i *x = (const __m512i *)xq4;
        __m512i sumi = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                           _mm512_maddubs_epi16(_mm512_and_si512(q0, m4), _mm512_loadu_si512(x)),
                                           _mm512_permutexvar_epi16(i02, s16));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(q0, 4), m4),
                                                              _mm512_loadu_si512(x + 1)),
                                   _mm512_permutexvar_epi16(i13, s16));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(_mm512_and_si512(q1, m4), _mm512_loadu_si512(x + 2)),
                                   _mm512_permutexvar_epi16(i46, s16));
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(q1, 4), m4),
                                                              _mm512_loadu_si512(x + 3)),
                                   _mm512_permutexvar_epi16(i57, s16));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d), acc);
        offv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_k_mins(mn, b32)), _mm256_set1_ps(dmin), offv);
    }
    return _mm512_reduce_add_ps(acc) - hsum256(offv) + precise;
}

/* Q6_K: per half of 128 weights, the 64 bytes of ql as one zmm: low nibbles are values 0-63, high ones
 * 64-127, in order; value 32k + i takes bits 2k, 2k + 1 of qh[i] as bits 4-5 (qh broadcast to both 256-bit
 * halves and shifted per half: k = 0, 1 by 4, 2 to the left, k = 2, 3 by 0, 2 to the right, then & 0x30) */
static float rowk512_q6_k(const uint8_t *w, const kx_t *a, int64_t nsb) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i e0 = eighths16(0), e4 = eighths16(4), e8 = eighths16(8), e12 = eighths16(12);
    const int8_t *x8 = a->x8;
    const float *xd = a->xd8;
    const int32_t *bs = a->bs;
    float precise = 0.0f;
    for (int64_t s = 0; s < nsb; s++, w += 210, x8 += 256, bs += 16) {
        if (a->precise[s]) {
            precise += row_q6_k(w, a->xq + 256 * s, a->xd + 8 * s, a->xs + 8 * s, 8);
            continue;
        }
        prefetch_ahead(w, 210);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192)); /* 16 int8 scales */
        const __m256i off = q6_k_offsets(sc8, bs);
        const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
        __m512i sumi = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5)));
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(w + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
            const __m512i v01 = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                                _mm512_and_si512(_mm512_sllv_epi16(qh, shl01), m30));
            const __m512i v23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                                _mm512_and_si512(_mm512_srlv_epi16(qh, shr23), m30));
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(v01, _mm512_loadu_si512((const void *)(x8 + 128 * h))),
                                       _mm512_permutexvar_epi16(h ? e8 : e0, s16));
            sumi = _mm512_dpwssd_epi32(sumi,
                                       _mm512_maddubs_epi16(v23, _mm512_loadu_si512((const void *)(x8 + 128 * h + 64))),
                                       _mm512_permutexvar_epi16(h ? e12 : e4, s16));
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(fp16_at(w + 208) * xd[s]), acc);
    }
    return _mm512_reduce_add_ps(acc) + precise;
}
#define GGUF_ROWK_Q4_K rowk512_q4_k
#define GGUF_ROWK_Q6_K rowk512_q6_k
#else
#define GGUF_ROWK_Q4_K rowk_q4_k
#define GGUF_ROWK_Q6_K rowk_q6_k
#endif

typedef float (*gguf_row_fn)(const uint8_t *, const int16_t *, const float *, const int32_t *, int64_t);
typedef float (*gguf_rowk_fn)(const uint8_t *, const kx_t *, int64_t);
/* n consecutive rows (row_bytes apart) of a K-type matrix against one activation row: y[r], r < n */
typedef void (*gguf_rowsk_fn)(const uint8_t *, int64_t, int64_t, const kx_t *, int64_t, float *);

/* A thread's rows of one matrix in one call: no per-row dispatch (matrix lookup, activation struct, call
 * through a pointer) inside the parallel loop. Measured at one thread on a Zen 5 machine (Qwen2.5 1.5B's
 * 28 gate_proj matrices, Q4_K, from memory, `mats_linear`): one dispatch per row 28.6-29.4 GB/s, one
 * call per run of rows 32.9-33.4 GB/s (forcing the row function inline into the loop: no further gain). */
#define GGUF_ROWS_K(name, row)                                                                                   \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t n, const kx_t *a, int64_t nsb, float *y) {   \
        for (int64_t r = 0; r < n; r++) y[r] = row(w + r * row_bytes, a, nsb);                                   \
    }
GGUF_ROWS_K(rows_q4_k, GGUF_ROWK_Q4_K)
GGUF_ROWS_K(rows_q6_k, GGUF_ROWK_Q6_K)

/* the row function of a 32-block type (not Q8_0, which q8_0.c reads in its split layout); NULL otherwise */
static inline gguf_row_fn gguf_row(int64_t type) {
    switch (type) {
    case T_Q4_0: return row_q4_0;
    case T_Q4_1: return row_q4_1;
    case T_Q5_0: return row_q5_0;
    case T_Q5_1: return row_q5_1;
    default: return NULL;
    }
}

/* the row function of a K type (int8 activations per 256); NULL otherwise */
static inline gguf_rowk_fn gguf_rowk(int64_t type) {
    return type == T_Q4_K ? GGUF_ROWK_Q4_K : type == T_Q6_K ? GGUF_ROWK_Q6_K : NULL;
}

/* the row loop of a K type (`GGUF_ROWS_K`); NULL otherwise */
static inline gguf_rowsk_fn gguf_rowsk(int64_t type) {
    return type == T_Q4_K ? rows_q4_k : type == T_Q6_K ? rows_q6_k : NULL;
}

/* Dequantize one row (K weights) of type `type` into out (K,) fp32: the same values the `gguf` package's
 * numpy dequantization gives (its products are formed in the same order: d * sc first for the K types). */
static void gguf_dequantize_row(int64_t type, const uint8_t *w, int64_t K, float *out) {
    if (type == T_Q4_K || type == T_Q6_K) {
        for (int64_t i = 0; i < K; i += 256) {
            if (type == T_Q4_K) {
                const uint8_t *blk = w + i / 256 * 144;
                const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
                uint8_t sc[8], mn[8];
                q4_k_scales(blk + 4, sc, mn);
                for (int j = 0; j < 4; j++) {
                    const uint8_t *q = blk + 16 + 32 * j;
                    const float d1 = d * sc[2 * j], m1 = dmin * mn[2 * j];
                    const float d2 = d * sc[2 * j + 1], m2 = dmin * mn[2 * j + 1];
                    for (int l = 0; l < 32; l++) {
                        out[i + 64 * j + l] = d1 * (q[l] & 0xF) - m1;
                        out[i + 64 * j + 32 + l] = d2 * (q[l] >> 4) - m2;
                    }
                }
            } else {
                const uint8_t *blk = w + i / 256 * 210;
                const float d = fp16_at(blk + 208);
                for (int h = 0; h < 2; h++) {
                    const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                    const int8_t *sc = (const int8_t *)(blk + 192 + 8 * h);
                    float *y = out + i + 128 * h;
                    for (int g = 0; g < 2; g++) { /* 16 weights per scale: (d * sc) first, then times (q - 32) */
                        const float s0 = d * sc[g], s1 = d * sc[g + 2], s2 = d * sc[g + 4], s3 = d * sc[g + 6];
                        for (int l = 16 * g; l < 16 * g + 16; l++) {
                            y[l] = s0 * (float)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                            y[l + 32] = s1 * (float)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                            y[l + 64] = s2 * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                            y[l + 96] = s3 * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                        }
                    }
                }
            }
        }
        return;
    }
    const int64_t bytes = gguf_row_bytes(type, 32);
    const int sign = type == T_Q4_0 || type == T_Q5_0;
    for (int64_t i = 0; i < K; i += 32) {
        const uint8_t *blk = w + i / 32 * bytes;
        const int five = type == T_Q5_0 || type == T_Q5_1;
        const int qs_at = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
        __m256i half[2];
        nibbles16(blk + qs_at, &half[0], &half[1]);
        if (five) add_fifth_bits(blk + (type == T_Q5_0 ? 2 : 4), &half[0], &half[1]);
        const float d = fp16_at(blk), m = sign ? 0.0f : fp16_at(blk + 2);
        const __m256i off = _mm256_set1_epi16(type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0);
        for (int h = 0; h < 2; h++) { /* as numpy: d * (q - off) for the signed types, d * q + m for the others */
            const __m256i v = _mm256_sub_epi16(half[h], off);
            for (int j = 0; j < 2; j++) {
                const __m128i v8 = j ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(v8)), _mm256_set1_ps(d));
                if (!sign) f = _mm256_add_ps(f, _mm256_set1_ps(m));
                _mm256_storeu_ps(out + i + 16 * h + 8 * j, f);
            }
        }
    }
}

#endif
