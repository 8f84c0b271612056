"""The Responses API's store (llamax.server.responses.ResponseStore):
bounded per tenant by count and by text, least recently used out first,
tenants apart."""
import pytest

from llamax.server.errors import APIError
from llamax.server.responses import ResponseStore


def _put(store, tenant, rid, text="x"):
    store.put(tenant, rid, {"id": rid, "text": text}, [{"role": "user", "content": text}])


def test_count_bound_drops_the_least_recently_used():
    s = ResponseStore(per_tenant=3)
    for i in range(3):
        _put(s, "a", f"r{i}")
    s.get("a", "r0")          # r0 used: r1 is now the oldest
    _put(s, "a", "r3")
    with pytest.raises(APIError) as ei:
        s.get("a", "r1")
    assert ei.value.status == 404 and "last 3" in ei.value.message
    assert [s.get("a", r).response["id"] for r in ("r0", "r2", "r3")] == ["r0", "r2", "r3"]


def test_text_bound_and_tenants_apart():
    s = ResponseStore(per_tenant=100, chars=3000)
    for i in range(5):
        _put(s, "a", f"r{i}", "y" * 1000)   # ~2 KB each: one fits
    _put(s, "b", "r0", "z")
    assert len(s) == 2
    assert s.get("a", "r4").response["id"] == "r4"
    assert s.get("b", "r0").response["text"] == "z"
    with pytest.raises(APIError):
        s.get("b", "r4")
    s.delete("a", "r4")
    with pytest.raises(APIError):
        s.delete("a", "r4")
    assert len(s) == 1
