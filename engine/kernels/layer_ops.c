/* Fused element-wise layer ops for CPU (fp32, and bf16 below): each replaces a chain of torch ops (and their
 * temporaries) with one pass over the rows. Decode steps are a few rows, where torch's per-op dispatch costs more
 * than the arithmetic; prefills are thousands of rows, where the temporaries cost memory bandwidth.
 *
 * Built with -ffp-contract=off: every product and sum is rounded on its own, as torch's separate ops round them,
 * so rotary embedding is bit-identical to the torch expression it replaces.
 *
 *   tandem_rms_norm      out = w * (x * rsqrt(mean(x^2) + eps)), mean(x^2) in torch's summation order (below)
 *   tandem_silu_mul      out[:, i] = silu(gu[:, i]) * gu[:, inter + i]
 *   tandem_rope          neox rotary embedding, in place, on the first `heads` heads of each token row
 *
 * Rows are `stride` floats apart; the innermost dimension is contiguous. Threads: OpenMP (torch's runtime) above
 * a size where forking pays.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "expf.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN 65536 /* elements */

/* mean(x^2) of one row, summed in exactly the order of torch's CPU float sum over a contiguous dimension
 * (ATen's cascade_sum: 8-lane vectors, 4 independent accumulators, a 4-level cascade for long rows, then the
 * accumulators, the leftover elements and the lanes in sequence), and divided as torch's mean divides. So
 * RMSNorm's inverse RMS equals transformers' bit for bit; engine/models/layers.py checks that against torch once
 * per row length and uses torch's own reduction if it ever differs (another torch build, another dispatch). */
#define SUM_VL 8
#define SUM_ILP 4
#define SUM_LEVELS 4

static inline void squares(const void *x, int bf16, int64_t at, float *sq) {
    for (int l = 0; l < SUM_VL; l++) {
        const float v = bf16 ? bf16_to_f32(((const uint16_t *)x)[at + l]) : ((const float *)x)[at + l];
        sq[l] = v * v;
    }
}

/* ATen's CeilLog2: 1 for x <= 2, else the bit width of x - 1. */
static inline int64_t ceil_log2(int64_t x) {
    int64_t bits = 0;
    if (x <= 2) return 1;
    for (x -= 1; x; x >>= 1) bits++;
    return bits;
}

static float torch_mean_square(const void *x, int bf16, int64_t n) {
    const int64_t nvec = n / SUM_VL, size = nvec / SUM_ILP;
    const int64_t cl = ceil_log2(size);
    const int64_t level_power = cl / SUM_LEVELS > 4 ? cl / SUM_LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[SUM_LEVELS][SUM_ILP][SUM_VL];
    memset(acc, 0, sizeof acc);
    float sq[SUM_VL];
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < SUM_ILP; k++) {
                squares(x, bf16, (i * SUM_ILP + k) * SUM_VL, sq);
                for (int l = 0; l < SUM_VL; l++) acc[0][k][l] += sq[l];
            }
        for (int j = 1; j < SUM_LEVELS; j++) {
            for (int k = 0; k < SUM_ILP; k++)
                for (int l = 0; l < SUM_VL; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < SUM_ILP; k++) {
            squares(x, bf16, (i * SUM_ILP + k) * SUM_VL, sq);
            for (int l = 0; l < SUM_VL; l++) acc[0][k][l] += sq[l];
        }
    for (int j = 1; j < SUM_LEVELS; j++)
        for (int k = 0; k < SUM_ILP; k++)
            for (int l = 0; l < SUM_VL; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t t = size * SUM_ILP; t < nvec; t++) {
        squares(x, bf16, t * SUM_VL, sq);
        for (int l = 0; l < SUM_VL; l++) acc[0][0][l] += sq[l];
    }
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < SUM_VL; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = nvec * SUM_VL; e < n; e++) {
        const float v = bf16 ? bf16_to_f32(((const uint16_t *)x)[e]) : ((const float *)x)[e];
        total += v * v;
    }
    for (int l = 0; l < SUM_VL; l++) total += acc[0][0][l];
    return total / (float)n;
}

/* Each row's mean(x^2) as above, for the check against torch (rows ``stride`` elements apart). */
void tandem_mean_square(const void *x, int64_t stride, int bf16, int64_t rows, int64_t dim, float *out) {
    for (int64_t r = 0; r < rows; r++)
        out[r] = torch_mean_square(bf16 ? (const void *)((const uint16_t *)x + r * stride)
                                        : (const void *)((const float *)x + r * stride), bf16, dim);
}

static inline float row_inv_rms(const float *x, int64_t dim, float eps) {
    return 1.0f / sqrtf(torch_mean_square(x, 0, dim) + eps);
}

void tandem_rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t dim,
                     float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        const float inv = row_inv_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}


#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) { /* tandem_expf (expf.h), 16 lanes, the same operations */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

void tandem_silu_mul(const float *gu, int64_t gu_stride, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * gu_stride, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = _mm512_loadu_ps(g + i);
            const __m512 sig = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(x, sig), _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = (g[i] / (1.0f + tandem_expf(-g[i]))) * u[i];
    }
}

void tandem_rope(float *x, int64_t tok_stride, int64_t tokens, int64_t heads, int64_t head_dim, const float *cos,
                 const float *sin) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * tok_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[half + i];
                /* torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded separately */
                v[i] = x1 * c[i] + (-x2) * s[i];
                v[half + i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
    }
}

/* ---- bfloat16 ----------------------------------------------------------------------------------------------
 * The same three ops on bf16 rows, rounding where transformers' bf16 modules round: each torch op on bf16 tensors
 * widens to fp32, computes, and rounds the result to nearest even, so every intermediate that torch materialises
 * as a bf16 tensor is rounded here too.
 *
 *   tandem_rms_norm_bf16  out = bf16(w * bf16(x * rsqrt(var + eps)))  (LlamaRMSNorm: fp32 inside, cast back, then
 *                         scaled in bf16). ``var`` is each row's mean(x^2) in fp32: given by the caller (torch's own
 *                         reduction), or NULL for the torch-order sum above. A one-ulp difference there does flip
 *                         greedy tokens of bf16 models.
 *   tandem_silu_mul_bf16  out = bf16(bf16(silu(g)) * u)
 *   tandem_rope_bf16      x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), in place; cos/sin are bf16 tables
 *
 * rope and rms_norm are bit-identical to the torch expressions (products of two bf16 values are exact in fp32;
 * 1/sqrtf is torch's rsqrt, both correctly rounded). silu_mul's expf can differ from torch's in the last fp32 bit,
 * so rarely by one bf16 ulp after rounding. */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__)
/* Round 16 fp32 lanes to bf16, nearest even (inputs are finite here: activations of a working model). */
static inline __m256i to_bf16x16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(x)), 16));
}
#endif

void tandem_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows,
                          int64_t dim, float eps, const float *var) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * dim;
        const float inv = 1.0f / sqrtf((var ? var[r] : torch_mean_square(xr, 1, dim)) + eps);
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i + 16 <= dim; i += 16) {
            const __m512 y = round_bf16x16(_mm512_mul_ps(load_bf16x16(xr + i), vinv));
            _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_mul_ps(load_bf16x16(w + i), y)));
        }
#endif
        for (; i < dim; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

void tandem_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * gu_stride, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = load_bf16x16(g + i);
            const __m512 sig = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
            const __m512 s = round_bf16x16(_mm512_div_ps(x, sig));
            _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_mul_ps(s, load_bf16x16(u + i))));
        }
#endif
        for (; i < inter; i++) {
            const float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(x / (1.0f + tandem_expf(-x))) * bf16_to_f32(u[i]));
        }
    }
}

void tandem_rope_bf16(uint16_t *x, int64_t tok_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                      const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + t * tok_stride + h * head_dim;
            int64_t i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= half; i += 16) {
                const __m512 x1 = load_bf16x16(v + i), x2 = load_bf16x16(v + half + i);
                const __m512 a1 = round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(c + i)));
                const __m512 b1 = round_bf16x16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                              load_bf16x16(s + i)));
                const __m512 a2 = round_bf16x16(_mm512_mul_ps(x2, load_bf16x16(c + half + i)));
                const __m512 b2 = round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(s + half + i)));
                _mm256_storeu_si256((__m256i *)(v + i), to_bf16x16(_mm512_add_ps(a1, b1)));
                _mm256_storeu_si256((__m256i *)(v + half + i), to_bf16x16(_mm512_add_ps(a2, b2)));
            }
#endif
            for (; i < half; i++) {
                const float x1 = bf16_to_f32(v[i]), x2 = bf16_to_f32(v[half + i]);
                const float a1 = round_bf16(x1 * bf16_to_f32(c[i])), b1 = round_bf16(-x2 * bf16_to_f32(s[i]));
                const float a2 = round_bf16(x2 * bf16_to_f32(c[half + i]));
                const float b2 = round_bf16(x1 * bf16_to_f32(s[half + i]));
                v[i] = f32_to_bf16(a1 + b1);
                v[half + i] = f32_to_bf16(a2 + b2);
            }
        }
    }
}
