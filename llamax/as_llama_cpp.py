"""``import llama_cpp`` meaning llamax, for every module of one process.

Libraries built on llama-cpp-python (LangChain's ``LlamaCpp``, LlamaIndex's
``LlamaCPP``, outlines, guidance) import ``llama_cpp`` themselves, so the
user's own ``import llamax as llama_cpp`` never reaches them.  Two opt-in
ways make the name mean llamax for the whole process, third-party modules
included, without editing them:

- in code, before the library is imported::

      import llamax.as_llama_cpp
      llamax.as_llama_cpp.install()
      from langchain_community.llms import LlamaCpp   # its `from llama_cpp import Llama` gets llamax's

- for a program as it is: ``python -m llamax as-llama-cpp app.py ARGS`` (or
  ``-m MODULE ARGS``, e.g. ``-m uvicorn app:api``) installs it, then runs
  the program.

It puts llamax's modules into ``sys.modules`` under the names in
:data:`MODULES` (the same module objects: ``llama_cpp.Llama is
llamax.Llama``), and a finder on ``sys.meta_path`` refuses every other
``llama_cpp.*`` name by name.  It never shadows an
installed llama-cpp-python silently: :func:`install` refuses
(:class:`llamax.ShadowingError`) where one is importable, unless called with
``replace=True``, which warns, naming the files it hides; and it refuses
outright where the real ``llama_cpp`` was imported already (two libraries
under one name in one process).  :func:`uninstall` undoes it.
docs/guide.md says why this design and not a second distribution.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

from llamax._errors import ArgumentTypeError, ShadowingError

__all__ = ["MODULES", "install", "uninstall", "installed", "main"]

# llama-cpp-python's module name -> the llamax module that stands for it
MODULES = {
    "llama_cpp": "llamax",
    "llama_cpp.llama": "llamax.llama",
    "llama_cpp.llama_types": "llamax.llama_types",
    "llama_cpp.llama_chat_format": "llamax.llama_chat_format",
    "llama_cpp.llama_grammar": "llamax.grammar",
    "llama_cpp.llama_cache": "llamax.llama_cache",
    "llama_cpp.llama_speculative": "llamax.llama_speculative",
    "llama_cpp.llama_tokenizer": "llamax.llama_tokenizer",
    "llama_cpp.llama_cpp": "llamax.llama_cpp",   # llama.h's C API through ctypes (generated at build time)
    "llama_cpp._internals": "llamax._internals",  # its thin classes over llama.h, backed by llamax's objects
}

# llama-cpp-python's modules llamax does not offer, and what to do instead
MISSING = {
    "llama_cpp.server": "llama-cpp-python's server is not aliased: run `python -m llamax serve MODEL` (docs/server.md)",
    "llama_cpp.llava_cpp": "llava (mtmd) bindings are not offered by llamax",
    "llama_cpp.mtmd_cpp": "mtmd bindings are not offered by llamax",
}


class _Finder(importlib.abc.MetaPathFinder):
    """Asked only for ``llama_cpp.*`` names that are not in ``sys.modules``
    (install put the offered ones there): each is refused by name, so that
    no llamax file is ever imported a second time under a ``llama_cpp``
    name (``llama_cpp`` is llamax's package, whose folder holds them)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("llama_cpp."):
            return None
        why = MISSING.get(fullname) or MISSING.get(".".join(fullname.split(".")[:2]))
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: `llama_cpp` is llamax in this process (llamax.as_llama_cpp), "
            f"which offers {', '.join(sorted(MODULES))}" + (f"; {why}" if why else ""), name=fullname)


_FINDER: _Finder | None = None


def installed() -> bool:
    """Whether ``llama_cpp`` means llamax in this process now."""
    return _FINDER is not None


def _real_llama_cpp():
    """The spec of a ``llama_cpp`` importable without this finder (an
    installed llama-cpp-python), or None."""
    return importlib.machinery.PathFinder.find_spec("llama_cpp")


def install(*, replace: bool = False) -> None:
    """From now on, ``import llama_cpp`` (and its submodules in
    :data:`MODULES`) anywhere in this process gives llamax's modules.

    Refuses (:class:`llamax.ShadowingError`) where the real ``llama_cpp``
    is imported already, and where llama-cpp-python is installed, unless
    ``replace=True`` (then a ``UserWarning`` names what is hidden).
    Calling it again does nothing."""
    global _FINDER
    if not isinstance(replace, bool):
        raise ArgumentTypeError(f"replace must be a bool, not {type(replace).__name__}")
    if _FINDER is not None:
        return
    mine = {id(importlib.import_module(t)) for t in MODULES.values()}
    loaded = [n for n in sys.modules if (n == "llama_cpp" or n.startswith("llama_cpp."))
              and id(sys.modules[n]) not in mine]
    if loaded:
        where = getattr(sys.modules[loaded[0]], "__file__", None) or "?"
        raise ShadowingError(
            f"llama_cpp is imported already in this process (from {where}): install llamax.as_llama_cpp before "
            "anything imports llama_cpp (or run the program with `python -m llamax as-llama-cpp`)")
    real = _real_llama_cpp()
    if real is not None:
        where = real.origin or ", ".join(real.submodule_search_locations or ()) or "?"
        if not replace:
            raise ShadowingError(
                f"llama-cpp-python is installed here ({where}): `import llama_cpp` would stop meaning it. "
                "Pass replace=True (`python -m llamax as-llama-cpp --replace ...`) to let llamax win in this "
                "process, or uninstall llama-cpp-python")
        warnings.warn(f"llama_cpp means llamax in this process; the installed llama-cpp-python ({where}) is "
                      "hidden until llamax.as_llama_cpp.uninstall()", UserWarning, stacklevel=2)
    for name, module in zip(MODULES, (importlib.import_module(t) for t in MODULES.values())):
        sys.modules[name] = module
    _FINDER = _Finder()
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """``import llama_cpp`` is what it was before :func:`install`: the
    finder is removed and the ``llama_cpp`` names it handed out are
    forgotten (modules that imported them keep the objects they hold)."""
    global _FINDER
    if _FINDER is None:
        return
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass
    _FINDER = None
    for name in [n for n in sys.modules if n == "llama_cpp" or n.startswith("llama_cpp.")]:
        if name in MODULES:
            del sys.modules[name]


def main(argv: list[str]) -> int:
    """``python -m llamax as-llama-cpp [--replace] (SCRIPT | -m MODULE) [ARGS...]``."""
    import runpy

    usage = "usage: python -m llamax as-llama-cpp [--replace] (SCRIPT | -m MODULE) [ARGS...]"
    args = list(argv)
    replace = False
    if args and args[0] == "--replace":
        replace, args = True, args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(usage + "\n\nRuns a Python program with `import llama_cpp` meaning llamax for every module "
              "(llamax.as_llama_cpp).", file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    try:
        install(replace=replace)
    except ShadowingError as e:
        print(f"llamax: {e}", file=sys.stderr)
        return 2
    if args[0] == "-m":
        if len(args) < 2:
            print(usage, file=sys.stderr)
            return 2
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")
    return 0
