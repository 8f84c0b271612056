// The address of each function of llama.h's C API (the table itself is
// generated at build time by buildsys/gen_llama_api.py from the pinned
// header), for llamax.llama_cpp's ctypes bindings: they call the llama.cpp
// linked into llamax._core, whose symbols stay hidden.
#pragma once

struct llamax_api_entry {
    const char * name;
    void * fn;
};

extern const llamax_api_entry llamax_llama_api[];
extern const int llamax_llama_api_n;
