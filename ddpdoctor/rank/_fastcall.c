/* The repeat-call path of ddpdoctor's collective wrappers in C (rank/patches/fastpath.py).
 *
 * Why C: the Python fast path (fastpath.make_wrapper's `wrapper`) was already a dict lookup,
 * two clock reads, two bytes formattings and two stores, yet cost ~28k instructions per
 * one-element all_reduce next to the ~62k of the call itself (callgrind), spread over ~270
 * bytecodes: the interpreter's own cost, with no hot spot left to remove in Python.
 *
 * What is here: `Wrapper`, a callable (vectorcall) that does exactly what `wrapper` does for a
 * call whose (call site, argument key) already has a `Hit`: the same checks in the same order,
 * the same in-flight slot bytes stored before the call, the same `rec.inflight` entry during it,
 * the same record bytes written after it, the same `failed(...)` on an exception (re-raised
 * unchanged) and the same async tracking. Everything else goes where the Python wrapper sends
 * it: `orig` (not tracing, nested, compiling), `general(...)` (a miss), or the Python wrapper
 * itself where an object is not of the plain type this file relies on (nothing has been done
 * yet at that point, so the Python wrapper redoing the checks changes nothing).
 *
 * The argument key of a call without keyword arguments (`all_reduce(t)`) is built here, from
 * the plan fastpath.key_function generates with its Python key function (the same tuple);
 * other calls are keyed by that Python function.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* f_lasti before PyFrame_GetLasti (3.11) */
#endif
#include "_native.h" /* FAST_FRAMES (see where()), ddp_put_ll */

/* Hit's fields (fastpath.Hit, a NamedTuple: read by index). */
enum { H_REC, H_G, H_OP, H_INSEQ, H_SITE, H_HEAD, H_MID, H_TAIL, H_SLOT_TAIL, H_ASYNC, H_WTAG,
       H_ENT, H_CODE, H_N };

#define MAXPLAN 8 /* branches of a key plan, and terms of one (torch's signatures: <= 6) */
#define KWROW MAXPLAN /* the plan's row for calls with keyword arguments */

static PyObject *s_shape, *s_dtype, *s_device, *s_is_cpu, *s_recorder, *s_enabled, *s_local, *s_depth,
    *s_flag, *s_inflight, *s_ddp_refs, *s_seq, *s_t0_ns, *s_slot, *s__mm, *s_writer, *s_mm, *s_write, *s_emit_bytes, *s_events,
    *s_last_event, *s_internal_error, *s_sites, *s__gkind, *s_at, *s__lib, *s__at;

/* The Python objects a Wrapper holds (see make()), for the X-macros below. */
#define FIELDS(X)                                                                          \
    X(orig) X(fastkey) X(general) X(fast) X(tc) X(failed) X(track_async) X(recmod) X(python) \
    X(perf_ns) X(lib)

#define NMEMO 8 /* memo entries (see find_hit): a loop calls a collective from a few sites */

typedef struct {
    PyObject *code, *hit; /* strong references; code NULL: an empty entry */
    long a, b;            /* the call's and its caller's instruction offsets */
    Py_ssize_t n;         /* positional arguments */
    int nv;
    PyObject *vals[MAXPLAN * 3]; /* the key's terms (read_terms) */
} Memo;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
#define DECLARE(f) PyObject *f;
    FIELDS(DECLARE) /* what make() was given */
    int reducing;
    /* fastpath.key_function's plan: for a call with n positional arguments and no keyword
     * arguments, term i of the key is args[pos[n][i]], read as kind[n][i] (0: its shape, dtype
     * and device; 1: its identity; 2: itself). nplan 0: no plan, the Python key function. */
    int nplan;
    signed char plen[MAXPLAN + 1], pos[MAXPLAN + 1][MAXPLAN], kind[MAXPLAN + 1][MAXPLAN];
    /* row KWROW of the plan: a call with keyword arguments (fastpath.key_function's `kwplan`):
     * term i is the argument of parameter kwname[i] (position kwpos[i], else by keyword, else
     * its default kwdef[i]), the key's tag -1. kwlen 0: no such plan (the Python key function). */
    int kwlen;
    Py_ssize_t kwpos[MAXPLAN];
    PyObject *kwname[MAXPLAN], *kwdef[MAXPLAN]; /* held */
    Memo memo[NMEMO];
} Wrapper;

/* ---- small helpers ---------------------------------------------------------------------- */

/* The current exception as one normalized object with its traceback; the error is cleared. */
static PyObject *take_exc(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL && v != NULL)
        PyException_SetTraceback(v, tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
#endif
}

/* Raise `exc` again, unchanged (steals the reference). */
static void give_exc(PyObject *exc) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyObject *t = (PyObject *)Py_TYPE(exc);
    Py_INCREF(t);
    PyErr_Restore(t, exc, PyException_GetTraceback(exc));
#endif
}

/* time.perf_counter_ns(): the clock of rec.t0_ns and of dist._failed's durations. */
static int perf_ns(Wrapper *w, long long *out) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    if (PyTime_PerfCounter(&t) < 0)
        return -1;
    *out = (long long)t;
    return 0;
#elif defined(__linux__)
    /* CPython's perf_counter on Linux is CLOCK_MONOTONIC, in nanoseconds */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *out = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    return 0;
#else
    PyObject *r = PyObject_CallNoArgs(w->perf_ns);
    if (r == NULL)
        return -1;
    *out = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
#endif
}

/* Python's a // 1000 (floor, also for a negative a). */
static long long us(long long ns) {
    long long q = ns / 1000;
    return (ns % 1000 != 0 && ns < 0) ? q - 1 : q;
}

/* Decimal digits of v, as b"%d" writes them, into buf (>= 21 bytes); returns the length. */
static Py_ssize_t digits(char *buf, long long v) {
    return ddp_put_ll(buf, v) - buf;
}

static int truthy_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

#if !FAST_FRAMES
/* frame.f_lasti as Python reads it (the key's instruction offsets). */
static long frame_lasti(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return (long)PyFrame_GetLasti(f);
#elif PY_VERSION_HEX >= 0x030A0000
    return f->f_lasti < 0 ? -1 : (long)f->f_lasti * 2; /* 3.10 counts code units */
#else
    return (long)f->f_lasti;
#endif
}
#endif

/* Where the user's call is: the code of the frame that called fastpath's shim (borrowed: that
 * frame holds it), its instruction offset and its caller's (-1 for none), as
 * frame.f_code/f_lasti/f_back read them. */
typedef struct {
    PyObject *code;
    PyObject *globals; /* (borrowed too) */
    long a, b;
#if FAST_FRAMES
    struct _PyInterpreterFrame *frame; /* the user's frame, in place */
#endif
} Where;

#if FAST_FRAMES
/* Session 5: PyEval_GetFrame/PyFrame_GetBack make a frame object for the shim's frame and
 * the user's, new at every call, and free them when those frames return: ~800 instructions
 * (callgrind). The interpreter's frames are read in place instead, skipping the incomplete
 * ones exactly as PyFrame_GetBack does; a frame object is made only where the general path
 * needs one (user_frame()). */
static _PyInterpreterFrame *complete(_PyInterpreterFrame *f) {
    while (f != NULL && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}

static long iframe_lasti(_PyInterpreterFrame *f) {
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : (long)lasti * (long)sizeof(_Py_CODEUNIT); /* PyFrame_GetLasti */
}

static int where(Where *o) {
    _PyInterpreterFrame *shim = complete(PyThreadState_Get()->cframe->current_frame);
    _PyInterpreterFrame *f = shim == NULL ? NULL : complete(shim->previous);
    if (f == NULL)
        return 0;
    _PyInterpreterFrame *back = complete(f->previous);
    o->code = (PyObject *)f->f_code;
    o->globals = f->f_globals;
    o->frame = f;
    o->a = iframe_lasti(f);
    o->b = back == NULL ? -1 : iframe_lasti(back);
    return 1;
}
#endif

/* The user's frame object (a new reference), or NULL (no error set) where there is none. */
static PyObject *user_frame(void) {
    PyFrameObject *shim = PyEval_GetFrame();
    return shim == NULL ? NULL : (PyObject *)PyFrame_GetBack(shim);
}

#if !FAST_FRAMES
static int where(Where *o) {
    PyFrameObject *frame = (PyFrameObject *)user_frame();
    if (frame == NULL)
        return 0;
    PyCodeObject *code = PyFrame_GetCode(frame);
    Py_DECREF(code); /* still alive: the frame holds it */
    PyFrameObject *back = PyFrame_GetBack(frame);
    o->code = (PyObject *)code;
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *g = PyFrame_GetGlobals(frame);
    Py_XDECREF(g); /* still alive: the frame holds them */
#else
    PyObject *g = frame->f_globals;
#endif
    o->globals = g;
    o->a = frame_lasti(frame);
    o->b = back == NULL ? -1 : frame_lasti(back);
    Py_XDECREF(back);
    Py_DECREF(frame);
    return 1;
}
#endif

/* ---- attribute reads and writes ---------------------------------------------------------- */

/* Session 5 (callgrind, one-element all_reduce): the ~17 attribute reads of a repeat call cost
 * ~5.4k instructions, ~300 each for a plain instance attribute (PyObject_GetAttr: the type's
 * method cache, then the instance's values), ~240 for a module's. The objects read here are
 * plain: the recorder, its in-flight slot and trace writer, the recorder and torch.compiler
 * modules. For such an object the attribute IS the entry of its instance dict, so it is read
 * (and written) there: one dict lookup. "Plain" is checked per (type, name) and remembered
 * with the type's version tag, which CPython changes whenever the type or a base changes (a
 * descriptor added later is seen). Anything else, or a name not in the dict, goes through
 * PyObject_GetAttr/SetAttr: the same result and the same errors in every case. */
typedef struct {
    PyTypeObject *tp; /* not a reference: a new type at the same address has a new tag */
    unsigned int tag;
    /* The value last read, valid while its dict is unchanged (PEP 509's version tag, which
     * every change of a dict moves, STORE_ATTR's included): a dict lookup was still ~110
     * instructions (the recorder's dict is a split table), this ~10. set_attr keeps it valid
     * across this file's own writes of other names. 3.11 only (the tag is deprecated later). */
    PyObject *dict, *val; /* strong references: an address compared here is never reused */
    unsigned long long ver;
} AttrSite;

#if PY_VERSION_HEX >= 0x030600A7 && PY_VERSION_HEX < 0x030C0000
#define DICT_VERSIONS 1
#define DICT_VER(d) (((PyDictObject *)(d))->ma_version_tag)
#else
#define DICT_VERSIONS 0
#endif

enum { A_RECORDER, A_ENABLED, A_LOCAL, A_FLAG, A_INFLIGHT, A_DDP_REFS, A_SEQ, A_T0_NS, A_SLOT,
       A__MM, A_WRITER, A_MM, A_EVENTS, A_LAST_EVENT, A_SITES, A_GKIND, A_LIBK, A_ATD, A_N };
static AttrSite get_sites[A_N], set_sites[A_N];

/* 1 and the instance dict of o (a new reference) where o.name is that dict's entry; 0 where
 * it may not be (the generic path then); -1 on error. */
static int plain_dict(PyObject *o, PyObject *name, AttrSite *c, int set, PyObject **dict) {
    PyTypeObject *tp = Py_TYPE(o);
    if (tp != c->tp || tp->tp_version_tag != c->tag || c->tag == 0) {
        if (set ? tp->tp_setattro != PyObject_GenericSetAttr
                : tp->tp_getattro != PyObject_GenericGetAttr)
            return 0;
#ifdef Py_TPFLAGS_MANAGED_DICT
        if (!(tp->tp_flags & Py_TPFLAGS_MANAGED_DICT) && tp->tp_dictoffset == 0)
#else
        if (tp->tp_dictoffset == 0)
#endif
            return 0;
        /* no class attribute of that name anywhere in the MRO: no descriptor, no default
         * (this lookup also gives the type a version tag where it can have one) */
        if (_PyType_Lookup(tp, name) != NULL || tp->tp_version_tag == 0)
            return 0;
        c->tp = tp;
        c->tag = tp->tp_version_tag;
    }
    *dict = PyObject_GenericGetDict(o, NULL);
    return *dict == NULL ? -1 : 1;
}

/* o.name as a new reference (NULL with an error set): see above. */
static PyObject *get_attr(PyObject *o, int which, PyObject *name) {
    PyObject *d = NULL, *v;
    int r;
    if (PyModule_CheckExact(o)) { /* module_getattro finds a module's globals in its dict */
        d = PyModule_GetDict(o);
        Py_INCREF(d);
        r = 1;
    } else {
        r = plain_dict(o, name, &get_sites[which], 0, &d);
    }
    if (r < 0)
        return NULL;
    if (r > 0) {
#if DICT_VERSIONS
        AttrSite *c = &get_sites[which];
        if (d == c->dict && DICT_VER(d) == c->ver) {
            Py_DECREF(d);
            Py_INCREF(c->val);
            return c->val;
        }
#endif
        v = PyDict_GetItemWithError(d, name);
        Py_XINCREF(v);
#if DICT_VERSIONS
        if (v != NULL && PyDict_CheckExact(d)) {
            Py_INCREF(d);
            Py_INCREF(v);
            Py_XSETREF(c->dict, d);
            Py_XSETREF(c->val, v);
            c->ver = DICT_VER(d);
        }
#endif
        Py_DECREF(d);
        if (v != NULL || PyErr_Occurred())
            return v;
    }
    return PyObject_GetAttr(o, name); /* (an absent name: its AttributeError, or __getattr__) */
}

/* o.name = v; 0, or -1 with an error set. */
static int set_attr(PyObject *o, int which, PyObject *name, PyObject *v) {
    PyObject *d = NULL;
    int r = plain_dict(o, name, &set_sites[which], 1, &d);
    if (r < 0)
        return -1;
    if (r == 0)
        return PyObject_SetAttr(o, name, v);
#if DICT_VERSIONS
    unsigned long long before = PyDict_CheckExact(d) ? DICT_VER(d) : 0;
#endif
    r = PyDict_SetItem(d, name, v);
#if DICT_VERSIONS
    /* only `name` changed: what was read of the others stays valid; `name` is now v */
    for (int i = 0; before != 0 && r == 0 && i < A_N; i++) {
        AttrSite *c = &get_sites[i];
        if (c->dict != d || c->ver != before)
            continue;
        c->ver = DICT_VER(d);
        if (i == which) {
            Py_INCREF(v);
            Py_SETREF(c->val, v);
        }
    }
#endif
    Py_DECREF(d);
    return r;
}

/* o.n1 = v1; o.n2 = v2 (in that order): one dict, one pass over the read cache (~100
 * instructions less than two set_attr calls); 0, or -1 with an error set. */
static int set_two(PyObject *o, int w1, PyObject *n1, PyObject *v1, int w2, PyObject *n2,
                   PyObject *v2) {
#if DICT_VERSIONS
    PyObject *d = NULL, *d2 = NULL;
    int r = plain_dict(o, n1, &set_sites[w1], 1, &d);
    if (r > 0 && PyDict_CheckExact(d)) {
        r = plain_dict(o, n2, &set_sites[w2], 1, &d2);
        Py_XDECREF(d2);
        if (r > 0 && d2 == d) {
            unsigned long long before = DICT_VER(d);
            r = PyDict_SetItem(d, n1, v1);
            if (r == 0)
                r = PyDict_SetItem(d, n2, v2);
            for (int i = 0; r == 0 && i < A_N; i++) {
                AttrSite *c = &get_sites[i];
                if (c->dict != d || c->ver != before)
                    continue;
                c->ver = DICT_VER(d);
                if (i == w1 || i == w2) {
                    Py_INCREF(i == w1 ? v1 : v2);
                    Py_SETREF(c->val, i == w1 ? v1 : v2);
                }
            }
            Py_DECREF(d);
            return r;
        }
    }
    Py_XDECREF(d);
    if (r < 0)
        return -1;
#endif
    if (set_attr(o, w1, n1, v1) < 0)
        return -1;
    return set_attr(o, w2, n2, v2);
}

#define GET(o, NAME, s) get_attr(o, A_##NAME, s)

static int truthy(PyObject *v) { /* consumes v (may be NULL: the error propagates) */
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* A tensor's shape, dtype or is_cpu: the getset descriptor of its type called directly
 * (~70 instructions less a read than PyObject_GetAttr's lookup, callgrind). Only where
 * PyObject_GetAttr would call that very getter: the type's getattro is the generic one and the
 * name resolves to a C getset (a data descriptor: it comes before the instance dict), checked
 * per type version like plain_dict's. */
typedef struct {
    PyTypeObject *tp;
    unsigned int tag;
    getter get;
    void *closure;
} GetSetSite;
enum { G_SHAPE, G_DTYPE, G_IS_CPU, G_N };
static GetSetSite getset_sites[G_N];

static PyObject *getset_attr(PyObject *o, int which, PyObject *name) {
    PyTypeObject *tp = Py_TYPE(o);
    GetSetSite *c = &getset_sites[which];
    if (tp != c->tp || tp->tp_version_tag != c->tag || c->tag == 0) {
        c->tp = NULL;
        if (tp->tp_getattro != PyObject_GenericGetAttr)
            return PyObject_GetAttr(o, name);
        PyObject *d = _PyType_Lookup(tp, name);
        if (d == NULL || Py_TYPE(d) != &PyGetSetDescr_Type ||
            ((PyGetSetDescrObject *)d)->d_getset->get == NULL || tp->tp_version_tag == 0)
            return PyObject_GetAttr(o, name);
        c->get = ((PyGetSetDescrObject *)d)->d_getset->get;
        c->closure = ((PyGetSetDescrObject *)d)->d_getset->closure;
        c->tag = tp->tp_version_tag;
        c->tp = tp;
    }
    return c->get(o, c->closure);
}

/* ---- the nesting depth ------------------------------------------------------------------ */

/* Session 5: `rec.local.depth` (recorder._ThreadState, a threading.local) cost ~560
 * instructions a call: threading.local finds the thread's dict, then the attribute in it.
 * `depth` is instead this data descriptor on _ThreadState (recorder.py installs it), which
 * keeps each thread's value in a C thread-local: Python code reads and writes
 * `rec.local.depth` as before (a data descriptor comes before the thread's dict, so the class
 * default and the per-thread dict are no longer used for it), and this file reads it in ~10
 * instructions. Per thread, a few (owner, depth) pairs: the owner (the _ThreadState) is held
 * while its depth is not 0, so an address compared here is never another object's; a depth
 * of 0 needs no entry. */
#define NDEPTH 8
typedef struct {
    PyObject *owner;
    long depth;
} DepthSlot;
static _Thread_local DepthSlot depth_tls[NDEPTH];

static long depth_of(PyObject *owner) {
    for (int i = 0; i < NDEPTH; i++)
        if (depth_tls[i].owner == owner)
            return depth_tls[i].depth;
    return 0;
}

typedef struct {
    PyObject_HEAD
} DepthDescr;

static PyObject *depth_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) { /* on the class: the descriptor itself */
        Py_INCREF(self);
        return self;
    }
    return PyLong_FromLong(depth_of(obj));
}

static int depth_set(PyObject *self, PyObject *obj, PyObject *value) {
    long v = 0;
    if (value != NULL) { /* (del: back to 0) */
        v = PyLong_AsLong(value);
        if (v == -1 && PyErr_Occurred())
            return -1;
    }
    DepthSlot *free_slot = NULL;
    for (int i = 0; i < NDEPTH; i++) {
        DepthSlot *d = &depth_tls[i];
        if (d->owner == obj) {
            if (v != 0) {
                d->depth = v;
            } else {
                d->owner = NULL;
                d->depth = 0;
                Py_DECREF(obj);
            }
            return 0;
        }
        if (d->owner == NULL && free_slot == NULL)
            free_slot = d;
    }
    if (v == 0)
        return 0;
    if (free_slot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ddpdoctor: too many nesting depths on one thread");
        return -1;
    }
    Py_INCREF(obj);
    free_slot->owner = obj;
    free_slot->depth = v;
    return 0;
}

static PyTypeObject DepthType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.rank._fastcall.Depth",
    .tp_doc = "recorder._ThreadState.depth: the nesting depth of this thread, in C.",
    .tp_basicsize = sizeof(DepthDescr),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_descr_get = depth_get,
    .tp_descr_set = depth_set,
    .tp_new = PyType_GenericNew,
};

/* Whether local.depth is this file's descriptor (per type version, as in plain_dict). */
static int c_depth(PyObject *local) {
    static PyTypeObject *tp;
    static unsigned int tag;
    PyTypeObject *t = Py_TYPE(local);
    if (t == tp && t->tp_version_tag == tag && tag != 0)
        return 1;
    PyObject *d = _PyType_Lookup(t, s_depth);
    if (d == NULL || Py_TYPE(d) != &DepthType || t->tp_version_tag == 0)
        return 0;
    tp = t;
    tag = t->tp_version_tag;
    return 1;
}

/* ---- the call --------------------------------------------------------------------------- */

/* Whether the Python wrapper would record this call: rec is not None and rec.enabled and not
 * rec.local.depth and not tc._is_compiling_flag (in that order). 1, 0 or -1.
 * Not dyn() (torch.compiler.is_dynamo_compiling): it returns False whenever it runs, Dynamo
 * folds it to True in the bytecode it traces, and Dynamo never runs a C callable while tracing
 * (it breaks the graph, and the call then runs eagerly). A Python call saved (~370 instr.). */
static int tracing(Wrapper *w, PyObject *rec) {
    if (rec == Py_None)
        return 0;
    int r = truthy(GET(rec, ENABLED, s_enabled));
    if (r <= 0)
        return r;
    PyObject *local = GET(rec, LOCAL, s_local);
    if (local == NULL)
        return -1;
    /* (a threading.local's getattro finds a data descriptor before the thread's dict) */
    r = c_depth(local) ? depth_of(local) != 0 : truthy_attr(local, s_depth);
    Py_DECREF(local);
    if (r != 0)
        return r < 0 ? -1 : 0;
    r = truthy(GET(w->tc, FLAG, s_flag));
    return r < 0 ? -1 : !r;
}

/* The call's positional arguments as a tuple and its keyword arguments as a fresh dict. */
static int pack(PyObject *const *args, Py_ssize_t n, PyObject *kwnames, PyObject **argt,
                PyObject **kw) {
    *argt = PyTuple_New(n);
    *kw = PyDict_New();
    if (*argt == NULL || *kw == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(*argt, i, args[i]);
    }
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nk; i++)
        if (PyDict_SetItem(*kw, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0)
            goto fail;
    return 0;
fail:
    Py_CLEAR(*argt);
    Py_CLEAR(*kw);
    return -1;
}

/* The terms of the key of a call with n positional arguments and no keyword arguments, from
 * its plan, into vals (new references): a tensor gives its shape, its dtype and `is_cpu or
 * device` (see fastpath.key_function), an enum its identity, anything else itself. Their
 * number, or -1 with an error set (AttributeError for an argument that is no tensor). */
static int read_terms(Wrapper *w, PyObject *const *args, Py_ssize_t n, PyObject **vals) {
    int j = 0;
    PyObject *v;
    for (int i = 0; i < w->plen[n]; i++) {
        PyObject *arg = args[(int)w->pos[n][i]];
        if (w->kind[n][i] == 0) { /* a tensor: what its description depends on */
            if ((vals[j] = getset_attr(arg, G_SHAPE, s_shape)) == NULL)
                goto fail;
            j++;
            if ((vals[j] = getset_attr(arg, G_DTYPE, s_dtype)) == NULL)
                goto fail;
            j++;
            if ((v = getset_attr(arg, G_IS_CPU, s_is_cpu)) == NULL)
                goto fail;
            int r = PyObject_IsTrue(v);
            if (r <= 0) { /* `or`: the device, only where the tensor is not on the CPU */
                Py_DECREF(v);
                if (r < 0 || (v = PyObject_GetAttr(arg, s_device)) == NULL)
                    goto fail;
            }
            vals[j++] = v;
            continue;
        }
        /* kind 1, a pybind enum (it hashes through Python): the object here, its identity in
         * the key (plan_key); the memo compares it by identity (a heap type) */
        v = arg;
        Py_INCREF(v);
        vals[j++] = v;
    }
    return j;
fail:
    while (j > 0)
        Py_DECREF(vals[--j]);
    return -1;
}

/* The key (code, lasti, caller's lasti, n, terms...), the tuple the Python key function
 * returns; NULL with an error set. */
static PyObject *plan_key(Wrapper *w, PyObject *head[3], Py_ssize_t n, PyObject **vals, int nv) {
    Py_ssize_t tag = n == KWROW ? -1 : n; /* the Python key's branch tag */
    PyObject *key = PyTuple_New(4 + nv), *v;
    if (key == NULL)
        return NULL;
    for (int i = 0; i < 3; i++) {
        Py_INCREF(head[i]);
        PyTuple_SET_ITEM(key, i, head[i]);
    }
    if ((v = PyLong_FromSsize_t(tag)) == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 3, v);
    int j = 0; /* vals[j] is term i's first value */
    for (int i = 0; i < w->plen[n]; i++) {
        int k = w->kind[n][i] == 0 ? 3 : 1;
        for (int e = 0; e < k; e++, j++) {
            if (w->kind[n][i] == 1) { /* its identity, as the Python key's _identity(v) */
                if ((v = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(vals[j]))) == NULL) {
                    Py_DECREF(key);
                    return NULL;
                }
            } else {
                v = vals[j];
                Py_INCREF(v);
            }
            PyTuple_SET_ITEM(key, 4 + j, v);
        }
    }
    return key;
}

/* ---- the memo: the last Hits found, without building and hashing their key --------------- */

/* Session 5: building the key tuple, hashing it (torch.Size, a device) and the dict lookup cost
 * ~1.5k instructions a call (callgrind). A repeat call from a site usually passes what the last
 * call from there passed: a few entries, by call site, remember the terms of the last key found
 * there and its Hit. An entry is used only where every term is the same as its own, which
 * implies that the key is equal (so `fast` holds that Hit under it): the same object, or for
 * C types (ints, torch.Size and its ints, torch.device) equal by their C comparison, which runs
 * no Python code. Anything else (a Python-level __eq__) is a miss: the dict path. */

static int same(PyObject *a, PyObject *b) {
    if (a == b)
        return 1;
    PyTypeObject *tp = Py_TYPE(a);
    if (tp != Py_TYPE(b) || (tp->tp_flags & Py_TPFLAGS_HEAPTYPE))
        return 0;
    if (PyTuple_Check(a)) { /* a torch.Size: its ints, one by one */
        Py_ssize_t k = PyTuple_GET_SIZE(a);
        if (k != PyTuple_GET_SIZE(b))
            return 0;
        for (Py_ssize_t i = 0; i < k; i++)
            if (!same(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i)))
                return 0;
        return 1;
    }
    if (tp == &PyList_Type || tp == &PyDict_Type || tp == &PySet_Type || tp == &PyFrozenSet_Type)
        return 0; /* containers: their items may compare in Python */
    int r = PyObject_RichCompareBool(a, b, Py_EQ);
    if (r < 0)
        PyErr_Clear(); /* a miss: the dict path compares again and raises what it raises */
    return r > 0;
}

static Memo *memo_slot(Wrapper *w, PyObject *code, long a, long b) {
    size_t h = ((size_t)code >> 4) ^ ((size_t)a * 31u) ^ ((size_t)b * 131u);
    return &w->memo[h % NMEMO];
}

static int memo_match(Wrapper *w, Memo *m, PyObject *code, long a, long b, Py_ssize_t n,
                      PyObject **vals, int nv) {
    if (m->code != code || m->a != a || m->b != b || m->n != n || m->nv != nv)
        return 0;
    int j = 0;
    for (int i = 0; i < w->plen[n]; i++) {
        if (w->kind[n][i] == 1) { /* keyed by its identity: the same object, nothing else */
            if (vals[j] != m->vals[j])
                return 0;
            j++;
            continue;
        }
        for (int e = w->kind[n][i] == 0 ? 3 : 1; e > 0; e--, j++)
            if (vals[j] != m->vals[j] && !same(vals[j], m->vals[j]))
                return 0;
    }
    return 1;
}

static void memo_clear(Memo *m) {
    for (int i = 0; i < m->nv; i++)
        Py_CLEAR(m->vals[i]);
    m->nv = 0;
    Py_CLEAR(m->code);
    Py_CLEAR(m->hit);
}

static void memo_store(Memo *m, PyObject *code, long a, long b, Py_ssize_t n, PyObject **vals,
                       int nv, PyObject *hit) {
    memo_clear(m);
    Py_INCREF(code);
    Py_INCREF(hit);
    m->code = code; /* held: an address compared here is never another code's */
    m->hit = hit;
    m->a = a;
    m->b = b;
    m->n = n;
    for (int i = 0; i < nv; i++) {
        Py_INCREF(vals[i]);
        m->vals[i] = vals[i];
    }
    m->nv = nv;
}

/* The arguments of the kwplan's terms for a call with keyword arguments (borrowed), as the
 * Python key reads them: `args[pos] if n > pos else kwargs.get(name, default)`. */
static void resolve_kw(Wrapper *w, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       PyObject **out) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (int i = 0; i < w->kwlen; i++) {
        Py_ssize_t p = w->kwpos[i];
        PyObject *v = NULL;
        if (p < nargs) {
            v = args[p];
        } else {
            /* keyword names are interned where the call is compiled: identity first */
            for (Py_ssize_t j = 0; j < nk && v == NULL; j++)
                if (PyTuple_GET_ITEM(kwnames, j) == w->kwname[i])
                    v = args[nargs + j];
            for (Py_ssize_t j = 0; j < nk && v == NULL; j++) {
                int r = PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, j), w->kwname[i]);
                if (r == 0)
                    v = args[nargs + j];
                else if (r == -1 && PyErr_Occurred())
                    PyErr_Clear(); /* (a name that is no str: no match, as kwargs.get) */
            }
        }
        out[i] = v == NULL ? w->kwdef[i] : v;
    }
}

/* The Hit of this call from `frame` (a new reference) into *hit, or NULL where there is none,
 * and its key (fastpath.key_function) into *key: None where the arguments cannot be keyed
 * (AttributeError/TypeError: the general path then handles the call), NULL where the memo
 * gave the Hit. *argt and *kw: the call's arguments as a tuple and a dict, made here when the
 * Python key function needs them. 0, or -1 with an error set. */
static int find_hit(Wrapper *w, PyObject *rec, const Where *at, PyObject *const *args,
                    Py_ssize_t nargs, PyObject *kwnames, PyObject **argt, PyObject **kw,
                    PyObject **key, PyObject **hit) {
    PyObject *code = at->code; /* alive: its frame holds it, and a Hit keeps it once cached */
    long la = at->a, lb = at->b;
    PyObject *vals[MAXPLAN * 3];
    int nv = -2; /* -2: no plan (the Python key function), -1: the terms raised */
    Memo *m = NULL;
    int nokw = kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0;
    Py_ssize_t row = nargs;
    PyObject *resolved[MAXPLAN];
    if (!nokw && w->kwlen > 0 && nargs <= MAXPLAN) { /* keyword arguments: the kwplan row */
        resolve_kw(w, args, nargs, kwnames, resolved);
        args = resolved;
        row = KWROW;
    }
    if ((nokw && nargs < w->nplan) || row == KWROW) {
        nv = read_terms(w, args, row, vals);
        if (nv >= 0) {
            m = memo_slot(w, code, la, lb);
            if (memo_match(w, m, code, la, lb, row, vals, nv) &&
                PyTuple_GET_ITEM(m->hit, H_REC) == rec) {
                *hit = m->hit;
                Py_INCREF(*hit);
                goto out;
            }
        }
    }
    /* object.__hash__ of the code, as fastpath's key and dist.general (fkey[0]) expect */
    PyObject *ident = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(code));
    PyObject *a = PyLong_FromLong(la), *b = PyLong_FromLong(lb);
    if (ident != NULL && a != NULL && b != NULL && nv != -1) {
        PyObject *head[3] = {ident, a, b};
        if (nv >= 0) {
            *key = plan_key(w, head, row, vals, nv);
        } else if (*argt != NULL || pack(args, nargs, kwnames, argt, kw) == 0) {
            PyObject *kargs[5] = {*argt, *kw, ident, a, b};
            *key = PyObject_Vectorcall(w->fastkey, kargs, 5, NULL);
        }
    }
    Py_XDECREF(ident);
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (*key != NULL) {
        *hit = PyDict_GetItemWithError(w->fast, *key); /* borrowed */
        Py_XINCREF(*hit);
    }
    if (*key == NULL || (*hit == NULL && PyErr_Occurred())) {
        /* arguments the key cannot hold (an unhashable one: TypeError): no key */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError) &&
            !PyErr_ExceptionMatches(PyExc_TypeError)) {
            Py_CLEAR(*key);
            goto fail;
        }
        PyErr_Clear();
        Py_XSETREF(*key, Py_None);
        Py_INCREF(Py_None);
    } else if (*hit != NULL && m != NULL && PyTuple_Check(*hit) && PyTuple_GET_SIZE(*hit) >= H_N &&
               PyTuple_GET_ITEM(*hit, H_REC) == rec) {
        memo_store(m, code, la, lb, row, vals, nv, *hit);
    }
out:
    for (int i = 0; i < nv; i++)
        Py_DECREF(vals[i]);
    return 0;
fail:
    for (int i = 0; i < nv; i++)
        Py_DECREF(vals[i]);
    return -1;
}

/* Whether `hit` is a Hit this file can record from (types checked once, before any effect). */
static int usable(PyObject *hit) {
    if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) < H_N)
        return 0;
    PyObject *ent = PyTuple_GET_ITEM(hit, H_ENT);
    return PyBytes_Check(PyTuple_GET_ITEM(hit, H_HEAD)) &&
           PyBytes_Check(PyTuple_GET_ITEM(hit, H_MID)) &&
           PyBytes_Check(PyTuple_GET_ITEM(hit, H_TAIL)) &&
           PyBytes_Check(PyTuple_GET_ITEM(hit, H_SLOT_TAIL)) && PyTuple_Check(ent) &&
           PyTuple_GET_SIZE(ent) >= 3 && PyUnicode_Check(PyTuple_GET_ITEM(ent, 1)) &&
           PyUnicode_Check(PyTuple_GET_ITEM(ent, 2));
}

/* A tuple of n objects, the last `own` of them stolen (new ints); NULL if any is NULL.
 * Py_BuildValue parses its format at every call: ~4x the instructions. */
static PyObject *tuple_of(int n, int own, PyObject **items) {
    PyObject *t = NULL;
    for (int i = 0; i < n; i++)
        if (items[i] == NULL)
            goto out;
    if ((t = PyTuple_New(n)) == NULL)
        goto out;
    for (int i = 0; i < n; i++) {
        if (i < n - own)
            Py_INCREF(items[i]);
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
out:
    for (int i = n - own; i < n; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

/* Concatenate pieces into dst. */
typedef struct {
    const char *p;
    Py_ssize_t n;
} Piece;

static Py_ssize_t total(const Piece *ps, int k) {
    Py_ssize_t n = 0;
    for (int i = 0; i < k; i++)
        n += ps[i].n;
    return n;
}

static void join(char *dst, const Piece *ps, int k) {
    for (int i = 0; i < k; i++) {
        memcpy(dst, ps[i].p, ps[i].n);
        dst += ps[i].n;
    }
}

#define BYTES_PIECE(o) ((Piece){PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o)})

/* slot._mm[:n] = the in-flight record: a short-lived buffer export (never held across calls:
 * it would block the slot's close). Errors propagate, as the Python slice assignment's do. */
static int store_slot(PyObject *slot, const Piece *ps, int k) {
    PyObject *mm = GET(slot, _MM, s__mm);
    if (mm == NULL)
        return -1;
    Py_buffer view;
    int r = PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE);
    Py_DECREF(mm);
    if (r < 0)
        return -1;
    Py_ssize_t n = total(ps, k);
    if (n > view.len) { /* make_hit keeps the line shorter than the slot: never here */
        PyErr_SetString(PyExc_IndexError, "mmap slice assignment is wrong size");
        r = -1;
    } else {
        join((char *)view.buf, ps, k);
    }
    PyBuffer_Release(&view);
    return r;
}

/* mm.write(data). For an object whose type has no instance dict and the generic getattro (the
 * mmap), mm.write is the bound method of the type's `write` descriptor: that descriptor,
 * looked up once per type version (as getset_attr), is called with (mm, data), which saves
 * the method lookup of PyObject_VectorcallMethod (~150 instructions, callgrind). */
static PyObject *call_write(PyObject *mm, PyObject *data) {
    static PyTypeObject *tp;
    static unsigned int tag;
    static PyObject *descr; /* held */
    PyTypeObject *t = Py_TYPE(mm);
    if (t != tp || t->tp_version_tag != tag || tag == 0) {
        tp = NULL;
        PyObject *d = NULL;
        if (t->tp_getattro == PyObject_GenericGetAttr && t->tp_dictoffset == 0
#ifdef Py_TPFLAGS_MANAGED_DICT
            && !(t->tp_flags & Py_TPFLAGS_MANAGED_DICT)
#endif
        )
            d = _PyType_Lookup(t, s_write);
        if (d == NULL || Py_TYPE(d) != &PyMethodDescr_Type || t->tp_version_tag == 0)
            return PyObject_VectorcallMethod(s_write, (PyObject *[]){mm, data}, 2, NULL);
        Py_INCREF(d);
        Py_XSETREF(descr, d);
        tag = t->tp_version_tag;
        tp = t;
    }
    return PyObject_Vectorcall(descr, (PyObject *[]){mm, data}, 2, NULL);
}

/* Everything after a successful call (fastpath's second `try` block); -1 with an error set. */
static int after(Wrapper *w, PyObject *rec, PyObject *hit, PyObject *inflight, PyObject *tid,
                 PyObject *result, const Piece *pre, long long start, long long ts,
                 PyObject *iseq) {
    if (PyDict_DelItem(inflight, tid) < 0)
        return -1;
    long long end;
    if (perf_ns(w, &end) < 0)
        return -1;
    long long dur = us(end - start);
    char dbuf[24];
    Piece ps[6] = {pre[0], pre[1], pre[2], pre[3], {",\"d\":", 5}, {dbuf, digits(dbuf, dur)}};
    PyObject *tail = PyTuple_GET_ITEM(hit, H_TAIL);
    PyObject *data = PyBytes_FromStringAndSize(NULL, total(ps, 6) + PyBytes_GET_SIZE(tail));
    if (data == NULL)
        return -1;
    join(PyBytes_AS_STRING(data), ps, 6);
    memcpy(PyBytes_AS_STRING(data) + total(ps, 6), PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail));
    /* rec.writer.mm.write(data): the mapped trace file; else rec.emit_bytes(data) */
    PyObject *r = NULL, *writer = GET(rec, WRITER, s_writer);
    if (writer != NULL) {
        PyObject *mm = GET(writer, MM, s_mm);
        Py_DECREF(writer);
        if (mm != NULL) {
            r = call_write(mm, data);
            Py_DECREF(mm);
        }
    }
    if (r == NULL && (PyErr_ExceptionMatches(PyExc_AttributeError) ||
                      PyErr_ExceptionMatches(PyExc_ValueError))) {
        PyErr_Clear();
        r = PyObject_CallMethodOneArg(rec, s_emit_bytes, data);
    }
    Py_DECREF(data);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    /* rec.events += 1 */
    PyObject *ev = GET(rec, EVENTS, s_events), *ev2 = NULL;
    long long evn;
    if (ev != NULL && PyLong_CheckExact(ev) && (evn = PyLong_AsLongLong(ev)) < LLONG_MAX &&
        !(evn == -1 && PyErr_Occurred())) {
        ev2 = PyLong_FromLongLong(evn + 1); /* an int: what int.__iadd__ gives, without it */
    } else if (ev != NULL) {
        PyErr_Clear(); /* (an int beyond long long: the generic addition) */
        PyObject *one = PyLong_FromLong(1);
        if (one != NULL)
            ev2 = PyNumber_InPlaceAdd(ev, one);
        Py_XDECREF(one);
    }
    Py_XDECREF(ev);
    if (ev2 == NULL)
        return -1;
    PyObject *op = PyTuple_GET_ITEM(hit, H_OP), *g = PyTuple_GET_ITEM(hit, H_G);
    PyObject *site = PyTuple_GET_ITEM(hit, H_SITE);
    PyObject *last = tuple_of(5, 1, (PyObject *[]){op, g, iseq, site, PyLong_FromLongLong(ts + dur)});
    if (last == NULL) {
        Py_DECREF(ev2);
        return -1;
    }
    /* rec.events += 1; rec.last_event = (...) */
    int rc = set_two(rec, A_EVENTS, s_events, ev2, A_LAST_EVENT, s_last_event, last);
    Py_DECREF(ev2);
    Py_DECREF(last);
    if (rc < 0)
        return -1;
    int is_async = PyObject_IsTrue(PyTuple_GET_ITEM(hit, H_ASYNC));
    if (is_async < 0)
        return -1;
    if (is_async && result != Py_None) {
        PyObject *targs[7] = {rec, result, op, g, iseq, site, PyTuple_GET_ITEM(hit, H_WTAG)};
        r = PyObject_Vectorcall(w->track_async, targs, 7, NULL);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* The call raised `exc` (a reference we own): dist._failed records it, and it is re-raised
 * unchanged. */
static PyObject *call_failed(Wrapper *w, PyObject *rec, PyObject *hit, PyObject *inflight,
                             PyObject *tid, PyObject *exc, long long seq, long long start,
                             long long ts, PyObject *iseq) {
    if (PyDict_DelItem(inflight, tid) < 0) /* inflight.pop(tid, None) */
        PyErr_Clear();
    PyObject *ent = PyTuple_GET_ITEM(hit, H_ENT), *g = PyTuple_GET_ITEM(hit, H_G);
    PyObject *begin = PyUnicode_FromFormat("%U%lld%U,\"ts\":%lld", PyTuple_GET_ITEM(ent, 1), seq,
                                           PyTuple_GET_ITEM(ent, 2), ts);
    PyObject *key = tuple_of(4, 1, (PyObject *[]){PyTuple_GET_ITEM(hit, H_OP), g, iseq,
                                                 PyLong_FromLongLong(ts)});
    PyObject *st = PyLong_FromLongLong(start), *r = NULL;
    if (begin != NULL && key != NULL && st != NULL) {
        PyObject *fargs[6] = {rec, exc, begin, PyTuple_GET_ITEM(hit, H_SITE), st, key};
        r = PyObject_Vectorcall(w->failed, fargs, 6, NULL);
    }
    Py_XDECREF(begin);
    Py_XDECREF(key);
    Py_XDECREF(st);
    if (r == NULL) { /* as in an `except` block: the new error propagates, `exc` its context */
        PyObject *exc2 = take_exc();
        PyException_SetContext(exc2, exc); /* steals exc */
        give_exc(exc2);
        return NULL;
    }
    Py_DECREF(r);
    give_exc(exc);
    return NULL;
}

/* The recorder whose call this thread is inside, where record_hit issued it (else NULL):
 * such a thread has its `rec.inflight` entry, which only the thread itself removes, so any
 * collective it calls meanwhile (torch's all_gather_into_tensor calls the patched
 * all_gather_single) goes to `orig` whatever the other checks say. Session 6 (callgrind):
 * that nested call cost ~640 instructions in this file (five attribute reads, the thread id,
 * the dict lookup); this test first, ~40. */
static _Thread_local PyObject *inside;

/* `Inside(recorder_module)`: true while this thread is inside a call that record_hit issued for
 * the module's current recorder (the test at the top of wrapper_vectorcall). fastpath's shim
 * tests it before calling the C path: a nested call (torch's all_gather_into_tensor calling
 * the patched all_gather_single) then calls torch's function from the shim, a Python-to-Python
 * call, instead of through this file (a C call and a fresh interpreter loop for torch's
 * function: ~900 instructions, callgrind); a call that is not nested pays ~40 for the test. */
typedef struct {
    PyObject_HEAD
    PyObject *recmod;
} InsideObject;

static int inside_bool(InsideObject *self) {
    if (inside == NULL)
        return 0;
    PyObject *rec = get_attr(self->recmod, A_RECORDER, s_recorder);
    if (rec == NULL) { /* never the user's error: the C path decides (and reports) */
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(rec);
    return rec == inside;
}

static PyObject *inside_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *recmod;
    if (!PyArg_ParseTuple(args, "O:Inside", &recmod))
        return NULL;
    InsideObject *self = (InsideObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        Py_INCREF(recmod);
        self->recmod = recmod;
    }
    return (PyObject *)self;
}

static void inside_dealloc(InsideObject *self) {
    Py_XDECREF(self->recmod);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyNumberMethods inside_number = {.nb_bool = (inquiry)inside_bool};

static PyTypeObject InsideType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.rank._fastcall.Inside",
    .tp_doc = "Inside(recorder_module): true while this thread is inside a call recorded by the C path.",
    .tp_basicsize = sizeof(InsideObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_number = &inside_number,
    .tp_new = inside_new,
    .tp_dealloc = (destructor)inside_dealloc,
};

/* cur: seqs.get(g) (borrowed; the caller looked it up, an exact int or NULL) */
static PyObject *record_hit(Wrapper *w, PyObject *rec, PyObject *hit, PyObject *inflight,
                            PyObject *tid, PyObject *seqs, PyObject *cur, PyObject *const *args,
                            size_t nargsf, PyObject *kwnames) {
    PyObject *g = PyTuple_GET_ITEM(hit, H_G);
    /* seqs.get(g, 0) + 1 */
    long long seq = cur == NULL ? 1 : PyLong_AsLongLong(cur) + 1;
    if (seq == 0 && PyErr_Occurred())
        return NULL;
    PyObject *seqo = PyLong_FromLongLong(seq);
    if (seqo == NULL)
        return NULL;
    int rc = PyDict_SetItem(seqs, g, seqo); /* (seqo is kept: the entries' iseq, usually) */
    long long start, t0;
    if (rc < 0 || perf_ns(w, &start) < 0)
        return NULL;
    PyObject *t0o = GET(rec, T0_NS, s_t0_ns);
    if (t0o == NULL)
        return NULL;
    static PyObject *t0_obj; /* held: the last rec.t0_ns read and its value (~130 instr.) */
    static long long t0_val;
    if (t0o == t0_obj) {
        t0 = t0_val;
    } else {
        t0 = PyLong_AsLongLong(t0o);
        if (!(t0 == -1 && PyErr_Occurred())) {
            Py_INCREF(t0o);
            Py_XSETREF(t0_obj, t0o);
            t0_val = t0;
        }
    }
    Py_DECREF(t0o);
    if (t0 == -1 && PyErr_Occurred())
        return NULL;
    long long ts = us(start - t0);
    /* the line up to its start time, shared by the in-flight slot and the record */
    char sbuf[24], tbuf[24];
    Piece pre[4] = {BYTES_PIECE(PyTuple_GET_ITEM(hit, H_HEAD)), {sbuf, digits(sbuf, seq)},
                    BYTES_PIECE(PyTuple_GET_ITEM(hit, H_MID)), {tbuf, digits(tbuf, ts)}};
    PyObject *slot = GET(rec, SLOT, s_slot);
    if (slot == NULL)
        return NULL;
    if (slot != Py_None) { /* survives the process dying inside the call (trace/inflight) */
        Piece ps[5] = {pre[0], pre[1], pre[2], pre[3], BYTES_PIECE(PyTuple_GET_ITEM(hit, H_SLOT_TAIL))};
        rc = store_slot(slot, ps, 5);
    }
    Py_DECREF(slot);
    if (rc < 0)
        return NULL;
    int in_seq = PyObject_IsTrue(PyTuple_GET_ITEM(hit, H_INSEQ));
    if (in_seq < 0)
        return NULL;
    PyObject *iseq = in_seq ? seqo : PyLong_FromLong(0);
    if (in_seq)
        Py_INCREF(iseq);
    Py_DECREF(seqo);
    PyObject *entry = iseq == NULL ? NULL
                                   : tuple_of(5, 1, (PyObject *[]){PyTuple_GET_ITEM(hit, H_OP), g, iseq,
                                                                   PyTuple_GET_ITEM(hit, H_SITE),
                                                                   PyLong_FromLongLong(ts)});
    if (entry == NULL || PyDict_SetItem(inflight, tid, entry) < 0) { /* the watchdog's view */
        Py_XDECREF(entry);
        Py_XDECREF(iseq);
        return NULL;
    }
    Py_DECREF(entry);
    /* the user's call, with the very arguments it was given */
    PyObject *outer = inside;
    inside = rec; /* (rec is held by our caller throughout) */
    PyObject *result = PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
    inside = outer;
    if (result == NULL) {
        PyObject *exc = take_exc();
        PyObject *r = call_failed(w, rec, hit, inflight, tid, exc, seq, start, ts, iseq);
        Py_DECREF(iseq);
        return r;
    }
    if (after(w, rec, hit, inflight, tid, result, pre, start, ts, iseq) < 0) {
        /* after the call: recorded as far as it went, never re-issued; only an Exception is
         * reported (rec.internal_error), anything else (KeyboardInterrupt) propagates */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_CLEAR(result);
        } else {
            PyObject *exc = take_exc();
            PyObject *r = PyObject_CallMethodOneArg(rec, s_internal_error, exc);
            Py_DECREF(exc);
            if (r == NULL)
                Py_CLEAR(result);
            Py_XDECREF(r);
        }
    }
    Py_DECREF(iseq);
    return result;
}

/* threading.get_ident() as an int, made once per thread (a new reference; ~130 instructions a
 * call less). The thread's int is never freed: one per thread that calls a collective. */
static _Thread_local PyObject *tid_obj;
static _Thread_local unsigned long tid_val;

static PyObject *thread_id(void) {
    unsigned long id = PyThread_get_thread_ident();
    if (tid_obj == NULL || tid_val != id) {
        PyObject *o = PyLong_FromUnsignedLong(id);
        if (o == NULL)
            return NULL;
        Py_XSETREF(tid_obj, o);
        tid_val = id;
    }
    Py_INCREF(tid_obj);
    return tid_obj;
}

#if FAST_FRAMES
/* SiteTable's verdicts on frames (_gkind by globals, _lib by code, both keyed by
 * object.__hash__) kept by address while the table is unchanged (its PEP 509 version, which
 * every change moves, and which no other dict shares): one comparison a frame instead of an
 * int made and a dict lookup (~470 instructions a frame, ~18 frames a FSDP2 collective,
 * callgrind). An address in the table is held by it (_gkind holds the globals, SiteTable._codes
 * the codes, cleared with _lib), so it is never another object's meanwhile; an object not in
 * the table is not in it while the table is unchanged, whatever its address. */
#define NVERDICT 128
typedef struct {
    PyObject *table; /* compared only */
    unsigned long long ver;
    void *key[NVERDICT];
    signed char val[NVERDICT];
} Verdicts;
static Verdicts g_verdicts, c_verdicts;

/* table[object.__hash__(obj)] as a verdict: _gkind: 1 plain library globals, 0 not, 2 not
 * classified; _lib: the kind 0, 1, 2, or 3 not classified. -1 with an error set. */
static int verdict(Verdicts *v, PyObject *table, PyObject *obj, int globals) {
    if (v->table != table || DICT_VER(table) != v->ver) {
        memset(v->key, 0, sizeof v->key);
        v->table = table;
        v->ver = DICT_VER(table);
    }
    size_t slot = ((size_t)obj >> 4) % NVERDICT;
    if (v->key[slot] == obj)
        return v->val[slot];
    PyObject *id = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(obj));
    if (id == NULL)
        return -1;
    PyObject *k = PyDict_GetItemWithError(table, id); /* borrowed */
    Py_DECREF(id);
    int r;
    if (k == NULL) {
        if (PyErr_Occurred())
            return -1;
        r = globals ? 2 : 3;
    } else if (globals) { /* (g, flag): anything else stops the pass, as in skip_library */
        r = PyTuple_Check(k) && PyTuple_GET_SIZE(k) >= 2 ? PyObject_IsTrue(PyTuple_GET_ITEM(k, 1)) : 0;
        if (r < 0)
            return -1;
    } else {
        long kind = PyLong_CheckExact(k) ? PyLong_AsLong(k) : 3;
        r = kind >= 0 && kind <= 2 ? (int)kind : 3;
    }
    if (DICT_VER(table) == v->ver) { /* (IsTrue ran no code that changed it) */
        v->key[slot] = obj;
        v->val[slot] = (signed char)r;
    }
    return r;
}
#endif

/* SiteTable.at's hit (callsite.py; the key of _sitewalk.c's site_key) read on the interpreter's
 * frames in place: the call site's id (a new reference), or NULL with no error where a frame
 * is not classified yet or the key is not in the table (SiteTable.at then does it all), NULL
 * with an error set on an error. Session 6 (callgrind, FSDP2): site_key's PyFrame_GetBack made
 * a frame object for each of the 11-16 library frames between FSDP's call and the user's
 * line, ~11k instructions a collective. */
static PyObject *site_in_place(PyObject *sites, PyObject *gkind, const Where *at) {
#if FAST_FRAMES
    PyObject *libk = GET(sites, LIBK, s__lib), *atd = NULL, *key = NULL, *sid = NULL;
    PyObject *fw[2 * MAXPLAN];
    int nfw = 0, ok = 0;
    if (libk == NULL || (atd = GET(sites, ATD, s__at)) == NULL)
        goto out;
    if (!PyDict_CheckExact(libk) || !PyDict_CheckExact(atd))
        goto out;
    _PyInterpreterFrame *f = at->frame, *b;
    /* frames of plain library modules, told by their globals (skip_library) */
    for (;;) {
        int r = verdict(&g_verdicts, gkind, f->f_globals, 1);
        if (r < 0)
            goto out;
        if (r == 2) {
            ok = 1; /* not classified yet: SiteTable.at */
            goto out;
        }
        if (!r || (b = complete(f->previous)) == NULL)
            break;
        f = b;
    }
    /* then frames by their code: library (1) passed, frameworks (2) part of the key */
    PyObject *cid = NULL;
    for (;;) {
        int k = verdict(&c_verdicts, libk, (PyObject *)f->f_code, 0);
        if (k < 0 || k == 3) {
            ok = k == 3; /* not classified yet: SiteTable.at */
            goto out_fw;
        }
        if (k == 0)
            break;
        if (k == 2) {
            if (nfw + 2 > 2 * MAXPLAN) { /* a deep framework stack: SiteTable.at */
                ok = 1;
                goto out_fw;
            }
            fw[nfw] = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash((PyObject *)f->f_code));
            if (fw[nfw] == NULL)
                goto out_fw;
            nfw++;
            if ((fw[nfw] = PyLong_FromLong(iframe_lasti(f))) == NULL)
                goto out_fw;
            nfw++;
        }
        if ((b = complete(f->previous)) == NULL)
            break;
        f = b;
    }
    if ((cid = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash((PyObject *)f->f_code))) == NULL)
        goto out_fw;
    b = complete(f->previous);
    key = PyTuple_New(3 + nfw);
    if (key == NULL) {
        Py_DECREF(cid);
        goto out_fw;
    }
    PyTuple_SET_ITEM(key, 0, cid);
    PyTuple_SET_ITEM(key, 1, PyLong_FromLong(iframe_lasti(f)));
    PyTuple_SET_ITEM(key, 2, PyLong_FromLong(b == NULL ? -1 : iframe_lasti(b)));
    for (int i = 0; i < nfw; i++)
        PyTuple_SET_ITEM(key, 3 + i, fw[i]); /* the references move into the key */
    nfw = 0;
    if (PyTuple_GET_ITEM(key, 1) == NULL || PyTuple_GET_ITEM(key, 2) == NULL)
        goto out;
    sid = PyDict_GetItemWithError(atd, key);
    Py_XINCREF(sid);
    ok = sid != NULL || !PyErr_Occurred();
    goto out;
out_fw:
    while (nfw > 0)
        Py_DECREF(fw[--nfw]);
out:
    if (!ok && PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear(); /* SiteTable.at runs and reports what it raises */
    Py_XDECREF(libk);
    Py_XDECREF(atd);
    Py_XDECREF(key);
    return sid;
#else
    return NULL;
#endif
}

/* ---- library callers ---------------------------------------------------------------------
 *
 * A collective called by library code (FSDP2's all-gathers and reduce-scatters, see
 * libcalls.py) has no Hit under its caller's key: its site is the user's line further out,
 * one of many for one library line. dist's general path stores its Hit in `lib` under (key,
 * site) instead; here the same lookup is made (the caller told by its globals, as
 * rec.sites._gkind classifies them; the site by rec.sites.at(frame)) and a Hit found is
 * recorded by record_hit, the path of a user's repeat call, where libcalls.replay did it in
 * Python. Anything unusual (no such table, a site lookup that raises) finds no Hit: the general
 * path then does what it did before, its own error reports included. */
static int lib_hit(Wrapper *w, PyObject *rec, const Where *at, PyObject *key, PyObject **frame,
                   PyObject **hit) {
    if (!PyDict_CheckExact(w->lib) || at->globals == NULL)
        return 0;
    PyObject *sites = GET(rec, SITES, s_sites), *gkind = NULL, *gid = NULL, *site = NULL;
    PyObject *lkey = NULL;
    int r = -1;
    if (sites == NULL || (gkind = GET(sites, GKIND, s__gkind)) == NULL)
        goto out;
    r = 0;
    if (!PyDict_CheckExact(gkind))
        goto out;
    /* gk = _gkind.get(object.__hash__(frame.f_globals)); a library caller where gk[1] */
#if FAST_FRAMES
    int is_lib = verdict(&g_verdicts, gkind, at->globals, 1);
    if (is_lib != 1) {
        r = is_lib < 0 ? -1 : 0;
        goto out;
    }
#else
    if ((gid = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(at->globals))) == NULL) {
        r = -1;
        goto out;
    }
    PyObject *gk = PyDict_GetItemWithError(gkind, gid); /* borrowed */
    if (gk == NULL || !PyTuple_CheckExact(gk) || PyTuple_GET_SIZE(gk) < 2) {
        r = PyErr_Occurred() ? -1 : 0;
        goto out;
    }
    int is_lib = PyObject_IsTrue(PyTuple_GET_ITEM(gk, 1));
    if (is_lib <= 0) {
        r = is_lib;
        goto out;
    }
#endif
    site = site_in_place(sites, gkind, at);
    if (site == NULL && PyErr_Occurred())
        goto out;
    if (site == NULL && *frame == NULL && (*frame = user_frame()) == NULL)
        goto out;
    if (site == NULL)
        site = PyObject_CallMethodOneArg(sites, s_at, *frame);
    if (site == NULL) { /* the general path looks it up again and reports what it raises */
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            r = -1;
        else
            PyErr_Clear();
        goto out;
    }
    if ((lkey = PyTuple_Pack(2, key, site)) == NULL) {
        r = -1;
        goto out;
    }
    PyObject *h = PyDict_GetItemWithError(w->lib, lkey); /* borrowed */
    if (h == NULL) {
        if (PyErr_Occurred()) { /* (as general's own lookup: reported there) */
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                r = -1;
            else
                PyErr_Clear();
        }
        goto out;
    }
    if (PyTuple_Check(h) && PyTuple_GET_SIZE(h) >= H_N && PyTuple_GET_ITEM(h, H_REC) == rec) {
        Py_INCREF(h);
        *hit = h;
    }
out:
    Py_XDECREF(sites);
    Py_XDECREF(gkind);
    Py_XDECREF(gid);
    Py_XDECREF(site);
    Py_XDECREF(lkey);
    return r;
}

static PyObject *wrapper_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames) {
    Wrapper *w = (Wrapper *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *rec = GET(w->recmod, RECORDER, s_recorder);
    if (rec == NULL)
        return NULL;
    if (rec == inside) { /* nested in a call recorded here, on this thread (see `inside`) */
        Py_DECREF(rec);
        return PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
    }
    PyObject *tid = NULL, *inflight = NULL, *seqs = NULL, *argt = NULL, *kw = NULL, *key = NULL;
    PyObject *hit = NULL, *result = NULL, *frame = NULL;
    int r = tracing(w, rec);
    if (r <= 0) { /* not tracing, nested in a patched call, compiling (or an error) */
        if (r == 0)
            result = PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
        goto done;
    }
    tid = thread_id(); /* threading.get_ident() */
    inflight = GET(rec, INFLIGHT, s_inflight);
    if (tid == NULL || inflight == NULL)
        goto done;
    if (!PyDict_CheckExact(inflight))
        goto python;
    r = PyDict_Contains(inflight, tid);
    if (r != 0) { /* inside another recorded call (all_gather_object -> all_gather) */
        if (r > 0)
            result = PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
        goto done;
    }
    /* the user's frame: the caller of fastpath's shim, the Python frame that called this
     * (read after the nesting check, as the Python wrapper does) */
    Where at;
    if (!where(&at))
        goto python;
    if (w->fastkey != Py_None) {
        r = w->reducing ? truthy(GET(rec, DDP_REFS, s_ddp_refs)) : 0; /* (ddp_overlap: general) */
        if (r < 0)
            goto done;
        if (!r) {
            if (find_hit(w, rec, &at, args, nargs, kwnames, &argt, &kw, &key,
                         &hit) < 0)
                goto done;
            /* no Hit for a user's line: a library caller's, by (key, the user's site)? */
            if (hit == NULL && key != NULL && key != Py_None &&
                lib_hit(w, rec, &at, key, &frame, &hit) < 0)
                goto done;
        }
    }
    if (hit == NULL || !PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) < H_N ||
        PyTuple_GET_ITEM(hit, H_REC) != rec) {
        if (argt == NULL && pack(args, nargs, kwnames, &argt, &kw) < 0)
            goto done;
        if (frame == NULL && (frame = user_frame()) == NULL)
            goto python;
        PyObject *gargs[7] = {rec, tid, frame, key == NULL ? Py_None : key, w->fast, argt, kw};
        result = PyObject_Vectorcall(w->general, gargs, 7, NULL);
        goto done;
    }
    seqs = GET(rec, SEQ, s_seq);
    if (seqs == NULL)
        goto done;
    PyObject *cur = PyDict_CheckExact(seqs) ? PyDict_GetItemWithError(seqs, PyTuple_GET_ITEM(hit, H_G)) : NULL;
    if (!PyDict_CheckExact(seqs) || !usable(hit) || (cur != NULL && !PyLong_CheckExact(cur)))
        goto python;
    result = record_hit(w, rec, hit, inflight, tid, seqs, cur, args, nargsf, kwnames);
    goto done;
python: /* an object of another type than this file relies on: nothing done yet */
    if (!PyErr_Occurred())
        result = PyObject_Vectorcall(w->python, args, nargsf, kwnames);
done:
    Py_DECREF(rec);
    Py_XDECREF(tid);
    Py_XDECREF(inflight);
    Py_XDECREF(frame);
    Py_XDECREF(seqs);
    Py_XDECREF(argt);
    Py_XDECREF(kw);
    Py_XDECREF(key);
    Py_XDECREF(hit);
    return result;
}

/* ---- the type --------------------------------------------------------------------------- */

#define VISIT(f) Py_VISIT(w->f);
#define CLEAR(f) Py_CLEAR(w->f);
#define NULLIFY(f) w->f = NULL;
#define INCREF(f) Py_INCREF(w->f);

static int wrapper_traverse(Wrapper *w, visitproc visit, void *arg) {
    FIELDS(VISIT)
    for (int i = 0; i < w->kwlen; i++) {
        Py_VISIT(w->kwname[i]);
        Py_VISIT(w->kwdef[i]);
    }
    for (int i = 0; i < NMEMO; i++) {
        Py_VISIT(w->memo[i].code);
        Py_VISIT(w->memo[i].hit);
        for (int j = 0; j < w->memo[i].nv; j++)
            Py_VISIT(w->memo[i].vals[j]);
    }
    return 0;
}

static int wrapper_clear(Wrapper *w) {
    FIELDS(CLEAR)
    for (int i = 0; i < w->kwlen; i++) {
        Py_CLEAR(w->kwname[i]);
        Py_CLEAR(w->kwdef[i]);
    }
    w->kwlen = 0;
    for (int i = 0; i < NMEMO; i++)
        memo_clear(&w->memo[i]);
    return 0;
}

static void wrapper_dealloc(Wrapper *w) {
    PyObject_GC_UnTrack(w);
    wrapper_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ddpdoctor.rank._fastcall.Wrapper",
    .tp_doc = "The C path of a collective's wrapper, called by fastpath.make_wrapper's shim.",
    .tp_basicsize = sizeof(Wrapper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Wrapper, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)wrapper_traverse,
    .tp_clear = (inquiry)wrapper_clear,
    .tp_dealloc = (destructor)wrapper_dealloc,
};

/* Copy fastpath.key_function's plan ((position, kind) pairs per number of positional
 * arguments) into w; 0 where it does not fit (the Python key function is then used), -1 on
 * error. */
static int read_plan(Wrapper *w, PyObject *plan) {
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) > MAXPLAN)
        return 0;
    for (Py_ssize_t n = 0; n < PyTuple_GET_SIZE(plan); n++) {
        PyObject *terms = PyTuple_GET_ITEM(plan, n);
        if (!PyTuple_Check(terms) || PyTuple_GET_SIZE(terms) > MAXPLAN)
            return 0;
        w->plen[n] = (signed char)PyTuple_GET_SIZE(terms);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(terms); i++) {
            int p, k;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(terms, i), "ii", &p, &k))
                return -1;
            if (p < 0 || p >= n || k < 0 || k > 2)
                return 0; /* a term beyond the call's arguments: not a plan this file reads */
            w->pos[n][i] = (signed char)p;
            w->kind[n][i] = (signed char)k;
        }
    }
    return (int)PyTuple_GET_SIZE(plan);
}

/* Copy fastpath.key_function's kwplan ((position, kind, name, default) per term) into w's row
 * KWROW; 0 where it does not fit (calls with keyword arguments then take the Python key). */
static int read_kwplan(Wrapper *w, PyObject *kwplan) {
    if (!PyTuple_Check(kwplan) || PyTuple_GET_SIZE(kwplan) == 0 || PyTuple_GET_SIZE(kwplan) > MAXPLAN)
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(kwplan);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(kwplan, i), *name, *dflt;
        Py_ssize_t p;
        int k;
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "niUO", &p, &k, &name, &dflt)) {
            PyErr_Clear();
            return 0;
        }
        if (k < 0 || k > 2 || p < 0)
            return 0;
        w->kwpos[i] = p;
        w->pos[KWROW][i] = (signed char)i; /* the resolved arguments, in term order */
        w->kind[KWROW][i] = (signed char)k;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(kwplan, i);
        w->kwname[i] = PyTuple_GET_ITEM(t, 2);
        w->kwdef[i] = PyTuple_GET_ITEM(t, 3);
        Py_INCREF(w->kwname[i]);
        Py_INCREF(w->kwdef[i]);
    }
    w->plen[KWROW] = (signed char)n;
    w->kwlen = (int)n;
    return 1;
}

static PyObject *make(PyObject *module, PyObject *args) {
    Wrapper *w = PyObject_GC_New(Wrapper, &WrapperType);
    if (w == NULL)
        return NULL;
    w->vectorcall = wrapper_vectorcall;
    FIELDS(NULLIFY)
    memset(w->memo, 0, sizeof w->memo);
    w->kwlen = 0;
    PyObject *plan, *kwplan;
    if (!PyArg_ParseTuple(args, "OOOO!pOOOOOOOOO:make", &w->orig, &w->fastkey, &w->general,
                          &PyDict_Type, &w->fast, &w->reducing, &w->tc, &w->failed,
                          &w->track_async, &w->recmod, &w->python, &w->perf_ns, &plan, &w->lib, &kwplan)) {
        FIELDS(NULLIFY) /* borrowed until parsed */
        Py_DECREF(w);
        return NULL;
    }
    FIELDS(INCREF)
    w->nplan = read_plan(w, plan);
    if (w->nplan >= 0 && read_kwplan(w, kwplan) < 0)
        w->nplan = -1;
    if (w->nplan < 0) {
        Py_DECREF(w);
        return NULL;
    }
    PyObject_GC_Track(w);
    return (PyObject *)w;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS,
     "make(orig, fastkey, general, fast, reducing, tc, failed, track_async, recorder_module,"
     " python_wrapper, perf_counter_ns, key_plan, library_hits, keyword_plan) -> Wrapper: see"
     " fastpath.make_wrapper."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_fastcall",
    "The repeat-call path of ddpdoctor's collective wrappers, in C (see fastpath.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void) {
    if (PyType_Ready(&WrapperType) < 0 || PyType_Ready(&DepthType) < 0 || PyType_Ready(&InsideType) < 0)
        return NULL;
#define INTERN(var, text)                                   \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_shape, "shape");
    INTERN(s_dtype, "dtype");
    INTERN(s_device, "device");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_recorder, "_recorder");
    INTERN(s_enabled, "enabled");
    INTERN(s_local, "local");
    INTERN(s_depth, "depth");
    INTERN(s_flag, "_is_compiling_flag");
    INTERN(s_inflight, "inflight");
    INTERN(s_ddp_refs, "ddp_refs");
    INTERN(s_seq, "seq");
    INTERN(s_t0_ns, "t0_ns");
    INTERN(s_slot, "slot");
    INTERN(s__mm, "_mm");
    INTERN(s_writer, "writer");
    INTERN(s_mm, "mm");
    INTERN(s_write, "write");
    INTERN(s_emit_bytes, "emit_bytes");
    INTERN(s_events, "events");
    INTERN(s_last_event, "last_event");
    INTERN(s_internal_error, "internal_error");
    INTERN(s_sites, "sites");
    INTERN(s__gkind, "_gkind");
    INTERN(s_at, "at");
    INTERN(s__lib, "_lib");
    INTERN(s__at, "_at");
#undef INTERN
    PyObject *m = PyModule_Create(&moduledef);
    Py_INCREF(&WrapperType);
    if (m != NULL && PyModule_AddObject(m, "Wrapper", (PyObject *)&WrapperType) < 0) {
        Py_DECREF(&WrapperType);
        Py_CLEAR(m);
    }
    Py_INCREF(&DepthType);
    if (m != NULL && PyModule_AddObject(m, "Depth", (PyObject *)&DepthType) < 0) {
        Py_DECREF(&DepthType);
        Py_CLEAR(m);
    }
    Py_INCREF(&InsideType);
    if (m != NULL && PyModule_AddObject(m, "Inside", (PyObject *)&InsideType) < 0) {
        Py_DECREF(&InsideType);
        Py_CLEAR(m);
    }
    return m;
}
