/* The library frames of a call-site lookup, passed over in C (rank/callsite.py, SiteTable.at).
 *
 * Why: a collective issued by a library (FSDP2's all-gathers and reduce-scatters, DDP's join)
 * is 11-16 frames of torch away from the user's line (FSDP's hooks, nn.Module's call path,
 * autograd's backward). SiteTable.at passes those frames by the identity of their globals;
 * in Python that loop is ~15 bytecodes a frame, ~200 a collective (callgrind, issue #11). Here
 * it is the same test in C: the frame's globals looked up in the same table (``_gkind``, keyed
 * by ``object.__hash__`` of the globals), stopping at the first frame whose globals are not
 * known to be plain library code; SiteTable.at goes on from there exactly as before.
 *
 * Optional (setup.py, optional=True); without it the Python loop does the whole walk. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

PyDoc_STRVAR(skip_doc,
"skip_library(frame, gkind)\n--\n\n"
"The first frame from ``frame`` outwards whose globals are not in ``gkind`` as plain library\n"
"code (``gkind[object.__hash__(globals)][1]`` true), or the outermost frame.");

static PyObject *
skip_library(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyFrame_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "skip_library(frame, dict)");
        return NULL;
    }
    PyFrameObject *f = (PyFrameObject *)args[0];
    PyObject *gkind = args[1];
    Py_INCREF(f);
#if PY_VERSION_HEX >= 0x030B0000
    for (;;) {
        PyObject *g = PyFrame_GetGlobals(f);
        if (g == NULL) {
            PyErr_Clear();
            break;
        }
        /* object.__hash__(g): the key SiteTable uses (id() would raise an audit event) */
        PyObject *key = PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(g));
        Py_DECREF(g);
        if (key == NULL)
            goto error;
        PyObject *k = PyDict_GetItemWithError(gkind, key);  /* borrowed */
        Py_DECREF(key);
        if (k == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;  /* globals not classified yet: SiteTable.at does that */
        }
        if (!PyTuple_Check(k) || PyTuple_GET_SIZE(k) < 2 || PyTuple_GET_ITEM(k, 0) == NULL)
            break;
        int lib = PyObject_IsTrue(PyTuple_GET_ITEM(k, 1));
        if (lib < 0)
            goto error;
        if (!lib)
            break;
        PyFrameObject *b = PyFrame_GetBack(f);
        if (b == NULL)
            break;
        Py_DECREF(f);
        f = b;
    }
#endif
    return (PyObject *)f;
error:
    Py_DECREF(f);
    return NULL;
}

static PyMethodDef methods[] = {
    {"skip_library", (PyCFunction)(void (*)(void))skip_library, METH_FASTCALL, skip_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sitewalk",
    "Library frames of a call-site lookup passed over in C (see callsite.SiteTable.at).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__sitewalk(void)
{
    return PyModule_Create(&module);
}
