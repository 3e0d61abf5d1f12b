/*
 * _decimal_signals: a decimal.Context's `flags` and `traps` are handed out as
 * a view that holds the context.
 *
 * CPython 3.11's `Context.flags` and `Context.traps` are SignalDict objects
 * that keep a bare pointer into their context's C struct and no reference to
 * it: `decimal.Context().flags` outlived its context, read the next object
 * placed in that memory and, through `update()` (MutableMapping's Python code
 * calling the C `__setitem__`), set and cleared its bits (a red-team pass,
 * session 35: an immutable bytes object changed, a heap address read, a
 * worker crash). The two names are answered by the type's own tp_getattro,
 * before any descriptor, so `install(Context, view)` replaces that slot with
 * one that wraps what the original returns for them in `view(context,
 * signals)` (sandbox/cpython_fixes.py: a read-only mapping that holds both).
 * The type's `__getattribute__` slot wrapper is pointed at it too, so a
 * subclass made later takes the same slot. No other route reaches the two
 * names: Context's MRO dictionaries hold no `flags` or `traps`.
 *
 * `install()` patches once per process (idempotent) and returns True.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static getattrofunc original;
static PyObject *view;      /* held for the life of the process */

static PyObject *
held_getattro(PyObject *self, PyObject *name)
{
    PyObject *value = original(self, name);
    if (value == NULL || !PyUnicode_Check(name)
            || (!_PyUnicode_EqualToASCIIString(name, "flags")
                && !_PyUnicode_EqualToASCIIString(name, "traps"))) {
        return value;
    }
    PyObject *wrapped = PyObject_CallFunctionObjArgs(view, self, value, NULL);
    Py_DECREF(value);
    return wrapped;
}

static PyObject *
install(PyObject *module, PyObject *args)
{
    PyTypeObject *type;
    PyObject *factory;
    if (!PyArg_ParseTuple(args, "O!O:install", &PyType_Type, &type, &factory)) {
        return NULL;
    }
    if (original != NULL) {
        Py_RETURN_TRUE;
    }
    PyObject *wrapper = PyDict_GetItemString(type->tp_dict, "__getattribute__");
    if (type->tp_getattro == NULL || wrapper == NULL
            || !Py_IS_TYPE(wrapper, &PyWrapperDescr_Type)
            || ((PyWrapperDescrObject *)wrapper)->d_wrapped != (void *)type->tp_getattro) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the type's __getattribute__ is not its tp_getattro's wrapper");
        return NULL;
    }
    PyObject *subclasses = PyObject_CallMethod((PyObject *)type, "__subclasses__", NULL);
    if (subclasses == NULL) {
        return NULL;
    }
    Py_ssize_t existing = PyList_GET_SIZE(subclasses);
    Py_DECREF(subclasses);
    if (existing) {     /* they copied the original slot: install before any is made */
        PyErr_SetString(PyExc_RuntimeError, "the type has subclasses already");
        return NULL;
    }
    Py_INCREF(factory);
    view = factory;
    original = type->tp_getattro;
    type->tp_getattro = held_getattro;
    ((PyWrapperDescrObject *)wrapper)->d_wrapped = (void *)held_getattro;
    PyType_Modified(type);
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS,
     "install(Context, view): hand out flags and traps as view(context, signals)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_decimal_signals",
    "decimal.Context's flags and traps handed out in a view that holds the context.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__decimal_signals(void) { return PyModule_Create(&moduledef); }
