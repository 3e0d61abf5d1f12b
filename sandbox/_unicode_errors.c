/*
 * _unicode_errors: UnicodeDecodeError, UnicodeEncodeError and
 * UnicodeTranslateError refuse a start or end outside their object.
 *
 * CPython 3.11's constructors take any integers for start and end, and the
 * classes' __str__ reads the object at `start` checking only `start < len`:
 * `str(UnicodeDecodeError("x", b"A", -4096, -4095, "r"))` printed a byte
 * from 4 KB before the buffer, so a script read its worker's memory byte by
 * byte (security review, session 16). Scripts may raise, catch and build
 * these errors, so instead of hiding the classes this replaces their
 * tp_init (which every call of the class runs, whatever name or `type(e)` it
 * was reached by) with one that runs the original and then checks
 * 0 <= start <= end <= len(object), raising ValueError otherwise. The errors
 * codecs raise always pass. The classes' `__init__` slot wrappers are pointed
 * at the checked function too: a subclass made later takes its tp_init from
 * that wrapper, and `UnicodeDecodeError.__init__(e, ...)` calls it.
 *
 * `install()` patches once per process (idempotent) and returns True.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define N_TYPES 3

static initproc original[N_TYPES];
static int installed;

static int
in_range(PyObject *self)
{
    PyUnicodeErrorObject *exc = (PyUnicodeErrorObject *)self;
    Py_ssize_t size;
    if (exc->object == NULL) {
        return 0;
    }
    if (PyBytes_Check(exc->object)) {
        size = PyBytes_GET_SIZE(exc->object);
    }
    else if (PyUnicode_Check(exc->object)) {
        size = PyUnicode_GET_LENGTH(exc->object);
    }
    else {
        PyErr_Format(PyExc_TypeError, "%s: object must be bytes or str",
                     Py_TYPE(self)->tp_name);
        return -1;
    }
    if (exc->start < 0 || exc->start > exc->end || exc->end > size) {
        PyErr_Format(PyExc_ValueError,
                     "%s: start and end must satisfy 0 <= start <= end <= len(object)",
                     Py_TYPE(self)->tp_name);
        return -1;
    }
    return 0;
}

#define CHECKED_INIT(i)                                                   \
    static int checked_init_##i(PyObject *self, PyObject *args, PyObject *kw) \
    {                                                                     \
        if (original[i](self, args, kw) < 0) {                            \
            return -1;                                                    \
        }                                                                 \
        return in_range(self);                                            \
    }

CHECKED_INIT(0)
CHECKED_INIT(1)
CHECKED_INIT(2)

static PyObject *
install(PyObject *module, PyObject *unused)
{
    if (!installed) {
        PyTypeObject *types[N_TYPES] = {
            (PyTypeObject *)PyExc_UnicodeDecodeError,
            (PyTypeObject *)PyExc_UnicodeEncodeError,
            (PyTypeObject *)PyExc_UnicodeTranslateError,
        };
        initproc checked[N_TYPES] = {checked_init_0, checked_init_1, checked_init_2};
        for (int i = 0; i < N_TYPES; i++) {
            if (types[i]->tp_init == NULL) {
                PyErr_SetString(PyExc_RuntimeError, "a Unicode error class has no tp_init");
                return NULL;
            }
        }
        PyObject *wrappers[N_TYPES];
        for (int i = 0; i < N_TYPES; i++) {
            wrappers[i] = PyDict_GetItemString(types[i]->tp_dict, "__init__");
            if (wrappers[i] == NULL || !Py_IS_TYPE(wrappers[i], &PyWrapperDescr_Type)
                    || ((PyWrapperDescrObject *)wrappers[i])->d_wrapped
                       != (void *)types[i]->tp_init) {
                PyErr_SetString(PyExc_RuntimeError,
                                "a Unicode error class's __init__ is not its tp_init's wrapper");
                return NULL;
            }
        }
        for (int i = 0; i < N_TYPES; i++) {
            original[i] = types[i]->tp_init;
            types[i]->tp_init = checked[i];
            ((PyWrapperDescrObject *)wrappers[i])->d_wrapped = (void *)checked[i];
        }
        PyType_Modified((PyTypeObject *)PyExc_UnicodeError);
        installed = 1;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Make the three Unicode error classes check start and end (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_unicode_errors",
    "Unicode error classes that refuse a start or end outside their object.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__unicode_errors(void) { return PyModule_Create(&moduledef); }
