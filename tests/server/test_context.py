"""One typed request context (llamax.server.context.RequestContext) instead
of loose keys on ``request.state``: no server module reads or writes a key
there.  What the context carries is exercised end to end by test_tenants.py
(the caller, limits and headers, usage log's model and adapters, per-tenant
TTFT and queue time) and tests/rayserve (the replica's header, the usage
recorded at the ingress from the replicas' Results)."""
import ast
from pathlib import Path

from llamax.server.context import RequestContext, context_of_scope

SERVER = Path(__file__).resolve().parents[2] / "llamax" / "server"


def _state_uses(path: Path) -> list[str]:
    """``request.state.X`` / ``getattr(request.state, ...)`` and
    ``scope["state"]`` in one module (``app.state`` is the app's, allowed)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "state" and not (
                isinstance(node.value, ast.Attribute) and node.value.attr == "app") and not (
                isinstance(node.value, ast.Name) and node.value.id == "app"):
            found.append(f"{path.name}:{node.lineno}: .state")
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "state":
            found.append(f"{path.name}:{node.lineno}: [\"state\"]")
    return found


def test_no_server_module_uses_request_state():
    uses = []
    for path in sorted(SERVER.rglob("*.py")):
        if path.name == "context.py":
            continue  # the one place that keeps the context in the ASGI scope
        uses += _state_uses(path)
    assert not uses, "use llamax.server.context.request_context(request) instead:\n" + "\n".join(uses)


def test_the_check_sees_what_it_looks_for(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f(request, scope, app):\n    request.state.x = 1\n    getattr(request.state, 'y')\n"
                 "    scope['state']['z'] = 2\n    app.state.backend\n    request.app.state.config\n")
    assert [u.split(": ", 1)[1] for u in _state_uses(p)] == [".state", ".state", '["state"]']


def test_one_context_per_scope():
    scope: dict = {}
    ctx = context_of_scope(scope)
    assert context_of_scope(scope) is ctx and scope["state"]["ctx"] is ctx
    made = RequestContext(model_name="m")
    assert context_of_scope({"state": {"ctx": made}}) is made


def test_admission_gives_every_place_back_once_last_first():
    import asyncio
    from llamax.server.context import Admission
    log = []
    adm = Admission()

    async def run():
        async with adm:
            adm.hold(lambda: log.append("tenant"))
            adm.hold(lambda: log.append("server"))
            assert adm.holding == 2 and log == []
    asyncio.run(run())
    assert log == ["server", "tenant"] and adm.holding == 0
    adm.release()  # again: nothing more
    assert log == ["server", "tenant"]
    adm.hold(lambda: log.append("late"))  # taken after the end: given back at once
    assert log == ["server", "tenant", "late"] and adm.holding == 0


def test_admission_gives_back_the_rest_when_one_fails(caplog):
    from llamax.server.context import Admission
    log = []
    adm = Admission()
    adm.hold(lambda: log.append("tenant"))
    adm.hold(lambda: 1 / 0)
    adm.release()
    assert log == ["tenant"]
    assert "releasing a request's places failed" in caplog.text
