"""The build's own code (buildsys/), for what must agree with the build: the
test data read from the pinned llama.cpp tree, the peers built with the same
CPU flags, llama-bench built from the same tree, the device check's packing.

    from llamax_dev.buildsys import llama_build     # buildsys/build_llama_cpp.py

buildsys/ is no package and isn't installed: pip puts it on sys.path only
while it runs the build backend (pyproject.toml's backend-path).  This is the
one place that loads it otherwise, by path, under the module names the
backend itself imports, so ``import build_llama_cpp`` in the backend finds
this same module.
"""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from . import ROOT

BUILDSYS = ROOT / "buildsys"


def _load(name: str) -> ModuleType:
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(name, BUILDSYS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


llama_build = _load("build_llama_cpp")


def load_backend() -> ModuleType:
    """buildsys/_llamax_backend.py, the PEP 517 backend (it imports setuptools,
    so only on demand)."""
    return _load("_llamax_backend")
