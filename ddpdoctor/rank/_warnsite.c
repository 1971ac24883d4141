/* warnings.warn for traced processes, in C: counts ``stacklevel`` over ddpdoctor's own frames.
 *
 * Why (rank/warnsite.py has the reason for the mechanism): torch 2.13 deprecates
 * all_gather_into_tensor and reduce_scatter_tensor with a decorator that calls warnings.warn on
 * *every* call, so warn is on the collectives' hot path. The Python replacement cost ~8k
 * instructions a call there (a Python call, sys._getframe, the walk, the real warn called from
 * Python); a C function has no frame of its own, reads the caller's frame directly and calls the
 * real warn with the same vector of arguments: a few hundred instructions over a plain run.
 *
 * Optional (setup.py, optional=True); without it, or with DDPDOCTOR_NATIVE=0, warnsite.py
 * installs its Python function. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include "_native.h" /* FAST_FRAMES (see adjusted()) */

static PyObject *real_warn = NULL;   /* the warnings.warn this one replaced (strong reference) */
static PyObject *prefix = NULL;      /* ddpdoctor's package folder, with a trailing separator */
static PyObject *level_name = NULL;  /* "stacklevel", interned */

/* The last code objects classified and their verdicts (held: an address compared here is
 * never another code's); a hit saves the prefix comparison, ~120 instructions a call. */
#define NSEEN 4
static PyObject *seen_code[NSEEN];
static int seen_ours[NSEEN], seen_next;

static int
code_is_ours(PyCodeObject *co)
{
    for (int i = 0; i < NSEEN; i++)
        if (seen_code[i] == (PyObject *)co)
            return seen_ours[i];
    int hit = PyUnicode_Tailmatch(co->co_filename, prefix, 0, PY_SSIZE_T_MAX, -1) == 1;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    Py_INCREF(co);
    Py_XSETREF(seen_code[seen_next], (PyObject *)co);
    seen_ours[seen_next] = hit;
    seen_next = (seen_next + 1) % NSEEN;
    return hit;
}

#if FAST_FRAMES
/* Session 6 (callgrind, all_gather_into_tensor): PyEval_GetFrame/PyFrame_GetBack made frame
 * objects for warn's caller and the frame above it at every call, ~1.2k instructions of the
 * ~1.3k this function added to the real warn. The interpreter's frames are read in place
 * instead, skipping the incomplete ones exactly as PyFrame_GetBack does (as _fastcall.c). */
static _PyInterpreterFrame *
complete(_PyInterpreterFrame *f)
{
    while (f != NULL && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}

/* The stacklevel that names, from the caller's frame, the frame a plain run would name: one
 * more for each ddpdoctor frame passed on the way up (as warnsite.adjusted_level). */
static long
adjusted(long level)
{
    /* warn's caller: a C function has no frame of its own */
    _PyInterpreterFrame *f = complete(PyThreadState_Get()->cframe->current_frame);
    long extra = 0;
    for (long i = 0; i < level - 1 && f != NULL; i++) {
        f = complete(f->previous);
        while (f != NULL && code_is_ours(f->f_code)) {
            f = complete(f->previous);
            extra++;
        }
    }
    return level + extra;
}
#else
static int
is_ours(PyFrameObject *f)
{
    PyCodeObject *co = PyFrame_GetCode(f);
    if (co == NULL) {
        PyErr_Clear();
        return 0;
    }
    int hit = code_is_ours(co);
    Py_DECREF(co);
    return hit;
}

/* The stacklevel that names, from the caller's frame, the frame a plain run would name: one
 * more for each ddpdoctor frame passed on the way up (as warnsite.adjusted_level). */
static long
adjusted(long level)
{
    PyFrameObject *f = PyEval_GetFrame();  /* borrowed: warn's caller (a C function has no frame) */
    long extra = 0;
    Py_XINCREF(f);
    for (long i = 0; i < level - 1 && f != NULL; i++) {
        PyFrameObject *b = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = b;
        while (f != NULL && is_ours(f)) {
            b = PyFrame_GetBack(f);
            Py_DECREF(f);
            f = b;
            extra++;
        }
    }
    Py_XDECREF(f);
    return level + extra;
}
#endif

static PyObject *
warn(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    (void)self;
    if (real_warn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ddpdoctor warnsite: not installed");
        return NULL;
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    Py_ssize_t at = -1;  /* where stacklevel is in args, if given */
    if (nargs > 2) {
        at = 2;
    } else {
        /* keyword names are interned where the call is compiled: by identity first (the
         * comparison of each other name cost ~90 instructions a call, callgrind) */
        for (Py_ssize_t i = 0; i < nkw && at < 0; i++)
            if (PyTuple_GET_ITEM(kwnames, i) == level_name)
                at = nargs + i;
        for (Py_ssize_t i = 0; i < nkw && at < 0; i++)
            if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), level_name) == 0)
                at = nargs + i;
    }
    long level = 1;
    if (at >= 0) {
        if (!PyLong_Check(args[at]))  /* the real warn raises its own TypeError */
            return PyObject_Vectorcall(real_warn, args, nargs, kwnames);
        level = PyLong_AsLong(args[at]);
        if (level == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return PyObject_Vectorcall(real_warn, args, nargs, kwnames);
        }
    }
    if (level <= 1)
        return PyObject_Vectorcall(real_warn, args, nargs, kwnames);
    long want = adjusted(level);
    if (want == level)
        return PyObject_Vectorcall(real_warn, args, nargs, kwnames);
    /* the same arguments with stacklevel replaced (or added after the positional ones) */
    Py_ssize_t total = nargs + nkw;
    PyObject *small[16];
    PyObject **vec = total < 16 ? small : PyMem_Malloc(sizeof(PyObject *) * (total + 1));
    if (vec == NULL)
        return PyErr_NoMemory();
    PyObject *lv = PyLong_FromLong(want);
    if (lv == NULL) {
        if (vec != small)
            PyMem_Free(vec);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < total; i++)
        vec[i] = i == at ? lv : args[i];
    PyObject *res = PyObject_Vectorcall(real_warn, vec, nargs, kwnames);
    Py_DECREF(lv);
    if (vec != small)
        PyMem_Free(vec);
    return res;
}

static PyObject *
install(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "install(real_warn, package_prefix)");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(real_warn, args[0]);
    Py_XSETREF(prefix, args[1]);
    for (int i = 0; i < NSEEN; i++)  /* verdicts of the former prefix */
        Py_CLEAR(seen_code[i]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"warn", (PyCFunction)(void (*)(void))warn, METH_FASTCALL | METH_KEYWORDS,
     "warnings.warn, with stacklevel counted over ddpdoctor's frames."},
    {"install", (PyCFunction)(void (*)(void))install, METH_FASTCALL,
     "install(real_warn, package_prefix): what warn calls, and whose frames it steps over."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_warnsite", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__warnsite(void)
{
    level_name = PyUnicode_InternFromString("stacklevel");
    if (level_name == NULL)
        return NULL;
    return PyModule_Create(&module);
}
