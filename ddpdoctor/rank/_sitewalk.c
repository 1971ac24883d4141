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

/* object.__hash__(o) as a Python int: the identity keys of SiteTable's tables. */
static PyObject *
identity(PyObject *o)
{
    return PyLong_FromSsize_t(PyBaseObject_Type.tp_hash(o));
}

PyDoc_STRVAR(key_doc,
"site_key(frame, gkind, lib)\n--\n\n"
"The key SiteTable.at builds for a call made from ``frame`` (the first user frame's code\n"
"identity and instruction offset, its caller's offset, the framework frames in between), or\n"
"None where a frame's globals or code are not classified yet: SiteTable.at then walks.");

/* SiteTable.at's hit path in C: the same two loops over the same tables, with no audit event
 * (PyFrame_GetCode raises none, frame.f_code does) and no Python frame per step. */
static PyObject *
site_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyFrame_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "site_key(frame, dict, dict)");
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *lib = args[2];
    PyFrameObject *f = (PyFrameObject *)skip_library(self, args, 2);
    if (f == NULL)
        return NULL;
    /* skip_library stops at globals it does not know too: known non-library ones go on */
    PyObject *g = PyFrame_GetGlobals(f);
    PyObject *gid = g == NULL ? NULL : identity(g);
    Py_XDECREF(g);
    if (gid == NULL)
        goto fail;
    PyObject *gk = PyDict_GetItemWithError(args[1], gid);
    Py_DECREF(gid);
    if (gk == NULL) {
        if (PyErr_Occurred())
            goto fail;
        goto unknown;
    }
    PyObject *fw = PyList_New(0);  /* (code identity, offset) of each framework frame */
    if (fw == NULL)
        goto fail;
    PyObject *cid = NULL;
    for (;;) {
        PyCodeObject *code = PyFrame_GetCode(f);
        Py_XDECREF(cid);
        cid = identity((PyObject *)code);
        Py_DECREF(code);
        if (cid == NULL)
            goto fail_fw;
        PyObject *kind = PyDict_GetItemWithError(lib, cid);
        if (kind == NULL) {
            Py_DECREF(cid);
            Py_DECREF(fw);
            if (PyErr_Occurred())
                goto fail;
            goto unknown;
        }
        long k = PyLong_AsLong(kind);
        if (k == -1 && PyErr_Occurred())
            goto fail_cid;
        if (k == 0)
            break;
        if (k == 2) {
            PyObject *off = PyLong_FromLong(PyFrame_GetLasti(f));
            if (off == NULL || PyList_Append(fw, cid) < 0 || PyList_Append(fw, off) < 0) {
                Py_XDECREF(off);
                goto fail_cid;
            }
            Py_DECREF(off);
        }
        PyFrameObject *b = PyFrame_GetBack(f);
        if (b == NULL)
            break;
        Py_DECREF(f);
        f = b;
    }
    PyFrameObject *b = PyFrame_GetBack(f);
    Py_ssize_t n = PyList_GET_SIZE(fw);
    PyObject *key = PyTuple_New(3 + n);
    if (key == NULL) {
        Py_XDECREF(b);
        goto fail_cid;
    }
    PyTuple_SET_ITEM(key, 0, cid);  /* the reference moves into the key */
    PyTuple_SET_ITEM(key, 1, PyLong_FromLong(PyFrame_GetLasti(f)));
    PyTuple_SET_ITEM(key, 2, PyLong_FromLong(b == NULL ? -1 : PyFrame_GetLasti(b)));
    Py_XDECREF(b);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(fw, i);
        Py_INCREF(o);
        PyTuple_SET_ITEM(key, 3 + i, o);
    }
    Py_DECREF(fw);
    Py_DECREF(f);
    if (PyTuple_GET_ITEM(key, 1) == NULL || PyTuple_GET_ITEM(key, 2) == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    return key;
fail_cid:
    Py_DECREF(cid);
fail_fw:
    Py_DECREF(fw);
fail:
    Py_DECREF(f);
    return NULL;
unknown:
    Py_DECREF(f);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"skip_library", (PyCFunction)(void (*)(void))skip_library, METH_FASTCALL, skip_doc},
    {"site_key", (PyCFunction)(void (*)(void))site_key, METH_FASTCALL, key_doc},
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
