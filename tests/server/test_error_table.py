"""Python -> HTTP errors by class: every LlamaxError subclass has a row of
its own (none falls through to 500 by accident), and an exception gets the
row of its own class before any base's."""
import pytest

import llamax
import llamax.server.app  # noqa: F401  (imports every module that defines an error class)
from llamax.server import errors


def _subclasses(cls):
    out = []
    for c in cls.__subclasses__():
        if c.__module__.startswith("llamax"):
            out.append(c)
        out.extend(_subclasses(c))
    return out


def test_every_llamax_error_has_a_row():
    classes = [llamax.LlamaxError, *_subclasses(llamax.LlamaxError)]
    assert len(classes) >= 20
    # (a private class, e.g. grammar.py's _Unsatisfiable, is caught where it
    # is raised; were one to escape, its public base's row answers)
    missing = [c.__qualname__ for c in classes if c not in errors.BY_CLASS and not c.__name__.startswith("_")]
    assert not missing, f"add rows to llamax/server/errors.py BY_CLASS for {missing}"


@pytest.mark.parametrize("cls,status,code", [
    (llamax.KVCacheFullError, 503, "kv_cache_full"),      # a DecodeError, with its own row
    (llamax.CancelledError, 503, "cancelled"),
    (llamax.DecodeError, 500, "decode_error"),
    (llamax.ContextBusyError, 503, "context_busy"),
    (llamax.UnknownAdapterError, 404, "adapter_not_found"),
    (llamax.ContextOverflowError, 400, "context_length_exceeded"),
    (llamax.ArgumentTypeError, 400, "invalid_type"),
])
def test_own_row_first(cls, status, code):
    err = errors.from_exception(cls("what to fix"))
    assert (err.status, err.code) == (status, code)
    assert "what to fix" in err.message
    assert (err.headers or {}).get("Retry-After") == ("1" if status == 503 else None)


def test_a_subclass_made_elsewhere_gets_its_nearest_base_row():
    class Mine(llamax.GrammarError):
        pass
    err = errors.from_exception(Mine("bad"))
    assert (err.status, err.code, err.message) == (400, "grammar_error", "bad")
    assert errors.from_exception(ValueError("x")) is None
    # a 500 says which error it was
    assert errors.from_exception(llamax.DecodeError("boom")).message == "DecodeError: boom"


def test_unknown_adapter_message_has_no_quotes():
    assert errors.from_exception(llamax.UnknownAdapterError("no adapter 'x'")).message == "no adapter 'x'"
