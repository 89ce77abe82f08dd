/* kvtransfer._tcp_pump: the tcp sender's writes on one native thread per connection, without the GIL.
 *
 * A Pump owns nothing but a queue: Python pushes a run of buffers (frame headers, and memoryviews of the KV
 * tensors' own memory as payloads) with a deadline, under the GIL, and returns at once; the pump's thread
 * gathers everything queued into sendmsg calls (IOV_MAX buffers at most per call) straight from that memory,
 * waiting in poll() for room, never taking the GIL. Each pushed buffer is held (a Py_buffer, so the exporting
 * object stays alive and its memory stays put) until it went out; the thread only moves finished items to a
 * list that Python releases on its next call (push, pending, close), with the GIL.
 *
 * A failed send (peer gone, reset) or a deadline that passes mid-send is final: the pump records why, shuts the
 * socket down both ways (so the sender's reader thread, blocked in recv on it, sees the end and fails every
 * request on the connection, as the Python path does) and drops what is queued. The socket's fd stays Python's:
 * close() stops and joins the thread before Python closes it.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define PUMP_IOV 512          /* buffers per sendmsg call, under Linux's IOV_MAX of 1024 */
#define PUMP_SLICE_MS 100     /* longest poll(): the thread re-checks stop between slices */

typedef struct Item {
    struct Item *next;
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    double deadline;          /* CLOCK_MONOTONIC seconds, as Python's time.monotonic() */
} Item;

typedef struct {
    PyObject_HEAD
    int fd;
    int started;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Item *head, *tail;        /* queued, in push order */
    Item *done;               /* sent or dropped: Python releases their buffers */
    int stop, dead, busy;
    unsigned long long pushed, sent;  /* bytes */
    char error[256];
} Pump;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void release_items(Item *it) {  /* with the GIL */
    while (it) {
        Item *next = it->next;
        for (Py_ssize_t i = 0; i < it->nbufs; i++) PyBuffer_Release(&it->bufs[i]);
        PyMem_RawFree(it->bufs);
        PyMem_RawFree(it);
        it = next;
    }
}

static void release_done(Pump *p) {  /* with the GIL */
    pthread_mutex_lock(&p->mu);
    Item *done = p->done;
    p->done = NULL;
    pthread_mutex_unlock(&p->mu);
    release_items(done);
}

static void append_done(Pump *p, Item *first, Item *last) {  /* under mu */
    if (!first) return;
    last->next = p->done;
    p->done = first;
}

/* Send every buffer of the batch [first..] before the earliest deadline; 0, or -1 with p->error set. */
static int send_batch(Pump *p, Item *first, unsigned long long *nbytes) {
    double deadline = first->deadline;
    Py_ssize_t total = 0;
    for (Item *it = first; it; it = it->next) {
        if (it->deadline < deadline) deadline = it->deadline;
        total += it->nbufs;
    }
    struct iovec *iov = malloc(sizeof(struct iovec) * (size_t)(total ? total : 1));
    if (!iov) {
        snprintf(p->error, sizeof p->error, "out of memory");
        return -1;
    }
    Py_ssize_t n = 0;
    for (Item *it = first; it; it = it->next)
        for (Py_ssize_t i = 0; i < it->nbufs; i++)
            if (it->bufs[i].len > 0) {
                iov[n].iov_base = it->bufs[i].buf;
                iov[n].iov_len = (size_t)it->bufs[i].len;
                *nbytes += (unsigned long long)it->bufs[i].len;
                n++;
            }
    Py_ssize_t at = 0;
    int rc = 0;
    while (at < n) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov + at;
        msg.msg_iovlen = (size_t)((n - at) < PUMP_IOV ? (n - at) : PUMP_IOV);
        ssize_t sent = sendmsg(p->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                snprintf(p->error, sizeof p->error, "send failed: %s", strerror(errno));
                rc = -1;
                break;
            }
            double left = deadline - now_s();
            if (left <= 0) {
                snprintf(p->error, sizeof p->error, "deadline passed during the send");
                rc = -1;
                break;
            }
            int ms = left * 1e3 > PUMP_SLICE_MS ? PUMP_SLICE_MS : (int)(left * 1e3) + 1;
            struct pollfd pfd = {.fd = p->fd, .events = POLLOUT};
            poll(&pfd, 1, ms);
            pthread_mutex_lock(&p->mu);
            int stop = p->stop;
            pthread_mutex_unlock(&p->mu);
            if (stop) {
                snprintf(p->error, sizeof p->error, "sender closed during the send");
                rc = -1;
                break;
            }
            continue;
        }
        size_t left = (size_t)sent;
        while (at < n && left >= iov[at].iov_len) {
            left -= iov[at].iov_len;
            at++;
        }
        if (left) {
            iov[at].iov_base = (char *)iov[at].iov_base + left;
            iov[at].iov_len -= left;
        }
    }
    free(iov);
    return rc;
}

static void *pump_main(void *arg) {
    Pump *p = arg;
    pthread_setname_np(pthread_self(), "kv-tcp-pump");
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->head) pthread_cond_wait(&p->cv, &p->mu);
        if (!p->head) break;  /* stopped with nothing queued */
        Item *first = p->head, *last = p->tail;
        p->head = p->tail = NULL;
        p->busy = 1;
        pthread_mutex_unlock(&p->mu);
        unsigned long long nbytes = 0;
        int rc = send_batch(p, first, &nbytes);
        pthread_mutex_lock(&p->mu);
        p->busy = 0;
        append_done(p, first, last);
        if (rc == 0) {
            p->sent += nbytes;
            pthread_cond_broadcast(&p->cv);
            continue;
        }
        p->dead = 1;  /* final: drop what is queued, cut the connection both ways */
        append_done(p, p->head, p->tail);
        p->head = p->tail = NULL;
        shutdown(p->fd, SHUT_RDWR);
        pthread_cond_broadcast(&p->cv);
        break;
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static int Pump_init(Pump *p, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", NULL};
    int fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &fd)) return -1;
    if (p->started) {
        PyErr_SetString(PyExc_RuntimeError, "Pump already started");
        return -1;
    }
    p->fd = fd;
    p->head = p->tail = p->done = NULL;
    p->stop = p->dead = p->busy = 0;
    p->pushed = p->sent = 0;
    p->error[0] = 0;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    int rc = pthread_create(&p->thread, NULL, pump_main, p);
    if (rc) {
        PyErr_Format(PyExc_OSError, "pthread_create: %s", strerror(rc));
        return -1;
    }
    p->started = 1;
    return 0;
}

static void stop_join(Pump *p) {
    if (!p->started) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(p->thread, NULL);
    Py_END_ALLOW_THREADS
    p->started = 0;
    release_items(p->head);
    p->head = p->tail = NULL;
    release_done(p);
}

static void Pump_dealloc(Pump *p) {
    if (p->started) {
        pthread_mutex_lock(&p->mu);
        p->stop = 1;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        pthread_join(p->thread, NULL);  /* the thread never takes the GIL */
        p->started = 0;
        release_items(p->head);
        p->head = NULL;
        release_items(p->done);
        p->done = NULL;
    }
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* push(buffers, deadline) -> bool: queue the buffers (any objects with the buffer protocol, held until sent) as
 * one item; False when the pump is dead or closed (nothing queued). */
static PyObject *Pump_push(Pump *p, PyObject *args) {
    PyObject *seq;
    double deadline;
    if (!PyArg_ParseTuple(args, "Od", &seq, &deadline)) return NULL;
    release_done(p);
    PyObject *fast = PySequence_Fast(seq, "push() takes a sequence of buffers");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Item *it = PyMem_RawCalloc(1, sizeof(Item));
    Py_buffer *bufs = PyMem_RawCalloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (!it || !bufs) {
        PyMem_RawFree(it);
        PyMem_RawFree(bufs);
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    it->bufs = bufs;
    it->deadline = deadline;
    unsigned long long nbytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &bufs[i], PyBUF_C_CONTIGUOUS) < 0) {
            release_items(it);
            Py_DECREF(fast);
            return NULL;
        }
        it->nbufs = i + 1;
        nbytes += (unsigned long long)bufs[i].len;
    }
    Py_DECREF(fast);
    pthread_mutex_lock(&p->mu);
    if (p->dead || p->stop || !p->started) {
        pthread_mutex_unlock(&p->mu);
        release_items(it);
        Py_RETURN_FALSE;
    }
    if (p->tail) p->tail->next = it;
    else p->head = it;
    p->tail = it;
    p->pushed += nbytes;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    Py_RETURN_TRUE;
}

/* state() -> (pushed bytes, sent bytes, error or None) */
static PyObject *Pump_state(Pump *p, PyObject *Py_UNUSED(ignored)) {
    release_done(p);
    pthread_mutex_lock(&p->mu);
    unsigned long long pushed = p->pushed, sent = p->sent;
    int dead = p->dead;
    char error[256];
    memcpy(error, p->error, sizeof error);
    pthread_mutex_unlock(&p->mu);
    if (dead) return Py_BuildValue("KKs", pushed, sent, error);
    return Py_BuildValue("KKO", pushed, sent, Py_None);
}

/* drain(timeout_s) -> bool: wait (without the GIL) until everything pushed went out; False on timeout or death. */
static PyObject *Pump_drain(Pump *p, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    double end = now_s() + timeout;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    for (;;) {
        ok = !p->dead && !p->head && !p->busy;
        if (ok || p->dead || !p->started) break;
        double left = end - now_s();
        if (left <= 0) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + (left < 0.1 ? left : 0.1);
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    }
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    release_done(p);
    return PyBool_FromLong(ok);
}

static PyObject *Pump_close(Pump *p, PyObject *Py_UNUSED(ignored)) {
    stop_join(p);
    Py_RETURN_NONE;
}

static PyMethodDef Pump_methods[] = {
    {"push", (PyCFunction)Pump_push, METH_VARARGS, "push(buffers, deadline) -> bool: queue one run of buffers"},
    {"state", (PyCFunction)Pump_state, METH_NOARGS, "state() -> (pushed bytes, sent bytes, error or None)"},
    {"drain", (PyCFunction)Pump_drain, METH_VARARGS, "drain(timeout_s) -> bool: wait until all pushed went out"},
    {"close", (PyCFunction)Pump_close, METH_NOARGS, "stop and join the thread (the fd stays open)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtransfer._tcp_pump.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pump(fd): one native thread that writes pushed buffers to the socket fd, without the GIL",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pump_init,
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_methods = Pump_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tcp_pump", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__tcp_pump(void) {
    if (PyType_Ready(&PumpType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PumpType);
    if (PyModule_AddObject(m, "Pump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(&PumpType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
