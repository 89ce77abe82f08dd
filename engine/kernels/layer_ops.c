/* Fused fp32 element-wise layer ops for CPU: each replaces a chain of torch ops (and their temporaries) with one
 * pass over the rows. Decode steps are a few rows, where torch's per-op dispatch costs more than the arithmetic;
 * prefills are thousands of rows, where the temporaries cost memory bandwidth.
 *
 * Built with -ffp-contract=off: every product and sum is rounded on its own, as torch's separate ops round them,
 * so rotary embedding is bit-identical to the torch expression it replaces.
 *
 *   tandem_rms_norm      out = x * rsqrt(mean(x^2) + eps) * w
 *   tandem_silu_mul      out[:, i] = silu(gu[:, i]) * gu[:, inter + i]
 *   tandem_rope          neox rotary embedding, in place, on the first `heads` heads of each token row
 *
 * Rows are `stride` floats apart; the innermost dimension is contiguous. Threads: OpenMP (torch's runtime) above
 * a size where forking pays.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "expf.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN 65536 /* elements */

static inline float row_inv_rms(const float *x, int64_t dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)dim + eps);
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
