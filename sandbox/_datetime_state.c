/*
 * _datetime_state: datetime.date, datetime.datetime and datetime.time refuse
 * a pickled state whose fields are out of range.
 *
 * The three constructors take their pickle form too: `date(b"\x00\x00\x01\x01")`
 * copies the bytes (or a latin-1 str) into the object, and CPython 3.11
 * checks only the month (for `time`, the hour). Year 0 made `weekday()`
 * negative, and `ctime()` indexed its table of day names with it: the
 * pointer found before the table was printed as a string (another table's
 * text came back) or crashed the worker (a red-team pass, session 35).
 * `install()` replaces the three types' tp_new with one that runs the
 * original and, when the first argument was a state (bytes or str), checks
 * every field as the ordinary constructor would: year 1-9999, the day within
 * its month, hour < 24, minute and second < 60, microsecond < 1,000,000
 * (ValueError otherwise). States `pickle` and `copy` make from valid objects
 * pass. A type's `__new__` calls its tp_new, and a subclass made later takes
 * its tp_new from its base: both get the check; subclasses that exist already
 * and inherited the original get it too.
 *
 * `install()` patches once per process (idempotent) and returns True.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>

#define N_TYPES 3

static newfunc original[N_TYPES];
static int installed;

static int
days_in_month(int year, int month)
{
    static const int days[13] = {0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (month == 2 && year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)) {
        return 29;
    }
    return days[month];
}

static int
date_ok(PyObject *obj)
{
    int year = PyDateTime_GET_YEAR(obj), month = PyDateTime_GET_MONTH(obj);
    int day = PyDateTime_GET_DAY(obj);
    return year >= 1 && year <= 9999 && month >= 1 && month <= 12
           && day >= 1 && day <= days_in_month(year, month);
}

static int
clock_ok(int hour, int minute, int second, int microsecond)
{
    return hour >= 0 && hour < 24 && minute >= 0 && minute < 60 && second >= 0 && second < 60
           && microsecond >= 0 && microsecond < 1000000;
}

static int
fields_ok(int which, PyObject *obj)
{
    switch (which) {
    case 0:
        return date_ok(obj);
    case 1:
        return date_ok(obj)
               && clock_ok(PyDateTime_DATE_GET_HOUR(obj), PyDateTime_DATE_GET_MINUTE(obj),
                           PyDateTime_DATE_GET_SECOND(obj),
                           PyDateTime_DATE_GET_MICROSECOND(obj));
    default:
        return clock_ok(PyDateTime_TIME_GET_HOUR(obj), PyDateTime_TIME_GET_MINUTE(obj),
                        PyDateTime_TIME_GET_SECOND(obj), PyDateTime_TIME_GET_MICROSECOND(obj));
    }
}

static PyObject *
checked(int which, PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *obj = original[which](type, args, kw);
    if (obj == NULL || !PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) {
        return obj;
    }
    PyObject *first = PyTuple_GET_ITEM(args, 0);
    if ((PyBytes_Check(first) || PyUnicode_Check(first)) && !fields_ok(which, obj)) {
        Py_DECREF(obj);
        PyErr_Format(PyExc_ValueError, "%s: a pickled state with a field out of range",
                     type->tp_name);
        return NULL;
    }
    return obj;
}

static PyObject *checked_0(PyTypeObject *t, PyObject *a, PyObject *k) { return checked(0, t, a, k); }
static PyObject *checked_1(PyTypeObject *t, PyObject *a, PyObject *k) { return checked(1, t, a, k); }
static PyObject *checked_2(PyTypeObject *t, PyObject *a, PyObject *k) { return checked(2, t, a, k); }

/* Point `type` and its subclasses that still run `from` at `to`. */
static int
repoint(PyTypeObject *type, newfunc from, newfunc to)
{
    if (type->tp_new == from) {
        type->tp_new = to;
    }
    PyObject *subclasses = PyObject_CallMethod((PyObject *)type, "__subclasses__", NULL);
    if (subclasses == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(subclasses); i++) {
        if (repoint((PyTypeObject *)PyList_GET_ITEM(subclasses, i), from, to) < 0) {
            Py_DECREF(subclasses);
            return -1;
        }
    }
    Py_DECREF(subclasses);
    PyType_Modified(type);
    return 0;
}

static PyObject *
install(PyObject *module, PyObject *unused)
{
    if (!installed) {
        PyDateTime_IMPORT;
        if (PyDateTimeAPI == NULL) {
            return NULL;
        }
        PyTypeObject *types[N_TYPES] = {PyDateTimeAPI->DateType, PyDateTimeAPI->DateTimeType,
                                        PyDateTimeAPI->TimeType};
        newfunc replacements[N_TYPES] = {checked_0, checked_1, checked_2};
        for (int i = 0; i < N_TYPES; i++) {
            if (types[i]->tp_new == NULL) {
                PyErr_SetString(PyExc_RuntimeError, "a datetime type has no tp_new");
                return NULL;
            }
            original[i] = types[i]->tp_new;
        }
        /* datetime derives from date but has a tp_new of its own: each
           original is only ever replaced by its own check. */
        for (int i = 0; i < N_TYPES; i++) {
            if (repoint(types[i], original[i], replacements[i]) < 0) {
                return NULL;
            }
        }
        installed = 1;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Make date, datetime and time check a pickled state's fields (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_datetime_state",
    "datetime types that refuse a pickled state with a field out of range.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__datetime_state(void) { return PyModule_Create(&moduledef); }
