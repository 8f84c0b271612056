// C++ exception -> llamax.LlamaxError subclass.  Included only by the Cython
// module (it needs Python.h); the shim itself never touches Python.
#pragma once

#include <Python.h>

#include <cstring>
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

// Messages can quote bytes from a hostile file (a tensor name, a log line):
// decoded with "replace", never strictly (that would raise UnicodeDecodeError
// instead of the llamax error; found by tools/fuzz.py).
inline void set_error(PyObject * cls, const char * msg) {
    PyObject * text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t) std::strlen(msg), "replace");
    if (text == nullptr) {
        return;  // (MemoryError is set)
    }
    PyErr_SetObject(cls, text);
    Py_DECREF(text);
}

// Used as `except +llamax::translate_exception` in _shim.pxd: called inside
// the catch block with the GIL held.
inline void translate_exception() {
    try {
        throw;
    } catch (const Error & e) {
        if (e.kind == ErrorKind::Interrupted) {
            // Ctrl-C stopped the call: run Python's handler now (it raises
            // KeyboardInterrupt and consumes the pending signal); if the
            // signal was consumed elsewhere, raise what it would have raised.
            if (PyErr_CheckSignals() == 0) {
                PyErr_SetNone(PyExc_KeyboardInterrupt);
            }
            return;
        }
        PyObject * cls = g_error_classes[(int) e.kind];
        set_error(cls ? cls : PyExc_RuntimeError, e.what());
    } catch (const std::bad_alloc &) {
        PyObject * cls = g_error_classes[(int) ErrorKind::OutOfMemory];
        PyErr_SetString(cls ? cls : PyExc_MemoryError, "out of memory in llamax/llama.cpp");
    } catch (const std::invalid_argument & e) {
        PyObject * cls = g_error_classes[(int) ErrorKind::InvalidArgument];
        set_error(cls ? cls : PyExc_ValueError, e.what());
    } catch (const std::exception & e) {
        PyObject * cls = g_error_classes[(int) ErrorKind::Decode];
        set_error(cls ? cls : PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in llamax");
    }
}

}  // namespace llamax
