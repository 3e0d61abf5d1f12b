/*
 * _typepatch: replace C code of built-in types that a script can make use
 * freed memory (sandbox/cpython_fixes.py installs it, once per process).
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

/*
 * Slots of `list`, `bytearray` and `OrderedDict` that run a script's code while they hold a
 * pointer into an object the script can free meanwhile (a review, session 25;
 * none needs a comparison answering NotImplemented):
 *
 * - `a[::2] = generator`: list_ass_subscript works out the slice from the
 *   list's size, then consumes the value, whose code may shrink the list,
 *   then writes at the indexes worked out before: past the new end (a heap
 *   write). The value is made a list first, before any index is computed.
 * - `[[x]] < [[y]]`: list_richcompare compares the last differing items
 *   without holding them (CPython gh-120298): a script's __eq__ that empties
 *   the outer list frees the inner one being compared. The replacement is
 *   3.11's function with that fix (each item held while it is compared).
 * - `bytearray % args`: the format is read from the bytearray's own buffer
 *   while `%a`/`%r` and mapping lookups run script code that can clear it.
 *   The replacement formats from a copy.
 * - `od1 == od2` (OrderedDicts): after dict's own comparison, the keys are
 *   compared in order from the two dicts' linked lists, unheld, with only a
 *   "changed?" check that passes when the script empties both (CPython
 *   gh-119004): freed keys and nodes were read. The replacement compares
 *   the keys from two lists it holds, as OrderedDict's Python version does.
 *
 * `install()` puts the four in place once per process, before any script
 * runs, and returns how many it installed. A slot alone is not enough: the
 * type's `__lt__`, `__setitem__`, `__mod__`... wrappers keep the function
 * they were made from, and a subclass takes its slots from them, so a
 * script's `class L(list)` got the old code back (a further review): the
 * wrappers are pointed at the replacements too, and subclasses that exist
 * already get their slots replaced.
 */
static objobjargproc list_ass_original;
static richcmpfunc list_richcompare_original;
static binaryfunc bytearray_mod_original;
static richcmpfunc odict_richcompare_original;

static int
list_ass_subscript_checked(PyObject *self, PyObject *key, PyObject *value)
{
    /* A list or tuple runs nothing; what cannot be iterated gets the original's
       own error (its conversion runs no code either). */
    if (value == NULL || !PySlice_Check(key) || PyList_CheckExact(value)
            || PyTuple_CheckExact(value)
            || (Py_TYPE(value)->tp_iter == NULL && !PySequence_Check(value))) {
        return list_ass_original(self, key, value);
    }
    PyObject *items = PySequence_List(value);   /* the script's code runs here, first */
    if (items == NULL) {
        return -1;
    }
    int result = list_ass_original(self, key, items);
    Py_DECREF(items);
    return result;
}

static PyObject *
list_richcompare_held(PyObject *v, PyObject *w, int op)
{
    if (!PyList_Check(v) || !PyList_Check(w)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (PyList_GET_SIZE(v) != PyList_GET_SIZE(w) && (op == Py_EQ || op == Py_NE)) {
        if (op == Py_EQ) {
            Py_RETURN_FALSE;
        }
        Py_RETURN_TRUE;
    }
    Py_ssize_t i;
    for (i = 0; i < PyList_GET_SIZE(v) && i < PyList_GET_SIZE(w); i++) {
        PyObject *vitem = PyList_GET_ITEM(v, i);
        PyObject *witem = PyList_GET_ITEM(w, i);
        if (vitem == witem) {
            continue;
        }
        Py_INCREF(vitem);
        Py_INCREF(witem);
        int k = PyObject_RichCompareBool(vitem, witem, Py_EQ);
        Py_DECREF(vitem);
        Py_DECREF(witem);
        if (k < 0) {
            return NULL;
        }
        if (!k) {
            break;
        }
    }
    if (i >= PyList_GET_SIZE(v) || i >= PyList_GET_SIZE(w)) {
        Py_RETURN_RICHCOMPARE(PyList_GET_SIZE(v), PyList_GET_SIZE(w), op);
    }
    if (op == Py_EQ) {
        Py_RETURN_FALSE;
    }
    if (op == Py_NE) {
        Py_RETURN_TRUE;
    }
    PyObject *vitem = PyList_GET_ITEM(v, i);
    PyObject *witem = PyList_GET_ITEM(w, i);
    Py_INCREF(vitem);
    Py_INCREF(witem);
    PyObject *result = PyObject_RichCompare(vitem, witem, op);
    Py_DECREF(vitem);
    Py_DECREF(witem);
    return result;
}

static PyObject *
bytearray_mod_copied(PyObject *v, PyObject *w)
{
    if (!PyByteArray_Check(v)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *format = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(v),
                                                 PyByteArray_GET_SIZE(v));
    if (format == NULL) {
        return NULL;
    }
    PyObject *result = _PyBytes_FormatEx(PyBytes_AS_STRING(format), PyBytes_GET_SIZE(format),
                                         w, 1);
    Py_DECREF(format);
    return result;
}

static PyObject *
odict_richcompare_held(PyObject *v, PyObject *w, int op)
{
    if (!PyODict_Check(v) || !PyDict_Check(w) || (op != Py_EQ && op != Py_NE)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *result = PyDict_Type.tp_richcompare(v, w, Py_EQ);
    if (result == NULL || result == Py_NotImplemented) {
        return result;
    }
    if (result == Py_True && PyODict_Check(w)) {
        /* The same keys and values: now their order, from held copies. */
        Py_DECREF(result);
        PyObject *keys_v = PySequence_List(v);
        if (keys_v == NULL) {
            return NULL;
        }
        PyObject *keys_w = PySequence_List(w);
        if (keys_w == NULL) {
            Py_DECREF(keys_v);
            return NULL;
        }
        result = list_richcompare_held(keys_v, keys_w, Py_EQ);
        Py_DECREF(keys_v);
        Py_DECREF(keys_w);
        if (result == NULL) {
            return NULL;
        }
    }
    if (op == Py_EQ) {
        return result;
    }
    int equal = PyObject_IsTrue(result);
    Py_DECREF(result);
    if (equal < 0) {
        return NULL;
    }
    return PyBool_FromLong(!equal);
}

/*
 * `repr(list)`: list_repr called repr on each item without holding it (review,
 * session 30): an item whose repr runs script code (a `Counter`'s sorts its
 * items with the script's `__lt__`) that empties the list freed the item -
 * a `slice` whose `stop` was then read freed. The same function, each item
 * held while its repr runs.
 */
static reprfunc list_repr_original;

static PyObject *
list_repr_held(PyObject *self)
{
    PyListObject *v = (PyListObject *)self;
    if (Py_SIZE(v) == 0) {
        return PyUnicode_FromString("[]");
    }
    int entered = Py_ReprEnter(self);
    if (entered != 0) {
        return entered > 0 ? PyUnicode_FromString("[...]") : NULL;
    }
    _PyUnicodeWriter writer;
    _PyUnicodeWriter_Init(&writer);
    writer.overallocate = 1;
    writer.min_length = 1 + 1 + (2 + 1) * (Py_SIZE(v) - 1) + 1;
    if (_PyUnicodeWriter_WriteChar(&writer, '[') < 0) {
        goto error;
    }
    /* The item's repr may change the list: its size is read again each time. */
    for (Py_ssize_t i = 0; i < Py_SIZE(v); ++i) {
        if (i > 0 && _PyUnicodeWriter_WriteASCIIString(&writer, ", ", 2) < 0) {
            goto error;
        }
        PyObject *item = v->ob_item[i];
        Py_INCREF(item);
        PyObject *s = PyObject_Repr(item);
        Py_DECREF(item);
        if (s == NULL) {
            goto error;
        }
        if (_PyUnicodeWriter_WriteStr(&writer, s) < 0) {
            Py_DECREF(s);
            goto error;
        }
        Py_DECREF(s);
    }
    writer.overallocate = 0;
    if (_PyUnicodeWriter_WriteChar(&writer, ']') < 0) {
        goto error;
    }
    Py_ReprLeave(self);
    return _PyUnicodeWriter_Finish(&writer);
error:
    _PyUnicodeWriter_Dealloc(&writer);
    Py_ReprLeave(self);
    return NULL;
}

/* Point the wrappers named in `names` of `type` that call `old` at `new`. */
static int
repoint_wrappers(PyTypeObject *type, const char *const *names, void *old, void *new)
{
    for (; *names != NULL; names++) {
        PyObject *descr = PyDict_GetItemString(type->tp_dict, *names);   /* borrowed */
        if (descr == NULL || !Py_IS_TYPE(descr, &PyWrapperDescr_Type)) {
            PyErr_Format(PyExc_RuntimeError, "%s.%s is not a slot wrapper", type->tp_name,
                         *names);
            return -1;
        }
        PyWrapperDescrObject *wrapper = (PyWrapperDescrObject *)descr;
        if (wrapper->d_wrapped == old) {
            wrapper->d_wrapped = new;
        }
        else if (wrapper->d_wrapped != new) {
            PyErr_Format(PyExc_RuntimeError, "%s.%s wraps an unknown function", type->tp_name,
                         *names);
            return -1;
        }
    }
    return 0;
}

/* Subclasses made before the replacement (none of a script's): their slots
   too, all the way down. */
static int
replace_in_subclasses(PyTypeObject *type)
{
    PyObject *subclasses = PyObject_CallMethod((PyObject *)type, "__subclasses__", NULL);
    if (subclasses == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(subclasses); i++) {
        PyTypeObject *sub = (PyTypeObject *)PyList_GET_ITEM(subclasses, i);
        if (sub->tp_as_mapping != NULL
                && sub->tp_as_mapping->mp_ass_subscript == list_ass_original) {
            sub->tp_as_mapping->mp_ass_subscript = list_ass_subscript_checked;
        }
        if (sub->tp_richcompare == list_richcompare_original) {
            sub->tp_richcompare = list_richcompare_held;
        }
        if (list_repr_original != NULL && sub->tp_repr == list_repr_original) {
            sub->tp_repr = list_repr_held;
        }
        if (sub->tp_as_number != NULL && bytearray_mod_original != NULL
                && sub->tp_as_number->nb_remainder == bytearray_mod_original) {
            sub->tp_as_number->nb_remainder = bytearray_mod_copied;
        }
        if (odict_richcompare_original != NULL
                && sub->tp_richcompare == odict_richcompare_original) {
            sub->tp_richcompare = odict_richcompare_held;
        }
        PyType_Modified(sub);
        if (replace_in_subclasses(sub) < 0) {
            Py_DECREF(subclasses);
            return -1;
        }
    }
    Py_DECREF(subclasses);
    return 0;
}

/* The six comparison wrappers (OrderedDict's too). */
static const char *const LIST_COMPARISONS[] = {"__lt__", "__le__", "__eq__", "__ne__", "__gt__",
                                               "__ge__", NULL};
static const char *const LIST_ASSIGNMENTS[] = {"__setitem__", "__delitem__", NULL};
static const char *const BYTEARRAY_MOD[] = {"__mod__", "__rmod__", NULL};
static const char *const LIST_REPR[] = {"__repr__", NULL};

static PyObject *
install(PyObject *module, PyObject *unused)
{
    if (PyList_Type.tp_richcompare != list_richcompare_held) {
        PyMappingMethods *mapping = PyList_Type.tp_as_mapping;
        PyNumberMethods *number = PyByteArray_Type.tp_as_number;
        if (mapping == NULL || mapping->mp_ass_subscript == NULL || number == NULL
                || number->nb_remainder == NULL || PyList_Type.tp_richcompare == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "list or bytearray lacks an expected slot");
            return NULL;
        }
        list_ass_original = mapping->mp_ass_subscript;
        list_richcompare_original = PyList_Type.tp_richcompare;
        list_repr_original = PyList_Type.tp_repr;
        bytearray_mod_original = number->nb_remainder;
        if (repoint_wrappers(&PyList_Type, LIST_COMPARISONS, (void *)list_richcompare_original,
                             (void *)list_richcompare_held) < 0
                || repoint_wrappers(&PyList_Type, LIST_ASSIGNMENTS, (void *)list_ass_original,
                                    (void *)list_ass_subscript_checked) < 0
                || repoint_wrappers(&PyList_Type, LIST_REPR, (void *)list_repr_original,
                                    (void *)list_repr_held) < 0
                || repoint_wrappers(&PyByteArray_Type, BYTEARRAY_MOD,
                                    (void *)bytearray_mod_original,
                                    (void *)bytearray_mod_copied) < 0) {
            return NULL;
        }
        odict_richcompare_original = PyODict_Type.tp_richcompare;
        if (odict_richcompare_original == NULL
                || repoint_wrappers(&PyODict_Type, LIST_COMPARISONS,
                                    (void *)odict_richcompare_original,
                                    (void *)odict_richcompare_held) < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "OrderedDict lacks a comparison");
            }
            return NULL;
        }
        mapping->mp_ass_subscript = list_ass_subscript_checked;
        PyList_Type.tp_richcompare = list_richcompare_held;
        PyList_Type.tp_repr = list_repr_held;
        number->nb_remainder = bytearray_mod_copied;
        PyODict_Type.tp_richcompare = odict_richcompare_held;
        PyType_Modified(&PyList_Type);
        PyType_Modified(&PyByteArray_Type);
        PyType_Modified(&PyODict_Type);
        if (replace_in_subclasses(&PyList_Type) < 0
                || replace_in_subclasses(&PyByteArray_Type) < 0
                || replace_in_subclasses(&PyODict_Type) < 0) {
            return NULL;
        }
    }
    return PyLong_FromLong(5);
}

static PyMethodDef methods[] = {
    {"set_attribute", set_attribute, METH_VARARGS,
     "set_attribute(type, name, value): store value under name in the type's dictionary"},
    {"install", install, METH_NOARGS,
     "install() -> the number of slots replaced (5: list slice assignment, comparison and "
     "repr, bytearray %, OrderedDict comparison)"},
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
