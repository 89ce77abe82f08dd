/* Scalar expf shared by the kernels: Cephes' polynomial, branch-free so loops around it vectorise, ~1 ulp.
 * The input is clamped to [-87, 88] (exp(-87) ~ 1.6e-38 stands in for 0 where the callers sum weights). */
#ifndef TANDEM_EXPF_H
#define TANDEM_EXPF_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float tandem_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float e;
    memcpy(&e, &bits, sizeof e);
    return p * e;
}
#endif
