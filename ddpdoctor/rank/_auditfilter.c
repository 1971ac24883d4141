/* A C-level audit hook that calls ddpdoctor's Python file hook only for the events it watches.
 *
 * Why: a hook installed with sys.addaudithook is a Python call for *every* audit event of the
 * process (~2-3k instructions each, callgrind, issue #11), and most events are not file
 * operations: each `id()` (torch._dynamo's disable wrappers that FSDP2 builds every step call it
 * ~29 times a step), each `frame.f_code` and `sys._getframe`. Filtering by name in Python still
 * pays for the call. A hook added with PySys_AddAuditHook runs in C: an unwatched event costs a
 * few string comparisons, and the Python hook is called with the same (event, args) as
 * sys.addaudithook would pass it, so it records the same operations.
 *
 * Optional (setup.py, optional=True); without it, or with DDPDOCTOR_NATIVE=0, ddpdoctor uses
 * sys.addaudithook as before (rank/auditfilter.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_EVENTS 64

static char *names[MAX_EVENTS];
static int n_names = 0;
static PyObject *callback = NULL;             /* strong reference, never released: hooks stay */
static PyInterpreterState *owner = NULL;      /* the callback's interpreter: others are skipped */
static int hook_added = 0;

static PyThreadState *
current_tstate(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyThreadState_GetUnchecked();
#else
    return _PyThreadState_UncheckedGet();
#endif
}

static int
hook(const char *event, PyObject *args, void *data)
{
    (void)data;
    if (callback == NULL || event == NULL)
        return 0;
    /* A runtime-wide hook also sees events raised with no thread state (without the GIL, which
     * guards the names) and in subinterpreters: the Python callback belongs to one interpreter. */
    PyThreadState *ts = current_tstate();
    if (ts == NULL || PyThreadState_GetInterpreter(ts) != owner)
        return 0;
    int i;
    for (i = 0; i < n_names; i++) {
        if (event[0] == names[i][0] && strcmp(event, names[i]) == 0)
            break;
    }
    if (i == n_names)
        return 0;
    PyObject *ev = PyUnicode_FromString(event);
    if (ev == NULL)
        return -1;
    PyObject *empty = NULL;
    if (args == NULL) {
        empty = PyTuple_New(0);
        if (empty == NULL) {
            Py_DECREF(ev);
            return -1;
        }
    }
    PyObject *cb = callback;
    Py_INCREF(cb);  /* install() may replace it while it runs */
    PyObject *res = PyObject_CallFunctionObjArgs(cb, ev, args != NULL ? args : empty, NULL);
    Py_DECREF(cb);
    Py_DECREF(ev);
    Py_XDECREF(empty);
    if (res == NULL)
        return -1;  /* as a Python hook that raised: the event's operation fails with it */
    Py_DECREF(res);
    return 0;
}

PyDoc_STRVAR(install_doc,
"install(events, callback)\n--\n\n"
"Call ``callback(event, args)`` for each audit event named in ``events`` (strings), from a C\n"
"audit hook; every other event leaves in C. A second call replaces the events and callback.");

static PyObject *
install(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "install(events, callback) takes 2 arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "events must be a sequence of str");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_EVENTS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many events");
        return NULL;
    }
    if (!PyCallable_Check(args[1])) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "callback must be callable");
        return NULL;
    }
    char *fresh[MAX_EVENTS];
    Py_ssize_t k;
    for (k = 0; k < n; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, k);
        const char *s = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        if (s == NULL || s[0] == '\0') {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "events must be non-empty str");
            goto fail;
        }
        fresh[k] = PyMem_RawMalloc(strlen(s) + 1);
        if (fresh[k] == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        strcpy(fresh[k], s);
    }
    Py_DECREF(seq);
    if (!hook_added) {
        if (PySys_AddAuditHook(hook, NULL) < 0) {  /* vetoed by another hook */
            for (Py_ssize_t j = 0; j < n; j++)
                PyMem_RawFree(fresh[j]);
            return NULL;
        }
        hook_added = 1;
    }
    /* Replaced under the GIL, which every call of hook() holds: no event sees a mix. The old
     * names are freed; the hook reads them only while holding the GIL too. */
    n_names = 0;
    for (int j = 0; j < MAX_EVENTS; j++) {
        if (names[j] != NULL) {
            PyMem_RawFree(names[j]);
            names[j] = NULL;
        }
    }
    for (k = 0; k < n; k++)
        names[k] = fresh[k];
    Py_INCREF(args[1]);
    Py_XSETREF(callback, args[1]);
    owner = PyThreadState_GetInterpreter(PyThreadState_Get());
    n_names = (int)n;
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t j = 0; j < k; j++)
        PyMem_RawFree(fresh[j]);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"install", (PyCFunction)(void (*)(void))install, METH_FASTCALL, install_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_auditfilter",
    "A C audit hook that calls a Python hook only for the events it names (see auditfilter.py).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__auditfilter(void)
{
    return PyModule_Create(&module);
}
