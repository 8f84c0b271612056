"""Generate llamax's ``llama_cpp.llama_cpp``: ctypes bindings of the pinned
``llama.h``, with llama-cpp-python's names, over the llama.cpp linked into
``llamax._core``.

  python3 buildsys/gen_llama_api.py LLAMA_H PATCH_DIR OUT_PY OUT_CPP

(setup.py runs it at build time, on the tree it builds; the outputs are
not committed.)  From the header, parsed as C by pycparser after the C
preprocessor (the header's own #includes replaced by the few typedef names
it takes from ggml and the C library):

- every ``struct`` the header defines becomes a ``ctypes.Structure`` (an
  anonymous union inside one, a ``ctypes.Union`` named ``<struct>_value``),
  every opaque one ``<name>_p`` (a ``ctypes.c_void_p``), every function
  pointer type a ``ctypes.CFUNCTYPE``, every enumerator and numeric
  ``#define`` a module constant;
- every function becomes a ctypes function object of that name, with
  ``argtypes``/``restype`` from its declaration, bound to the address
  ``llamax._core`` holds for it: OUT_CPP is the C++ table of those
  addresses (``llamax_llama_api``), compiled into the extension, so the
  bindings reach the very llama.cpp llamax uses (its symbols stay hidden:
  another llama.cpp in the process can't interpose on it).

Functions and structs that llamax's own patches add to the header
(``+`` lines of ``third_party/patches/*.patch``) are left out: they are
llamax's private extensions, not llama.cpp's API.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# typedef names llama.h takes from its #includes: a declaration each, so that
# pycparser can parse the header alone (their ctypes types are in EXTERNAL)
PRELUDE = """
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;
typedef unsigned long size_t; typedef _Bool bool; typedef struct _FILE FILE;
typedef void * ggml_backend_dev_t; typedef void * ggml_backend_buffer_type_t; typedef void * ggml_threadpool_t;
typedef void * ggml_opt_dataset_t; typedef void * ggml_opt_result_t; typedef void * ggml_abort_callback;
typedef void * ggml_log_callback; typedef void * ggml_backend_sched_eval_callback;
typedef void * ggml_opt_epoch_callback; typedef void * ggml_opt_get_optimizer_params;
"""

# C type name -> ctypes expression
EXTERNAL = {
    "int8_t": "ctypes.c_int8", "uint8_t": "ctypes.c_uint8", "int16_t": "ctypes.c_int16",
    "uint16_t": "ctypes.c_uint16", "int32_t": "ctypes.c_int32", "uint32_t": "ctypes.c_uint32",
    "int64_t": "ctypes.c_int64", "uint64_t": "ctypes.c_uint64", "size_t": "ctypes.c_size_t",
    "bool": "ctypes.c_bool", "_Bool": "ctypes.c_bool", "char": "ctypes.c_char", "int": "ctypes.c_int",
    "unsigned int": "ctypes.c_uint", "long": "ctypes.c_long", "unsigned long": "ctypes.c_ulong",
    "float": "ctypes.c_float", "double": "ctypes.c_double", "void": "None",
    "FILE": "ctypes.c_void_p",
    "ggml_backend_dev_t": "ctypes.c_void_p", "ggml_backend_buffer_type_t": "ctypes.c_void_p",
    "ggml_threadpool_t": "ctypes.c_void_p", "ggml_opt_dataset_t": "ctypes.c_void_p",
    "ggml_opt_result_t": "ctypes.c_void_p", "ggml_backend_sched_eval_callback": "ctypes.c_void_p",
    "ggml_opt_epoch_callback": "ctypes.c_void_p", "ggml_opt_get_optimizer_params": "ctypes.c_void_p",
    # ggml.h's own callbacks, as llama-cpp-python types them
    "ggml_abort_callback": "ggml_abort_callback", "ggml_log_callback": "ggml_log_callback",
}

HEAD = '''"""llama.cpp's C API (``llama.h`` of the pinned llama.cpp) through ctypes,
with llama-cpp-python's names: ``llama_cpp.llama_cpp`` when
``llamax.as_llama_cpp`` is installed, and re-exported by ``llamax``.

GENERATED at build time by buildsys/gen_llama_api.py from {header}; do not
edit.  Each function is bound to the address ``llamax._core`` holds for it,
so these calls reach the llama.cpp llamax itself runs.  This is the raw C
API: misuse is what llama.cpp makes it, except that what llamax owns can't
be freed here (``llama_free(llm.ctx)`` and the like raise).  ``llamax.Model``,
``llamax.Context`` and ``llamax.Sampler`` pass as the pointers they hold.
"""
# flake8: noqa
from __future__ import annotations

import ctypes
from typing import NewType

from llamax import _core
from llamax._errors import InvalidArgumentError

_ADDR = _core._llama_api()

ggml_abort_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)
ggml_log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _bind(name, restype, argtypes):
    return ctypes.CFUNCTYPE(restype, *argtypes)(_ADDR[name])

'''

# what llamax owns and these functions would free: refused for llamax's objects
FREES = {"llama_free": "Context", "llama_model_free": "Model", "llama_free_model": "Model",
         "llama_sampler_free": "Sampler", "llama_adapter_lora_free": "LoraAdapter"}


def patch_added(patch_dir: Path) -> tuple[set[str], set[str]]:
    """The function and struct names llamax's patches add to llama.h."""
    funcs: set[str] = set()
    structs: set[str] = set()
    for p in sorted(patch_dir.glob("*.patch")):
        in_header = False
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("+++ "):
                in_header = line[4:].split("\t")[0].strip().endswith("include/llama.h")
                continue
            if not in_header or not line.startswith("+"):
                continue
            m = re.search(r"LLAMA_API\b.*?\b(\w+)\s*\(", line)
            if m:
                funcs.add(m.group(1))
            m = re.match(r"\+\s*(?:typedef\s+)?struct\s+(\w+)\s*\{", line)
            if m:
                structs.add(m.group(1))
    return funcs, structs


def preprocess(header: Path) -> str:
    text = header.read_text()
    text = re.sub(r"^\s*#\s*include\s+[<\"].*$", "", text, flags=re.M)
    cc = subprocess.run(["cc", "-E", "-P", "-x", "c", "-U__GNUC__", "-"], input=PRELUDE + text,
                        capture_output=True, text=True, check=True)
    return cc.stdout


def defines(header: Path, prefix: str = "LLAMA_") -> dict[str, int]:
    """The header's numeric #defines whose names start with ``prefix``."""
    out: dict[str, int] = {}
    for name, value in re.findall(rf"^#define\s+({prefix}\w+)\s+([^\s/]+)", header.read_text(), flags=re.M):
        value = value.strip("()")
        value = re.sub(r"(?<=[0-9a-fA-F])[uUlL]+$", "", value)
        if value in out:
            out[name] = out[value]
            continue
        try:
            out[name] = int(value, 0)
        except ValueError:
            pass
    return out


class Gen:
    def __init__(self, ast, skip_funcs: set[str], skip_structs: set[str], ggml_defines: dict[str, int]):
        from pycparser import c_ast
        self.ggml_defines = ggml_defines   # (enumerators of llama.h may be ggml.h's numbers)
        self.c_ast = c_ast
        self.ast = ast
        self.skip_funcs = skip_funcs
        self.skip_structs = skip_structs
        self.defined: dict[str, object] = {}    # struct tag -> its Struct node (with decls)
        self.typedefs: dict[str, object] = {}   # typedef name -> its type node
        self.opaque: list[str] = []
        self.enums: list[tuple[str, int]] = []
        self.lines: list[str] = []
        self.funcs: list[str] = []

    # -- types -------------------------------------------------------------------

    def ctype(self, node, where: str) -> str:
        a = self.c_ast
        if isinstance(node, a.TypeDecl):
            t = node.type
            if isinstance(t, a.IdentifierType):
                name = " ".join(t.names)
                if name in EXTERNAL:
                    return EXTERNAL[name]
                if name in self.typedefs:
                    return name
                raise ValueError(f"{where}: unknown type {name}")
            if isinstance(t, a.Struct):
                if t.name in self.defined:
                    return t.name
                raise ValueError(f"{where}: struct {t.name} by value but not defined")
            if isinstance(t, a.Enum):
                return "ctypes.c_int"
            if isinstance(t, a.Union):
                raise ValueError(f"{where}: a named union")
        if isinstance(node, a.PtrDecl):
            inner = node.type
            if isinstance(inner, a.TypeDecl):
                t = inner.type
                if isinstance(t, a.IdentifierType):
                    name = " ".join(t.names)
                    if name == "char":
                        return "ctypes.c_char_p"
                    if name == "void":
                        return "ctypes.c_void_p"
                    if name in self.typedefs and self.typedefs[name] == "opaque":
                        return "ctypes.c_void_p"
                    return f"ctypes.POINTER({self.ctype(inner, where)})"
                if isinstance(t, a.Struct):
                    if t.name in self.defined:
                        return f"ctypes.POINTER({t.name})"
                    return "ctypes.c_void_p"   # an opaque handle (llama_model_p, ...)
                if isinstance(t, a.Enum):
                    return "ctypes.POINTER(ctypes.c_int)"
            if isinstance(inner, a.FuncDecl):
                return self.functype(inner, where)
            if isinstance(inner, a.PtrDecl):
                sub = self.ctype(inner, where)
                return f"ctypes.POINTER({sub})"
        if isinstance(node, a.ArrayDecl):
            n = int(node.dim.value, 0)
            return f"({self.ctype(node.type, where)} * {n})"
        raise ValueError(f"{where}: can't type {type(node).__name__}")

    def functype(self, fdecl, where: str) -> str:
        res = self.ctype(fdecl.type, where)
        args = [self.ctype(p.type, where) for p in self.params(fdecl)]
        return f"ctypes.CFUNCTYPE({res}{''.join(', ' + x for x in args)})"

    def params(self, fdecl) -> list:
        a = self.c_ast
        ps = list(fdecl.args.params) if fdecl.args else []
        if len(ps) == 1 and isinstance(ps[0], a.Typename) and isinstance(ps[0].type, a.TypeDecl) and \
                isinstance(ps[0].type.type, a.IdentifierType) and ps[0].type.type.names == ["void"]:
            return []
        for p in ps:
            if isinstance(p, a.EllipsisParam):
                raise ValueError("a variadic function")
        return ps

    # -- the walk ------------------------------------------------------------------

    def collect(self) -> None:
        """Struct definitions and typedef names, before anything is written."""
        a = self.c_ast
        for ext in self.ast.ext:
            t = getattr(ext, "type", None)
            if isinstance(ext, a.Typedef):
                self.typedefs[ext.name] = ext.type
            struct = t.type if isinstance(t, a.TypeDecl) else t
            if isinstance(struct, a.Struct) and struct.decls is not None and struct.name not in self.skip_structs:
                self.defined[struct.name] = struct
        for name, node in list(self.typedefs.items()):
            if isinstance(node, a.PtrDecl) and isinstance(node.type, a.TypeDecl) and \
                    isinstance(node.type.type, a.Struct) and node.type.type.name not in self.defined:
                self.typedefs[name] = "opaque"

    def enum(self, e) -> None:
        value = -1
        for en in e.values.enumerators:
            value = value + 1 if en.value is None else self.const(en.value)
            self.enums.append((en.name, value))

    def const(self, node) -> int:
        a = self.c_ast
        if isinstance(node, a.Constant):
            return int(re.sub(r"[uUlL]+$", "", node.value), 0)
        if isinstance(node, a.UnaryOp) and node.op == "-":
            return -self.const(node.expr)
        if isinstance(node, a.BinaryOp):
            x, y = self.const(node.left), self.const(node.right)
            return {"<<": x << y, "|": x | y, "+": x + y, "-": x - y, "*": x * y}[node.op]
        if isinstance(node, a.ID):
            known = {**self.ggml_defines, **dict(self.enums)}
            return known[node.name]
        raise ValueError(f"an enumerator value {node}")

    def run(self) -> str:
        a = self.c_ast
        self.collect()
        out = self.lines
        for tag in self.defined:
            out.append(f"class {tag}(ctypes.Structure):\n    pass\n")
        for tag in self.defined:
            out.append(f"{tag}_p = ctypes.POINTER({tag})")
        out.append("")
        for ext in self.ast.ext:
            t = getattr(ext, "type", None)
            inner = t.type if isinstance(t, a.TypeDecl) else t
            if isinstance(inner, a.Enum) and inner.values is not None:
                self.enum(inner)
            if isinstance(ext, a.Decl) and isinstance(inner, a.Struct) and inner.decls is None and \
                    inner.name not in self.defined:
                self.opaque.append(inner.name)   # struct llama_model; (a forward declaration)
        for name in self.opaque:
            if name.startswith("llama_"):
                out.append(f'{name}_p = NewType("{name}_p", int)\n{name}_p_ctypes = ctypes.c_void_p')
        for name, value in self.enums:
            out.append(f"{name} = {value}")
        out.append("")
        # typedefs (function pointers, scalars, opaque pointers), in order
        for ext in self.ast.ext:
            if not isinstance(ext, a.Typedef):
                continue
            node = ext.type
            if ext.name in EXTERNAL:
                continue
            if self.typedefs[ext.name] == "opaque":
                out.append(f"{ext.name} = ctypes.c_void_p")
            elif isinstance(node, a.PtrDecl) and isinstance(node.type, a.FuncDecl):
                out.append(f"{ext.name} = {self.functype(node.type, ext.name)}")
            elif isinstance(node, a.TypeDecl) and isinstance(node.type, a.IdentifierType):
                out.append(f"{ext.name} = {self.ctype(node, ext.name)}")
            elif isinstance(node, a.PtrDecl):
                out.append(f"{ext.name} = {self.ctype(node, ext.name)}")
            elif isinstance(node, a.TypeDecl) and isinstance(node.type, a.Enum):
                out.append(f"{ext.name} = ctypes.c_int")
        out.append("")
        # struct fields (after every type they may name)
        for tag, struct in self.defined.items():
            fields, anon = [], []
            for d in struct.decls:
                if d.name is None and isinstance(d.type, a.Union):   # an anonymous union
                    u = d.type
                    uname = f"{tag}_value"
                    ufields = ", ".join(f'("{x.name}", {self.ctype(x.type, uname)})' for x in u.decls)
                    out.append(f"class {uname}(ctypes.Union):\n    _fields_ = [{ufields}]\n")
                    fields.append(f'("value", {uname})')
                    anon.append("value")
                    continue
                fields.append(f'("{d.name}", {self.ctype(d.type, tag + "." + str(d.name))})')
            if anon:
                out.append(f"{tag}._anonymous_ = {tuple(anon)!r}")
            out.append(f"{tag}._fields_ = [\n    " + ",\n    ".join(fields) + ",\n]\n")
        # functions
        for ext in self.ast.ext:
            if not (isinstance(ext, a.Decl) and isinstance(ext.type, a.FuncDecl)):
                continue
            name = ext.name
            if name in self.skip_funcs or not name.startswith("llama_"):
                continue
            fd = ext.type
            res = self.ctype(fd.type, name)
            args = [self.ctype(p.type, name) for p in self.params(fd)]
            argl = "[" + ", ".join(args) + "]"
            if name in FREES:
                out.append(f"_{name} = _bind({name!r}, {res}, {argl})\n\n"
                           f"def {name}(p):\n"
                           f"    _refuse_owned(p, {name!r}, {FREES[name]!r})\n"
                           f"    return _{name}(p)\n")
            else:
                out.append(f"{name} = _bind({name!r}, {res}, {argl})")
            self.funcs.append(name)
        out.append("")
        # llama-cpp-python's ``_lib`` (its CDLL of libllama), which libraries read
        # function addresses from (llguidance: ctypes.cast(_lib.llama_tokenize, c_void_p))
        out.append("class _Lib:\n"
                   "    \"\"\"Each function of llama.h by name, bound to llamax's llama.cpp (the frees checked).\"\"\"\n\n")
        out.append("_lib = _Lib()")
        out.append("_lib.__dict__.update({" + ", ".join(f"{n!r}: {n}" for n in self.funcs) + "})")
        out.append("")
        return "\n".join(out)


OWNED = '''

def _refuse_owned(p, fn: str, cls: str) -> None:
    """A llamax object (or the pointer it holds) is llamax's to free."""
    if isinstance(p, (_core.Model, _core.Context, _core.Sampler, _core.LoraAdapter)):
        raise InvalidArgumentError(f"{fn}: this {type(p).__name__} is llamax's: close() it instead")
    addr = p.value if isinstance(p, ctypes.c_void_p) else p
    if isinstance(addr, int) and _core._llama_owned(addr):
        raise InvalidArgumentError(f"{fn}: this pointer is a llamax {cls}'s: close() the object instead")

'''


def generate(header: Path, patch_dir: Path, out_py: Path, out_cpp: Path) -> list[str]:
    from pycparser import c_parser
    skip_funcs, skip_structs = patch_added(patch_dir)
    ast = c_parser.CParser().parse(preprocess(header), str(header))
    ggml_h = header.parent.parent / "ggml" / "include" / "ggml.h"
    g = Gen(ast, skip_funcs, skip_structs, defines(ggml_h, "GGML_") if ggml_h.exists() else {})
    body = g.run()
    consts = "\n".join(f"{k} = {v}" for k, v in defines(header).items())
    names = g.funcs
    exports = sorted({*names, *g.defined, *(f"{t}_p" for t in g.defined), *(n for n, _ in g.enums),
                      *defines(header), *(f"{n}_p" for n in g.opaque if n.startswith("llama_")),
                      *(f"{n}_p_ctypes" for n in g.opaque if n.startswith("llama_")),
                      *(n for n in g.typedefs if n not in EXTERNAL), "ggml_abort_callback", "ggml_log_callback"})
    py = (HEAD.format(header=f"llama.h ({header.stat().st_size} bytes)") + consts + "\n\n" + body + OWNED +
          "__all__ = [\n" + "".join(f"    {n!r},\n" for n in exports) + "]\n")
    out_py.write_text(py)
    cpp = ["// GENERATED by buildsys/gen_llama_api.py from llama.h: the address of each",
           "// function of llama.h's C API, for llamax's ctypes bindings (llamax/llama_cpp.py).",
           '#include "llama.h"', '#include "llama_api_table.h"',
           "#pragma GCC diagnostic ignored \"-Wdeprecated-declarations\"",
           "const llamax_api_entry llamax_llama_api[] = {"]
    cpp += [f'    {{"{n}", reinterpret_cast<void *>(&{n})}},' for n in names]
    cpp += ["};", f"const int llamax_llama_api_n = {len(names)};", ""]
    out_cpp.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(cpp)
    if not out_cpp.exists() or out_cpp.read_text() != text:   # (unchanged: no recompile)
        out_cpp.write_text(text)
    return names


if __name__ == "__main__":
    h, pd, op, oc = map(Path, sys.argv[1:5])
    print(f"{len(generate(h, pd, op, oc))} functions")
