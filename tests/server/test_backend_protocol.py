"""The three backends (one model, several models, the Ray ingress) offer
what llamax.server.backend.Backend declares, with the same parameters and
async-ness, and the routes call nothing else on a backend."""
import ast
import inspect
from pathlib import Path

import pytest

from llamax.server.app import build_app
from llamax.server.backend import Backend, ProcessBackend
from llamax.server.backends.local import LocalBackend
from llamax.server.backends.multi import MultiBackend
from llamax.server.config import ServerConfig

SERVER = Path(__file__).resolve().parents[2] / "llamax" / "server"


def _members(proto) -> dict:
    """The protocol's methods by name (its own and inherited)."""
    return {n: f for n, f in inspect.getmembers(proto, inspect.isfunction) if not n.startswith("_")}


def _same_methods(cls, proto=Backend):
    for name, want in _members(proto).items():
        got = getattr(cls, name)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), (cls.__name__, name)
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), \
            (cls.__name__, name)


@pytest.mark.parametrize("which", ["local", "multi"])
def test_each_process_backend_is_a_backend(which, tmp_path):
    cfg = ServerConfig(model=str(tmp_path / "m.gguf"), alias="m")
    b = LocalBackend(cfg) if which == "local" else \
        MultiBackend([cfg, ServerConfig(model=str(tmp_path / "n.gguf"), alias="n")])
    build_app(b)  # (sets .tenancy, as the server does; loads nothing until the app starts)
    assert isinstance(b, Backend) and isinstance(b, ProcessBackend)
    _same_methods(type(b), ProcessBackend)


def test_the_ray_ingress_is_a_backend():
    # (the class only: an instance needs Ray Serve handles; Serve's ingress
    # wrapper subclasses it, so its methods are the class's)
    from llamax.server.backends.ray.ingress import Ingress
    _same_methods(Ingress)
    assert isinstance(Ingress.title, str)


def test_the_check_fails_for_a_backend_missing_a_route(tmp_path):
    class Partial:
        title = "x"
        cfg = ServerConfig(model=str(tmp_path / "m.gguf"))
        tenancy = None

        async def ready(self, request):
            pass
    assert not isinstance(Partial(), Backend)


def test_routes_call_only_the_protocol():
    """Every ``backend.X`` and ``_backend(request).X`` in routes.py names a
    Backend member: a route can't reach past the protocol."""
    tree = ast.parse((SERVER / "routes.py").read_text())
    allowed = set(_members(Backend)) | {"title", "cfg", "tenancy"}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "backend") or (
                    isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "_backend"):
                used.add(node.attr)
    assert used, "the check found no backend calls: it looks in the wrong place"
    assert used <= allowed, f"routes.py calls {sorted(used - allowed)} on a backend, which Backend does not declare"
