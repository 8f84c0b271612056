"""llamax/_core.pyi stays true to the built extension and is what mypy uses.

* ``mypy.stubtest`` compares the stubs with the imported ``llamax._core``
  (names, methods vs properties, parameter names, kinds and defaults).
* ``mypy --strict`` type-checks tests/typing/usage.py (which pins return
  types with ``assert_type``) and rejects a call with a wrong argument type.
* Cython's ``__init__`` has no introspectable signature (stubtest sees
  ``(self, *args, **kwargs)``), so the constructors are compared with
  ``def __init__`` in llamax/_core.pyx instead.

The subprocesses run in tmp_path, not the repository root, so that they
import the *installed* llamax (and mypy writes its cache there).  mypy
can't follow setuptools' editable-install import hook, so when llamax
lives outside site-packages (editable install, checkout) its parent folder
goes on MYPYPATH; an installed wheel is found through ``py.typed``.
"""
import ast
import importlib.util
import os
import re
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import llamax

# Slow tier (`pytest tests -m slow`; .ci/run runs it): mypy over the stubs (~20 s).
pytestmark = pytest.mark.slow

if importlib.util.find_spec("mypy") is None:
    pytest.skip("mypy is not installed (it is in the 'test' extra)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
USAGE = ROOT / "tests" / "typing" / "usage.py"
PKG_DIR = Path(llamax.__file__).resolve().parent
STUB = PKG_DIR / "_core.pyi"
PYX = PKG_DIR / "_core.pyx"
ALLOWLIST = Path(__file__).resolve().parent / "stubtest_allowlist.txt"

# --strict.  --follow-imports=silent: llamax's pure-Python modules are read
# for their types, but their own errors are not these tests' business.
MYPY_FLAGS = ["--strict", "--follow-imports=silent"]


def _env():
    env = dict(os.environ)
    sites = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if PKG_DIR.parent not in sites:
        env["MYPYPATH"] = os.pathsep.join(filter(None, [str(PKG_DIR.parent), env.get("MYPYPATH")]))
    return env


def _run(args, cwd):
    r = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=600)
    return r.returncode, r.stdout + r.stderr


def _mypy(tmp_path, *files):
    return _run(["-m", "mypy", *MYPY_FLAGS, "--cache-dir", str(tmp_path / ".mypy_cache"), *map(str, files)],
                cwd=tmp_path)


def test_stubtest(tmp_path):
    # stubtest type-checks the package around the stubs first and stops on
    # any error; llamax's pure-Python modules are only imported, not checked.
    cfg = tmp_path / "mypy.ini"
    cfg.write_text(f"[mypy]\nfollow_imports = silent\ncache_dir = {tmp_path / '.mypy_cache'}\n")
    # stubtest reports success, silently, when it finds no stub for a
    # private module such as _core: first make sure mypy, set up the same
    # way, finds it.
    rc, out = _run(["-m", "mypy", "--config-file", str(cfg), "-c", "import llamax._core"], cwd=tmp_path)
    assert rc == 0, f"mypy can't find llamax/_core.pyi:\n{out}"
    args = ["-m", "mypy.stubtest", "llamax._core", "--mypy-config-file", str(cfg)]
    if ALLOWLIST.exists():
        args += ["--allowlist", str(ALLOWLIST)]
    rc, out = _run(args, cwd=tmp_path)
    print(out)
    assert rc == 0, out


def test_usage_file_type_checks(tmp_path):
    rc, out = _mypy(tmp_path, USAGE)
    print(out)
    assert rc == 0, out


def test_mypy_rejects_wrong_argument_type(tmp_path):
    # Proves the stubs are in use: without them llamax._core is missing
    # (an import error) or Any (no error at the call).
    snippet = tmp_path / "bad_usage.py"
    snippet.write_text(textwrap.dedent("""\
        from llamax import Model

        def f(m: Model) -> None:
            m.tokenize(123)
        """))
    rc, out = _mypy(tmp_path, snippet)
    print(out)
    assert rc == 1, out
    assert re.search(r'Argument 1 to "tokenize" of "Model" has incompatible type "int"', out), out
    assert out.count("error:") == 1, out


# -- constructors: stub vs .pyx source ------------------------------------------

def _params(fn: ast.FunctionDef):
    """(kind, name, default) per parameter; default None where the stub says ``...``."""
    a = fn.args
    out = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for i, (p, d) in enumerate(zip(pos, defaults)):
        out.append(("posonly" if i < len(a.posonlyargs) else "pos", p.arg, d))
    if a.vararg:
        out.append(("*", a.vararg.arg, None))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(("kwonly", p.arg, d))
    if a.kwarg:
        out.append(("**", a.kwarg.arg, None))
    return out


def _default(node):
    if node is None:
        return "<required>"
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return "<any>"
    return ast.literal_eval(node)


def _pyx_inits():
    # _core.pyx and the per-class .pxi files it includes
    src = "\n".join(p.read_text() for p in [PYX, *sorted(PKG_DIR.glob("_*.pxi"))])
    starts = [m.start() for m in re.finditer(r"^cdef class ", src, re.M)] + [len(src)]
    inits = {}
    for a, b in zip(starts, starts[1:]):
        block = src[a:b]
        name = re.match(r"cdef class (\w+)", block).group(1)
        m = re.search(r"^    def __init__\((.*?)\):\n", block, re.M | re.S)
        if m:
            params = re.sub(r"\b[A-Z]\w* (\w+)", r"\1", m.group(1))  # drop Cython types (``Model model``)
            inits[name] = ast.parse(f"def __init__({params}): pass").body[0]
    return inits


@pytest.mark.skipif(not PYX.exists(), reason="no llamax/_core.pyx next to the module (installed wheel)")
def test_constructor_signatures_match_pyx():
    pyx = _pyx_inits()
    stub = {n.name: n for n in ast.parse(STUB.read_text()).body if isinstance(n, ast.ClassDef)}
    assert pyx, "found no def __init__ in _core.pyx"
    for name, pyx_init in pyx.items():
        assert name in stub, f"{name} is not in _core.pyi"
        stub_init = next((n for n in stub[name].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                         None)
        assert stub_init is not None, f"{name}.__init__ is not in _core.pyi"
        want, got = _params(pyx_init), _params(stub_init)
        assert [(k, n) for k, n, _ in got] == [(k, n) for k, n, _ in want], name
        for (_, pname, d_pyx), (_, _, d_stub) in zip(want, got):
            ds = _default(d_stub)
            assert ds == "<any>" and d_pyx is not None or ds == _default(d_pyx), f"{name}({pname}=...)"
