"""What one request may make the Ray path hold (issue #30, item 7), without
a cluster: the ingress' per-request adapter cap and its bounded table of
multiplexed ids, a replica's cap on loaded adapters (least recently used
idle ones unloaded, a bounded wait while running requests hold them all),
and the command line that sets them."""
from __future__ import annotations

import argparse
import asyncio
import types

import pytest

pytest.importorskip("ray.serve")

from llamax.server import config as cli  # noqa: E402  (the command line's options)
from llamax.server.backends.ray import ingress as ray_ingress  # noqa: E402
from llamax.server.backends.ray import replica as ray_replica  # noqa: E402
from llamax.server import protocol  # noqa: E402
from llamax.server.errors import APIError  # noqa: E402


class FakeIngress:
    """The Ingress' bookkeeping alone (an Ingress object is Serve's ASGI
    wrapper, made in a replica)."""
    set_key = ray_ingress.Ingress.set_key
    _cached = ray_ingress.Ingress._cached
    forget = ray_ingress.Ingress.forget


def ingress(max_adapters=2, max_affinity_sets=3):
    ing = FakeIngress()
    ing.max_adapters, ing.max_affinity_sets, ing.affine = max_adapters, max_affinity_sets, set()
    return ing


def loras(*names):
    return [{"name": n, "scale": 1.0} for n in names]


def test_ingress_refuses_a_set_over_the_cap():
    ing = ingress()
    body = protocol.CompletionRequest(prompt="x", active_loras=[{"name": n} for n in "abc"])
    with pytest.raises(APIError) as e:
        ing.set_key(loras("a", "b", "c"), body)
    err = e.value
    assert err.status == 400 and err.param == "active_loras" and err.code == "invalid_value"
    assert "names 3 adapters but max_loaded_adapters=2" in err.message
    body = protocol.CompletionRequest(prompt="x", lora=[{"id": i} for i in range(3)])
    with pytest.raises(APIError, match="max_loaded_adapters=2") as e:
        ing.set_key(loras("a", "b", "c"), body)
    assert e.value.param == "lora"
    assert ing.set_key(loras("b", "a"), body) == "a+b"
    assert ing.set_key(None, body) == ""


def test_request_lists_are_bounded():
    for field, item in (("active_loras", {"name": "a"}), ("lora", {"id": 0}), ("control_vectors", {"name": "c"})):
        protocol.CompletionRequest(prompt="x", **{field: [item] * protocol.MAX_LIST_ADAPTERS})
        with pytest.raises(ValueError, match=f"at most {protocol.MAX_LIST_ADAPTERS} items"):
            protocol.CompletionRequest(prompt="x", **{field: [item] * (protocol.MAX_LIST_ADAPTERS + 1)})


def test_multiplexed_ids_are_a_bounded_table():
    ing = ingress(max_affinity_sets=3)
    assert [ing._cached(k) for k in ("a", "b", "a+b", "c", "a")] == [True, True, True, False, True]
    ing.forget("b")   # an unregistered adapter's sets leave the table
    assert ing.affine == {"a"}
    assert ing._cached("c") and ing._cached("d") and not ing._cached("e")


class FakeLlama:
    def __init__(self):
        self.loaded: set[str] = set()
        self.loads = 0

    def load_lora(self, name, path):
        assert name not in self.loaded
        self.loaded.add(name)
        self.loads += 1

    def unload_lora(self, name):
        self.loaded.remove(name)


def replica(max_adapters=2, names="abcd"):
    """A LlamaReplica's adapter bookkeeping on a fake model, with a dict for
    Ray's multiplexed cache (it never evicts here: Ray's LRU of sets is the
    Ray tests' part)."""
    r = object.__new__(ray_replica.LlamaReplica)
    llm = FakeLlama()
    r.backend = types.SimpleNamespace(llm=llm, adapters=types.SimpleNamespace(paths={n: f"/{n}.gguf" for n in names}),
                                      close=lambda: None)
    r.registry = types.SimpleNamespace(held=types.SimpleNamespace(remote=lambda *a: None))
    r.replica_id = "r0"
    r.max_adapters = max_adapters
    r.loaded, r.used, r.refs, r.holding, r.sets = {}, {}, {}, {}, {}
    r._loop = asyncio.get_running_loop()
    r._load_lock = asyncio.Lock()
    r._freed = asyncio.Event()

    async def get_set(key):
        if key not in r.sets:
            s = ray_replica._AdapterSet(r, key)
            r._ref(s)
            r.sets[key] = s
        return r.sets[key]
    r._get_set = get_set
    return r, llm


def test_replica_keeps_at_most_max_adapters_loaded():
    async def main():
        r, llm = replica(max_adapters=2)
        for key in ("a", "b", "a", "c"):   # c: b is the least recently used idle adapter
            s = await r._hold(key)
            assert len(llm.loaded) <= 2
            r._done(s)
        assert llm.loaded == {"a", "c"} and llm.loads == 3
        # a set Ray's cache does not hold is let go when its request ends
        s = await r._hold("d", cached=False)
        assert llm.loaded == {"c", "d"}
        r._done(s)
        assert llm.loaded == {"c"} and "d" not in r.refs and r.holding == {}
        a = await r._hold("a")
        b = await r._hold("b", cached=False)
        assert llm.loaded == {"a", "b"}
        # every loaded adapter is held: c waits for a request to end
        waiting = asyncio.ensure_future(r._hold("c"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        r._done(b)
        c = await asyncio.wait_for(waiting, 5)
        assert llm.loaded == {"a", "c"}
        r._done(a)
        r._done(c)
        assert r.holding == {}
    asyncio.run(main())


def test_replica_waits_a_bounded_time_then_503(monkeypatch):
    monkeypatch.setattr(ray_replica, "MAKE_ROOM_S", 0.2)

    async def main():
        r, llm = replica(max_adapters=1)
        a = await r._hold("a", cached=False)
        with pytest.raises(APIError) as e:
            await r._hold("b", cached=False)
        assert e.value.status == 503 and e.value.code == "adapters_busy"
        assert "all 1 adapters" in e.value.message and "--max-loaded-adapters" in e.value.message
        assert r.holding == {"a": 1} and llm.loaded == {"a"}
        # a set over the cap is refused before anything loads
        with pytest.raises(APIError, match="names 2 adapters but max_loaded_adapters=1") as e:
            await r._hold("b+c", cached=False)
        assert e.value.status == 400 and llm.loads == 1
        r._done(a)
    asyncio.run(main())


def test_cli_flags():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    o = cli.ray_options(p.parse_args(["m.gguf", "--replicas", "2"]))
    assert (o.replicas, o.max_adapters, o.max_sets) == (2, 8, 4)
    o = cli.ray_options(p.parse_args(["m.gguf", "--replicas", "2", "--max-loaded-adapters", "3",
                                      "--max-adapter-sets", "5"]))
    assert (o.max_adapters, o.max_sets) == (3, 5)
    for bad in (["--max-loaded-adapters", "0"], ["--max-adapter-sets", "0"]):
        with pytest.raises(ValueError, match="must be positive"):
            cli.ray_options(p.parse_args(["m.gguf", "--replicas", "1", *bad]))
