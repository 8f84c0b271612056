// C++ exception -> llamax.LlamaxError subclass.  Included only by the Cython
// module (it needs Python.h); the shim itself never touches Python.
#pragma once

#include <Python.h>

#include <new>
#include <stdexcept>

#include "llamax.h"

namespace llamax {

// Filled once at import by _core (llamax_register_error), indexed by ErrorKind.
inline PyObject * g_error_classes[16] = {nullptr};

inline void register_error(int kind, PyObject * cls) {
    if (kind >= 0 && kind < 16) {
        Py_XINCREF(cls);
        g_error_classes[kind] = cls;
    }
}

// Used as `except +llamax::translate_exception` in _shim.pxd: called inside
// the catch block with the GIL held.
inline void translate_exception() {
    try {
        throw;
    } catch (const Error & e) {
        PyObject * cls = g_error_classes[(int) e.kind];
        PyErr_SetString(cls ? cls : PyExc_RuntimeError, e.what());
    } catch (const std::bad_alloc &) {
        PyObject * cls = g_error_classes[(int) ErrorKind::OutOfMemory];
        PyErr_SetString(cls ? cls : PyExc_MemoryError, "out of memory in llamax/llama.cpp");
    } catch (const std::invalid_argument & e) {
        PyObject * cls = g_error_classes[(int) ErrorKind::InvalidArgument];
        PyErr_SetString(cls ? cls : PyExc_ValueError, e.what());
    } catch (const std::exception & e) {
        PyObject * cls = g_error_classes[(int) ErrorKind::Decode];
        PyErr_SetString(cls ? cls : PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in llamax");
    }
}

}  // namespace llamax
