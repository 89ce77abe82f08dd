/* The KV block-hash chain (engine/block_hash.py) in one call: keyed BLAKE2b, 8-byte digest, per RFC 7693.
 *
 * Block i of `tokens` hashes the message
 *     parent (8 bytes LE) | block_size tokens (int32 LE each) | extra
 * where parent is the previous block's digest (the caller's `parent` for block 0), extra is the caller's
 * b"\x00" + key.encode() for each extra key, and the 8-byte digest is read as a little-endian uint64. The key is
 * the fixed "tandem-kv-block-hash-v1", so the state after the key block is the same for every block: it is
 * computed once, when the library is loaded, and each block starts from a copy of it.
 *
 *   tandem_hash_blocks   hashes of the n_tokens / block_size full blocks into out; returns their number, or -1
 *                        on bad arguments or when the message buffer cannot be allocated
 *
 * Pure C, no threads, no global state written after load: safe to call from several threads at once.
 *
 * Built with -DTANDEM_PY_EXTENSION and the interpreter's headers, the file is also the CPython module
 * engine._block_hash, whose hash_blocks(tokens, block_size, extra, parent, start) reads a list or tuple of ints
 * directly: packing 1024 token ids into a buffer for the ctypes call cost as much as hashing them. It returns None,
 * and leaves the errors to engine/block_hash.py's other paths, for anything but exact ints within int32.
 */
#ifdef TANDEM_PY_EXTENSION /* the same file built as the CPython module engine._block_hash (see the end) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The round needs 16 state words, 16 message words and temporaries: more than x86-64 has general registers. With
 * -march=native on an AVX-512 Zen, GCC's Zen tuning spills them into xmm16-31 (a register-file crossing per spill)
 * instead of the stack, which makes compression 4x slower; generic tuning spills to the stack. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("tune=generic")
#endif

#define BLOCK_BYTES 128
#define DIGEST_BYTES 8

static const char KEY[] = "tandem-kv-block-hash-v2";
#define KEY_BYTES (sizeof(KEY) - 1)

/* RFC 7693 section 2.6: the SHA-512 initialisation vector. */
static const uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* RFC 7693 section 2.7: message word schedule; rounds 10 and 11 reuse rows 0 and 1. */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

typedef struct {
    uint64_t h[8];
    uint64_t t; /* bytes compressed so far (the high word of the RFC's 128-bit counter stays 0 here) */
} state;

static state keyed; /* after the parameter block and the key block; set by init_keyed() at load */

static inline uint64_t rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store_le64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

/* RFC 7693 section 3.1: the mixing function G on four words of the working vector. */
#define MIX(a, b, c, d, x, y)            \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];              \
        v[b] = rotr(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];              \
        v[b] = rotr(v[b] ^ v[c], 63);    \
    } while (0)

/* One round: G on the four columns, then on the four diagonals. */
#define ROUND(r)                                                  \
    do {                                                          \
        MIX(0, 4, 8, 12, m[SIGMA[r][0]], m[SIGMA[r][1]]);         \
        MIX(1, 5, 9, 13, m[SIGMA[r][2]], m[SIGMA[r][3]]);         \
        MIX(2, 6, 10, 14, m[SIGMA[r][4]], m[SIGMA[r][5]]);        \
        MIX(3, 7, 11, 15, m[SIGMA[r][6]], m[SIGMA[r][7]]);        \
        MIX(0, 5, 10, 15, m[SIGMA[r][8]], m[SIGMA[r][9]]);        \
        MIX(1, 6, 11, 12, m[SIGMA[r][10]], m[SIGMA[r][11]]);      \
        MIX(2, 7, 8, 13, m[SIGMA[r][12]], m[SIGMA[r][13]]);       \
        MIX(3, 4, 9, 14, m[SIGMA[r][14]], m[SIGMA[r][15]]);       \
    } while (0)

/* RFC 7693 section 3.2: compress one 128-byte block into h; t is the byte count including this block. */
static void compress(uint64_t h[8], const uint8_t block[BLOCK_BYTES], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* low word of the counter; the high word (v[13]) would take t >> 64, always 0 */
    if (last) v[14] = ~v[14];
    /* Spelled out with a constant round number, so the schedule lookups fold away and v stays in registers. */
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* Parameter block (digest length, key length, fanout 1, depth 1) folded into h[0], then the zero-padded key as
 * the first block, never the last one: every message here has at least the 8 parent bytes after it. */
__attribute__((constructor)) static void init_keyed(void) {
    uint8_t block[BLOCK_BYTES] = {0};
    for (int i = 0; i < 8; i++) keyed.h[i] = IV[i];
    keyed.h[0] ^= 0x01010000ULL ^ ((uint64_t)KEY_BYTES << 8) ^ DIGEST_BYTES;
    memcpy(block, KEY, KEY_BYTES);
    keyed.t = BLOCK_BYTES;
    compress(keyed.h, block, keyed.t, 0);
}

/* Digest of msg[0:len] (len >= 1) continuing from the keyed state. */
static uint64_t hash_message(const uint8_t *msg, size_t len) {
    uint64_t h[8];
    uint64_t t = keyed.t;
    memcpy(h, keyed.h, sizeof h);
    while (len > BLOCK_BYTES) {
        t += BLOCK_BYTES;
        compress(h, msg, t, 0);
        msg += BLOCK_BYTES;
        len -= BLOCK_BYTES;
    }
    uint8_t last[BLOCK_BYTES] = {0};
    memcpy(last, msg, len);
    compress(h, last, t + len, 1);
    return h[0]; /* the first 8 output bytes, little-endian: exactly h[0] */
}

int64_t tandem_hash_blocks(const int32_t *tokens, int64_t n_tokens, int64_t block_size, const uint8_t *extra,
                           int64_t extra_len, uint64_t parent, uint64_t *out) {
    if (n_tokens < 0 || block_size <= 0 || extra_len < 0 || block_size > (INT64_MAX - 8 - extra_len) / 4) return -1;
    int64_t n_blocks = n_tokens / block_size;
    if (n_blocks == 0) return 0;
    size_t token_bytes = (size_t)block_size * 4;
    size_t len = 8 + token_bytes + (size_t)extra_len;
    uint8_t *msg = malloc(len);
    if (msg == NULL) return -1;
    if (extra_len) memcpy(msg + 8 + token_bytes, extra, (size_t)extra_len); /* the same for every block */
    for (int64_t b = 0; b < n_blocks; b++) {
        const int32_t *blk = tokens + b * block_size;
        store_le64(msg, parent);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        for (int64_t i = 0; i < block_size; i++) {
            uint32_t v = (uint32_t)blk[i];
            for (int k = 0; k < 4; k++) msg[8 + 4 * i + k] = (uint8_t)(v >> (8 * k));
        }
#else
        memcpy(msg + 8, blk, token_bytes);
#endif
        parent = hash_message(msg, len);
        out[b] = parent;
    }
    free(msg);
    return n_blocks;
}

#ifdef TANDEM_PY_EXTENSION
static PyObject *py_hash_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "hash_blocks(tokens, block_size, extra, parent, start)");
        return NULL;
    }
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "extra must be bytes");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    unsigned long long parent = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (block_size <= 0 || start < 0 || start > n) Py_RETURN_NONE;
    Py_ssize_t n_blocks = (n - start) / block_size, count = n_blocks * block_size;
    PyObject **items = PySequence_Fast_ITEMS(seq) + start;
    int32_t *tokens = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(int32_t));
    uint64_t *out = PyMem_Malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * sizeof(uint64_t));
    if (tokens == NULL || out == NULL) {
        PyMem_Free(tokens);
        PyMem_Free(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int overflow = 0;
        long v = PyLong_CheckExact(items[i]) ? PyLong_AsLongAndOverflow(items[i], &overflow) : 0;
        if (!PyLong_CheckExact(items[i]) || overflow || v < INT32_MIN || v > INT32_MAX) {
            PyMem_Free(tokens);
            PyMem_Free(out);
            Py_RETURN_NONE;
        }
        tokens[i] = (int32_t)v;
    }
    const uint8_t *extra = (const uint8_t *)PyBytes_AS_STRING(args[2]);
    Py_ssize_t extra_len = PyBytes_GET_SIZE(args[2]);
    int64_t got;
    Py_BEGIN_ALLOW_THREADS
    got = tandem_hash_blocks(tokens, count, block_size, extra, extra_len, parent, out);
    Py_END_ALLOW_THREADS
    PyMem_Free(tokens);
    PyObject *result = NULL;
    if (got != n_blocks) {
        PyErr_SetString(PyExc_MemoryError, "block hash: message buffer");
    } else if ((result = PyList_New(n_blocks)) != NULL) {
        for (Py_ssize_t b = 0; b < n_blocks; b++) {
            PyObject *h = PyLong_FromUnsignedLongLong(out[b]);
            if (h == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, b, h);
        }
    }
    PyMem_Free(out);
    return result;
}

static PyMethodDef block_hash_methods[] = {
    {"hash_blocks", (PyCFunction)(void (*)(void))py_hash_blocks, METH_FASTCALL,
     "hash_blocks(tokens, block_size, extra, parent, start) -> list of block hashes, or None to use another path"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef block_hash_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_block_hash", .m_doc = "engine/kernels/block_hash.c for Python lists.",
    .m_size = -1, .m_methods = block_hash_methods,
};

PyMODINIT_FUNC PyInit__block_hash(void) { return PyModule_Create(&block_hash_module); }
#endif
