/*
 * _frameshape: how many objects a msgpack frame decodes to, before decoding it.
 *
 * A worker's frame is capped in bytes (protocol.MAX_REPLY_BYTES), but msgpack
 * packs an empty map in one byte and Python makes ~70 bytes of it: a worker
 * taken over by its script made the service allocate ~300 MB and stall its
 * event loop for up to a second with one 4 MiB frame of empty maps (security
 * review, session 25). `items(buf, max_items, max_depth)` walks the encoding
 * without allocating anything and returns the number of objects (every map
 * key and value, array element and the top object count one), or -1 when
 * there are more than `max_items`, containers nest deeper than `max_depth`,
 * the bytes are not exactly one msgpack object, or they hold a type the
 * protocol never uses (ext, timestamps). The service decodes a worker's frame
 * only when it returns a count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_DEPTH_LIMIT 64

static uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* Objects in buf[0:len], or -1 (see above). */
static Py_ssize_t
count_items(const unsigned char *buf, Py_ssize_t len, Py_ssize_t max_items, int max_depth)
{
    /* left[d]: objects still to read in the container open at depth d. */
    uint64_t left[MAX_DEPTH_LIMIT + 1];
    int depth = 0;
    Py_ssize_t pos = 0, items = 0;
    left[0] = 1;
    while (1) {
        while (depth > 0 && left[depth] == 0) {
            depth--;
        }
        if (left[depth] == 0) {   /* depth 0: the one top object is read */
            return pos == len ? items : -1;
        }
        left[depth]--;
        if (++items > max_items || pos >= len) {
            return -1;
        }
        unsigned char b = buf[pos++];
        uint64_t skip = 0, open = 0;
        int width = 0, container = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            continue;                               /* fixint, nil, false, true */
        }
        else if (b >= 0x80 && b <= 0x8f) {
            open = 2 * (uint64_t)(b & 0x0f); container = 1;
        }
        else if (b >= 0x90 && b <= 0x9f) {
            open = b & 0x0f; container = 1;
        }
        else if (b >= 0xa0 && b <= 0xbf) {
            skip = b & 0x1f;
        }
        else {
            switch (b) {
            case 0xc4: case 0xd9: width = 1; break;   /* bin8, str8 */
            case 0xc5: case 0xda: width = 2; break;   /* bin16, str16 */
            case 0xc6: case 0xdb: width = 4; break;   /* bin32, str32 */
            case 0xca: skip = 4; break;               /* float32 */
            case 0xcb: skip = 8; break;               /* float64 */
            case 0xcc: case 0xd0: skip = 1; break;
            case 0xcd: case 0xd1: skip = 2; break;
            case 0xce: case 0xd2: skip = 4; break;
            case 0xcf: case 0xd3: skip = 8; break;
            case 0xdc: width = 2; container = 1; break;   /* array16 */
            case 0xdd: width = 4; container = 1; break;   /* array32 */
            case 0xde: width = 2; container = 2; break;   /* map16 */
            case 0xdf: width = 4; container = 2; break;   /* map32 */
            default:
                return -1;   /* 0xc1 (never used), ext and fixext */
            }
            if (width) {
                if (len - pos < width) {
                    return -1;
                }
                uint64_t n = be(buf + pos, width);
                pos += width;
                if (container) {
                    open = n * (uint64_t)container;
                }
                else {
                    skip = n;
                }
            }
        }
        if (container) {
            /* Each element counts when read; more than the limit allows is refused now. */
            if (open > (uint64_t)(max_items - items)) {
                return -1;
            }
            if (open) {
                if (depth >= max_depth) {
                    return -1;
                }
                left[++depth] = open;
            }
            else if (depth >= max_depth) {
                return -1;
            }
        }
        else {
            if (skip > (uint64_t)(len - pos)) {
                return -1;
            }
            pos += (Py_ssize_t)skip;
        }
    }
}

static PyObject *
items(PyObject *module, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t max_items;
    int max_depth;
    if (!PyArg_ParseTuple(args, "y*ni:items", &view, &max_items, &max_depth)) {
        return NULL;
    }
    if (max_items < 1 || max_depth < 0 || max_depth > MAX_DEPTH_LIMIT) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "max_items must be >= 1 and max_depth 0-64");
        return NULL;
    }
    Py_ssize_t n = count_items((const unsigned char *)view.buf, view.len, max_items, max_depth);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"items", items, METH_VARARGS,
     "items(buf, max_items, max_depth) -> objects in the one msgpack object buf holds, "
     "or -1 past a limit or for anything else"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_frameshape",
    "Counts a msgpack frame's objects without decoding it.", -1, methods,
};

PyMODINIT_FUNC
PyInit__frameshape(void)
{
    return PyModule_Create(&module);
}
