/* Weight-only quantized linear layers for CPU: y[m, n] = sum_k x[m, k] * w[n, k] with w = (q - zero) * scale per
 * group of ``group`` inputs, computed as sum_g scale[n, g] * (sum_{k in g} x[m, k] * q[n, k] - zero[n, g] * xs[m, g])
 * in fp32, where xs[m, g] is the group's sum of x (computed once per call by the caller's loop below).
 *
 * Weights: INT8 as int8 [N, K]; INT4 as uint8 [N, K / 2], input 2j in the low nibble and 2j + 1 in the high one,
 * each stored as q + 8. Each thread takes a range of output rows, widens one weight row to fp32 once, and dots it
 * with every input row: at decode batch sizes the weights' bytes, read once, are the cost, so INT8 reads half of
 * bf16's and INT4 a quarter. Activations arrive as fp32 (the caller widens bf16). */
#include <stdint.h>
#include <string.h>
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
 * q: int8 [N, K] (bits 8) or uint8 [N, K / 2] (bits 4); scale: fp32 [N, G]; zero: fp32 [N, G] or NULL;
 * y: fp32 [M, N]. K = G * group. */
void tandem_wq_linear(const float *x, int64_t xstride, const float *xs, const void *q, int bits, const float *scale,
                      const float *zero, float *y, int64_t m, int64_t n, int64_t k, int64_t group) {
    const int64_t groups = k / group;
    const int64_t row_bytes = bits == 8 ? k : k / 2;
    const int64_t blocks = (n + RB - 1) / RB;
#pragma omp parallel
    {
        float *w = (float *)__builtin_alloca((size_t)(RB * k) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * RB, nrows = n - r0 < RB ? n - r0 : RB;
            for (int64_t j = 0; j < nrows; j++) {
                const uint8_t *qr = (const uint8_t *)q + (r0 + j) * row_bytes;
                if (bits == 8)
                    widen_i8((const int8_t *)qr, w + j * k, k);
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
/* The bf16-activation variant: each weight row is widened once to bf16, exactly (integers of at most 8 bits fit
 * bf16's 8-bit significand), and dotted with the bf16 input by AVX512-BF16's vdpbf16ps, whose products are exact in
 * fp32 and accumulate in fp32: the same sums as the fp32 path on the same (bf16) input, at half the instructions
 * per weight. Groups must be multiples of 32 (one vdpbf16ps); the caller checks. */
static inline void widen_i8_bf16(const int8_t *q, __m512bh *w, int64_t k) {
    for (int64_t i = 0; i < k; i += 32) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i + 16))));
        w[i / 32] = _mm512_cvtne2ps_pbh(b, a); /* lanes 0-15 from a, 16-31 from b */
    }
}

/* INT4 rows widen without a conversion: bf16 0x4300 | u is exactly 128 + u for a nibble u, so each 32-bit lane
 * (one byte: inputs 2j and 2j + 1) becomes the bf16 pair (128 + lo, 128 + hi) in input order with a few integer
 * operations. The dot then holds sum x * (q + 136); the caller subtracts 136 * (the group's sum of x). */
static inline void widen_u4_bf16(const uint8_t *q, __m512bh *w, int64_t k) {
    const __m512i lo_mask = _mm512_set1_epi32(0x0f), hi_mask = _mm512_set1_epi32(0xf0);
    const __m512i magic = _mm512_set1_epi32(0x43004300);
    for (int64_t i = 0; i < k; i += 32) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + i / 2)));
        const __m512i pair = _mm512_or_si512(_mm512_and_si512(b, lo_mask),
                                             _mm512_slli_epi32(_mm512_and_si512(b, hi_mask), 12));
        w[i / 32] = (__m512bh)_mm512_or_si512(pair, magic);
    }
}

#define U4_BIAS 136.0f /* 128 (the bf16 exponent trick) + 8 (the unsigned offset) */

/* As tandem_wq_linear, with x bf16 [M, K] (row stride xstride), K and group multiples of 32, and xs (the group sums
 * of x) always given for INT4. */
void tandem_wq_linear_bf16(const uint16_t *x, int64_t xstride, const float *xs, const void *q, int bits,
                           const float *scale, const float *zero, float *y, int64_t m, int64_t n, int64_t k,
                           int64_t group) {
    const int64_t groups = k / group, vecs = k / 32, gvecs = group / 32;
    const int64_t row_bytes = bits == 8 ? k : k / 2;
    const int64_t blocks = (n + RB - 1) / RB;
#pragma omp parallel
    {
        __m512bh *w = (__m512bh *)__builtin_alloca((size_t)(RB * vecs) * sizeof(__m512bh) + 64);
        w = (__m512bh *)(((uintptr_t)w + 63) & ~(uintptr_t)63);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * RB, nrows = n - r0 < RB ? n - r0 : RB;
            for (int64_t j = 0; j < RB; j++) {
                const int64_t r = r0 + (j < nrows ? j : 0); /* a partial block repeats its first row */
                const uint8_t *qr = (const uint8_t *)q + r * row_bytes;
                if (bits == 8)
                    widen_i8_bf16((const int8_t *)qr, w + j * vecs, k);
                else
                    widen_u4_bf16(qr, w + j * vecs, k);
            }
            for (int64_t i = 0; i < m; i++) {
                const uint16_t *xi = x + i * xstride;
                __m512 tot[RB];
                for (int j = 0; j < RB; j++) tot[j] = _mm512_setzero_ps();
                for (int64_t g = 0; g < groups; g++) {
                    __m512 d[RB];
                    for (int j = 0; j < RB; j++) d[j] = _mm512_setzero_ps();
                    for (int64_t v = g * gvecs; v < (g + 1) * gvecs; v++) {
                        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xi + v * 32));
                        for (int j = 0; j < RB; j++) d[j] = _mm512_dpbf16_ps(d[j], xv, w[j * vecs + v]);
                    }
                    for (int j = 0; j < RB; j++) {
                        const int64_t r = r0 + (j < nrows ? j : 0);
                        tot[j] = _mm512_fmadd_ps(d[j], _mm512_set1_ps(scale[r * groups + g]), tot[j]);
                    }
                }
                for (int64_t j = 0; j < nrows; j++) {
                    float acc = _mm512_reduce_add_ps(tot[j]);
                    const float *sr = scale + (r0 + j) * groups;
                    if (zero || bits == 4) {
                        const float *zr = zero ? zero + (r0 + j) * groups : NULL;
                        for (int64_t g = 0; g < groups; g++)
                            acc -= sr[g] * ((zr ? zr[g] : 0.0f) + (bits == 4 ? U4_BIAS : 0.0f)) * xs[i * groups + g];
                    }
                    y[i * n + r0 + j] = acc;
                }
            }
        }
    }
}

int tandem_wq_has_bf16(void) { return 1; }
#else
int tandem_wq_has_bf16(void) { return 0; }
#endif
