/* The DDP backward event (rank/patches/ddp.py's _BackwardHook) in C.
 *
 * Why (issue #11): per DDP step the backward event cost ~40k instructions of a ~1.54M step in
 * Python: the output's tensor hook (~100 bytecodes), DD015's finiteness test of the output
 * gradient (grad.sum().item(): a TensorIterator reduction, ~11k) and the two autograd-engine
 * callbacks that end the event (a functools.partial, then a Python method with the record). Here
 * one object is the tensor hook (called with the gradient) and both engine callbacks (called
 * with no argument): no Python frame, no bound method or partial per step, the record formatted
 * in C. It does what _BackwardHook does, in the same order, and writes the same records.
 *
 * DD015 (rank/patches/grads.py): when the module's _Grads is `quiet` (its steady state: nothing
 * pending, CPU output gradients of one float dtype seen before) and the gradient is an exact
 * torch.Tensor, CPU, strided, not nested, contiguous, float32/float64, its elements are read
 * through data_ptr()/numel() while the hook holds the tensor: all finite means the Python check
 * would have done nothing (a NaN/Inf element makes the sum non-finite; a finite overflowing sum
 * is no finding there either), so it is not called. Anything else (a non-finite element, another
 * dtype or layout, a subclass, an error) calls the Python check, which decides as before.
 *
 * Optional (setup.py, optional=True); without it, or with DDPDOCTOR_NATIVE=0, ddp.py uses its
 * Python _BackwardHook. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <structmember.h>
#include <frameobject.h>
#include "_native.h" /* ddp_put_ll */

/* set once by setup() (strong references, never released) */
static PyObject *queue_cb = NULL;   /* the autograd engine's queue_callback (bound method) */
static PyObject *perf_ns = NULL;    /* time.perf_counter_ns: the clock the Python hook reads */
static PyObject *tensor_type = NULL, *f32 = NULL, *f64 = NULL, *strided = NULL;
static PyObject *odict = NULL, *hook_id = NULL;  /* collections.OrderedDict, ddp._HOOK_ID */
static PyObject *first_grad_tensor = NULL;      /* ddp._first_grad_tensor */
static PyObject *is_grad_enabled = NULL, *site_of = NULL;  /* torch.is_grad_enabled, ddp's site lookup */
static PyObject *site_key = NULL;  /* callsite._site_key, or None */

static PyObject *s_bwd, *s_fwd, *s_fwd_at_bwd, *s_g, *s_grads, *s_seq, *s_t0_ns, *s_inflight,
    *s_ddp_ptrs, *s_dirty, *s_writer, *s_mm, *s_write, *s_emit_bytes, *s_internal_error,
    *s_quiet, *s_fast, *s_is_cpu, *s_layout, *s_dtype, *s_is_nested, *s_is_contiguous,
    *s_nbytes, *s_data_ptr, *s_ddp_bwd, *s_ddp_backward, *s_backward_hooks, *s_grad_fn,
    *s_register_hook_dict, *s_register_hook, *s_gfwd, *s_has_rebuilt_buckets, *s_next_seq,
    *s_require_backward_grad_sync, *s_requires_grad, *s_modules_buffers, *s_check_sync_bufs, *s_sites,
    *s_fkey, *s_ddp_forward, *s_gkind, *s_lib, *s_at, *one, *zero;

typedef struct {
    PyObject_HEAD
    PyObject *rec, *info, *site;
    PyObject *key;                  /* ("ddp_bwd", thread id) once fired */
    PyObject *seq, *step;           /* ints, once fired */
    long long start;                /* µs since rec.t0_ns */
    long long t0;                   /* rec.t0_ns (set once, at the recorder's creation) */
    int have_t0;
    int phase;                      /* 0 not fired, 1 re-queue pending, 2 end pending, 3 ended */
    vectorcallfunc vectorcall;
} Hook;

/* rec.internal_error(exc) for the exception being raised: recording stops being exact, the
 * program goes on (ddpdoctor must never break it). */
static void
internal_error(PyObject *rec)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    if (value != NULL) {
        PyObject *r = PyObject_CallMethodOneArg(rec, s_internal_error, value);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* time.perf_counter_ns(): on Linux CPython reads CLOCK_MONOTONIC, read here directly (no
 * Python call, no int object); elsewhere the function itself. */
static int
perf_counter_ns(long long *out)
{
#if defined(__linux__)
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) == 0) {
        *out = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        return 0;
    }
#endif
    PyObject *ns = PyObject_CallNoArgs(perf_ns);
    if (ns == NULL)
        return -1;
    *out = PyLong_AsLongLong(ns);
    Py_DECREF(ns);
    return PyErr_Occurred() ? -1 : 0;
}

/* (perf_counter_ns() - rec.t0_ns) // 1000, as the Python hook computes it; t0 read once. */
static int
now_us(Hook *self, long long *out)
{
    if (!self->have_t0) {
        PyObject *t0 = PyObject_GetAttr(self->rec, s_t0_ns);
        if (t0 == NULL)
            return -1;
        self->t0 = PyLong_AsLongLong(t0);
        Py_DECREF(t0);
        if (PyErr_Occurred())
            return -1;
        self->have_t0 = 1;
    }
    long long a;
    if (perf_counter_ns(&a) < 0)
        return -1;
    long long d = a - self->t0;
    *out = d >= 0 ? d / 1000 : -((-d + 999) / 1000);  /* Python's floor division */
    return 0;
}

/* 1: every element finite; 0: one is not; -1: cannot tell here (error cleared). */
static int
all_finite_c(PyObject *t)
{
    if (Py_TYPE(t) != (PyTypeObject *)tensor_type)
        return -1;
    int res = -1;
    PyObject *v = NULL, *n = NULL, *p = NULL;
    v = PyObject_GetAttr(t, s_is_cpu);
    if (v != Py_True)
        goto done;
    Py_CLEAR(v);
    v = PyObject_GetAttr(t, s_layout);
    if (v != strided)
        goto done;
    Py_CLEAR(v);
    v = PyObject_GetAttr(t, s_is_nested);
    if (v != Py_False)
        goto done;
    Py_CLEAR(v);
    v = PyObject_GetAttr(t, s_dtype);
    int is32 = v == f32;
    if (!is32 && v != f64)
        goto done;
    Py_CLEAR(v);
    v = PyObject_CallMethodNoArgs(t, s_is_contiguous);
    if (v != Py_True)
        goto done;
    n = PyObject_GetAttr(t, s_nbytes);  /* numel * itemsize, a getter (numel() is a method call) */
    if (n == NULL)
        goto done;
    p = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (p == NULL)
        goto done;
    Py_ssize_t count = PyLong_AsSsize_t(n) / (is32 ? 4 : 8);
    void *ptr = PyLong_AsVoidPtr(p);
    if (PyErr_Occurred() || count < 0 || (ptr == NULL && count > 0))
        goto done;
    /* Non-finite (NaN or Inf) = all exponent bits set. An OR over blocks of integer tests,
     * which the compiler vectorizes (isfinite() element by element cost ~20 instructions each). */
    res = 1;
    if (is32) {
        const uint32_t *x = (const uint32_t *)ptr;
        for (Py_ssize_t i = 0; i < count && res; i += 256) {
            Py_ssize_t end = count - i < 256 ? count : i + 256;
            uint32_t bad = 0;
            for (Py_ssize_t j = i; j < end; j++)
                bad |= (uint32_t)((x[j] & 0x7f800000u) == 0x7f800000u);
            res = !bad;
        }
    } else {
        const uint64_t *x = (const uint64_t *)ptr;
        for (Py_ssize_t i = 0; i < count && res; i += 256) {
            Py_ssize_t end = count - i < 256 ? count : i + 256;
            uint64_t bad = 0;
            for (Py_ssize_t j = i; j < end; j++)
                bad |= (uint64_t)((x[j] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull);
            res = !bad;
        }
    }
done:
    if (res < 0)
        PyErr_Clear();
    Py_XDECREF(v);
    Py_XDECREF(n);
    Py_XDECREF(p);
    return res;
}

/* Whether DD015's Python check would do nothing for this gradient (see the top comment). */
static int
grads_quiet_and_finite(PyObject *grads, PyObject *grad)
{
    PyObject *q = PyObject_GetAttr(grads, s_quiet);
    if (q == NULL) {
        PyErr_Clear();
        return 0;
    }
    int quiet = q == Py_True;
    Py_DECREF(q);
    if (!quiet)
        return 0;
    PyObject *fast = PyObject_GetAttr(grads, s_fast);
    if (fast == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *dt = PyObject_GetAttr(grad, s_dtype);
    int same = dt != NULL && dt == fast;
    Py_DECREF(fast);
    Py_XDECREF(dt);
    if (!same) {
        PyErr_Clear();
        return 0;
    }
    return all_finite_c(grad) == 1;
}

static int
set_item_plus_one(PyObject *d, PyObject *k, PyObject **out)
{
    PyObject *cur = PyObject_GetItem(d, k);
    if (cur == NULL)
        return -1;
    PyObject *nxt = PyNumber_Add(cur, one);
    Py_DECREF(cur);
    if (nxt == NULL || PyObject_SetItem(d, k, nxt) < 0) {
        Py_XDECREF(nxt);
        return -1;
    }
    *out = nxt;
    return 0;
}

/* Backward reached the model's output: _BackwardHook.__call__. */
static PyObject *
hook_fire(Hook *self, PyObject *grad)
{
    if (self->phase)
        Py_RETURN_NONE;
    PyObject *rec = self->rec, *info = self->info;
    PyObject *g = NULL, *seqs = NULL, *seq = NULL, *entry = NULL, *inflight = NULL, *r = NULL;
    PyObject *tid = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (tid == NULL)
        goto error;
    self->key = PyTuple_Pack(2, s_ddp_bwd, tid);
    Py_DECREF(tid);
    if (self->key == NULL)
        goto error;
    self->phase = 1;
    if (set_item_plus_one(info, s_bwd, &self->step) < 0)
        goto error;
    PyObject *fwd = PyObject_GetItem(info, s_fwd);
    if (fwd == NULL)
        goto error;
    int rc = PyObject_SetItem(info, s_fwd_at_bwd, fwd);
    Py_DECREF(fwd);
    if (rc < 0)
        goto error;
    g = PyObject_GetItem(info, s_g);
    if (g == NULL)
        goto error;
    seqs = PyObject_GetAttr(rec, s_seq);
    if (seqs == NULL)
        goto error;
    PyObject *cur = PyDict_Check(seqs) ? PyDict_GetItemWithError(seqs, g) : NULL;  /* borrowed */
    if (cur == NULL && PyErr_Occurred())
        goto error;
    if (!PyDict_Check(seqs)) {
        PyErr_SetString(PyExc_TypeError, "rec.seq is not a dict");
        goto error;
    }
    seq = PyNumber_Add(cur != NULL ? cur : zero, one);
    if (seq == NULL || PyDict_SetItem(seqs, g, seq) < 0)
        goto error;
    self->seq = seq;
    Py_INCREF(seq);
    if (now_us(self, &self->start) < 0)
        goto error;
    PyObject *start = PyLong_FromLongLong(self->start);
    if (start == NULL)
        goto error;
    entry = PyTuple_Pack(5, s_ddp_backward, g, seq, self->site, start);
    Py_DECREF(start);
    if (entry == NULL)
        goto error;
    inflight = PyObject_GetAttr(rec, s_inflight);
    if (inflight == NULL || PyObject_SetItem(inflight, self->key, entry) < 0)
        goto error;
    /* The hook runs before any parameter's gradient, so a callback queued now runs before the
     * one DDP queues to wait for its all-reduce; called, it queues itself again, and the second
     * call (after DDP's wait) ends the event. */
    r = PyObject_CallOneArg(queue_cb, (PyObject *)self);
    if (r == NULL)
        goto error;
    Py_CLEAR(r);
    PyObject *grads = PyObject_GetItem(info, s_grads);
    if (grads == NULL)
        goto error;
    if (grads != Py_None && !grads_quiet_and_finite(grads, grad)) {
        /* DD015/DD016 (grads.py): before DDP queues its end-of-backward callback */
        PyObject *args[3] = {grad, self->step, self->site};
        r = PyObject_Vectorcall(grads, args, 3, NULL);
        if (r == NULL) {
            Py_DECREF(grads);
            goto error;
        }
        Py_CLEAR(r);
    }
    Py_DECREF(grads);
    goto done;
error:
    internal_error(rec);
done:
    Py_XDECREF(g);
    Py_XDECREF(seqs);
    Py_XDECREF(seq);
    Py_XDECREF(entry);
    Py_XDECREF(inflight);
    Py_RETURN_NONE;
}

/* Decimal digits of v at p; returns the end. */
static char *
put_str(char *p, const char *s)
{
    size_t n = strlen(s);
    memcpy(p, s, n);
    return p + n;
}

/* The record's bytes, as the general format would give them, for an ASCII group name of up to
 * 64 characters and exact ints (bools excluded) that fit a long long; else NULL (no error set)
 * and the caller formats it the general way (~7k instructions less per step, issue #11). */
static PyObject *
fast_record(PyObject *g, Hook *self, long long d)
{
    PyObject *nums[3] = {self->seq, self->site, self->step};
    long long v[3];
    for (int i = 0; i < 3; i++) {
        if (!PyLong_CheckExact(nums[i]))
            return NULL;
        int overflow = 0;
        v[i] = PyLong_AsLongLongAndOverflow(nums[i], &overflow);
        if (overflow || (v[i] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return NULL;
        }
    }
    if (!PyUnicode_CheckExact(g) || !PyUnicode_IS_ASCII(g) || PyUnicode_GET_LENGTH(g) > 64)
        return NULL;
    char buf[256];
    char *p = put_str(buf, "{\"t\":\"c\",\"op\":\"ddp_backward\",\"g\":\"");
    Py_ssize_t glen = PyUnicode_GET_LENGTH(g);
    memcpy(p, PyUnicode_DATA(g), (size_t)glen);
    p += glen;
    p = ddp_put_ll(put_str(p, "\",\"s\":"), v[0]);
    p = ddp_put_ll(put_str(p, ",\"ts\":"), self->start);
    p = ddp_put_ll(put_str(p, ",\"d\":"), d);
    p = ddp_put_ll(put_str(p, ",\"site\":"), v[1]);
    p = ddp_put_ll(put_str(p, ",\"step\":"), v[2]);
    p = put_str(p, "}\n");
    return PyBytes_FromStringAndSize(buf, p - buf);
}

/* One record with its newline, encoded, into the mapped trace file (ddp._store). */
static int
store(PyObject *rec, PyObject *data)
{
    PyObject *r = NULL, *mm = NULL;
    PyObject *w = PyObject_GetAttr(rec, s_writer);
    if (w != NULL) {
        mm = PyObject_GetAttr(w, s_mm);
        Py_DECREF(w);
    }
    if (mm != NULL) {
        r = PyObject_CallMethodOneArg(mm, s_write, data);  /* a memcpy, no syscall */
        Py_DECREF(mm);
    }
    if (r == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError) && !PyErr_ExceptionMatches(PyExc_ValueError))
            return -1;
        PyErr_Clear();  /* a full chunk, a plain writer, no file (yet) */
        r = PyObject_CallMethodOneArg(rec, s_emit_bytes, data);
    }
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* After DDP's wait for its all-reduce: _BackwardHook._done. */
static int
hook_end(Hook *self)
{
    PyObject *rec = self->rec;
    if (self->key == NULL || self->seq == NULL || self->step == NULL)
        return 0;  /* the hook failed before it queued the callback: never the case here */
    PyObject *inflight = PyObject_GetAttr(rec, s_inflight);
    if (inflight == NULL)
        return -1;
    int rc;
    if (PyDict_CheckExact(inflight)) {  /* inflight.pop(key, None) */
        rc = PyDict_DelItem(inflight, self->key);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear();
            rc = 0;
        }
    } else {
        PyObject *r = PyObject_CallMethod(inflight, "pop", "OO", self->key, Py_None);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(inflight);
    if (rc < 0)
        return -1;
    /* gradients exist now (the first backward creates them): rebuild the overlap map */
    PyObject *ptrs = PyObject_GetAttr(rec, s_ddp_ptrs);
    if (ptrs == NULL)
        return -1;
    rc = PyObject_SetItem(ptrs, s_dirty, Py_True);
    Py_DECREF(ptrs);
    if (rc < 0)
        return -1;
    long long now;
    if (now_us(self, &now) < 0)
        return -1;
    PyObject *g = PyObject_GetItem(self->info, s_g);
    if (g == NULL)
        return -1;
    PyObject *data = fast_record(g, self, now - self->start);
    if (data == NULL && PyErr_Occurred()) {
        Py_DECREF(g);
        return -1;
    }
    if (data == NULL) {  /* a group name or number fast_record does not take: the general format */
        PyObject *line = PyUnicode_FromFormat(
            "{\"t\":\"c\",\"op\":\"ddp_backward\",\"g\":\"%S\",\"s\":%S,\"ts\":%lld,\"d\":%lld,"
            "\"site\":%S,\"step\":%S}\n", g, self->seq, self->start, now - self->start, self->site,
            self->step);
        if (line != NULL) {
            data = PyUnicode_AsEncodedString(line, "utf-8", "backslashreplace");
            Py_DECREF(line);
        }
    }
    Py_DECREF(g);
    if (data == NULL)
        return -1;
    rc = store(rec, data);
    Py_DECREF(data);
    return rc;
}

static PyObject *
hook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hook *self = (Hook *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        PyErr_SetString(PyExc_TypeError, "ddpdoctor hook: no keyword arguments");
        return NULL;
    }
    if (nargs == 1)
        return hook_fire(self, args[0]);
    if (nargs != 0) {
        PyErr_SetString(PyExc_TypeError, "ddpdoctor hook: 0 or 1 argument");
        return NULL;
    }
    /* an engine callback: never raise into the program's backward */
    if (self->phase == 1) {
        self->phase = 2;
        PyObject *r = PyObject_CallOneArg(queue_cb, op);
        if (r == NULL)
            internal_error(self->rec);
        Py_XDECREF(r);
    } else if (self->phase == 2) {
        self->phase = 3;
        if (hook_end(self) < 0)
            internal_error(self->rec);
    }
    Py_RETURN_NONE;
}

static void
hook_dealloc(Hook *self)
{
    Py_XDECREF(self->rec);
    Py_XDECREF(self->info);
    Py_XDECREF(self->site);
    Py_XDECREF(self->key);
    Py_XDECREF(self->seq);
    Py_XDECREF(self->step);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef hook_members[] = {
    {"key", T_OBJECT, offsetof(Hook, key), READONLY, "(\"ddp_bwd\", thread id) once fired"},
    {"site", T_OBJECT, offsetof(Hook, site), READONLY, NULL},
    {NULL},
};

/* Not tracked by the garbage collector: it refers to the recorder, the module's info dict and a
 * site id, none of which refers back to a hook (one allocation per step in gen 0 less). */
static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.rank._ddpstep.Hook",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "The DDP backward event: a tensor hook (one argument) and its two engine callbacks "
              "(no argument).",
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_members = hook_members,
};

static PyObject *
make_hook(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "hook(rec, info, site)");
        return NULL;
    }
    if (queue_cb == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ddpdoctor _ddpstep: setup() not called");
        return NULL;
    }
    Hook *h = PyObject_New(Hook, &HookType);
    if (h == NULL)
        return NULL;
    h->rec = Py_NewRef(args[0]);
    h->info = Py_NewRef(args[1]);
    h->site = Py_NewRef(args[2]);
    h->key = h->seq = h->step = NULL;
    h->start = h->t0 = 0;
    h->have_t0 = 0;
    h->phase = 0;
    h->vectorcall = hook_vectorcall;
    return (PyObject *)h;
}

/* ddp._hook_output(t, hook(rec, info, site)) without a Python frame: the same hook dict on the
 * tensor and the same registration with its node; a tensor that already has hooks, no node or
 * another type than torch.Tensor takes the public t.register_hook(hook). */
static PyObject *
attach(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "attach(t, rec, info, site)");
        return NULL;
    }
    PyObject *t = args[0];
    PyObject *hook = make_hook(m, args + 1, 3);
    if (hook == NULL)
        return NULL;
    PyObject *r = NULL;
    if (Py_TYPE(t) == (PyTypeObject *)tensor_type) {
        PyObject *hooks = PyObject_GetAttr(t, s_backward_hooks);
        if (hooks == NULL)
            goto fail;
        int none = hooks == Py_None;
        Py_DECREF(hooks);
        if (none) {
            PyObject *fn = PyObject_GetAttr(t, s_grad_fn);
            if (fn == NULL)
                goto fail;
            if (fn != Py_None) {
                PyObject *d = PyObject_CallNoArgs(odict);
                if (d == NULL || PyObject_SetItem(d, hook_id, hook) < 0
                        || PyObject_SetAttr(t, s_backward_hooks, d) < 0) {
                    Py_XDECREF(d);
                    Py_DECREF(fn);
                    goto fail;
                }
                Py_DECREF(d);
                r = PyObject_CallMethodOneArg(fn, s_register_hook_dict, t);
                Py_DECREF(fn);
                goto out;
            }
            Py_DECREF(fn);
        }
    }
    r = PyObject_CallMethodOneArg(t, s_register_hook, hook);
out:
    Py_DECREF(hook);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
fail:
    Py_DECREF(hook);
    return NULL;
}

/* rec.t0_ns, read once per recorder (it is set when the recorder is made, never changed). */
static PyObject *t0_rec = NULL;
static long long t0_val = 0;

static int
rec_now_us(PyObject *rec, long long *out)
{
    if (rec != t0_rec) {
        PyObject *t0 = PyObject_GetAttr(rec, s_t0_ns);
        if (t0 == NULL)
            return -1;
        long long v = PyLong_AsLongLong(t0);
        Py_DECREF(t0);
        if (v == -1 && PyErr_Occurred())
            return -1;
        Py_XSETREF(t0_rec, Py_NewRef(rec));
        t0_val = v;
    }
    long long a;
    if (perf_counter_ns(&a) < 0)
        return -1;
    long long d = a - t0_val;
    *out = d >= 0 ? d / 1000 : -((-d + 999) / 1000);
    return 0;
}

static const char *const fwd_extra[4] = {"", ",\"bufs\":1", ",\"grad\":1", ",\"bufs\":1,\"grad\":1"};

/* The forward record's bytes (ddp.py's format), by hand for an ASCII group name and exact ints,
 * else the general format. */
static PyObject *
forward_record(int comm, PyObject *g, PyObject *seq, long long start, long long d, PyObject *site,
               PyObject *step, int extra)
{
    PyObject *nums[3] = {seq, site, step};
    long long v[3];
    int fast = PyUnicode_CheckExact(g) && PyUnicode_IS_ASCII(g) && PyUnicode_GET_LENGTH(g) <= 64;
    for (int i = 0; i < 3 && fast; i++) {
        int overflow = 0;
        fast = PyLong_CheckExact(nums[i]);
        if (fast) {
            v[i] = PyLong_AsLongLongAndOverflow(nums[i], &overflow);
            fast = !overflow && !(v[i] == -1 && PyErr_Occurred());
            PyErr_Clear();
        }
    }
    if (!fast) {
        PyObject *line = PyUnicode_FromFormat(
            "{\"t\":\"%s\",\"op\":\"ddp_forward\",\"g\":\"%S\",\"s\":%S,\"ts\":%lld,\"d\":%lld,"
            "\"site\":%S,\"step\":%S%s}\n", comm ? "c" : "e", g, seq, start, d, site, step,
            fwd_extra[extra]);
        if (line == NULL)
            return NULL;
        PyObject *data = PyUnicode_AsEncodedString(line, "utf-8", "backslashreplace");
        Py_DECREF(line);
        return data;
    }
    char buf[256];
    char *p = put_str(buf, comm ? "{\"t\":\"c\"" : "{\"t\":\"e\"");
    p = put_str(p, ",\"op\":\"ddp_forward\",\"g\":\"");
    Py_ssize_t glen = PyUnicode_GET_LENGTH(g);
    memcpy(p, PyUnicode_DATA(g), (size_t)glen);
    p += glen;
    p = ddp_put_ll(put_str(p, "\",\"s\":"), v[0]);
    p = ddp_put_ll(put_str(p, ",\"ts\":"), start);
    p = ddp_put_ll(put_str(p, ",\"d\":"), d);
    p = ddp_put_ll(put_str(p, ",\"site\":"), v[1]);
    p = ddp_put_ll(put_str(p, ",\"step\":"), v[2]);
    p = put_str(put_str(p, fwd_extra[extra]), "}\n");
    return PyBytes_FromStringAndSize(buf, p - buf);
}

/* ddp._forward_end_python: what the DDP forward wrapper does once the forward returned (the
 * record, the output's hook), without its ~100 bytecodes. Errors go to rec.internal_error. */
static PyObject *
forward_end(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "forward_end(ddp, rec, info, out, comm, seq, start, site, "
                                         "sync_bufs, grad, rebuilt_before)");
        return NULL;
    }
    PyObject *ddp = args[0], *rec = args[1], *info = args[2], *out = args[3], *seq = args[5];
    PyObject *site = args[7];
    int comm = PyObject_IsTrue(args[4]), sync_bufs = PyObject_IsTrue(args[8]);
    int grad = PyObject_IsTrue(args[9]);
    PyObject *step = NULL, *g = NULL, *data = NULL, *t = NULL;
    Py_INCREF(seq);
    if (comm < 0 || sync_bufs < 0 || grad < 0)
        goto error;
    long long start = PyLong_AsLongLong(args[6]);
    if (start == -1 && PyErr_Occurred())
        goto error;
    if (set_item_plus_one(info, s_fwd, &step) < 0)
        goto error;
    if (grad && PyObject_SetItem(info, s_gfwd, step) < 0)  /* overlap(): was it reduced? */
        goto error;
    g = PyObject_GetItem(info, s_g);
    if (g == NULL)
        goto error;
    if (args[10] == Py_False && !comm) {  /* DDP rebuilt its buckets in this forward: it communicated */
        PyObject *hb = PyObject_GetAttr(ddp, s_has_rebuilt_buckets);
        if (hb == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                goto error;
            PyErr_Clear();
        } else if (hb == Py_True) {
            comm = 1;
            Py_SETREF(seq, PyObject_CallMethodOneArg(rec, s_next_seq, g));
            if (seq == NULL)
                goto error;
        }
        Py_XDECREF(hb);
    }
    long long now;
    if (rec_now_us(rec, &now) < 0)
        goto error;
    data = forward_record(comm, g, seq, start, now - start, site, step, sync_bufs + 2 * grad);
    if (data == NULL || store(rec, data) < 0)
        goto error;
    PyObject *ptrs = PyObject_GetAttr(rec, s_ddp_ptrs);
    if (ptrs == NULL)
        goto error;
    int rc = PyObject_SetItem(ptrs, s_dirty, Py_True);
    Py_DECREF(ptrs);
    if (rc < 0)
        goto error;
    if (grad) {
        PyObject *sync = PyObject_GetAttr(ddp, s_require_backward_grad_sync);
        if (sync == NULL)
            goto error;
        int on = PyObject_IsTrue(sync);
        Py_DECREF(sync);
        if (on < 0)
            goto error;
        if (on) {
            if (Py_TYPE(out) == (PyTypeObject *)tensor_type) {
                PyObject *rg = PyObject_GetAttr(out, s_requires_grad);
                if (rg == NULL)
                    goto error;
                if (rg == Py_True)
                    t = Py_NewRef(out);
                Py_DECREF(rg);
            } else {
                t = PyObject_CallOneArg(first_grad_tensor, out);
                if (t == NULL)
                    goto error;
                if (t == Py_None)
                    Py_CLEAR(t);
            }
            if (t != NULL) {
                PyObject *a[4] = {t, rec, info, site};
                PyObject *r = attach(m, a, 4);
                if (r == NULL)
                    goto error;
                Py_DECREF(r);
            }
        }
    }
    goto done;
error:
    internal_error(rec);
done:
    Py_XDECREF(step);
    Py_XDECREF(g);
    Py_XDECREF(data);
    Py_XDECREF(t);
    Py_XDECREF(seq);
    Py_RETURN_NONE;
}

/* What SiteTable.at returns at once when the C key (callsite._site_key, rank/_sitewalk.c) is set
 * and already interned: key = _site_key(f, sites._gkind, sites._lib), then sites._at.get(key).
 * NULL without an error: anything else (no C key, a new key), and the caller calls ``at``. */
static PyObject *
site_hit(PyObject *sites, PyFrameObject *f)
{
    if (site_key == Py_None)
        return NULL;
    PyObject *gkind = PyObject_GetAttr(sites, s_gkind);
    PyObject *lib = gkind != NULL ? PyObject_GetAttr(sites, s_lib) : NULL;
    PyObject *key = NULL, *at = NULL, *sid = NULL;
    if (lib != NULL) {
        PyObject *a[3] = {(PyObject *)f, gkind, lib};
        key = PyObject_Vectorcall(site_key, a, 3, NULL);
    }
    if (key != NULL && key != Py_None)
        at = PyObject_GetAttr(sites, s_at);
    if (at != NULL && PyDict_CheckExact(at)) {
        sid = PyDict_GetItemWithError(at, key);  /* borrowed */
        Py_XINCREF(sid);
    }
    Py_XDECREF(gkind);
    Py_XDECREF(lib);
    Py_XDECREF(key);
    Py_XDECREF(at);
    if (sid == NULL)
        PyErr_Clear();  /* ``at`` itself decides (and raises, if it must) */
    return sid;
}

/* ddp._forward_begin_python: before a DDP forward runs (called from the forward wrapper, whose
 * caller, nn.Module's _call_impl, is the frame the site lookup starts from). Raises on error:
 * the wrapper reports it and runs the forward untraced. */
static PyObject *
forward_begin(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "forward_begin(ddp, rec, info)");
        return NULL;
    }
    PyObject *ddp = args[0], *rec = args[1], *info = args[2];
    PyObject *grad = NULL, *rebuilt_before = NULL, *gname = NULL, *site = NULL, *seq = NULL;
    PyObject *fkey = NULL, *start_o = NULL, *entry = NULL, *inflight = NULL, *res = NULL;
    int sync_bufs = 0, comm;
    grad = PyObject_CallNoArgs(is_grad_enabled);
    if (grad == NULL)
        goto done;
    int grad_on = PyObject_IsTrue(grad);
    if (grad_on < 0)
        goto done;
    /* DDP's own test, two Python calls: only for a module with buffers to broadcast */
    PyObject *mb = PyObject_GetAttr(ddp, s_modules_buffers);
    if (mb == NULL)
        goto done;
    sync_bufs = PyObject_IsTrue(mb);
    Py_DECREF(mb);
    if (sync_bufs > 0) {
        PyObject *r = PyObject_CallMethodNoArgs(ddp, s_check_sync_bufs);
        if (r == NULL)
            goto done;
        sync_bufs = PyObject_IsTrue(r);
        Py_DECREF(r);
    }
    if (sync_bufs < 0)
        goto done;
    rebuilt_before = PyObject_GetAttr(ddp, s_has_rebuilt_buckets);
    if (rebuilt_before == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto done;
        PyErr_Clear();
        rebuilt_before = Py_NewRef(Py_True);
    }
    comm = sync_bufs;
    if (!comm && grad_on) {
        int rb = PyObject_IsTrue(rebuilt_before);
        if (rb < 0)
            goto done;
        if (!rb) {
            PyObject *bwd = PyObject_GetItem(info, s_bwd);
            if (bwd == NULL)
                goto done;
            comm = PyObject_RichCompareBool(bwd, zero, Py_GT);
            Py_DECREF(bwd);
            if (comm < 0)
                goto done;
        }
    }
    gname = PyObject_GetItem(info, s_g);
    if (gname == NULL)
        goto done;
    PyObject *sites = PyObject_GetAttr(rec, s_sites);
    if (sites == NULL)
        goto done;
    PyFrameObject *here = PyEval_GetFrame();  /* borrowed: the wrapper's frame */
    PyFrameObject *caller = here != NULL ? PyFrame_GetBack(here) : NULL;
    if (caller != NULL) {
        site = site_hit(sites, caller);  /* SiteTable.at's first lines, without its Python frame */
        if (site == NULL && !PyErr_Occurred()) {
            PyObject *a[2] = {sites, (PyObject *)caller};
            site = PyObject_Vectorcall(site_of, a, 2, NULL);
        }
        Py_DECREF(caller);
    } else {
        site = PyObject_CallMethod(sites, "current", "i", 2);
    }
    Py_DECREF(sites);
    if (site == NULL)
        goto done;
    seq = comm ? PyObject_CallMethodOneArg(rec, s_next_seq, gname) : Py_NewRef(zero);
    if (seq == NULL)
        goto done;
    long long start;
    if (rec_now_us(rec, &start) < 0)
        goto done;
    start_o = PyLong_FromLongLong(start);
    fkey = PyObject_GetItem(info, s_fkey);
    if (start_o == NULL || fkey == NULL)
        goto done;
    entry = PyTuple_Pack(5, s_ddp_forward, gname, seq, site, start_o);
    inflight = PyObject_GetAttr(rec, s_inflight);
    if (entry == NULL || inflight == NULL || PyObject_SetItem(inflight, fkey, entry) < 0)
        goto done;
    res = PyTuple_Pack(9, comm ? Py_True : Py_False, seq, start_o, site, sync_bufs ? Py_True : Py_False,
                       grad, rebuilt_before, gname, fkey);
done:
    Py_XDECREF(grad);
    Py_XDECREF(rebuilt_before);
    Py_XDECREF(gname);
    Py_XDECREF(site);
    Py_XDECREF(seq);
    Py_XDECREF(fkey);
    Py_XDECREF(start_o);
    Py_XDECREF(entry);
    Py_XDECREF(inflight);
    return res;
}

/* stephooks._Post in C: an optimizer's step post hook (the step count, replica digests when
 * due), called by torch after every optimizer step: ~40 bytecodes and a Python frame a step. */
static PyObject *steps_list = NULL, *gen_list = NULL, *step_hooks = NULL, *refresh_reps = NULL;
static PyObject *s_steps, *s_due, *s_after_step;

typedef struct {
    PyObject_HEAD
    PyObject *first;                /* the first-step pre hook's handle until that step is over */
    PyObject *gen;                  /* GEN[0] when reps was computed (NULL: never) */
    PyObject *reps;                 /* a tuple of replicas.py's per-module states */
    vectorcallfunc vectorcall;
} Post;

static PyObject *
post_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Post *self = (Post *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "post hook(opt, args, kwargs)");
        return NULL;
    }
    /* STEPS[0] += 1 */
    PyObject *n = PyNumber_Add(PyList_GET_ITEM(steps_list, 0), one);
    if (n == NULL || PyList_SetItem(steps_list, 0, n) < 0)
        return NULL;
    PyObject *gen = PyList_GET_ITEM(gen_list, 0);
    int changed = self->gen == NULL ? 1 : PyObject_RichCompareBool(self->gen, gen, Py_NE);
    if (changed < 0)
        return NULL;
    if (changed) {
        Py_XSETREF(self->gen, Py_NewRef(gen));
        PyObject *first = self->first != NULL ? self->first : Py_NewRef(Py_None);  /* NULL: cleared */
        self->first = Py_NewRef(Py_None);
        PyObject *a[2] = {first, args[0]};
        PyObject *reps = PyObject_Vectorcall(refresh_reps, a, 2, NULL);
        Py_DECREF(first);
        PyObject *tup = reps != NULL ? PySequence_Tuple(reps) : NULL;
        Py_XDECREF(reps);
        if (tup == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;
            PyErr_Clear();  /* never break the program's step; its digests are not taken */
            tup = PyTuple_New(0);
            if (tup == NULL)
                return NULL;
        }
        Py_XSETREF(self->reps, tup);
    }
    if (self->reps == NULL)  /* cleared by the garbage collector */
        Py_RETURN_NONE;
    PyObject *reps = Py_NewRef(self->reps);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reps); i++) {
        PyObject *rep = PyTuple_GET_ITEM(reps, i);
        PyObject *cur = PyObject_GetAttr(rep, s_steps);
        PyObject *nxt = cur != NULL ? PyNumber_Add(cur, one) : NULL;
        Py_XDECREF(cur);
        if (nxt == NULL || PyObject_SetAttr(rep, s_steps, nxt) < 0) {
            Py_XDECREF(nxt);
            Py_DECREF(reps);
            return NULL;
        }
        PyObject *due = PyObject_GetAttr(rep, s_due);
        int at = due != NULL ? PyObject_RichCompareBool(nxt, due, Py_GE) : -1;
        Py_DECREF(nxt);
        Py_XDECREF(due);
        if (at > 0) {  /* a digest is due, or accelerator copies are pending (replicas.py) */
            PyObject *r = PyObject_CallMethodOneArg(step_hooks, s_after_step, rep);
            if (r == NULL)
                at = -1;
            Py_XDECREF(r);
        }
        if (at < 0) {
            Py_DECREF(reps);
            return NULL;
        }
    }
    Py_DECREF(reps);
    Py_RETURN_NONE;
}

static int
post_traverse(Post *self, visitproc visit, void *arg)
{
    Py_VISIT(self->first);
    Py_VISIT(self->gen);
    Py_VISIT(self->reps);
    return 0;
}

static int
post_clear(Post *self)
{
    Py_CLEAR(self->first);
    Py_CLEAR(self->gen);
    Py_CLEAR(self->reps);
    return 0;
}

static void
post_dealloc(Post *self)
{
    PyObject_GC_UnTrack(self);
    post_clear(self);
    PyObject_GC_Del(self);
}

/* Tracked by the garbage collector (one per optimizer: what replicas.py's states refer to is
 * theirs to decide), unlike the per-step Hook. */
static PyTypeObject PostType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.rank._ddpstep.Post",
    .tp_basicsize = sizeof(Post),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An optimizer's step post hook (stephooks._Post).",
    .tp_dealloc = (destructor)post_dealloc,
    .tp_traverse = (traverseproc)post_traverse,
    .tp_clear = (inquiry)post_clear,
    .tp_vectorcall_offset = offsetof(Post, vectorcall),
    .tp_call = PyVectorcall_Call,
};

static PyObject *
make_post(PyObject *m, PyObject *first)
{
    (void)m;
    if (refresh_reps == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ddpdoctor _ddpstep: step_setup() not called");
        return NULL;
    }
    Post *p = PyObject_GC_New(Post, &PostType);
    if (p == NULL)
        return NULL;
    p->first = Py_NewRef(first);
    p->gen = NULL;
    p->reps = PyTuple_New(0);
    p->vectorcall = post_vectorcall;
    PyObject_GC_Track(p);
    if (p->reps == NULL) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static PyObject *
step_setup(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    if (nargs != 4 || !PyList_CheckExact(args[0]) || PyList_GET_SIZE(args[0]) != 1
            || !PyList_CheckExact(args[1]) || PyList_GET_SIZE(args[1]) != 1) {
        PyErr_SetString(PyExc_TypeError, "step_setup(STEPS, GEN, HOOKS, refresh_reps)");
        return NULL;
    }
    PyObject **slots[4] = {&steps_list, &gen_list, &step_hooks, &refresh_reps};
    for (int i = 0; i < 4; i++)
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

static PyObject *
setup(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "setup(queue_callback, perf_counter_ns, Tensor, float32, "
                        "float64, strided, OrderedDict, hook_id, first_grad_tensor, is_grad_enabled, "
                        "site_of, site_key)");
        return NULL;
    }
    PyObject **slots[12] = {&queue_cb, &perf_ns, &tensor_type, &f32, &f64, &strided, &odict, &hook_id,
                            &first_grad_tensor, &is_grad_enabled, &site_of, &site_key};
    for (int i = 0; i < 12; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    Py_RETURN_NONE;
}

static PyObject *
all_finite(PyObject *m, PyObject *t)
{
    (void)m;
    if (tensor_type == NULL)
        Py_RETURN_NONE;
    int r = all_finite_c(t);
    if (r < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL,
     "setup(queue_callback, perf_counter_ns, Tensor, float32, float64, strided, OrderedDict, hook_id, "
     "first_grad_tensor, is_grad_enabled, site_of, site_key)"},
    {"step_setup", (PyCFunction)(void (*)(void))step_setup, METH_FASTCALL,
     "step_setup(STEPS, GEN, HOOKS, refresh_reps): stephooks' shared state"},
    {"post", make_post, METH_O, "post(first): an optimizer's step post hook (stephooks._Post)"},
    {"forward_begin", (PyCFunction)(void (*)(void))forward_begin, METH_FASTCALL,
     "forward_begin(ddp, rec, info) -> (comm, seq, start, site, sync_bufs, grad, rebuilt_before, "
     "gname, fkey)"},
    {"forward_end", (PyCFunction)(void (*)(void))forward_end, METH_FASTCALL,
     "forward_end(ddp, rec, info, out, comm, seq, start, site, sync_bufs, grad, rebuilt_before)"},
    {"attach", (PyCFunction)(void (*)(void))attach, METH_FASTCALL,
     "attach(t, rec, info, site): hook(rec, info, site) hung on the output t"},
    {"hook", (PyCFunction)(void (*)(void))make_hook, METH_FASTCALL,
     "hook(rec, info, site): the backward event of one forward's output"},
    {"all_finite", all_finite, METH_O,
     "True/False: every element of a CPU contiguous float32/float64 torch.Tensor finite; None: "
     "not such a tensor"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_ddpstep", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__ddpstep(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_bwd, "bwd"}, {&s_fwd, "fwd"}, {&s_fwd_at_bwd, "fwd_at_bwd"}, {&s_g, "g"},
        {&s_grads, "grads"}, {&s_seq, "seq"}, {&s_t0_ns, "t0_ns"}, {&s_inflight, "inflight"},
        {&s_ddp_ptrs, "_ddp_ptrs"}, {&s_dirty, "dirty"}, {&s_writer, "writer"}, {&s_mm, "mm"},
        {&s_write, "write"}, {&s_emit_bytes, "emit_bytes"}, {&s_internal_error, "internal_error"},
        {&s_quiet, "quiet"}, {&s_fast, "fast"}, {&s_is_cpu, "is_cpu"}, {&s_layout, "layout"},
        {&s_dtype, "dtype"}, {&s_is_nested, "is_nested"}, {&s_is_contiguous, "is_contiguous"},
        {&s_nbytes, "nbytes"}, {&s_data_ptr, "data_ptr"}, {&s_ddp_bwd, "ddp_bwd"},
        {&s_ddp_backward, "ddp_backward"}, {&s_backward_hooks, "_backward_hooks"},
        {&s_grad_fn, "grad_fn"}, {&s_register_hook_dict, "_register_hook_dict"},
        {&s_register_hook, "register_hook"}, {&s_gfwd, "gfwd"},
        {&s_has_rebuilt_buckets, "_has_rebuilt_buckets"}, {&s_next_seq, "next_seq"},
        {&s_require_backward_grad_sync, "require_backward_grad_sync"},
        {&s_requires_grad, "requires_grad"}, {&s_modules_buffers, "modules_buffers"},
        {&s_check_sync_bufs, "_check_sync_bufs_pre_fwd"}, {&s_sites, "sites"}, {&s_fkey, "fkey"},
        {&s_ddp_forward, "ddp_forward"}, {&s_gkind, "_gkind"}, {&s_lib, "_lib"}, {&s_at, "_at"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL)
            return NULL;
    }
    one = PyLong_FromLong(1);
    zero = PyLong_FromLong(0);
    s_steps = PyUnicode_InternFromString("steps");
    s_due = PyUnicode_InternFromString("due");
    s_after_step = PyUnicode_InternFromString("after_step");
    if (one == NULL || zero == NULL || s_steps == NULL || s_due == NULL || s_after_step == NULL
            || PyType_Ready(&HookType) < 0 || PyType_Ready(&PostType) < 0)
        return NULL;
    return PyModule_Create(&module);
}
