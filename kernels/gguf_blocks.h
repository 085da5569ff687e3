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
 * rounding is 8.5 (issue 30). Measured: on the dev machine the unpacking costs more than the bytes save
 * (docs/results.md, session 26), so this is for exactness and memory, not speed.
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

/* Q4_K: per 64 weights, 32 bytes of nibbles: low nibbles are sub-block 2j, high ones sub-block 2j + 1 */
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

/* Q6_K: two halves of 128 weights per 256; each 32-block has two sub-blocks of 16 with their own scale */
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* With AVX-512 (the dev machine's Zen 4; the build targets -march=native), Q4_K: 32 bytes of a 64-weight
 * chunk go straight to 32 int16 lanes of one zmm (no byte stage), one madd covers a block, and the
 * combined scales and offsets of a super-block are formed 8 at a time. Same integer sums as the AVX2 loop.
 * Measured against it (M = 1, one thread, 640 x 2048, fastest of 64 cold calls): 0.76x the time. (Q6_K
 * with zmm measured the same as its AVX2 loop, and the 32-block types' zmm loops no faster than their
 * 256-bit ones with AVX-512VL lane masks: they keep those.) */
/* acc + (32 int16 values . 32 int16 activations, as 16 exact int32 pair sums) * s */
static inline __m512 fma_block512(__m512i v, const int16_t *x, float s, __m512 acc) {
    const __m512i p = _mm512_madd_epi16(v, _mm512_loadu_si512((const void *)x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(s), acc);
}

/* Q4_K: 32 bytes of nibbles -> 32 int16 lanes once; low nibbles are sub-block 2j, high ones 2j + 1 */
static float row512_q4_k(const uint8_t *w, const int16_t *xq, const float *xd, const int32_t *xs, int64_t nb) {
    __m512 e = _mm512_setzero_ps(), o = _mm512_setzero_ps();
    __m256 offv = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi16(0x0F);
    for (int64_t b0 = 0; b0 < nb; b0 += 8, w += 144) {
        const float d = fp16_at(w), dmin = fp16_at(w + 2);
        uint8_t sc[8], mn[8];
        q4_k_scales(w + 4, sc, mn);
        float c[8];
        const __m256 xd8 = _mm256_loadu_ps(xd + b0);
        _mm256_storeu_ps(c, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d),
                                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)))),
                                          xd8));
        /* offsets: dmin * m_s * xd * xs of the 8 sub-blocks, summed in lanes */
        offv = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dmin),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)))),
                               _mm256_mul_ps(xd8, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xs + b0)))), offv);
        for (int j = 0; j < 4; j++) {
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j)));
            const int64_t b = b0 + 2 * j;
            e = fma_block512(_mm512_and_si512(q, m4), xq + b * 32, c[2 * j], e);
            o = fma_block512(_mm512_srli_epi16(q, 4), xq + (b + 1) * 32, c[2 * j + 1], o);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(e, o)) - hsum256(offv);
}

#endif

typedef float (*gguf_row_fn)(const uint8_t *, const int16_t *, const float *, const int32_t *, int64_t);

/* the row function of a block type (not Q8_0, which q8_0.c reads in its split layout); NULL if unknown */
static inline gguf_row_fn gguf_row(int64_t type) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (type == T_Q4_K) return row512_q4_k;
#endif
    switch (type) {
    case T_Q4_0: return row_q4_0;
    case T_Q4_1: return row_q4_1;
    case T_Q5_0: return row_q5_0;
    case T_Q5_1: return row_q5_1;
    case T_Q4_K: return row_q4_k;
    case T_Q6_K: return row_q6_k;
    default: return NULL;
    }
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
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        y[l] = d * sc[is] * (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                        y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                        y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                        y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
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
