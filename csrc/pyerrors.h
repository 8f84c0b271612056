// C++ exception -> llamax.LlamaxError subclass.  Included only by the Cython
// module (it needs Python.h); the shim itself never touches Python.
#pragma once

#include <Python.h>

#include <cstring>
#include <new>
#include <stdexcept>

#include "llamax.h"

namespace llamax {

// Filled once at import by _core (register_errors), indexed by ErrorKind.
inline PyObject * g_error_classes[kErrorKinds] = {nullptr};

// Look every kind's class up by its name (LLAMAX_ERROR_KINDS) in the
// namespace of llamax._errors.  Returns 0, or -1 with ImportError set when
// a class is missing or not an exception class.
inline int register_errors(PyObject * ns) {
    for (int k = 0; k < kErrorKinds; ++k) {
        const char * name = error_class_name(k);
        if (name == nullptr) {
            continue;
        }
        PyObject * cls = PyDict_GetItemString(ns, name);  // borrowed
        if (cls == nullptr || !PyExceptionClass_Check(cls)) {
            PyErr_Format(PyExc_ImportError, "llamax._errors has no exception class %s (csrc/llamax.h)", name);
            return -1;
        }
        Py_INCREF(cls);
        g_error_classes[k] = cls;
    }
    return 0;
}

// LoadError is an OSError: raised as cls(errno, message) when the shim knows
// the errno, so `e.errno` is set like the OSError Python itself would raise.
inline void set_os_error(PyObject * cls, int code, const char * msg) {
    PyObject * text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t) std::strlen(msg), "replace");
    if (text == nullptr) {
        return;
    }
    PyObject * args = Py_BuildValue("(iN)", code, text);
    if (args == nullptr) {
        return;
    }
    PyErr_SetObject(cls, args);
    Py_DECREF(args);
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
        const int k = (int) e.kind;
        PyObject * cls = k >= 0 && k < kErrorKinds ? g_error_classes[k] : nullptr;
        if (e.kind == ErrorKind::Load && e.code > 0 && cls != nullptr) {
            set_os_error(cls, e.code, e.what());
            return;
        }
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
