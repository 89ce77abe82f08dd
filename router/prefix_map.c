/* PrefixMap: the lookup side of router/kv_index.py's KVIndex, as a CPython extension type.
 *
 * A map from a 64-bit block hash to the (interned) Python int bitmask of the worker slots that hold it, and the
 * prefix walk of KVIndex.match over it. Why C: on a cold 1M-entry index a Python dict lookup costs three DRAM misses
 * (index table, entry, key object) one after another; here a lookup is one miss into an open-addressing table
 * whose slots hold the key inline, and the walk prefetches the next PREFETCH positions' slots while it works, so
 * the misses overlap.
 *
 * Table: linear probing, capacity a power of two, load <= 1/2, home slot = Fibonacci hash of the key (block hashes
 * are already uniform; this also spreads small test keys). Deletion shifts the following run back (no tombstones),
 * so lookups never slow down with churn. A slot is empty when its value is NULL. Values must be ints (the masks),
 * which cannot form reference cycles, so the type needs no GC support.
 *
 * match(hashes, ids) -> (dict, pos): the same walk as the Python path. `run` is the AND of the masks seen so far;
 * where it loses bits at position i, the workers of the lost bits (ids[slot] per bit; ids is KVIndex._ids, a list
 * holding None for a free slot) matched i leading blocks. The walk ends at the first position no still-matching worker holds;
 * `pos` is where it ended (0 when the first block is held by nobody). A hash outside [0, 2**64) cannot be in the
 * map (insertion refuses it), so it ends the walk like a miss.
 *
 * match_depths(hashes, depths) -> pos: the same walk, but the result is written per slot into `depths` (a writable
 * int32 buffer, zeroed first, one entry per slot): no dict of a hundred workers is built, and the router's cost
 * kernel reads the candidates' entries straight from it. A free slot holds no hash, so its entry stays 0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH 16
#define STACK_KEYS 256

typedef struct {
    uint64_t key;
    PyObject *value; /* owned; NULL = empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t cap; /* power of two */
    size_t len;
    unsigned shift; /* 64 - log2(cap) */
} PrefixMap;

static inline size_t home_of(const PrefixMap *m, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> m->shift);
}

static inline Slot *find(const PrefixMap *m, uint64_t key) {
    const size_t mask = m->cap - 1;
    for (size_t i = home_of(m, key);; i = (i + 1) & mask) {
        Slot *s = &m->slots[i];
        if (s->value == NULL) return NULL;
        if (s->key == key) return s;
    }
}

static int as_key(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block hashes must be int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    /* CPython 3.11 digits read in place: PyLong_AsUnsignedLongLong goes through a byte-by-byte conversion for any
     * int above 2**30, which is every block hash, and cost a fifth of a cold match. */
    Py_ssize_t size = Py_SIZE(o);
    const digit *d = ((PyLongObject *)o)->ob_digit;
    if (size >= 0 && size <= 3 && (size < 3 || d[2] < 16u)) {
        uint64_t v = 0;
        for (Py_ssize_t j = size - 1; j >= 0; j--) v = (v << PyLong_SHIFT) | d[j];
        *out = v;
        return 0;
    }
    PyErr_SetString(PyExc_OverflowError, "block hash outside [0, 2**64)");
    return -1;
#else
    unsigned long long v = PyLong_AsUnsignedLongLong(o); /* OverflowError when negative or >= 2**64 */
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
#endif
}

static int resize(PrefixMap *m, size_t cap) {
    Slot *slots = PyMem_Calloc(cap, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = m->slots;
    size_t old_cap = m->cap;
    m->slots = slots;
    m->cap = cap;
    m->shift = 64u - (unsigned)__builtin_ctzll((unsigned long long)cap);
    const size_t mask = cap - 1;
    for (size_t j = 0; j < old_cap; j++) {
        if (old[j].value == NULL) continue;
        size_t i = home_of(m, old[j].key);
        while (slots[i].value != NULL) i = (i + 1) & mask;
        slots[i] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

static int insert(PrefixMap *m, uint64_t key, PyObject *value) {
    Slot *s = find(m, key);
    if (s != NULL) {
        PyObject *old = s->value;
        Py_INCREF(value);
        s->value = value;
        Py_DECREF(old);
        return 0;
    }
    if ((m->len + 1) * 2 > m->cap && resize(m, m->cap * 2) < 0) return -1;
    const size_t mask = m->cap - 1;
    size_t i = home_of(m, key);
    while (m->slots[i].value != NULL) i = (i + 1) & mask;
    Py_INCREF(value);
    m->slots[i].key = key;
    m->slots[i].value = value;
    m->len++;
    return 0;
}

/* Empty slot i and pull back every later entry of its probe run that may live at or before the hole. */
static void erase(PrefixMap *m, Slot *s) {
    const size_t mask = m->cap - 1;
    size_t hole = (size_t)(s - m->slots);
    PyObject *old = s->value;
    for (size_t j = (hole + 1) & mask; m->slots[j].value != NULL; j = (j + 1) & mask) {
        size_t h = home_of(m, m->slots[j].key);
        if (((j - h) & mask) >= ((j - hole) & mask)) { /* the hole lies on j's probe path: move it there */
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].value = NULL;
    m->len--;
    Py_DECREF(old);
}

static void clear_all(PrefixMap *m) {
    for (size_t i = 0; i < m->cap; i++) {
        PyObject *v = m->slots[i].value;
        if (v != NULL) {
            m->slots[i].value = NULL;
            Py_DECREF(v);
        }
    }
    m->len = 0;
}

static PyObject *PrefixMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "PrefixMap() takes no arguments");
        return NULL;
    }
    PrefixMap *m = (PrefixMap *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->slots = NULL;
    m->cap = 0;
    m->len = 0;
    if (resize(m, 16) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void PrefixMap_dealloc(PrefixMap *m) {
    if (m->slots != NULL) {
        clear_all(m);
        PyMem_Free(m->slots);
    }
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t PrefixMap_len(PrefixMap *m) { return (Py_ssize_t)m->len; }

static PyObject *PrefixMap_getitem(PrefixMap *m, PyObject *k) {
    uint64_t key;
    if (as_key(k, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
        PyErr_SetObject(PyExc_KeyError, k);
        return NULL;
    }
    Slot *s = find(m, key);
    if (s == NULL) {
        PyErr_SetObject(PyExc_KeyError, k);
        return NULL;
    }
    return Py_NewRef(s->value);
}

static int PrefixMap_setitem(PrefixMap *m, PyObject *k, PyObject *v) {
    uint64_t key;
    if (v != NULL && !PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "PrefixMap values must be int masks, not %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    if (as_key(k, &key) < 0) {
        if (v == NULL && PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetObject(PyExc_KeyError, k);
        }
        return -1;
    }
    if (v != NULL) return insert(m, key, v);
    Slot *s = find(m, key);
    if (s == NULL) {
        PyErr_SetObject(PyExc_KeyError, k);
        return -1;
    }
    erase(m, s);
    return 0;
}

static PyObject *PrefixMap_get(PrefixMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *dflt = nargs == 2 ? args[1] : Py_None;
    uint64_t key;
    if (as_key(args[0], &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
        return Py_NewRef(dflt);
    }
    Slot *s = find(m, key);
    return Py_NewRef(s != NULL ? s->value : dflt);
}

static PyObject *PrefixMap_clear(PrefixMap *m, PyObject *Py_UNUSED(ignored)) {
    clear_all(m);
    Py_RETURN_NONE;
}

/* The set bits of a non-negative int `mask`, as a word array: `*words` 30-bit words (CPython 3.11's own digits,
 * read in place) or 8-bit words (newer CPythons, converted into `buf`). Returns the bits per word, or -1. */
static int mask_words(PyObject *mask, unsigned char *buf, size_t buf_len, const void **words, size_t *count) {
#if PY_VERSION_HEX < 0x030C0000
    (void)buf;
    (void)buf_len;
    Py_ssize_t size = Py_SIZE(mask);
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "worker mask is negative");
        return -1;
    }
    *words = ((PyLongObject *)mask)->ob_digit;
    *count = (size_t)size;
    return PyLong_SHIFT;
#else
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t got = PyLong_AsNativeBytes(mask, buf, (Py_ssize_t)buf_len,
                                          Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (got < 0) return -1;
    if ((size_t)got > buf_len) {
        PyErr_SetString(PyExc_ValueError, "worker mask has a bit past the last slot");
        return -1;
    }
#else
    if (_PyLong_AsByteArray((PyLongObject *)mask, buf, buf_len, 1, 0) < 0) return -1;
#endif
    *words = buf;
    *count = buf_len;
    return 8;
#endif
}

static inline uint32_t word_at(const void *words, int bits, size_t j) {
    return bits == 8 ? ((const unsigned char *)words)[j] : (uint32_t)((const digit *)words)[j];
}

/* Where a walk puts what it finds: a dict keyed by worker id (match), or an int32 entry per slot (match_depths). */
typedef struct {
    PyObject *ids;  /* match: KVIndex._ids (a list); NULL for match_depths */
    PyObject *out;  /* match: the result dict, created at the first drop */
    int32_t *depths; /* match_depths: one entry per slot */
    Py_ssize_t nslots;
} Sink;

/* Record `pos` for every slot whose bit is set in `mask`: out[ids[s]] = pos (None entries of ids are free slots:
 * skipped), or depths[s] = pos. The first drop creates `out` presized for its workers, so that a system prompt shared
 * by a hundred workers does not resize the dict five times on the way. */
static int emit(Sink *sink, PyObject *mask, Py_ssize_t pos) {
    unsigned char stack_buf[256];
    Py_ssize_t nslots = sink->nslots;
#if PY_VERSION_HEX < 0x030C0000
    size_t n = 0; /* mask_words reads the int's own digits: no buffer, so no allocation past 2048 slots */
#else
    size_t n = ((size_t)nslots + 7) / 8;
#endif
    unsigned char *buf = n <= sizeof stack_buf ? stack_buf : PyMem_Malloc(n);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = -1;
    PyObject *p = NULL;
    const void *words;
    size_t count;
    int bits = mask_words(mask, buf, n, &words, &count);
    if (bits < 0) goto done;
    if (sink->ids != NULL) {
        if (sink->out == NULL) {
            Py_ssize_t total = 0;
            for (size_t j = 0; j < count; j++) total += __builtin_popcount(word_at(words, bits, j));
            if ((sink->out = _PyDict_NewPresized(total)) == NULL) goto done;
        }
        if ((p = PyLong_FromSsize_t(pos)) == NULL) goto done;
    }
    for (size_t j = 0; j < count; j++) {
        for (uint32_t w = word_at(words, bits, j); w; w &= w - 1) {
            Py_ssize_t slot = (Py_ssize_t)(j * (size_t)bits + (size_t)__builtin_ctz(w));
            if (slot >= nslots) {
                PyErr_SetString(PyExc_ValueError, "worker mask has a bit past the last slot");
                goto done;
            }
            if (sink->ids == NULL) {
                sink->depths[slot] = (int32_t)pos;
                continue;
            }
            PyObject *worker = PyList_GET_ITEM(sink->ids, slot);
            if (worker != Py_None && PyDict_SetItem(sink->out, worker, p) < 0) goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(p);
    if (buf != stack_buf) PyMem_Free(buf);
    return rc;
}

/* The prefix walk over `hashes` into `sink`; returns the position where it ended, or -1 with an exception set. */
static Py_ssize_t walk(PrefixMap *m, PyObject *hashes, Sink *sink) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t stack_keys[STACK_KEYS];
    uint64_t *keys = n <= STACK_KEYS ? stack_keys : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    PyObject *run = NULL;
    Py_ssize_t pos = -1;
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t valid = 0; /* keys[0:valid] converted; the walk cannot pass the first hash that cannot be stored */
    for (; valid < n; valid++) {
        if (as_key(items[valid], &keys[valid]) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) goto done;
            PyErr_Clear();
            break;
        }
    }
    for (Py_ssize_t i = 0; i < valid && i < PREFETCH; i++) __builtin_prefetch(&m->slots[home_of(m, keys[i])]);
    PyObject *prev = NULL; /* borrowed: the previous position's mask */
    Py_ssize_t i = 0;
    for (; i < valid; i++) {
        if (i + PREFETCH < valid) __builtin_prefetch(&m->slots[home_of(m, keys[i + PREFETCH])]);
        Slot *s = find(m, keys[i]);
        PyObject *mask = s != NULL ? s->value : NULL;
        if (i == 0) {
            if (mask == NULL) break; /* nobody holds the first block */
            run = Py_NewRef(mask);
            prev = mask;
            continue;
        }
        if (mask == prev) continue; /* same run of masks: nothing changes */
        prev = mask;
        if (mask == NULL) break; /* every still-matching worker stops here (handled below) */
        PyObject *kept = PyNumber_And(run, mask);
        if (kept == NULL) goto done;
        int same = PyObject_RichCompareBool(kept, run, Py_EQ);
        if (same != 0) {
            Py_DECREF(kept);
            if (same < 0) goto done;
            continue;
        }
        PyObject *dropped = PyNumber_Xor(run, kept);
        int rc = dropped == NULL ? -1 : emit(sink, dropped, i);
        Py_XDECREF(dropped);
        Py_SETREF(run, kept);
        if (rc < 0) goto done;
        int alive = PyObject_IsTrue(run);
        if (alive < 0) goto done;
        if (!alive) {
            Py_CLEAR(run);
            break;
        }
    }
    if (run != NULL && emit(sink, run, i) < 0) goto done;
    pos = i;
done:
    Py_XDECREF(run);
    if (keys != NULL && keys != stack_keys) PyMem_Free(keys);
    Py_DECREF(seq);
    return pos;
}

static PyObject *PrefixMap_match(PrefixMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "match(hashes, ids)");
        return NULL;
    }
    PyObject *ids = args[1];
    if (!PyList_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "ids must be a list (worker id or None per slot)");
        return NULL;
    }
    Sink sink = {.ids = ids, .out = NULL, .depths = NULL, .nslots = PyList_GET_SIZE(ids)};
    Py_ssize_t pos = walk(m, args[0], &sink);
    if (pos < 0) {
        Py_XDECREF(sink.out);
        return NULL;
    }
    if (sink.out == NULL && (sink.out = PyDict_New()) == NULL) return NULL;
    return Py_BuildValue("(Nn)", sink.out, pos);
}

static PyObject *PrefixMap_match_depths(PrefixMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "match_depths(hashes, depths)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return NULL;
    if (view.ndim != 1 || view.itemsize != sizeof(int32_t) || view.format == NULL ||
        (strcmp(view.format, "i") != 0 && strcmp(view.format, "=i") != 0 && strcmp(view.format, "<i") != 0)) {
        PyErr_SetString(PyExc_ValueError, "depths must be a writable 1-D int32 buffer");
        PyBuffer_Release(&view);
        return NULL;
    }
    Sink sink = {.ids = NULL, .out = NULL, .depths = view.buf, .nslots = view.shape[0]};
    memset(view.buf, 0, (size_t)view.len);
    Py_ssize_t pos = walk(m, args[0], &sink);
    PyBuffer_Release(&view);
    return pos < 0 ? NULL : PyLong_FromSsize_t(pos);
}

static PyMappingMethods PrefixMap_as_mapping = {
    .mp_length = (lenfunc)PrefixMap_len,
    .mp_subscript = (binaryfunc)PrefixMap_getitem,
    .mp_ass_subscript = (objobjargproc)PrefixMap_setitem,
};

static PyMethodDef PrefixMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))PrefixMap_get, METH_FASTCALL, "get(key, default=None): the mask, or default"},
    {"clear", (PyCFunction)PrefixMap_clear, METH_NOARGS, "Remove every entry."},
    {"match", (PyCFunction)(void (*)(void))PrefixMap_match, METH_FASTCALL,
     "match(hashes, ids) -> (dict worker -> leading blocks, position where the walk ended)"},
    {"match_depths", (PyCFunction)(void (*)(void))PrefixMap_match_depths, METH_FASTCALL,
     "match_depths(hashes, depths) -> position where the walk ended; depths[slot] = that slot's leading blocks"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PrefixMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._prefix_map.PrefixMap",
    .tp_doc = "64-bit block hash -> int worker mask, with KVIndex's prefix walk (see router/prefix_map.c).",
    .tp_basicsize = sizeof(PrefixMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PrefixMap_new,
    .tp_dealloc = (destructor)PrefixMap_dealloc,
    .tp_as_mapping = &PrefixMap_as_mapping,
    .tp_methods = PrefixMap_methods,
};

static struct PyModuleDef prefix_map_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_prefix_map", .m_doc = "KVIndex's native lookup table.", .m_size = -1,
};

PyMODINIT_FUNC PyInit__prefix_map(void) {
    if (PyType_Ready(&PrefixMapType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&prefix_map_module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "PrefixMap", (PyObject *)&PrefixMapType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
