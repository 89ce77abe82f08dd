/* Grammar masks filled off the GIL: a native thread that computes one step's llguidance masks while the forward pass
 * runs, and the cache in front of the tokenizer that llguidance calls while it computes them.
 *
 * Masks. tandem_masks_new(compute) makes a worker whose thread waits for a job; compute is llguidance's
 * llg_matcher_compute_mask_into, looked up by the caller in the library Python already loaded. Per step:
 *
 *   tandem_masks_start(w, matchers, n, dest, words, eos)   engine thread, before the forward pass: publish the job,
 *                                                            wake the thread (no wait)
 *   ... forward pass ...                                     worker thread: takes rows one at a time
 *   tandem_masks_finish(w)                                   engine thread, in the sampler: takes the rows the worker
 *                                                            has not begun, then waits for the ones it is computing
 *
 * Row j's mask goes to dest + j * words (32-bit words, one bit per token). A row whose matcher is in its error state
 * gets a mask that allows only `eos`, as llguidance's Python API writes it (the C call leaves the buffer as it was).
 * The two threads take rows through one atomic counter, so a busy host whose spare CPU went elsewhere costs the step
 * no more than filling inline; on an idle core the masks cost the step nothing. finish returns the number of rows
 * in error. Nothing here holds the GIL: a matcher must not be touched by Python between start and finish (the engine
 * advances the matchers before the step starts and reads them after the sampler).
 *
 * Tokenizer. llguidance tokenizes forced byte runs (a JSON key after its first characters, say) while it computes
 * masks, through the tokenize function its C API requires. That function is Python's (the model's own HF tokenizer);
 * calling it takes the GIL, the hand-off this file exists to avoid. tandem_tokenize_cached answers from a table of
 * the byte runs seen before (a grammar forces the same few runs again and again) and calls the Python function only
 * for a run not seen yet, outside the table's lock. The table is cleared when half full.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int32_t (*compute_mask_fn)(void *matcher, uint32_t *dest, size_t bytes);
typedef size_t (*tokenize_fn)(const void *user_data, const uint8_t *bytes, size_t len, uint32_t *out, size_t cap);

/* ---------------------------------------------------------------- masks */

typedef struct {
    compute_mask_fn compute;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake, idle;
    /* the current job, published under mu; rows are claimed through `next` */
    void *const *matchers;
    uint32_t *dest;
    int64_t n, words;
    uint32_t eos;
    uint64_t job;          /* incremented per start */
    bool busy;             /* the worker is inside the current job */
    bool stop;
    atomic_int_fast64_t next;
    atomic_int_fast64_t errors;
} masks_worker;

static void fill_row(masks_worker *w, int64_t j) {
    uint32_t *row = w->dest + j * w->words;
    if (w->compute(w->matchers[j], row, (size_t)w->words * 4) != 0) {
        memset(row, 0, (size_t)w->words * 4);
        if ((int64_t)(w->eos / 32) < w->words)
            row[w->eos / 32] = 1u << (w->eos % 32);
        atomic_fetch_add(&w->errors, 1);
    }
}

static void take_rows(masks_worker *w) {
    for (;;) {
        int64_t j = atomic_fetch_add(&w->next, 1);
        if (j >= w->n)
            return;
        fill_row(w, j);
    }
}

static void *worker_main(void *arg) {
    masks_worker *w = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stop && w->job == seen)
            pthread_cond_wait(&w->wake, &w->mu);
        if (w->stop)
            break;
        seen = w->job;
        w->busy = true;
        pthread_mutex_unlock(&w->mu);
        take_rows(w);
        pthread_mutex_lock(&w->mu);
        w->busy = false;
        pthread_cond_broadcast(&w->idle);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

void *tandem_masks_new(compute_mask_fn compute) {
    masks_worker *w = calloc(1, sizeof *w);
    if (w == NULL)
        return NULL;
    w->compute = compute;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->wake, NULL);
    pthread_cond_init(&w->idle, NULL);
    atomic_init(&w->next, 0);
    atomic_init(&w->errors, 0);
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
        free(w);
        return NULL;
    }
    return w;
}

/* Wait until the worker is out of the previous job (it may still be inside one nobody finished). Holds mu. */
static void wait_idle_locked(masks_worker *w) {
    while (w->busy)
        pthread_cond_wait(&w->idle, &w->mu);
}

void tandem_masks_start(masks_worker *w, void *const *matchers, int64_t n, uint32_t *dest, int64_t words,
                        uint32_t eos) {
    pthread_mutex_lock(&w->mu);
    wait_idle_locked(w);
    w->matchers = matchers;
    w->dest = dest;
    w->n = n;
    w->words = words;
    w->eos = eos;
    atomic_store(&w->next, 0);
    atomic_store(&w->errors, 0);
    w->job++;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
}

int64_t tandem_masks_finish(masks_worker *w) {
    take_rows(w);
    pthread_mutex_lock(&w->mu);
    wait_idle_locked(w);
    /* the worker may not have woken for this job yet: it will find no row left, so nothing of it is pending */
    pthread_mutex_unlock(&w->mu);
    return atomic_load(&w->errors);
}

/* The same fill on the calling thread alone (no worker): for callers that start no job. */
int64_t tandem_masks_fill(compute_mask_fn compute, void *const *matchers, int64_t n, uint32_t *dest, int64_t words,
                          uint32_t eos) {
    masks_worker w = {.compute = compute, .matchers = matchers, .dest = dest, .n = n, .words = words, .eos = eos};
    atomic_init(&w.next, 0);
    atomic_init(&w.errors, 0);
    take_rows(&w);
    return atomic_load(&w.errors);
}

void tandem_masks_free(masks_worker *w) {
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->wake);
    pthread_cond_destroy(&w->idle);
    free(w);
}

/* ---------------------------------------------------------------- tokenizer cache */

typedef struct {
    uint8_t *key;          /* NULL: empty slot */
    size_t len;
    uint32_t *tokens;
    size_t ntokens;
} tok_entry;

typedef struct {
    tokenize_fn slow;
    const void *slow_data;
    pthread_mutex_t mu;
    tok_entry *slots;
    size_t cap, used;      /* cap a power of two */
    uint64_t hits, misses;
} tok_cache;

static uint64_t hash_bytes(const uint8_t *b, size_t n) {
    uint64_t h = 1469598103934665603ull;  /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

void *tandem_tokcache_new(tokenize_fn slow, const void *slow_data, int64_t cap_log2) {
    tok_cache *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->cap = (size_t)1 << cap_log2;
    c->slots = calloc(c->cap, sizeof *c->slots);
    if (c->slots == NULL) {
        free(c);
        return NULL;
    }
    c->slow = slow;
    c->slow_data = slow_data;
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

static void clear_locked(tok_cache *c) {
    for (size_t i = 0; i < c->cap; i++) {
        free(c->slots[i].key);
        free(c->slots[i].tokens);
    }
    memset(c->slots, 0, c->cap * sizeof *c->slots);
    c->used = 0;
}

/* Slot for key: the entry holding it, or the empty slot where it would go. Holds mu. */
static tok_entry *find_locked(tok_cache *c, const uint8_t *b, size_t n) {
    size_t i = (size_t)hash_bytes(b, n) & (c->cap - 1);
    for (;;) {
        tok_entry *e = &c->slots[i];
        if (e->key == NULL || (e->len == n && memcmp(e->key, b, n) == 0))
            return e;
        i = (i + 1) & (c->cap - 1);
    }
}

static size_t copy_out(const uint32_t *tokens, size_t ntokens, uint32_t *out, size_t cap) {
    memcpy(out, tokens, (ntokens < cap ? ntokens : cap) * sizeof *tokens);
    return ntokens;
}

/* llguidance's LlgTokenizeFn; user_data is the cache. Thread-safe. */
size_t tandem_tokenize_cached(const void *user_data, const uint8_t *bytes, size_t len, uint32_t *out, size_t cap) {
    tok_cache *c = (tok_cache *)user_data;
    const uint8_t *key = len ? bytes : (const uint8_t *)"";
    pthread_mutex_lock(&c->mu);
    tok_entry *e = find_locked(c, key, len);
    if (e->key != NULL) {
        size_t r = copy_out(e->tokens, e->ntokens, out, cap);
        c->hits++;
        pthread_mutex_unlock(&c->mu);
        return r;
    }
    c->misses++;
    pthread_mutex_unlock(&c->mu);

    /* Not cached: ask the slow function, first for the count, then (if the caller's buffer is short) for all. */
    size_t want = cap > 64 ? cap : 64;
    uint32_t *tokens = malloc(want * sizeof *tokens);
    if (tokens == NULL)
        return c->slow(c->slow_data, bytes, len, out, cap);
    size_t ntokens = c->slow(c->slow_data, bytes, len, tokens, want);
    if (ntokens > want) {
        uint32_t *bigger = realloc(tokens, ntokens * sizeof *tokens);
        if (bigger == NULL) {
            free(tokens);
            return c->slow(c->slow_data, bytes, len, out, cap);
        }
        tokens = bigger;
        c->slow(c->slow_data, bytes, len, tokens, ntokens);
    }
    size_t r = copy_out(tokens, ntokens, out, cap);

    /* No tokens for a non-empty text means the slow function failed (it logs why): not cached, asked again. */
    uint8_t *k = ntokens > 0 || len == 0 ? malloc(len ? len : 1) : NULL;
    if (k == NULL) {
        free(tokens);
        return r;
    }
    memcpy(k, key, len);
    pthread_mutex_lock(&c->mu);
    if ((c->used + 1) * 2 > c->cap)
        clear_locked(c);
    e = find_locked(c, key, len);
    if (e->key == NULL) {  /* another thread may have stored it meanwhile */
        *e = (tok_entry){.key = k, .len = len, .tokens = tokens, .ntokens = ntokens};
        c->used++;
        k = NULL;
        tokens = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    free(k);
    free(tokens);
    return r;
}

void tandem_tokcache_stats(tok_cache *c, uint64_t *hits, uint64_t *misses, uint64_t *entries) {
    pthread_mutex_lock(&c->mu);
    *hits = c->hits;
    *misses = c->misses;
    *entries = c->used;
    pthread_mutex_unlock(&c->mu);
}

void tandem_tokcache_free(tok_cache *c) {
    pthread_mutex_lock(&c->mu);
    clear_locked(c);
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_destroy(&c->mu);
    free(c->slots);
    free(c);
}
