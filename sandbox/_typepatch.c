/*
 * _typepatch: put a value into a built-in type's dictionary.
 *
 * `set_attribute(type, name, value)` does what `type.name = value` may not
 * do for a type defined in C (immutable from Python): it stores `value`
 * under `name` in the type's own dictionary and tells CPython the type
 * changed (its method cache). The sandbox uses it once per process, before
 * any script runs, to replace C methods that CPython 3.11.7 got wrong in a
 * way a script can reach (sandbox/cpython_fixes.py): `deque.index` compared
 * an item it held no reference to, so a script's `__eq__` that cleared the
 * deque made the comparison use freed memory, which a review turned into
 * reading the worker's memory and running unrestricted code (session 25).
 * The old method object is dropped with the entry: no route to it is left.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
set_attribute(PyObject *module, PyObject *args)
{
    PyTypeObject *type;
    PyObject *name, *value;
    if (!PyArg_ParseTuple(args, "O!UO:set_attribute", &PyType_Type, &type, &name, &value)) {
        return NULL;
    }
    PyObject *dict = type->tp_dict;
    if (dict == NULL || !PyDict_Check(dict)) {
        PyErr_SetString(PyExc_RuntimeError, "the type's dictionary cannot be reached");
        return NULL;
    }
    if (PyDict_SetItem(dict, name, value) < 0) {
        return NULL;
    }
    PyType_Modified(type);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_attribute", set_attribute, METH_VARARGS,
     "set_attribute(type, name, value): store value under name in the type's dictionary"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_typepatch",
    "Replaces attributes of types defined in C (sandbox/cpython_fixes.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__typepatch(void)
{
    return PyModule_Create(&module);
}
