/* service.http._scan: where a request's journaled facts may hold its secret.
 *
 * One call walks the names and values `service.http.journal_facts` keeps of
 * a finished request and answers the three questions its pure-Python `_scan`
 * answers, with the same result (tests/service/http/test_secret_scan.py
 * compares the two on generated facts):
 *
 *   found:  does the secret appear as it is in a value or a query
 *           parameter's name, or in any letter case in a header's name?
 *   marked: does a name or value carry a mark of an encoding that could
 *           hide it ("%", "\\", a NUL: UTF-16 read as one byte a character)?
 *   shaped: does a name or value hold the start of another secret or token
 *           the service issues ("lsk_", "lat_", "login/", "logic_session":
 *           service.http.redaction.SHAPE_PREFIXES), in any letter case? Only
 *           then are they searched for with a regular expression.
 *
 * It answers None for any shape it does not know (a secret that is not
 * ASCII, a value that is neither text nor bytes, a subclass of str, bytes,
 * dict or list, whose methods Python's joins would call): the caller then
 * runs the Python version. Text is searched in place (no joined copies); only an
 * ASCII header name longer than a small buffer is copied, to lower it.
 * Optional: when it cannot be compiled the install still succeeds and
 * the Python version is used (setup.py).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Facts' positions (service.http.journal_facts.FIELDS). */
enum { QUERY = 10, HEADERS = 11, BODY = 12, RESPONSE_HEADERS = 14, RESPONSE_BODY = 15 };
static const int TEXTS[] = {13, 16, 17, 19, 21}; /* user agent, output, error, message, traceback */

typedef struct {
    const char *needle;       /* the secret, ASCII */
    const char *lowered;      /* the secret in lower case */
    Py_ssize_t size;
    PyObject *needle_obj;     /* for text that is not one byte per character */
    PyObject *lowered_obj;
    int found;
    int marked;
    int shaped;
} Scan;

#define UNKNOWN (-2)  /* a shape this scan does not know: the caller uses Python */

static int
holds(const char *data, Py_ssize_t size, const char *needle, Py_ssize_t needle_size)
{
    return needle_size <= size && memmem(data, (size_t)size, needle, (size_t)needle_size) != NULL;
}

/* The shapes' prefixes (service.http.redaction.SHAPE_PREFIXES), lower case,
 * by the character each is found by: the "_" or "/" it holds (at `at`). */
static const struct { const char *prefix; Py_ssize_t size, at; char anchor; } PREFIXES[] = {
    {"lsk_", 4, 3, '_'}, {"lat_", 4, 3, '_'}, {"logic_session", 13, 5, '_'}, {"login/", 6, 5, '/'},
};
#define N_PREFIXES (sizeof PREFIXES / sizeof PREFIXES[0])

/* Whether the anchor at `at` in `data` ends or splits a shape's prefix, its
 * ASCII letters in any case. */
static int
prefix_at(const char *data, Py_ssize_t size, Py_ssize_t at)
{
    for (size_t k = 0; k < N_PREFIXES; k++) {
        Py_ssize_t start = at - PREFIXES[k].at;
        if (PREFIXES[k].anchor != data[at] || start < 0 || start + PREFIXES[k].size > size)
            continue;
        Py_ssize_t i = 0;
        for (; i < PREFIXES[k].size; i++) {
            char c = data[start + i];
            if (((c >= 'A' && c <= 'Z') ? (char)(c + ('a' - 'A')) : c) != PREFIXES[k].prefix[i])
                break;
        }
        if (i == PREFIXES[k].size)
            return 1;
    }
    return 0;
}

/* Whether `data` holds a shape's prefix, its ASCII letters in any case: one
 * memchr pass for each anchor ("_", "/"), a few comparisons at each one found. */
static int
shaped_bytes(const char *data, Py_ssize_t size)
{
    static const char anchors[] = {'_', '/'};
    for (size_t a = 0; a < sizeof anchors; a++) {
        const char *end = data + size;
        for (const char *p = memchr(data, anchors[a], (size_t)size); p != NULL;
             p = memchr(p + 1, anchors[a], (size_t)(end - p - 1))) {
            if (prefix_at(data, size, p - data))
                return 1;
            if (p + 1 >= end)
                break;
        }
    }
    return 0;
}

/* Characters looked for one pass over a short value: the marks, the anchors. */
enum { MARK = 1, ANCHOR = 2 };
static unsigned char CHARS[256];
/* Up to this many bytes, one pass with `CHARS` costs less than a memchr call
 * for each character looked for (most header names and values are this short). */
#define SHORT_VALUE 64

/* The marks and the shapes' prefixes in bytes one character each (bytes,
 * Latin-1 text, an ASCII name), for whichever `s` has not seen yet. */
static void
scan_marks(Scan *s, const char *data, Py_ssize_t size)
{
    if (s->marked && s->shaped)
        return;
    if (size <= SHORT_VALUE) {
        unsigned char seen = 0;
        for (Py_ssize_t i = 0; i < size; i++)
            seen |= CHARS[(unsigned char)data[i]];
        if (seen & MARK)
            s->marked = 1;
        for (Py_ssize_t i = 0; (seen & ANCHOR) && !s->shaped && i < size; i++)
            if (CHARS[(unsigned char)data[i]] == ANCHOR)
                s->shaped = prefix_at(data, size, i);
        return;
    }
    if (!s->marked && (memchr(data, '%', (size_t)size) || memchr(data, '\\', (size_t)size)
                       || memchr(data, '\0', (size_t)size)))
        s->marked = 1;
    if (!s->shaped)
        s->shaped = shaped_bytes(data, size);
}

/* The same for text of two or four bytes a character: lowered as Python
 * lowers it (KELVIN SIGN is "k") by str.lower itself, only when it holds an
 * anchor (no character lowers to one). 1, 0, or -1 on an error. */
static int
shaped_wide(PyObject *text)
{
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    Py_ssize_t under = PyUnicode_FindChar(text, '_', 0, length, 1);
    Py_ssize_t slash = under == -1 ? PyUnicode_FindChar(text, '/', 0, length, 1) : 0;
    if (under == -2 || slash == -2)
        return -1;
    if (under == -1 && slash == -1)
        return 0;
    PyObject *lowered = PyObject_CallMethod((PyObject *)&PyUnicode_Type, "lower", "O", text);
    if (lowered == NULL)
        return -1;
    int result = 0;
    for (size_t k = 0; k < N_PREFIXES && result == 0; k++) {
        PyObject *prefix = PyUnicode_FromStringAndSize(PREFIXES[k].prefix, PREFIXES[k].size);
        if (prefix == NULL) {
            result = -1;
            break;
        }
        Py_ssize_t at = PyUnicode_Find(lowered, prefix, 0, PyUnicode_GET_LENGTH(lowered), 1);
        Py_DECREF(prefix);
        result = at == -2 ? -1 : at >= 0;
    }
    Py_DECREF(lowered);
    return result;
}

/* 1 when `text` holds `ch`, 0 when not, -1 on an error. */
static int
has_char(PyObject *text, Py_UCS4 ch)
{
    Py_ssize_t at = PyUnicode_FindChar(text, ch, 0, PyUnicode_GET_LENGTH(text), 1);
    return at == -2 ? -1 : at >= 0;
}

/* A text value, or a query parameter's name (searched as it is). */
static int
scan_text(Scan *s, PyObject *text)
{
    if (!PyUnicode_CheckExact(text))
        return UNKNOWN;
    if (PyUnicode_READY(text) < 0)
        return -1;
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (PyUnicode_KIND(text) == PyUnicode_1BYTE_KIND) {
        /* ASCII or Latin-1: one byte per character, and the secret's
         * (ASCII) bytes can only match the same ASCII characters. */
        const char *data = (const char *)PyUnicode_1BYTE_DATA(text);
        if (!s->found && holds(data, length, s->needle, s->size))
            s->found = 1;
        /* Latin-1 letters lower to no ASCII one: shapes as str.lower would find them. */
        scan_marks(s, data, length);
        return 0;
    }
    if (!s->shaped) {
        int shape = shaped_wide(text);
        if (shape < 0)
            return -1;
        s->shaped = shape;
    }
    if (!s->found) {
        int in = PyUnicode_Contains(text, s->needle_obj);
        if (in < 0)
            return -1;
        s->found = in;
    }
    if (!s->marked) {
        int mark = has_char(text, '%');
        if (mark == 0)
            mark = has_char(text, '\\');
        if (mark == 0)
            mark = has_char(text, '\0');
        if (mark < 0)
            return -1;
        s->marked = mark;
    }
    return 0;
}

/* A header's name: the secret is looked for in any letter case. */
static int
scan_name(Scan *s, PyObject *name)
{
    if (!PyUnicode_CheckExact(name))
        return UNKNOWN;
    if (PyUnicode_READY(name) < 0)
        return -1;
    if (!PyUnicode_IS_ASCII(name)) {
        /* Lowered as Python lowers it (some letters lower to ASCII ones):
         * by str.lower itself (the type is exact). `name` is borrowed: held
         * while code that may allocate (and so run a collection) runs. */
        Py_INCREF(name);
        PyObject *lowered = PyObject_CallMethod((PyObject *)&PyUnicode_Type, "lower", "O", name);
        if (lowered == NULL) {
            Py_DECREF(name);
            return -1;
        }
        Scan probe = *s;
        probe.needle = s->lowered;
        probe.needle_obj = s->lowered_obj;
        probe.marked = 1;  /* marks and shapes: looked for in the name as it is, below */
        probe.shaped = 1;
        int rc = scan_text(&probe, lowered);
        Py_DECREF(lowered);
        if (rc != 0) {
            Py_DECREF(name);
            return rc;
        }
        int found = probe.found;
        rc = scan_text(s, name);  /* its marks (lowering adds or removes none) */
        Py_DECREF(name);
        s->found = s->found || found;
        return rc;
    }
    Py_ssize_t length = PyUnicode_GET_LENGTH(name);
    const char *data = (const char *)PyUnicode_1BYTE_DATA(name);
    scan_marks(s, data, length);
    if (s->found || length < s->size)
        return 0;
    /* A name is at most a request head or a script's reply (1 MiB) long. */
    char small[512];
    char *lowered = length <= (Py_ssize_t)sizeof small ? small : PyMem_Malloc((size_t)length);
    if (lowered == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        char c = data[i];
        lowered[i] = (c >= 'A' && c <= 'Z') ? (char)(c + ('a' - 'A')) : c;
    }
    s->found = holds(lowered, length, s->lowered, s->size);
    if (lowered != small)
        PyMem_Free(lowered);
    return 0;
}

/* A body: bytes (or text, kept as text by an older journal entry). */
static int
scan_body(Scan *s, PyObject *body)
{
    if (PyBytes_Check(body)) {
        const char *data = PyBytes_AS_STRING(body);
        Py_ssize_t size = PyBytes_GET_SIZE(body);
        if (!s->found && holds(data, size, s->needle, s->size))
            s->found = 1;
        scan_marks(s, data, size);
        return 0;
    }
    return scan_text(s, body);  /* its NULs are marks as in any text */
}

static int
scan_facts(Scan *s, PyObject *facts)
{
    if (!PyTuple_CheckExact(facts) || PyTuple_GET_SIZE(facts) <= 21)
        return UNKNOWN;
    PyObject *query = PyTuple_GET_ITEM(facts, QUERY);
    PyObject *headers = PyTuple_GET_ITEM(facts, HEADERS);
    PyObject *response_headers = PyTuple_GET_ITEM(facts, RESPONSE_HEADERS);
    if (!PyDict_CheckExact(query) || !PyDict_CheckExact(headers)
            || !PyList_CheckExact(response_headers))
        return UNKNOWN;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    int rc;
    while (PyDict_Next(headers, &pos, &key, &value)) {
        Py_INCREF(key);
        Py_INCREF(value);
        if ((rc = scan_name(s, key)) == 0)
            rc = scan_text(s, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (rc != 0)
            return rc;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(response_headers); i++) {
        PyObject *pair = PyList_GET_ITEM(response_headers, i);
        if (!(PyList_CheckExact(pair) || PyTuple_CheckExact(pair))
                || PySequence_Fast_GET_SIZE(pair) != 2)
            return UNKNOWN;
        Py_INCREF(pair);
        PyObject *name = PySequence_Fast_GET_ITEM(pair, 0);
        PyObject *text = PySequence_Fast_GET_ITEM(pair, 1);
        Py_INCREF(name);
        Py_INCREF(text);
        if ((rc = scan_name(s, name)) == 0)
            rc = scan_text(s, text);
        Py_DECREF(name);
        Py_DECREF(text);
        Py_DECREF(pair);
        if (rc != 0)
            return rc;
    }
    pos = 0;
    while (PyDict_Next(query, &pos, &key, &value)) {
        Py_INCREF(key);
        Py_INCREF(value);
        rc = scan_text(s, key);
        if (rc == 0 && PyList_CheckExact(value)) {  /* a repeated parameter's values */
            for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(value); i++) {
                PyObject *item = PyList_GET_ITEM(value, i);
                Py_INCREF(item);
                rc = scan_text(s, item);
                Py_DECREF(item);
            }
        } else if (rc == 0) {
            rc = scan_text(s, value);
        }
        Py_DECREF(key);
        Py_DECREF(value);
        if (rc != 0)
            return rc;
    }
    for (size_t i = 0; i < sizeof TEXTS / sizeof TEXTS[0]; i++) {
        PyObject *text = PyTuple_GET_ITEM(facts, TEXTS[i]);
        int truth = PyObject_IsTrue(text);
        if (truth < 0)
            return -1;
        if (truth && (rc = scan_text(s, text)) != 0)
            return rc;
    }
    PyObject *body = PyTuple_GET_ITEM(facts, BODY);
    if (!PyBytes_CheckExact(body) && !PyUnicode_CheckExact(body))
        return UNKNOWN;
    if ((rc = scan_body(s, body)) != 0)
        return rc;
    PyObject *response_body = PyTuple_GET_ITEM(facts, RESPONSE_BODY);
    if (!PyBytes_CheckExact(response_body))
        return UNKNOWN;
    return scan_body(s, response_body);
}

static PyObject *
scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "scan(secret, lowered, facts)");
        return NULL;
    }
    PyObject *needle = args[0], *lowered = args[1];
    if (!PyUnicode_Check(needle) || !PyUnicode_Check(lowered)
            || PyUnicode_READY(needle) < 0 || PyUnicode_READY(lowered) < 0)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    if (!PyUnicode_IS_ASCII(needle) || !PyUnicode_IS_ASCII(lowered)
            || PyUnicode_GET_LENGTH(needle) == 0
            || PyUnicode_GET_LENGTH(needle) != PyUnicode_GET_LENGTH(lowered))
        return Py_NewRef(Py_None);
    const char *plain = (const char *)PyUnicode_1BYTE_DATA(needle);
    const char *low = (const char *)PyUnicode_1BYTE_DATA(lowered);
    for (Py_ssize_t i = 0; i < PyUnicode_GET_LENGTH(needle); i++) {
        char c = plain[i];
        if (low[i] != ((c >= 'A' && c <= 'Z') ? (char)(c + ('a' - 'A')) : c))
            return Py_NewRef(Py_None);  /* not the secret in lower case */
    }
    Scan s = {
        .needle = (const char *)PyUnicode_1BYTE_DATA(needle),
        .lowered = (const char *)PyUnicode_1BYTE_DATA(lowered),
        .size = PyUnicode_GET_LENGTH(needle),
        .needle_obj = needle,
        .lowered_obj = lowered,
    };
    int rc = scan_facts(&s, args[2]);
    if (rc == -1)
        return NULL;
    if (rc == UNKNOWN)
        return Py_NewRef(Py_None);
    return Py_BuildValue("(OOO)", s.found ? Py_True : Py_False, s.marked ? Py_True : Py_False,
                         s.shaped ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(secret, lowered, facts) -> (found, marked, shaped), or None for a shape it does "
     "not know."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scan", "Where a request's journaled facts may hold its secret.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__scan(void)
{
    CHARS['%'] = CHARS['\\'] = CHARS['\0'] = MARK;
    CHARS['_'] = CHARS['/'] = ANCHOR;
    return PyModule_Create(&module);
}
