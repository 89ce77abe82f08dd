/* The routing cost over many candidates, and the pick: router/cost.py's array path in one call.
 *
 * router/cost.py defines the formula (CostModel.terms) and keeps a numpy version of this path as the fallback and
 * the reference. Why C: at 64-512 candidates the numpy path is ~20 small array operations, each costing about a
 * microsecond of dispatch whatever the length, which was most of a routing decision. Here it is one pass.
 *
 * score(table, slots, positions, overlap, r, pw, dw, qw, inv_bs, temperature, u, out) -> int
 *   table      float64 (3, cap), C order: prefill_tokens, decode_blocks, queue_depth per load slot
 *   slots      intp (n,): each candidate's slot in table
 *   positions  dict worker -> candidate index; overlap: dict worker -> cached leading blocks (workers that are not
 *              candidates are skipped); or, as KVIndex.match_depths gives them:
 *              positions intp (n,): each candidate's slot in the index (-1: none); overlap int32 (index slots,):
 *              cached leading blocks per index slot
 *   out        float64 (5, n), C order, written: overlap (capped at r), prefill, decode, queue, total
 *   returns the chosen index; at temperature 0 with several exact minimum totals, -1 (the caller breaks the tie
 *   with its rng, as CostModel.choose_array does). At temperature > 0, u in [0, 1) is the caller's one draw: the
 *   pick is the first index whose cumulative softmax weight exceeds u times their sum.
 *
 * Every term is computed with the same operations in the same order as CostModel.terms on arrays, in double, with
 * no contraction into fused multiply-adds (-ffp-contract=off is set in the build), so totals are bit-identical to
 * the numpy path; the test suite checks that.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#pragma STDC FP_CONTRACT OFF

static int get_buffer(PyObject *obj, Py_buffer *view, int ndim, Py_ssize_t itemsize, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->ndim != ndim || view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d-D with %zd-byte items", what, ndim, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *score(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "score(table, slots, positions, overlap, r, pw, dw, qw, inv_bs, temperature, u, out)");
        return NULL;
    }
    PyObject *positions = args[2], *overlap = args[3];
    const int by_dict = PyDict_Check(positions);
    if (by_dict != PyDict_Check(overlap)) {
        PyErr_SetString(PyExc_TypeError, "positions and overlap must both be dicts, or both arrays");
        return NULL;
    }
    long r_long = PyLong_AsLong(args[4]);
    double pw = PyFloat_AsDouble(args[5]), dw = PyFloat_AsDouble(args[6]), qw = PyFloat_AsDouble(args[7]);
    double inv_bs = PyFloat_AsDouble(args[8]), temperature = PyFloat_AsDouble(args[9]);
    double u = PyFloat_AsDouble(args[10]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer tv, sv, ov, pv = {0}, dv = {0};
    if (get_buffer(args[0], &tv, 2, sizeof(double), 0, "table") < 0) return NULL;
    if (get_buffer(args[1], &sv, 1, sizeof(Py_ssize_t), 0, "slots") < 0) {
        PyBuffer_Release(&tv);
        return NULL;
    }
    if (get_buffer(args[11], &ov, 2, sizeof(double), 1, "out") < 0) {
        PyBuffer_Release(&tv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = sv.shape[0], cap = tv.shape[1];
    if (tv.shape[0] != 3 || ov.shape[0] != 5 || ov.shape[1] != n || n < 1) {
        PyErr_SetString(PyExc_ValueError, "shapes: table (3, cap), slots (n,), out (5, n), n >= 1");
        goto done;
    }
    const double *tokens = tv.buf, *blocks = tokens + cap, *queued = blocks + cap;
    const Py_ssize_t *slots = sv.buf;
    double *ovl = ov.buf, *prefill = ovl + n, *decode = prefill + n, *queue = decode + n, *total = queue + n;
    const double r = (double)r_long;
    if (!by_dict) {
        if (get_buffer(positions, &pv, 1, sizeof(Py_ssize_t), 0, "index slots") < 0) goto done;
        if (get_buffer(overlap, &dv, 1, sizeof(int32_t), 0, "depths") < 0) goto done;
        if (pv.shape[0] != n) {
            PyErr_SetString(PyExc_ValueError, "index slots must have one entry per candidate");
            goto done;
        }
        const Py_ssize_t *islots = pv.buf, nd = dv.shape[0];
        const int32_t *depths = dv.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t s = islots[i];
            if (s >= nd) {
                PyErr_SetString(PyExc_IndexError, "index slot out of range");
                goto done;
            }
            double v = s < 0 ? 0.0 : (double)depths[s];
            ovl[i] = v < r ? v : r;
        }
        goto scored_overlap;
    }
    for (Py_ssize_t i = 0; i < n; i++) ovl[i] = 0.0;
    PyObject *key, *value;
    Py_ssize_t it = 0;
    while (PyDict_Next(overlap, &it, &key, &value)) {
        PyObject *at = PyDict_GetItemWithError(positions, key); /* borrowed */
        if (at == NULL) {
            if (PyErr_Occurred()) goto done;
            continue; /* a hit on a worker that is not a candidate */
        }
        Py_ssize_t i = PyLong_AsSsize_t(at);
        double v = PyFloat_AsDouble(value);
        if (PyErr_Occurred()) goto done;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "candidate position out of range");
            goto done;
        }
        ovl[i] = v < r ? v : r;
    }
scored_overlap:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = slots[i];
        if (s < 0 || s >= cap) {
            PyErr_SetString(PyExc_IndexError, "load slot out of range");
            goto done;
        }
        double uncached = r - ovl[i];
        prefill[i] = pw * (tokens[s] * inv_bs + uncached);
        decode[i] = dw * (blocks[s] + uncached);
        queue[i] = qw * queued[s];
        total[i] = prefill[i] + decode[i] + queue[i];
    }
    Py_ssize_t best_i = 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (total[i] < total[best_i]) best_i = i;
    const double best = total[best_i];
    Py_ssize_t pick = best_i;
    if (temperature == 0.0) {
        for (Py_ssize_t i = best_i + 1; i < n; i++)
            if (total[i] <= best) {
                pick = -1; /* exact ties: the caller's rng decides */
                break;
            }
    } else {
        const double inv = 1.0 / ((double)(r_long > 1 ? r_long : 1) * temperature);
        double stack_w[512];
        double *w = n <= 512 ? stack_w : PyMem_Malloc((size_t)n * sizeof(double));
        if (w == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        double cum = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) w[i] = cum += exp((best - total[i]) * inv); /* numpy's cumsum order */
        const double x = u * cum;
        pick = n - 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (w[i] > x) { /* searchsorted(cum, x, side="right") */
                pick = i;
                break;
            }
        if (w != stack_w) PyMem_Free(w);
    }
    result = PyLong_FromSsize_t(pick);
done:
    PyBuffer_Release(&tv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&ov);
    if (pv.obj != NULL) PyBuffer_Release(&pv);
    if (dv.obj != NULL) PyBuffer_Release(&dv);
    return result;
}

static PyMethodDef cost_methods[] = {
    {"score", (PyCFunction)(void (*)(void))score, METH_FASTCALL,
     "score(table, slots, positions, overlap, r, pw, dw, qw, inv_bs, temperature, u, out) -> chosen index or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cost_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cost_kernel", .m_doc = "router/cost.py's array path in C.", .m_size = -1,
    .m_methods = cost_methods,
};

PyMODINIT_FUNC PyInit__cost_kernel(void) { return PyModule_Create(&cost_module); }
