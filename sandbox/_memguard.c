/*
 * _memguard: per-invocation memory cap for untrusted scripts in a worker.
 *
 * Wraps the CPython allocators of the RAW, MEM and OBJ domains with
 * PyMem_SetAllocator.  While disarmed the wrappers only test one flag and call
 * through.  While armed every allocation is recorded in an open-addressing
 * hash table (pointer -> charged size) so its free can be credited; the running
 * total and the peak are kept, and an allocation that would push the total
 * past the cap returns NULL (CPython turns that into a clean MemoryError) and
 * sets a sticky "exceeded" flag that the worker reads at disarm time, so a
 * script that catches MemoryError is still reported.
 *
 * Why not tracemalloc: it captures a traceback per allocation and slows
 * allocation-heavy loops 8-24x; this costs one hash insert per allocation.
 *
 * Details that matter:
 * - Frees of pointers not in the table pass through: they were allocated
 *   before arming (or in an earlier invocation).  Entries carry a generation
 *   number, so arming is O(1): slots of older generations count as empty.
 * - pymalloc serves large PyObject_Malloc/PyMem_Malloc requests with
 *   PyMem_RawMalloc, i.e. through our RAW wrapper again; a thread-local
 *   "in_hook" flag stops such nested calls from being counted twice.
 * - The RAW domain may be called without the GIL from any thread, so table
 *   and counters are protected by a small spinlock (uncontended in a worker:
 *   it runs one thread).
 * - Charges are rounded up to 16 bytes, like pymalloc's blocks; this bounds
 *   the number of live entries by cap/16.
 * - An allocation the underlying allocator refuses (the worker's per-job
 *   RLIMIT_AS, see sandbox/limits.py) also marks the run "exceeded".
 * - After the first refusal the limit is raised by a small grace so the
 *   interpreter can still unwind, format the error and build the reply;
 *   past cap + grace allocations fail again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void *ptr;
    uint32_t size;
    uint32_t gen;
} slot_t;

#define MIN_CHARGE 16u
#define INITIAL_BITS 12
#define MAX_CAP_BYTES ((size_t)1 << 31)

static slot_t *table = NULL;
static size_t table_mask = 0;   /* capacity - 1; capacity is a power of two */
static unsigned table_bits = 0;
static size_t table_used = 0;   /* live entries of the current generation */
static uint32_t cur_gen = 0;

static volatile int armed = 0;
static size_t total = 0, peak = 0, cap_bytes = 0, limit_now = 0;
static int exceeded = 0;
static _Thread_local int in_hook = 0;
static char lock_flag = 0;

static PyMemAllocatorEx orig_raw, orig_mem, orig_obj;
static int installed = 0;

static inline void lock(void) {
    while (__atomic_test_and_set(&lock_flag, __ATOMIC_ACQUIRE)) {
    }
}

static inline void unlock(void) { __atomic_clear(&lock_flag, __ATOMIC_RELEASE); }

static inline size_t home(void *p) {
    uint64_t h = ((uint64_t)(uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> (64 - table_bits));
}

static inline int live(const slot_t *s) { return s->ptr != NULL && s->gen == cur_gen; }

static inline size_t charge_of(size_t size) {
    size_t c = (size + 15u) & ~(size_t)15u;
    return c < MIN_CHARGE ? MIN_CHARGE : c;
}

/* Place an entry without growth checks; the table has room. */
static void place(void *p, uint32_t size) {
    size_t i = home(p);
    while (live(&table[i])) {
        if (table[i].ptr == p) {            /* missed free: replace */
            total -= table[i].size;
            table[i].size = size;
            return;
        }
        i = (i + 1) & table_mask;
    }
    table[i].ptr = p;
    table[i].size = size;
    table[i].gen = cur_gen;
    table_used++;
}

static int grow(void) {
    unsigned bits = table ? table_bits + 1 : INITIAL_BITS;
    size_t cap = (size_t)1 << bits;
    slot_t *fresh = calloc(cap, sizeof(slot_t));   /* libc: never our hooks */
    if (fresh == NULL) {
        return 0;
    }
    slot_t *old = table;
    size_t old_cap = table ? table_mask + 1 : 0;
    table = fresh;
    table_mask = cap - 1;
    table_bits = bits;
    table_used = 0;
    uint32_t gen = cur_gen;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].ptr != NULL && old[i].gen == gen) {
            place(old[i].ptr, old[i].size);
        }
    }
    free(old);
    return 1;
}

static int insert(void *p, size_t size) {
    if (table == NULL || (table_used + 1) * 2 > table_mask + 1) {
        if (!grow()) {
            return 0;
        }
    }
    place(p, (uint32_t)size);
    return 1;
}

/* Remove p and return its charged size, 0 when it is not tracked. */
static size_t take(void *p) {
    if (table == NULL) {
        return 0;
    }
    size_t i = home(p);
    while (live(&table[i])) {
        if (table[i].ptr == p) {
            size_t size = table[i].size;
            /* Backward-shift deletion keeps probe chains intact without tombstones. */
            size_t j = i;
            for (;;) {
                j = (j + 1) & table_mask;
                if (!live(&table[j])) {
                    break;
                }
                size_t k = home(table[j].ptr);
                int movable = (j > i) ? (k <= i || k > j) : (k <= i && k > j);
                if (movable) {
                    table[i] = table[j];
                    i = j;
                }
            }
            table[i].ptr = NULL;
            table_used--;
            return size;
        }
        i = (i + 1) & table_mask;
    }
    return 0;
}

static inline void refuse(void) {
    if (!exceeded) {
        exceeded = 1;
        size_t grace = cap_bytes / 4;
        if (grace < 64 * 1024) {
            grace = 64 * 1024;
        }
        limit_now = cap_bytes + grace;
    }
}

static inline void account(size_t charge) {
    total += charge;
    if (total > peak) {
        peak = total;
    }
}

static void *mg_malloc(void *ctx, size_t size) {
    PyMemAllocatorEx *o = (PyMemAllocatorEx *)ctx;
    if (!armed || in_hook) {
        return o->malloc(o->ctx, size);
    }
    size_t charge = charge_of(size);
    lock();
    if (size >= MAX_CAP_BYTES || total + charge > limit_now) {
        refuse();
        unlock();
        return NULL;
    }
    in_hook = 1;
    void *p = o->malloc(o->ctx, size);
    in_hook = 0;
    if (p == NULL) {
        refuse();   /* the OS said no (the worker's address-space limit): over too */
    } else {
        if (insert(p, charge)) {
            account(charge);
        } else {
            in_hook = 1;
            o->free(o->ctx, p);
            in_hook = 0;
            p = NULL;
            refuse();
        }
    }
    unlock();
    return p;
}

static void *mg_calloc(void *ctx, size_t nelem, size_t elsize) {
    PyMemAllocatorEx *o = (PyMemAllocatorEx *)ctx;
    if (!armed || in_hook) {
        return o->calloc(o->ctx, nelem, elsize);
    }
    if (elsize != 0 && nelem > SIZE_MAX / elsize) {
        return NULL;
    }
    size_t size = nelem * elsize;
    size_t charge = charge_of(size);
    lock();
    if (size >= MAX_CAP_BYTES || total + charge > limit_now) {
        refuse();
        unlock();
        return NULL;
    }
    in_hook = 1;
    void *p = o->calloc(o->ctx, nelem, elsize);
    in_hook = 0;
    if (p == NULL) {
        refuse();
    } else {
        if (insert(p, charge)) {
            account(charge);
        } else {
            in_hook = 1;
            o->free(o->ctx, p);
            in_hook = 0;
            p = NULL;
            refuse();
        }
    }
    unlock();
    return p;
}

static void *mg_realloc(void *ctx, void *ptr, size_t size) {
    PyMemAllocatorEx *o = (PyMemAllocatorEx *)ctx;
    if (!armed || in_hook) {
        return o->realloc(o->ctx, ptr, size);
    }
    size_t charge = charge_of(size);
    lock();
    size_t old = ptr ? take(ptr) : 0;
    /* An untracked block (allocated before arming) is charged in full once it
       is resized: conservative, and it keeps later frees consistent. */
    if (size >= MAX_CAP_BYTES || total - old + charge > limit_now) {
        if (old) {
            place(ptr, (uint32_t)old);     /* slot was just freed: room exists */
        }
        refuse();
        unlock();
        return NULL;
    }
    in_hook = 1;
    void *q = o->realloc(o->ctx, ptr, size);
    in_hook = 0;
    if (q == NULL) {
        if (old) {
            place(ptr, (uint32_t)old);
        }
        if (size != 0) {
            refuse();
        }
    } else {
        total -= old;
        if (insert(q, charge)) {
            account(charge);
        } else {
            refuse();   /* cannot track: count it anyway, the run is over */
            account(charge);
        }
    }
    unlock();
    return q;
}

static void mg_free(void *ctx, void *ptr) {
    PyMemAllocatorEx *o = (PyMemAllocatorEx *)ctx;
    if (armed && !in_hook && ptr != NULL) {
        lock();
        total -= take(ptr);
        unlock();
    }
    o->free(o->ctx, ptr);
}

static PyObject *mg_install(PyObject *self, PyObject *unused) {
    if (!installed) {
        PyMemAllocatorEx hook = {NULL, mg_malloc, mg_calloc, mg_realloc, mg_free};
        PyMem_GetAllocator(PYMEM_DOMAIN_RAW, &orig_raw);
        PyMem_GetAllocator(PYMEM_DOMAIN_MEM, &orig_mem);
        PyMem_GetAllocator(PYMEM_DOMAIN_OBJ, &orig_obj);
        hook.ctx = &orig_raw;
        PyMem_SetAllocator(PYMEM_DOMAIN_RAW, &hook);
        hook.ctx = &orig_mem;
        PyMem_SetAllocator(PYMEM_DOMAIN_MEM, &hook);
        hook.ctx = &orig_obj;
        PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &hook);
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *mg_arm(PyObject *self, PyObject *arg) {
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!installed) {
        PyErr_SetString(PyExc_RuntimeError, "memguard is not installed");
        return NULL;
    }
    if (cap <= 0 || (size_t)cap >= MAX_CAP_BYTES) {
        PyErr_SetString(PyExc_ValueError, "cap must be between 1 byte and 2 GiB");
        return NULL;
    }
    if (table == NULL && !grow()) {
        return PyErr_NoMemory();
    }
    lock();
    cur_gen++;
    if (cur_gen == 0) {             /* wrapped: old entries could look live */
        memset(table, 0, (table_mask + 1) * sizeof(slot_t));
        cur_gen = 1;
    }
    table_used = 0;
    total = 0;
    peak = 0;
    exceeded = 0;
    cap_bytes = (size_t)cap;
    limit_now = (size_t)cap;
    armed = 1;
    unlock();
    Py_RETURN_NONE;
}

static PyObject *mg_disarm(PyObject *self, PyObject *unused) {
    lock();
    armed = 0;
    size_t p = peak;
    int e = exceeded;
    unlock();
    return Py_BuildValue("(nO)", (Py_ssize_t)p, e ? Py_True : Py_False);
}

static PyObject *mg_current(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(total);
}

static PyObject *mg_is_installed(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(installed);
}

static PyMethodDef methods[] = {
    {"install", mg_install, METH_NOARGS, "Wrap the RAW, MEM and OBJ allocators (idempotent)."},
    {"arm", mg_arm, METH_O, "arm(cap_bytes): start counting; refuse allocations past the cap."},
    {"disarm", mg_disarm, METH_NOARGS, "disarm() -> (peak_bytes, exceeded)."},
    {"current", mg_current, METH_NOARGS, "Bytes charged since arm() and not freed."},
    {"is_installed", mg_is_installed, METH_NOARGS, "True once install() ran."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_memguard",
    "Per-invocation allocation cap for sandbox workers.", -1, methods,
};

PyMODINIT_FUNC PyInit__memguard(void) { return PyModule_Create(&moduledef); }
