"""The import graph of ``llamax/`` read with ``ast`` (issue #31, items 7 and 1).

No cycles, deferred imports included; no module imports from a layer above
its own (LAYERS, below); the server uses only public names of the library.
Stdlib only: nothing is imported from llamax, no model is loaded.

What counts as an edge:

- every ``import``/``from ... import`` anywhere in a module, inside functions
  too (a deferred import is still a dependency), and ``import_module("llamax.x")``
  with a literal name; imports under ``if TYPE_CHECKING:`` are left out
  (they never run, and annotations may name a layer above);
- ``from llamax import _errors`` is an edge to ``llamax._errors`` (the name is
  a module); ``from llamax import LlamaxError`` is an edge to ``llamax`` (its
  ``__init__``); relative imports resolve against the importing module;
- ``import llamax.x.y`` is an edge to ``llamax.x.y`` only: Python runs the
  ``__init__`` of ``llamax`` and ``llamax.x`` on the way, but that is not a
  dependency we count;
- ``llamax._core`` is the compiled extension: a leaf.
"""
from __future__ import annotations

import ast
import collections
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "llamax"

# Lowest first. A module may import from its own layer or any layer below,
# never from one above; cycles inside a layer are test_no_cycles' business.
# Patterns are fnmatch patterns over dotted names; one that matches nothing
# yet is fine (only modules that exist are checked).
LAYERS = [
    # the native core and what it raises (_core is a leaf here: it is compiled)
    ["llamax._core", "llamax._errors", "llamax._validate", "llamax._cuda", "llamax._cpus"],
    # leaf helpers
    ["llamax.cancel", "llamax._fetch", "llamax.models", "llamax.llama_types", "llamax.gguf_tools",
     "llamax._sgemm", "llamax.sampling",
     # adapter stores (directory, S3, hub) and their disk tier
     "llamax.adapter_store",
     # llama.h's C API through ctypes (generated at build time: buildsys/gen_llama_api.py)
     "llamax.llama_cpp"],
    # the engine's typed surface: what every front submits (GenerationRequest, AdapterSet,
    # Share, ...) and the events it gets back; on sampling and cancel only
    ["llamax.engine"],
    # the building blocks of Llama
    ["llamax.pool", "llamax.grammar", "llamax.adapters", "llamax.control_vectors", "llamax.peft",
     "llamax.llama_cache", "llamax.templates", "llamax._sandbox", "llamax._session",
     "llamax.request", "llamax.formatters", "llamax.llama_chat_format", "llamax.llama_speculative",
     # llama-cpp-python's _internals classes over Model/Context and the C API
     "llamax._internals",
     # tool-call parsing and grammars (#35): llamax.grammar, _errors and the stdlib only
     "llamax.tool_calls", "llamax.tool_calls.*"],
    ["llamax.llama"],
    # what stands on a Llama (llama_tokenizer: llama-cpp-python's module name for
    # classes llama.py defines, since a Llama makes a tokenizer and back)
    ["llamax.embedder", "llamax.llama_tokenizer"],
    # the package's face
    ["llamax"],
    # the server, split by #31 item 2
    ["llamax.server.config", "llamax.server.protocol", "llamax.server.errors", "llamax.server.context",
     "llamax.server.backend",
     "llamax.server.files", "llamax.server.tenants"],
    ["llamax.server.translate", "llamax.server.streaming", "llamax.server.http", "llamax.server.adapters",
     "llamax.server.embeddings", "llamax.server.anthropic", "llamax.server.responses", "llamax.server.native",
     "llamax.server.metrics", "llamax.server.settings", "llamax.server.tenancy", "llamax.server.store"],
    ["llamax.server.routes"],
    ["llamax.server.app"],
    # the routes take their backend from app.state and import none; a Ray replica or
    # the ingress builds its app with server.app.build_app, so backends sit above it
    ["llamax.server.backends", "llamax.server.backends.serving", "llamax.server.backends.local",
     "llamax.server.backends.multi",
     "llamax.server.backends.ray", "llamax.server.backends.ray.*"],
    # the package re-exports ServerConfig, LocalBackend and build_app
    ["llamax.server", "llamax.server.run", "llamax.server.ray"],
    ["llamax.server.cli", "llamax.server.__main__"],
    # entry points: `python -m llamax serve` runs the server's cli; serve_ray is the
    # old name of llamax.server.ray
    ["llamax.__main__", "llamax.serve_ray", "llamax.as_llama_cpp"],
]

# -- the graph -----------------------------------------------------------------

def find_modules(root: Path = ROOT) -> dict:
    """Dotted name -> source path (None for the compiled extension)."""
    mods = {}
    for path in sorted((root / PKG).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    if (root / PKG / "_core.pyx").exists() or list((root / PKG).glob("_core.*.so")):
        mods[f"{PKG}._core"] = None
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _ours(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


def _known(name: str, mods) -> str:
    """The longest prefix of ``name`` that is a module (``import a.b`` of a missing b: a)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts)


def _base(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from X import ...`` reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_pkg else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
    """Every import of one module: (line, imported module, the name taken from it
    by `from ... import name` or None, the local name bound, the module that local
    name is bound to or None when it names something inside a module)."""

    def __init__(self, module: str, is_pkg: bool, mods):
        self.module, self.is_pkg, self.mods = module, is_pkg, mods
        self.found = []

    def visit_If(self, node):
        if _is_type_checking(node.test):  # never runs: not a dependency
            for n in node.orelse:  # the else branch does run
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for a in node.names:
            if _ours(a.name):
                target = _known(a.name, self.mods)
                # `import llamax.x` binds `llamax`; `import llamax.x as y` binds y to llamax.x
                local, bound = (a.asname, target) if a.asname else (PKG, PKG)
                self.found.append((node.lineno, target, None, local, bound))

    def visit_ImportFrom(self, node):
        base = _base(self.module, self.is_pkg, node)
        if not _ours(base):
            return
        for a in node.names:
            sub = f"{base}.{a.name}"
            if sub in self.mods:
                self.found.append((node.lineno, sub, a.name, a.asname or a.name, sub))
            else:
                self.found.append((node.lineno, _known(base, self.mods), a.name, a.asname or a.name, None))

    def visit_Call(self, node):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if (name.endswith("import_module") and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and _ours(node.args[0].value)):
            self.found.append((node.lineno, _known(node.args[0].value, self.mods), None, None, None))
        self.generic_visit(node)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def imports_of(module: str, mods) -> list:
    path = mods[module]
    if path is None:
        return []
    v = _Imports(module, path.name == "__init__.py", mods)
    v.visit(parse(path))
    return v.found


def build_graph(mods) -> dict:
    """module -> {imported module: [line, ...]}, self-imports left out."""
    graph = {}
    for m in mods:
        edges = collections.defaultdict(list)
        for line, target, *_ in imports_of(m, mods):
            if target and target != m and line not in edges[target]:
                edges[target].append(line)
        graph[m] = dict(edges)
    return graph


def where(a: str, b: str, graph, mods) -> str:
    path = mods[a]
    rel = path.relative_to(ROOT) if path is not None and path.is_relative_to(ROOT) else path
    return f"{a} -> {b} ({rel}:{','.join(map(str, graph[a][b]))})"


def find_cycles(graph) -> list:
    """For each arrow on a cycle, the shortest cycle through it: lists of modules,
    first == last, rotated to start at their smallest name; shortest first."""
    cycles = set()
    for a in graph:
        for b in graph[a]:
            # breadth-first from b back to a
            prev, todo = {b: None}, collections.deque([b])
            while todo and a not in prev:
                n = todo.popleft()
                for m in graph.get(n, ()):
                    if m not in prev:
                        prev[m] = n
                        todo.append(m)
            if a not in prev:
                continue
            path, n = [], a
            while n is not None:
                path.append(n)
                n = prev[n]
            ring = [a] + path[::-1][:-1]  # a, b, ..., (before a)
            i = ring.index(min(ring))
            ring = ring[i:] + ring[:i]
            cycles.add(tuple(ring + [ring[0]]))
    return sorted(cycles, key=lambda c: (len(c), c))


def layer_of(module: str):
    hits = [i for i, layer in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in layer)]
    return hits


def upward_arrows(graph) -> list:
    """(importer, imported) where the imported module sits in a higher layer."""
    up = []
    for a, edges in sorted(graph.items()):
        la = layer_of(a)
        for b in sorted(edges):
            lb = layer_of(b)
            if len(la) == 1 and len(lb) == 1 and lb[0] > la[0]:
                up.append((a, b))
    return up


def _cycle_report(cycles, graph, mods) -> str:
    out = []
    for c in cycles:
        out.append(" -> ".join(c))
        out.extend("    " + where(a, b, graph, mods) for a, b in zip(c, c[1:]))
    return "\n".join(out)


# -- the tests -----------------------------------------------------------------

@pytest.fixture(scope="module")
def mods():
    return find_modules()


@pytest.fixture(scope="module")
def graph(mods):
    return build_graph(mods)


def test_graph_reading(tmp_path):
    """The rules above, on a package made for the purpose."""
    pkg = tmp_path / PKG
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from llamax.a import A\n",
        "_core.pyx": "",
        "a.py": "from llamax import _b\nfrom llamax import A\nimport llamax.sub.c\n",
        "_b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llamax.sub import c\n"
                  "else:\n    from . import a\ndef f():\n    from .sub.c import C\n"),
        "sub/__init__.py": "from .c import C\nfrom .. import _core\n",
        "sub/c.py": "import importlib\nimportlib.import_module('llamax._b')\nfrom ..a import A\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    m = find_modules(tmp_path)
    g = {a: set(b) for a, b in build_graph(m).items()}
    assert g == {
        "llamax": {"llamax.a"},
        "llamax.a": {"llamax._b", "llamax", "llamax.sub.c"},  # not llamax.sub: only Python runs it
        "llamax._b": {"llamax.a", "llamax.sub.c"},            # not the TYPE_CHECKING import
        "llamax.sub": {"llamax.sub.c", "llamax._core"},
        "llamax.sub.c": {"llamax._b", "llamax.a"},
        "llamax._core": set(),
    }
    assert find_cycles(g)[0] == ("llamax", "llamax.a", "llamax")


def test_every_module_has_one_layer(mods):
    missing = [f"add {m} to LAYERS in tests/test_layers.py" for m in mods if not layer_of(m)]
    twice = [f"{m} matches layers {layer_of(m)} in tests/test_layers.py" for m in mods if len(layer_of(m)) > 1]
    assert not missing + twice, "\n".join(missing + twice)


def test_graph_is_read(graph):
    # a few arrows that must be seen, so that an empty graph cannot pass
    assert "llamax._core" in graph["llamax.pool"]
    assert "llamax._errors" in graph["llamax.cancel"]
    assert "llamax.llama" in graph["llamax"]


def test_no_cycles(graph, mods):
    cycles = find_cycles(graph)
    print(_cycle_report(cycles, graph, mods))
    assert not cycles, "import cycles:\n" + _cycle_report(cycles, graph, mods)


def test_no_upward_imports(graph, mods):
    up = [where(a, b, graph, mods) for a, b in upward_arrows(graph)]
    print("\n".join(up))
    assert not up, "imports from a layer above (see LAYERS):\n" + "\n".join(up)


# -- the server uses only public names (#31 item 1) ------------------------------

# llamax._errors defines the public exception classes (llamax re-exports them):
# the one private module the server may import.
PRIVATE_OK = {"llamax._errors"}


def _server(module: str) -> bool:
    return module == "llamax.server" or module.startswith("llamax.server.")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(module: str, mods) -> list:
    """What ast can see reliably: `_`-names imported from llamax modules outside
    llamax.server, private modules imported (llamax._x), attributes `_x` on names
    bound by those imports (`llamax._core.X`), and `llm._x` / `<...>.llm._x`
    (the server's handle to a Llama)."""
    path = mods[module]
    found, bound = [], {}  # bound: local name -> the llamax module it names
    for line, target, name, local, module_bound in imports_of(module, mods):
        if _server(target):
            continue
        if any(_private(p) for p in target.split(".")) and target not in PRIVATE_OK:
            found.append(f"{path.name}:{line}: imports the private module {target}")
        elif module_bound is None and name is not None and _private(name):
            found.append(f"{path.name}:{line}: imports {target}.{name}")
        if module_bound is not None:
            bound[local] = module_bound
    for node in ast.walk(parse(path)):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "llm") or (isinstance(v, ast.Attribute) and v.attr == "llm"):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)} (a Llama's private part)")
            continue
        chain = []  # the attributes between a bound name and node.attr
        while isinstance(v, ast.Attribute):
            chain.append(v.attr)
            v = v.value
        if isinstance(v, ast.Name) and v.id in bound:
            owner = ".".join([bound[v.id]] + chain[::-1])
            if not _server(owner) and f"{owner}.{node.attr}" not in PRIVATE_OK:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_use_reading(tmp_path):
    """What private_uses sees, on a server module made for the purpose."""
    (tmp_path / PKG / "server").mkdir(parents=True)
    for name in ("__init__.py", "request.py", "_errors.py", "_fetch.py", "server/__init__.py", "server/app.py"):
        (tmp_path / PKG / name).write_text("")
    (tmp_path / PKG / "_core.pyx").write_text("")
    (tmp_path / PKG / "server" / "x.py").write_text(
        "import llamax\nfrom llamax import _errors as E\nfrom llamax.request import _plan as plan, RequestParams\n"
        "from llamax._fetch import FetchError\nfrom llamax.server.app import _dumps\n"
        "E.LlamaxError, E._private, llamax._core.Model, llamax.__version__, llamax.Llama\n"
        "engine.llm._pool.slots, llm._embed(), self._own, llamax.server.app._dumps\n")
    found = private_uses("llamax.server.x", find_modules(tmp_path))
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports llamax.request._plan", "imports the private module llamax._fetch", "E._private",
        "llamax._core", "engine.llm._pool (a Llama's private part)", "llm._embed (a Llama's private part)"]


def test_server_uses_only_public_names(mods):
    found = []
    for m in sorted(mods):
        if _server(m) or m == "llamax.serve_ray":
            found += private_uses(m, mods)
    print("\n".join(found))
    assert not found, "the server reaches into llamax's private names:\n" + "\n".join(found)
