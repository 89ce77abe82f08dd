/* Weight-only quantized linear layers for CPU: y[m, n] = sum_k x[m, k] * w[n, k] with w = (q - zero) * scale per
 * group of ``group`` inputs, computed as sum_g scale[n, g] * (sum_{k in g} x[m, k] * q[n, k] - zero[n, g] * xs[m, g])
 * in fp32, where xs[m, g] is the group's sum of x.
 *
 * Weights (``fmt``): WQ_I8, int8 [N, K]; WQ_U4_PAIRS, uint8 [N, K / 2], input 2j in the low nibble and 2j + 1 in the
 * high one; WQ_U4_CHUNKS (K a multiple of 128), uint8 [N, K / 2] in chunks of 128 inputs, 64 bytes each, whose
 * 16-bit word t holds inputs t, t + 32, t + 64 and t + 96 in its bits 0-3, 4-7, 8-11 and 12-15, so that one 64-byte
 * load becomes four vectors of 32 consecutive inputs with a shift and a mask each, no shuffle. INT4 values are
 * stored as q + 8. WQ_I8_BLOCKED (K a multiple of 32) and WQ_U4_CHUNKS_BLOCKED (K a multiple of 128): WQ_I8's and
 * WQ_U4_CHUNKS's rows padded with zeros to a multiple of four, each block of four rows stored as pieces interleaved
 * (32 bytes of int8, one 64-byte chunk of INT4: row 0's first piece, row 1's, row 2's, row 3's, then their second
 * pieces, ...), so that a block's rows are read as one linear stream: at one input row INT8 streamed 2.3-2.5x faster
 * than as four row streams 768 bytes apart (the same instructions, bit-identical sums; AMD EPYC Zen 4, one thread).
 * Each thread takes a range of output rows, four at a time. Above one input row each block of four
 * weight rows is widened once and dotted with every input row; at one row (single-sequence decode) the rows are
 * widened in registers and dotted as they are read. */
#include <stdint.h>
#include <string.h>

#define WQ_I8 8
#define WQ_I8_BLOCKED 9
#define WQ_U4_PAIRS 4
#define WQ_U4_CHUNKS 5
#define WQ_U4_CHUNKS_BLOCKED 6
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline void widen_i8(const int8_t *q, float *w, int64_t k) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= k; i += 16)
        _mm512_storeu_ps(w + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i)))));
#endif
    for (; i < k; i++) w[i] = (float)q[i];
}

static inline void widen_u4(const uint8_t *q, float *w, int64_t k) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i lo_mask = _mm512_set1_epi32(0x0f), eight = _mm512_set1_epi32(8);
    const __m512i even = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i odd = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (; i + 32 <= k; i += 32) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + i / 2)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, lo_mask), eight));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
        _mm512_storeu_ps(w + i, _mm512_permutex2var_ps(lo, even, hi));
        _mm512_storeu_ps(w + i + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
#endif
    for (; i + 2 <= k; i += 2) {
        const uint8_t b = q[i / 2];
        w[i] = (float)((int)(b & 15) - 8);
        w[i + 1] = (float)((int)(b >> 4) - 8);
    }
}

/* One row of WQ_U4_CHUNKS to fp32 (k a multiple of 128). */
static inline void widen_u4c(const uint8_t *q, float *w, int64_t k) {
    for (int64_t c = 0; c < k; c += 128) {
        const uint16_t *words = (const uint16_t *)(q + c / 2);
        int64_t t = 0;
#if defined(__AVX512F__)
        for (; t < 32; t += 16) {
            const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(words + t)));
            for (int s = 0; s < 4; s++) {
                const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, 4 * s), _mm512_set1_epi32(15));
                _mm512_storeu_ps(w + c + 32 * s + t, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(8))));
            }
        }
#endif
        for (; t < 32; t++)
            for (int s = 0; s < 4; s++) w[c + 32 * s + t] = (float)((int)((words[t] >> (4 * s)) & 15) - 8);
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#define RB 4 /* weight rows per block: each x load feeds RB multiply-adds */

/* sum_g scale[j, g] * (x . w_j over group g) for RB rows w_j = w + j * k; one horizontal sum per row at the end */
static void block_dots(const float *x, const float *w, const float *scale, int64_t groups, int64_t k,
                       int64_t group, int64_t nrows, float *out) {
#if defined(__AVX512F__)
    if (group % 16 == 0 && nrows == RB) {
        __m512 tot[RB];
        for (int j = 0; j < RB; j++) tot[j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512 d[RB];
            for (int j = 0; j < RB; j++) d[j] = _mm512_setzero_ps();
            const int64_t base = g * group;
            for (int64_t i = base; i < base + group; i += 16) {
                const __m512 xv = _mm512_loadu_ps(x + i);
                for (int j = 0; j < RB; j++) d[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + j * k + i), d[j]);
            }
            for (int j = 0; j < RB; j++) tot[j] = _mm512_fmadd_ps(d[j], _mm512_set1_ps(scale[j * groups + g]), tot[j]);
        }
        for (int j = 0; j < RB; j++) out[j] = _mm512_reduce_add_ps(tot[j]);
        return;
    }
#endif
    for (int64_t j = 0; j < nrows; j++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) acc += scale[j * groups + g] * dot(x + g * group, w + j * k + g * group, group);
        out[j] = acc;
    }
}

/* x: fp32 [M, K] (row stride xstride); xs: fp32 [M, G] group sums of x (only read when zero != NULL);
 * q: the weight in ``fmt`` (see above); scale: fp32 [N, G]; zero: fp32 [N, G] or NULL;
 * y: fp32 [M, N]. K = G * group. */
void tandem_wq_linear(const float *x, int64_t xstride, const float *xs, const void *q, int fmt, const float *scale,
                      const float *zero, float *y, int64_t m, int64_t n, int64_t k, int64_t group) {
    const int64_t groups = k / group;
    const int64_t row_bytes = fmt == WQ_I8 || fmt == WQ_I8_BLOCKED ? k : k / 2;
    const int64_t blocks = (n + RB - 1) / RB;
#pragma omp parallel
    {
        float *w = (float *)__builtin_alloca((size_t)(RB * k) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * RB, nrows = n - r0 < RB ? n - r0 : RB;
            for (int64_t j = 0; j < nrows; j++) {
                const uint8_t *qr = (const uint8_t *)q + (r0 + j) * row_bytes;
                if (fmt == WQ_I8_BLOCKED) /* row j's pieces: 32 bytes every 32 * RB from the block's start + 32 j */
                    for (int64_t i = 0; i < k; i += 32)
                        widen_i8((const int8_t *)q + r0 * k + i * RB + 32 * j, w + j * k + i, 32);
                else if (fmt == WQ_I8)
                    widen_i8((const int8_t *)qr, w + j * k, k);
                else if (fmt == WQ_U4_CHUNKS_BLOCKED) /* row j's chunks: 64 bytes every 64 * RB, + 64 j */
                    for (int64_t i = 0; i < k; i += 128)
                        widen_u4c((const uint8_t *)q + r0 * (k / 2) + (i / 2) * RB + 64 * j, w + j * k + i, 128);
                else if (fmt == WQ_U4_CHUNKS)
                    widen_u4c(qr, w + j * k, k);
                else
                    widen_u4(qr, w + j * k, k);
            }
            const float *sr = scale + r0 * groups;
            for (int64_t i = 0; i < m; i++) {
                float out[RB];
                block_dots(x + i * xstride, w, sr, groups, k, group, nrows, out);
                for (int64_t j = 0; j < nrows; j++) {
                    float acc = out[j];
                    if (zero) {
                        const float *zr = zero + (r0 + j) * groups;
                        for (int64_t g = 0; g < groups; g++) acc -= sr[j * groups + g] * zr[g] * xs[i * groups + g];
                    }
                    y[i * n + r0 + j] = acc;
                }
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* The bf16-activation variant: weights widen exactly to bf16 (integers of at most 8 bits fit bf16's 8-bit
 * significand) and are dotted with the bf16 input by AVX512-BF16's vdpbf16ps, whose products are exact in fp32 and
 * accumulate in fp32: the same sums as the fp32 path on the same (bf16) input, at half the instructions per weight.
 * Groups must be multiples of 32 (one vdpbf16ps); the caller checks. */
static inline __m512bh widen_i8_vec(const int8_t *q) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_cvtne2ps_pbh(b, a); /* lanes 0-15 from a, 16-31 from b */
}

/* INT4 widens without a conversion: bf16 0x4300 | u is exactly 128 + u for a nibble u. The dot then holds
 * sum x * (q + 136); the caller subtracts 136 * (the group's sum of x). WQ_U4_PAIRS: each 32-bit lane (one byte:
 * inputs 2j and 2j + 1) becomes the bf16 pair (128 + lo, 128 + hi). */
static inline __m512bh widen_u4_pairs_vec(const uint8_t *q) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512i pair = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x0f)),
                                         _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xf0)), 12));
    return (__m512bh)_mm512_or_si512(pair, _mm512_set1_epi32(0x43004300));
}

/* WQ_U4_CHUNKS: one 64-byte load, four vectors of 32 consecutive inputs, one or two operations each ((w >> 4s) & 15
 * | 0x4300 in 16-bit lanes: a shift and one ternary-logic instruction). */
#define U4C_PART0(w) ((__m512bh)_mm512_ternarylogic_epi32((w), _mm512_set1_epi16(15), _mm512_set1_epi16(0x4300), 0xea))
#define U4C_PART(w, s) \
    ((__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16((w), 4 * (s)), _mm512_set1_epi16(15), \
                                         _mm512_set1_epi16(0x4300), 0xea))
#define U4C_PART3(w) ((__m512bh)_mm512_or_si512(_mm512_srli_epi16((w), 12), _mm512_set1_epi16(0x4300)))

static inline void widen_row_bf16(int fmt, const uint8_t *q, __m512bh *w, int64_t k) {
    if (fmt == WQ_I8 || fmt == WQ_I8_BLOCKED) { /* a blocked row's pieces are 32 * RB bytes apart */
        const int64_t step = fmt == WQ_I8 ? 1 : RB;
        for (int64_t i = 0; i < k; i += 32) w[i / 32] = widen_i8_vec((const int8_t *)q + i * step);
    } else if (fmt == WQ_U4_PAIRS) {
        for (int64_t i = 0; i < k; i += 32) w[i / 32] = widen_u4_pairs_vec(q + i / 2);
    } else { /* WQ_U4_CHUNKS, blocked or not */
        const int64_t step = fmt == WQ_U4_CHUNKS_BLOCKED ? RB : 1;
        for (int64_t i = 0; i < k; i += 128) {
            const __m512i b = _mm512_loadu_si512((const void *)(q + i / 2 * step));
            w[i / 32] = U4C_PART0(b);
            w[i / 32 + 1] = U4C_PART(b, 1);
            w[i / 32 + 2] = U4C_PART(b, 2);
            w[i / 32 + 3] = U4C_PART3(b);
        }
    }
}

#define U4_BIAS 136.0f /* 128 (the bf16 exponent trick) + 8 (the unsigned offset) */

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Software prefetch distance in bytes for the single-row case: the weights stream once per call (the rows of a
 * block, and the blocks, lie one after another), and fetching 8 KiB ahead of the reads measured ~1.7x faster than
 * the hardware prefetcher alone for INT4 and ~1.5x for INT8 on 16 distinct weights of 4096x768 (one thread, Intel
 * with AVX512-BF16, under load); 2-4 KiB was in between. */
#define PREFETCH 8192

/* One block of RB weight rows (rows[j], scales srow[j]) against one input row x, widened in registers as they are
 * read: the single-sequence case, where nothing would reuse a widened row. Group g's partial dot d is folded into
 * tot with its scale when the group's gvecs vectors are done. */
#define FOLD()                                                                                  \
    do {                                                                                        \
        if (--left == 0) {                                                                      \
            for (int j = 0; j < RB; j++) {                                                      \
                tot[j] = _mm512_fmadd_ps(d[j], _mm512_set1_ps(srow[j][g]), tot[j]);             \
                d[j] = _mm512_setzero_ps();                                                     \
            }                                                                                   \
            g++;                                                                                \
            left = gvecs;                                                                       \
        }                                                                                       \
    } while (0)

static inline void block_m1(int fmt, const uint16_t *x, const uint8_t *const *rows, const float *const *srow,
                            int64_t k, int64_t gvecs, __m512 *tot) {
    __m512 d[RB];
    for (int j = 0; j < RB; j++) d[j] = tot[j] = _mm512_setzero_ps();
    int64_t g = 0, left = gvecs;
    if (fmt == WQ_U4_CHUNKS || fmt == WQ_U4_CHUNKS_BLOCKED) {
        const int64_t step = fmt == WQ_U4_CHUNKS ? 1 : RB; /* input i of row j at rows[j] + i / 2 * step */
        for (int64_t i = 0; i < k; i += 128) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(x + i + 32));
            const __m512bh x2 = (__m512bh)_mm512_loadu_si512((const void *)(x + i + 64));
            const __m512bh x3 = (__m512bh)_mm512_loadu_si512((const void *)(x + i + 96));
            __m512i b[RB];
            for (int j = 0; j < RB; j++) b[j] = _mm512_loadu_si512((const void *)(rows[j] + i / 2 * step));
            for (int j = 0; j < RB; j++) /* blocked: the block's four chunks, one stream */
                _mm_prefetch((const char *)(step == 1 ? rows[j] + i / 2 + PREFETCH : rows[0] + i / 2 * RB + 64 * j + PREFETCH),
                             _MM_HINT_T0);
            if (gvecs % 4 == 0) { /* groups of 128 or more: fold once per chunk at most */
                for (int j = 0; j < RB; j++) {
                    d[j] = _mm512_dpbf16_ps(d[j], x0, U4C_PART0(b[j]));
                    d[j] = _mm512_dpbf16_ps(d[j], x1, U4C_PART(b[j], 1));
                    d[j] = _mm512_dpbf16_ps(d[j], x2, U4C_PART(b[j], 2));
                    d[j] = _mm512_dpbf16_ps(d[j], x3, U4C_PART3(b[j]));
                }
                left -= 3;
                FOLD();
            } else {
                for (int j = 0; j < RB; j++) d[j] = _mm512_dpbf16_ps(d[j], x0, U4C_PART0(b[j]));
                FOLD();
                for (int j = 0; j < RB; j++) d[j] = _mm512_dpbf16_ps(d[j], x1, U4C_PART(b[j], 1));
                FOLD();
                for (int j = 0; j < RB; j++) d[j] = _mm512_dpbf16_ps(d[j], x2, U4C_PART(b[j], 2));
                FOLD();
                for (int j = 0; j < RB; j++) d[j] = _mm512_dpbf16_ps(d[j], x3, U4C_PART3(b[j]));
                FOLD();
            }
        }
    } else if (fmt == WQ_I8 || fmt == WQ_I8_BLOCKED) {
        const int64_t step = fmt == WQ_I8 ? 1 : RB; /* input i of row j at rows[j] + i * step */
        /* INT8 has no exact integer-only route to bf16, so rows widen to fp32 and FMA with x widened to fp32 (one
         * shift: bf16 is fp32's upper half); the products are exact either way (8 by 8 significant bits), and this
         * measured 6-25% faster than widening to bf16 for vdpbf16ps */
        for (int64_t i = 0; i < k; i += 32) {
            const __m512i xw = _mm512_loadu_si512((const void *)(x + i));
            const __m512 xa = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm512_castsi512_si256(xw)), 16));
            const __m512 xb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm512_extracti64x4_epi64(xw, 1)), 16));
            if (step == 1 && i % 64 == 0)
                for (int j = 0; j < RB; j++) _mm_prefetch((const char *)(rows[j] + i + PREFETCH), _MM_HINT_T0);
            else if (step != 1) /* the block's 128 bytes for these 32 inputs are two lines of one stream */
                for (int l = 0; l < 2; l++) _mm_prefetch((const char *)(rows[0] + i * RB + 64 * l + PREFETCH), _MM_HINT_T0);
            for (int j = 0; j < RB; j++) {
                const int8_t *r = (const int8_t *)rows[j] + i * step;
                const __m512 wa = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)r)));
                const __m512 wb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 16))));
                d[j] = _mm512_fmadd_ps(xb, wb, _mm512_fmadd_ps(xa, wa, d[j]));
            }
            FOLD();
        }
    } else {
        for (int64_t i = 0; i < k; i += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i));
            if (i % 128 == 0) /* one cache line of INT4 pairs */
                for (int j = 0; j < RB; j++) _mm_prefetch((const char *)(rows[j] + i / 2 + PREFETCH), _MM_HINT_T0);
            for (int j = 0; j < RB; j++) d[j] = _mm512_dpbf16_ps(d[j], xv, widen_u4_pairs_vec(rows[j] + i / 2));
            FOLD();
        }
    }
}

#define MR 2 /* input rows per pass over a widened block: each weight vector loaded feeds MR * RB dot products */

/* Up to MR input rows (row stride xstride) against one block of RB widened rows w (vecs vectors each). */
static inline void block_rows(const uint16_t *x, int64_t xstride, int64_t mr, const __m512bh *w,
                              const float *const *srow, int64_t groups, int64_t gvecs, int64_t vecs,
                              __m512 tot[MR][RB]) {
    const uint16_t *x1 = mr > 1 ? x + xstride : x; /* a lone last row is computed twice, kept once */
    for (int j = 0; j < RB; j++) tot[0][j] = tot[1][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 d0[RB], d1[RB];
        for (int j = 0; j < RB; j++) d0[j] = d1[j] = _mm512_setzero_ps();
        for (int64_t v = g * gvecs; v < (g + 1) * gvecs; v++) {
            const __m512bh a = (__m512bh)_mm512_loadu_si512((const void *)(x + v * 32));
            const __m512bh b = (__m512bh)_mm512_loadu_si512((const void *)(x1 + v * 32));
            for (int j = 0; j < RB; j++) {
                const __m512bh wv = w[j * vecs + v];
                d0[j] = _mm512_dpbf16_ps(d0[j], a, wv);
                d1[j] = _mm512_dpbf16_ps(d1[j], b, wv);
            }
        }
        for (int j = 0; j < RB; j++) {
            const __m512 sc = _mm512_set1_ps(srow[j][g]);
            tot[0][j] = _mm512_fmadd_ps(d0[j], sc, tot[0][j]);
            tot[1][j] = _mm512_fmadd_ps(d1[j], sc, tot[1][j]);
        }
    }
}

/* As tandem_wq_linear, with x bf16 [M, K] (row stride xstride), K and group multiples of 32 (of 128 for
 * WQ_U4_CHUNKS); the group sums of x are computed here. y is fp32 [M, N], or bf16 (rounded to nearest even) when
 * y_bf16. */
void tandem_wq_linear_bf16(const uint16_t *x, int64_t xstride, const void *q, int fmt, const float *scale,
                           const float *zero, void *y, int y_bf16, int64_t m, int64_t n, int64_t k, int64_t group) {
    const int64_t groups = k / group, vecs = k / 32, gvecs = group / 32;
    const int is_i8 = fmt == WQ_I8 || fmt == WQ_I8_BLOCKED;
    const int64_t row_bytes = is_i8 ? k : k / 2;
    const int64_t blocks = (n + RB - 1) / RB;
    const int biased = zero != NULL || !is_i8;
    float xs_stack[256];
    float *xs = m * groups <= 256 ? xs_stack : (float *)__builtin_alloca((size_t)(m * groups) * sizeof(float));
    if (biased) { /* group sums of x: vdpbf16ps against ones, exact products, fp32 sums */
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
        for (int64_t i = 0; i < m; i++)
            for (int64_t g = 0; g < groups; g++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t v = g * gvecs; v < (g + 1) * gvecs; v++)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(x + i * xstride + v * 32)),
                                           ones);
                xs[i * groups + g] = _mm512_reduce_add_ps(acc);
            }
    }
    const float bias = is_i8 ? 0.0f : U4_BIAS;
#pragma omp parallel if (blocks > 1)
    {
        __m512bh *w = NULL;
        if (m > 1) {
            w = (__m512bh *)__builtin_alloca((size_t)(RB * vecs) * sizeof(__m512bh) + 64);
            w = (__m512bh *)(((uintptr_t)w + 63) & ~(uintptr_t)63);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * RB, nrows = n - r0 < RB ? n - r0 : RB;
            const uint8_t *rows[RB];
            const float *srow[RB];
            for (int64_t j = 0; j < RB; j++) { /* a partial block repeats its first row (blocked: its zero rows) */
                const int64_t r = r0 + (j < nrows ? j : 0);
                rows[j] = fmt == WQ_I8_BLOCKED          ? (const uint8_t *)q + r0 * k + 32 * j
                          : fmt == WQ_U4_CHUNKS_BLOCKED ? (const uint8_t *)q + r0 * (k / 2) + 64 * j
                                                        : (const uint8_t *)q + r * row_bytes;
                srow[j] = scale + r * groups;
            }
            if (m > 1)
                for (int64_t j = 0; j < RB; j++) widen_row_bf16(fmt, rows[j], w + j * vecs, k);
            for (int64_t i = 0; i < m; i += MR) {
                const int64_t mr = m - i < MR ? m - i : MR;
                __m512 tot[MR][RB];
                if (m == 1)
                    block_m1(fmt, x, rows, srow, k, gvecs, tot[0]);
                else
                    block_rows(x + i * xstride, xstride, mr, w, srow, groups, gvecs, vecs, tot);
                for (int64_t ii = 0; ii < mr; ii++)
                    for (int64_t j = 0; j < nrows; j++) {
                        float acc = _mm512_reduce_add_ps(tot[ii][j]);
                        if (biased) {
                            const float *zr = zero ? zero + (r0 + j) * groups : NULL;
                            const float *xsi = xs + (i + ii) * groups;
                            for (int64_t g = 0; g < groups; g++)
                                acc -= srow[j][g] * ((zr ? zr[g] : 0.0f) + bias) * xsi[g];
                        }
                        if (y_bf16)
                            ((uint16_t *)y)[(i + ii) * n + r0 + j] = to_bf16(acc);
                        else
                            ((float *)y)[(i + ii) * n + r0 + j] = acc;
                    }
            }
        }
    }
}

int tandem_wq_has_bf16(void) { return 1; }
#else
int tandem_wq_has_bf16(void) { return 0; }
#endif
