"""llamax's development helpers: what the tests, the benchmarks and the tools share.

Not part of the wheel.  How it is found:
  - pytest: ``pythonpath = ["tools"]`` in pyproject.toml;
  - scripts in tools/: their own folder is on sys.path;
  - everything else (benchmarks/, tools/compat/): ``pip install -e .`` installs
    it beside llamax (setup.py; editable installs only);
  - interpreters started by the tests or by these helpers get ``tools/`` on
    PYTHONPATH from whoever starts them (tests/conftest.py run_py, crash_search,
    peers.Worker).

  data                test models and files, fetched, verified and cached once
  buildsys            the build's own code (buildsys/) for what must agree with it
  peers               llama-cpp-python from the same sdist and CPU flags, and the
                      JSON-lines workers the benchmarks run in other venvs
  worker_loop         those workers' loop (standard library only)
  compat_diff_worker  the calls tools/compat/diff.py makes of both libraries
                      (tests/compat/test_diff_reference.py runs them on llamax)
  crash_search        the property-based crash search (tests/hardening,
                      tools/find_crashes.py)

Importing this package imports nothing else: the workers import it in venvs
that have neither llamax nor numpy.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]   # the checkout: tools/llamax_dev/ -> .
TOOLS = ROOT / "tools"                       # what PYTHONPATH needs for this package
TESTS = ROOT / "tests"


def tests_module(relpath: str) -> ModuleType:
    """A module of tests/ by its path there (``"api/test_stop_strings.py"``),
    for a tool or benchmark that reuses a test's inputs or reference code.
    tests/ is no package (pytest imports its files by path), so this loads
    the file by path too."""
    path = TESTS / relpath
    spec = importlib.util.spec_from_file_location(f"_llamax_tests.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
