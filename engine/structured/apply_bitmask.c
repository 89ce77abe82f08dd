/* Grammar token bitmasks applied to fp32 logits in place, in one pass over the constrained rows.
 *
 * tandem_apply_token_bitmask(logits, row_stride, bitmask, words, rows, nrows, width):
 *   for j in [0, nrows): row r = rows[j] of `logits` (fp32, `row_stride` floats apart, `width` columns) keeps column
 *   c where bit (c % 32) of bitmask[j * words + c / 32] is set and gets -inf where it is clear; columns at or past
 *   32 * words (the head's padding past the grammar's vocabulary) get -inf. Kept values are not touched, so the
 *   result is exactly a masked fill's. A word of all ones (every token allowed) is skipped, one of zeros is filled.
 *
 * Single-threaded, no allocation: it replaces building a 0/-inf bias and adding it (two passes over rows x width
 * and a bias buffer) for CPU logits.
 */
#include <math.h>
#include <stdint.h>

void tandem_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,
                                const int64_t *rows, int64_t nrows, int64_t width) {
    const float ninf = -INFINITY;
    const int64_t covered = words * 32 < width ? words * 32 : width;
    for (int64_t j = 0; j < nrows; j++) {
        float *row = logits + rows[j] * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + j * words);
        for (int64_t base = 0; base < covered; base += 32) {
            const uint32_t bits = mask[base / 32];
            const int64_t n = covered - base < 32 ? covered - base : 32;
            if (bits == 0xFFFFFFFFu)
                continue;
            float *out = row + base;
            if (bits == 0) {
                for (int64_t b = 0; b < n; b++)
                    out[b] = ninf;
                continue;
            }
            for (int64_t b = 0; b < n; b++)
                if (!((bits >> b) & 1u))
                    out[b] = ninf;
        }
        for (int64_t c = covered; c < width; c++)
            row[c] = ninf;
    }
}
