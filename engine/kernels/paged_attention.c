/* Paged attention for CPU: every query row of a step, read against the paged KV cache in place.
 *
 * One call per layer covers the whole flat batch: decodes (one query per sequence), fresh prefills, chunked
 * prefills over a cached prefix, and sliding windows. Sequence b owns query rows [cu_q[b], cu_q[b+1]) of the flat
 * batch; they sit at absolute positions ctx[b]-q_len .. ctx[b]-1, and each attends to keys
 * max(0, pos-window+1) .. pos, read through its block table row. No K/V copy, no mask tensor.
 *
 * Layouts (elements, not bytes):
 *   q      [T, q_token_stride], heads at h*D       (a view into the fused qkv projection is fine)
 *   cache  [num_blocks, block_size, KVH, D]         (K and V alike, contiguous)
 *   tables [B, table_stride] int64 block ids
 *   out    [T, H, D] contiguous
 * Query head h reads KV head h / (H/KVH), as transformers' repeat_kv does.
 *
 * Work item = (sequence, KV head, tile of up to QT consecutive queries); the G = H/KVH query heads sharing the KV
 * head go together, so each key row is loaded once for G*QT dot products. Scores for a chunk of up to KC keys are
 * kept in a small buffer; softmax is online across chunks (exact two-pass within a chunk, which is every decode
 * shorter than KC). Arithmetic is fp32; bf16 inputs are widened on load and the output rounded to nearest even.
 * Where the compiler targets AVX512-BF16, bf16 scores are VDPBF16PS dot products of the raw bf16 query and key
 * (exact products, fp32 sums) scaled afterwards, as torch's SDPA scales q.k, and values are widened in registers.
 *
 * Threads: OpenMP, the same runtime torch uses (libgomp.so.1 is already loaded by torch when this is dlopen'ed),
 * so torch.set_num_threads governs it too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "expf.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QT 8     /* queries per work item */
#define KC 256   /* keys per score chunk */
#define MAX_G 16 /* query heads per KV head */
#define MAX_D 256


#if defined(__AVX512F__)
/* Lane j of the result is the sum of v[j]'s 16 lanes: a shuffle tree (45 shuffles/adds for 16 vectors instead of a
 * horizontal reduction each). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512BF16__)
#define BF16_DOT 1
/* bf16 scores straight from the cache: one (unscaled) bf16 query row against ``cnt`` <= 16 bf16 key rows ``ks``
 * elements apart, with VDPBF16PS (exact bf16 products, summed in fp32), then scaled in fp32 as torch's SDPA
 * scales q.k. No widened copy of the keys. D % 32 == 0. */
static inline __attribute__((always_inline)) void score_run_bf16(const uint16_t *q, const uint16_t *k, int64_t ks,
                                                                 int cnt, int64_t D, float scale, float *out) {
    __m512 v[16];
    for (int j = 0; j < 16; j++) {
        __m512 acc = _mm512_setzero_ps();
        if (j < cnt)
            for (int64_t d = 0; d < D; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                                       (__m512bh)_mm512_loadu_si512(k + j * ks + d));
        v[j] = acc;
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << cnt) - 1u), _mm512_mul_ps(sum16(v), _mm512_set1_ps(scale)));
}

#else
#define BF16_DOT 0
#endif

/* Dot products of one (pre-scaled) query row with ``cnt`` <= 16 key rows ``ks`` floats apart. */
static inline __attribute__((always_inline)) void score_run(const float *q, const float *k, int64_t ks, int cnt,
                                                            int64_t D, float *out) {
#if defined(__AVX512F__)
    if ((D & 15) == 0) {
        /* One vector of partial products per key, then a shuffle tree sums the 16 vectors into one vector of 16
         * dot products (45 shuffles/adds for 16 keys, instead of a horizontal reduction per key). */
        __m512 v[16];
        for (int j = 0; j < 16; j++) {
            __m512 acc = _mm512_setzero_ps();
            if (j < cnt)
                for (int64_t d = 0; d < D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + j * ks + d), acc);
            v[j] = acc;
        }
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << cnt) - 1u), sum16(v));
        return;
    }
#endif
    for (int j = 0; j < cnt; j++) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; d++) s += q[d] * k[j * ks + d];
        out[j] = s;
    }
}

#if defined(__AVX512F__)
static inline __m512 exp_neg16(__m512 x) { /* tandem_expf (expf.h), 16 lanes */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

/* For scores p[j0:j1]: *cm = their max; then p[j] = exp(p[j] - max(*cm, prev_max)) and *sum = their sum. */
static inline void softmax_run(float *p, int64_t j0, int64_t j1, float prev_max, float *cm, float *sum) {
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int64_t j = j0; j < j1; j += 16) {
        __mmask16 k = j1 - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (j1 - j)) - 1u);
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, p + j));
    }
    *cm = _mm512_reduce_max_ps(vm);
    const __m512 nm = _mm512_set1_ps(*cm > prev_max ? *cm : prev_max);
    __m512 vs = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j += 16) {
        __mmask16 k = j1 - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (j1 - j)) - 1u);
        __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), nm));
        _mm512_mask_storeu_ps(p + j, k, e);
        vs = _mm512_mask_add_ps(vs, k, vs, e);
    }
    *sum = _mm512_reduce_add_ps(vs);
#else
    float m = -INFINITY, s = 0.0f;
    for (int64_t j = j0; j < j1; j++) m = p[j] > m ? p[j] : m;
    const float nm = m > prev_max ? m : prev_max;
    for (int64_t j = j0; j < j1; j++) {
        p[j] = tandem_expf(p[j] - nm);
        s += p[j];
    }
    *cm = m;
    *sum = s;
#endif
}

/* One value row's 16 lanes from ``i`` on, fp32 or widened from bf16 (exact): the cache is read in place. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 value16(const void *v, int64_t i, int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)v + i) : _mm512_loadu_ps((const float *)v + i);
}
#endif

/* o[0:D] += sum_j w[j] * v[j*vs : j*vs+D] over ``cnt`` value rows, fp32 or bf16 (``bf16``). */
static inline __attribute__((always_inline)) void value_run(float *o, const float *w, const void *v, int64_t vs,
                                                            int64_t cnt, int64_t D, int bf16) {
#if defined(__AVX512F__)
    if ((D & 15) == 0 && D <= MAX_D) {
        /* U independent accumulator sets (keys j, j+1, ... round robin): one set's FMAs would wait on each
         * other's latency. Summed at the end. */
        enum { U = 4 };
        const int64_t nv = D / 16;
        __m512 acc[U][MAX_D / 16];
        for (int64_t i = 0; i < nv; i++) {
            acc[0][i] = _mm512_loadu_ps(o + 16 * i);
            for (int u = 1; u < U; u++) acc[u][i] = _mm512_setzero_ps();
        }
        int64_t j = 0;
        for (; j + U <= cnt; j += U)
            for (int u = 0; u < U; u++) {
                const __m512 wj = _mm512_set1_ps(w[j + u]);
                for (int64_t i = 0; i < nv; i++)
                    acc[u][i] = _mm512_fmadd_ps(wj, value16(v, (j + u) * vs + 16 * i, bf16), acc[u][i]);
            }
        for (; j < cnt; j++) {
            const __m512 wj = _mm512_set1_ps(w[j]);
            for (int64_t i = 0; i < nv; i++)
                acc[0][i] = _mm512_fmadd_ps(wj, value16(v, j * vs + 16 * i, bf16), acc[0][i]);
        }
        for (int64_t i = 0; i < nv; i++)
            _mm512_storeu_ps(o + 16 * i, _mm512_add_ps(_mm512_add_ps(acc[0][i], acc[1][i]),
                                                       _mm512_add_ps(acc[2][i], acc[3][i])));
        return;
    }
#endif
    for (int64_t j = 0; j < cnt; j++) {
        const float wj = w[j];
        if (bf16) {
            const uint16_t *row = (const uint16_t *)v + j * vs;
            for (int64_t d = 0; d < D; d++) o[d] += wj * bf16_to_f32(row[d]);
        } else {
            const float *row = (const float *)v + j * vs;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += wj * row[d];
        }
    }
}

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *cu_q, *ctx, *tables;
    int64_t q_stride, table_stride, H, KVH, D, BS, window;
    float scale;
    int bf16;
} args_t;

/* A key or value row as fp32: a pointer into the cache (fp32), or widened into ``buf`` (bf16). */
static inline const float *row_f32(const void *base, int64_t off, int64_t D, int bf16, float *buf) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *s = (const uint16_t *)base + off;
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(s[d]);
    return buf;
}

static inline void prefetch_rows(const void *base, int64_t off, int64_t stride, int64_t n, int64_t D, int bf16) {
    const int64_t es = bf16 ? 2 : 4;
    const char *p = (const char *)base + off * es;
    for (int64_t j = 0; j < n; j++, p += stride * es)
        for (int64_t b = 0; b < D * es; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* One work item: queries [q0, q0+nq) of sequence b (offsets within the sequence), KV head kvh. Inlined into a
 * copy per common head size so that D is a constant and the per-row loops unroll into whole vectors. */
static inline __attribute__((always_inline)) void attend_tile(const args_t *a, int64_t b, int64_t kvh, int64_t q0,
                                                              int64_t nq, const int64_t D) {
    const int64_t G = a->H / a->KVH, BS = a->BS, row_stride = a->KVH * D;
    const int64_t ctx = a->ctx[b], first_row = a->cu_q[b], q_len = a->cu_q[b + 1] - first_row;
    const int64_t base_pos = ctx - q_len; /* absolute position of query 0 */
    const int64_t rows = nq * G;
    if (rows <= 0) return;
    const int64_t *table = a->tables + b * a->table_stride;
    const int bf16 = a->bf16;
    /* bf16 with AVX512-BF16: scores by VDPBF16PS on the cached keys, with no widened copy of them (``qh`` keeps
     * the raw bf16 queries). Values are read in place for every dtype (value_run). */
    const int direct = BF16_DOT && bf16 && (D % 32) == 0 && D <= MAX_D;

    /* Sized by the actual shape (at most QT*MAX_G rows of MAX_D): well inside a worker thread's stack. */
    float qv[rows * D], acc[rows * D], sc[rows * KC];
    float m[rows], l[rows], kbuf[D], ktile[16 * D];
    uint16_t qh[direct ? rows * D : 1];
    int64_t lo[rows], hi[rows]; /* allowed key range [lo, hi) per row */

    for (int64_t i = 0; i < nq; i++) {
        int64_t pos = base_pos + q0 + i;
        int64_t start = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
        for (int64_t g = 0; g < G; g++) {
            int64_t r = i * G + g, h = kvh * G + g;
            const int64_t q_off = (first_row + q0 + i) * a->q_stride + h * D;
            if (direct) memcpy(qh + r * D, (const uint16_t *)a->q + q_off, (size_t)D * sizeof(uint16_t));
            const float *src = row_f32(a->q, q_off, D, bf16, kbuf);
            for (int64_t d = 0; d < D; d++) qv[r * D + d] = src[d] * a->scale;
            for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.0f;
            lo[r] = start;
            hi[r] = pos + 1;
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    }
    /* Union of the rows' ranges: rows are in position order, so the first row starts lowest, the last ends last. */
    const int64_t first_pos = base_pos + q0;
    const int64_t k_begin = a->window > 0 && first_pos - a->window + 1 > 0 ? first_pos - a->window + 1 : 0;
    const int64_t k_end = first_pos + nq;

    for (int64_t c0 = k_begin; c0 < k_end; c0 += KC) {
        const int64_t c1 = c0 + KC < k_end ? c0 + KC : k_end, n = c1 - c0;
        /* scores, walking the block table one block at a time, up to 16 keys per run. The cache is far bigger
         * than the caches: the next block's keys and this block's values are prefetched while this block's keys
         * are scored (+15-25% on a DRAM-bound decode). */
        for (int64_t bi = c0 / BS; bi * BS < c1; bi++) {
            const int64_t t0 = bi * BS > c0 ? bi * BS : c0, t1 = (bi + 1) * BS < c1 ? (bi + 1) * BS : c1;
            int64_t off = ((table[bi] * BS + (t0 - bi * BS)) * a->KVH + kvh) * D;
            if ((bi + 1) * BS < c1) prefetch_rows(a->k, ((table[bi + 1] * BS) * a->KVH + kvh) * D, row_stride, BS, D, bf16);
            prefetch_rows(a->v, off, row_stride, t1 - t0, D, bf16);
            for (int64_t t = t0; t < t1; t += 16, off += 16 * row_stride) {
                const int cnt = t1 - t < 16 ? (int)(t1 - t) : 16;
#if BF16_DOT
                if (direct) {
                    for (int64_t r = 0; r < rows; r++)
                        score_run_bf16(qh + r * D, (const uint16_t *)a->k + off, row_stride, cnt, D, a->scale,
                                       sc + r * KC + (t - c0));
                    continue;
                }
#endif
                const float *kp = (const float *)a->k + off;
                int64_t ks = row_stride;
                if (bf16) {
                    for (int j = 0; j < cnt; j++) row_f32(a->k, off + j * row_stride, D, 1, ktile + j * D);
                    kp = ktile;
                    ks = D;
                }
                for (int64_t r = 0; r < rows; r++) score_run(qv + r * D, kp, ks, cnt, D, sc + r * KC + (t - c0));
            }
        }
        /* online softmax over the chunk; keys outside a row's range get weight 0 */
        for (int64_t r = 0; r < rows; r++) {
            float *p = sc + r * KC;
            const int64_t j0 = lo[r] > c0 ? lo[r] - c0 : 0, j1 = hi[r] < c1 ? hi[r] - c0 : n;
            for (int64_t j = 0; j < j0; j++) p[j] = 0.0f;
            for (int64_t j = j1 > j0 ? j1 : j0; j < n; j++) p[j] = 0.0f;
            if (j1 <= j0) continue; /* nothing of this chunk is visible to the row */
            float cm, sum;
            const float nm0 = m[r];
            softmax_run(p, j0, j1, nm0, &cm, &sum);
            const float nm = cm > nm0 ? cm : nm0;
            const float corr = nm0 == -INFINITY ? 0.0f : tandem_expf(nm0 - nm);
            l[r] = l[r] * corr + sum;
            m[r] = nm;
            if (corr != 1.0f)
                for (int64_t d = 0; d < D; d++) acc[r * D + d] *= corr;
        }
        /* weighted values, row by row so that a row's accumulator stays in registers */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t u0 = lo[r] > c0 ? lo[r] : c0, u1 = hi[r] < c1 ? hi[r] : c1;
            for (int64_t bi = u0 / BS; bi * BS < u1; bi++) {
                const int64_t t0 = bi * BS > u0 ? bi * BS : u0, t1 = (bi + 1) * BS < u1 ? (bi + 1) * BS : u1;
                const int64_t off = ((table[bi] * BS + (t0 - bi * BS)) * a->KVH + kvh) * D;
                const void *vp = bf16 ? (const void *)((const uint16_t *)a->v + off)
                                      : (const void *)((const float *)a->v + off);
                value_run(acc + r * D, sc + r * KC + (t0 - c0), vp, row_stride, t1 - t0, D, bf16);
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g, h = kvh * G + g;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            const int64_t off = ((first_row + q0 + i) * a->H + h) * D;
            if (bf16) {
                uint16_t *o = (uint16_t *)a->out + off;
                for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(acc[r * D + d] * inv);
            } else {
                float *o = (float *)a->out + off;
                for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
            }
        }
    }
}

static void tile_any(const args_t *a, int64_t b, int64_t kvh, int64_t q0, int64_t nq) {
    attend_tile(a, b, kvh, q0, nq, a->D);
}
#define TILE_FOR(DD)                                                                  \
    static void tile_##DD(const args_t *a, int64_t b, int64_t kvh, int64_t q0, int64_t nq) { \
        attend_tile(a, b, kvh, q0, nq, DD);                                           \
    }
TILE_FOR(32)
TILE_FOR(64)
TILE_FOR(128)

/* Returns 0, or -1 when a shape is outside what the fixed-size buffers hold (the caller falls back). */
int tandem_paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *cu_q, const int64_t *ctx, const int64_t *tables, int64_t table_stride,
                           int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window,
                           float scale, int bf16, void *out) {
    if (KVH <= 0 || H % KVH || H / KVH > MAX_G || D > MAX_D || D <= 0) return -1;
    args_t a = {q, k_cache, v_cache, out, cu_q, ctx, tables, q_stride, table_stride, H, KVH, D, block_size,
                window, scale, bf16};
    /* Flatten (sequence, query tile) into a list so that one parallel loop balances decodes and prefills. */
    int64_t tiles = 0;
    for (int64_t b = 0; b < B; b++) tiles += (cu_q[b + 1] - cu_q[b] + QT - 1) / QT;
    int64_t *tile_b = (int64_t *)malloc((size_t)(tiles > 0 ? tiles : 1) * 2 * sizeof(int64_t));
    if (!tile_b) return -1;
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < cu_q[b + 1] - cu_q[b]; s += QT) {
            tile_b[2 * n] = b;
            tile_b[2 * n + 1] = s;
            n++;
        }
    int64_t items = tiles * KVH;
    void (*run)(const args_t *, int64_t, int64_t, int64_t, int64_t) =
        D == 32 ? tile_32 : D == 64 ? tile_64 : D == 128 ? tile_128 : tile_any;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t tile = it / KVH, kvh = it % KVH;
        int64_t b = tile_b[2 * tile], s = tile_b[2 * tile + 1];
        int64_t q_len = cu_q[b + 1] - cu_q[b];
        run(&a, b, kvh, s, q_len - s < QT ? q_len - s : QT);
    }
    free(tile_b);
    return 0;
}

/* Scatter a step's new K and V rows into their cache slots: row t of k (and of v), ``row_bytes`` long and
 * ``k_stride``/``v_stride`` bytes apart (views into the fused qkv projection are fine), goes to slot
 * slot_mapping[t] of k_cache (v_cache), whose slots are ``row_bytes`` apart. */
void tandem_write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache,
                     void *v_cache, const int64_t *slot_mapping, int64_t tokens, int64_t row_bytes) {
#pragma omp parallel for schedule(static) if (tokens * row_bytes >= (1 << 20))
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slot_mapping[t];
        memcpy((char *)k_cache + slot * row_bytes, (const char *)k + t * k_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)v + t * v_stride, (size_t)row_bytes);
    }
}
