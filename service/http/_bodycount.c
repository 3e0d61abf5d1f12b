/* service.http._bodycount: how many values a JSON text holds, before it is parsed.
 *
 * `json_values(text)` counts, outside strings, where a value starts: the
 * first one, one after each ',' and ':', and one after each '[' or '{' whose
 * next character (past white space) is not its closer. For a valid document
 * that is the number of values `json` would build, object keys included
 * (for an invalid one, at most as many as `json` builds before it fails).
 * The invoke path refuses a body over its bound before `json` builds a
 * Python object for every value (service/http/event.py, MAX_BODY_VALUES):
 * parsing costs up to ~0.3 us a value, so a 1 MiB body of 349,000 empty
 * lists took 90 ms of the event loop. Strings are skipped with their
 * escapes, so text holding commas costs nothing. One read of the text, no
 * allocation; the pure-Python twin in service/http/event.py gives the same
 * count (tests/service/http/test_body_limits.py compares them). Optional:
 * when it cannot be compiled the install still succeeds and the twin is used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define COUNT_LOOP(TYPE)                                                     \
    do {                                                                     \
        const TYPE *p = (const TYPE *)data;                                  \
        for (Py_ssize_t i = 0; i < length; i++) {                            \
            Py_UCS4 c = p[i];                                                \
            if (in_string) {                                                 \
                if (escaped)                                                 \
                    escaped = 0;                                             \
                else if (c == '\\')                                          \
                    escaped = 1;                                             \
                else if (c == '"')                                           \
                    in_string = 0;                                           \
                continue;                                                    \
            }                                                                \
            if (c == ' ' || c == '\t' || c == '\n' || c == '\r')              \
                continue;                                                    \
            if (opened && c != ']' && c != '}')                              \
                count++;  /* a container's first value */                    \
            opened = 0;                                                      \
            if (c == '"')                                                    \
                in_string = 1;                                               \
            else if (c == ',' || c == ':')                                   \
                count++;                                                     \
            else if (c == '[' || c == '{')                                   \
                opened = 1;                                                  \
        }                                                                    \
    } while (0)

static PyObject *
json_values(PyObject *module, PyObject *text)
{
    (void)module;
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "json_values(text): text must be str");
        return NULL;
    }
    if (PyUnicode_READY(text) < 0)
        return NULL;
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t count = 1;
    int in_string = 0, escaped = 0, opened = 0;
    switch (PyUnicode_KIND(text)) {
    case PyUnicode_1BYTE_KIND:
        COUNT_LOOP(Py_UCS1);
        break;
    case PyUnicode_2BYTE_KIND:
        COUNT_LOOP(Py_UCS2);
        break;
    default:
        COUNT_LOOP(Py_UCS4);
        break;
    }
    return PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"json_values", json_values, METH_O,
     "json_values(text) -> an upper bound of the values a JSON text holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bodycount", "How many values a JSON text can hold.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__bodycount(void)
{
    return PyModule_Create(&module);
}
