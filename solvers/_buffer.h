/* Shared by the solvers' C extensions: a C-contiguous buffer of `count` items of `itemsize` bytes from any
 * object with the buffer protocol (numpy arrays), so the extensions need no numpy headers. */
#ifndef EPLB_SOLVERS_BUFFER_H
#define EPLB_SOLVERS_BUFFER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, int writable,
                  const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->itemsize != itemsize || view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes", name, count,
                     itemsize, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One argument's buffer: object, item size, items, writable, name for errors. */
typedef struct {
    PyObject *obj;
    Py_ssize_t itemsize, count;
    int writable;
    const char *name;
} BufferSpec;

static void release_buffers(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* The n buffers of `spec` into views[0 .. n-1]; on failure none is held and -1 is returned with the error set. */
static int buffers(const BufferSpec *spec, int n, Py_buffer *views) {
    for (int i = 0; i < n; i++)
        if (buffer(spec[i].obj, &views[i], spec[i].itemsize, spec[i].count, spec[i].writable, spec[i].name) < 0) {
            release_buffers(views, i);
            return -1;
        }
    return 0;
}

#endif
