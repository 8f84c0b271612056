# llama.h's C API for llamax.llama_cpp (ctypes bindings generated at build
# time by buildsys/gen_llama_api.py): the functions' addresses, what llamax
# owns, and the pointers llamax's objects pass as.

cdef extern from "llama_api_table.h":
    struct llamax_api_entry:
        const char * name
        void * fn
    const llamax_api_entry * llamax_llama_api
    const int llamax_llama_api_n


def _llama_api():
    """name -> address of each function of the pinned llama.h (its C API,
    without what llamax's patches add)."""
    return {llamax_llama_api[i].name.decode("ascii"): <uintptr_t> llamax_llama_api[i].fn
            for i in range(llamax_llama_api_n)}


def _llama_owned(addr):
    """Whether ``addr`` is a llama.cpp object llamax owns (a model, context,
    adapter or sampler of a live llamax object)."""
    if isinstance(addr, bool) or not isinstance(addr, int) or not 0 < addr < (1 << 64):
        return False
    return owned_has(<const void *> <uintptr_t> addr)
