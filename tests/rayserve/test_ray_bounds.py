"""What one request may make the Ray path hold (issue #30, item 7), without
a cluster: the ingress' per-request adapter cap and its bounded table of
multiplexed ids, a replica's cap on loaded adapters (its Llama's own LRU:
least recently used idle ones unloaded, a bounded wait while running
requests hold them all), and the command line that sets them."""
from __future__ import annotations

import argparse
import asyncio
import pickle

import pytest

pytest.importorskip("ray.serve")

import llamax  # noqa: E402

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


def _engine(smollm2_path, paths, max_adapters=2):
    """A replica's engine (what LlamaReplica does with the typed calls,
    without Ray) over a real Llama with at most ``max_adapters`` loaded."""
    import llamax
    reports = []
    llm = llamax.Llama(str(smollm2_path), n_ctx=256, n_threads=1, n_parallel=2, max_loaded_adapters=max_adapters)
    eng = ray_replica.ReplicaEngine(llm, lambda name, loaded: reports.append((name, loaded)))
    eng.apply({"id": ("e", 1), "paths": {n: str(p) for n, p in paths.items()}, "ids": {}, "default_set": []})
    return eng, reports


def _request(llm, *names, max_tokens=2):
    import llamax
    return llamax.GenerationRequest(tokens=llm.tokenize(b"Once upon a time"),
                                    sampling=llamax.SamplingParams(temperature=0.0),
                                    adapters=llamax.AdapterSet.of([{"name": n} for n in names]),
                                    max_tokens=max_tokens)


@pytest.fixture(scope="module")
def four_adapters(gen_dir, smollm2_path):
    from llamax import gguf_tools as gt
    d = gen_dir / "bounds"
    d.mkdir(exist_ok=True)
    return {n: gt.make_lora(smollm2_path, d / f"{n}.gguf", rank=2, seed=60 + i) for i, n in enumerate("abcd")}


def test_replica_keeps_at_most_max_adapters_loaded(smollm2_path, four_adapters):
    """The replica's Llama loads a set's adapters on demand and, past its
    cap, unloads the least recently used one no running request holds; the
    registry hears of every load and unload."""
    eng, reports = _engine(smollm2_path, four_adapters, max_adapters=2)
    llm = eng.llm
    try:
        def loaded():
            return {e["name"] for e in llm.list_loras() if e["loaded"]}

        for key in ("a", "b", "a", "c"):   # c: b is the least recently used idle adapter
            res = asyncio.run(eng.result(pickle.loads(pickle.dumps(_request(llm, key)))))
            assert isinstance(res, llamax.Result) and len(res.tokens) == 2
            assert len(loaded()) <= 2
        assert loaded() == {"a", "c"} and eng.held == {"a", "c"}
        assert reports == [("a", True), ("b", True), ("c", True), ("b", False)]
        # a running request's adapter is not unloaded to make room
        held, release = eng.submit(_request(llm, "d"))   # pinned until it ends (or is closed)
        assert loaded() == {"c", "d"}
        res = asyncio.run(eng.result(_request(llm, "a")))
        assert isinstance(res, llamax.Result) and loaded() == {"a", "d"}
        held.close()
        release()
        # the registry's table drops an adapter: unloaded here too
        eng.apply({"id": ("e", 2), "paths": {n: str(four_adapters[n]) for n in "abc"}, "ids": {}, "default_set": []})
        assert loaded() == {"a"} and reports[-1] == ("d", False)
        assert asyncio.run(eng.result(_request(llm, "d")))["error"][0] == 404
    finally:
        llm.close()


def test_replica_waits_a_bounded_time_then_503(smollm2_path, four_adapters, monkeypatch):
    import llamax.adapters
    monkeypatch.setattr(llamax.adapters.AdapterRegistry, "make_room_timeout", 0.2)
    eng, _ = _engine(smollm2_path, four_adapters, max_adapters=1)
    llm = eng.llm
    try:
        held, release = eng.submit(_request(llm, "a"))
        err = asyncio.run(eng.result(_request(llm, "b")))["error"]
        status, message, _, code, headers = err
        assert (status, code, headers) == (503, "adapters_busy", {"Retry-After": "1"})
        assert "--max-loaded-adapters" in message and "retry later" in message
        assert {e["name"] for e in llm.list_loras() if e["loaded"]} == {"a"}
        # a set over the cap is refused before anything loads
        err = asyncio.run(eng.result(_request(llm, "b", "c")))["error"]
        assert err[0] == 400 and "max_loaded_adapters=1" in err[1]
        held.close()
        release()
        assert isinstance(asyncio.run(eng.result(_request(llm, "b"))), llamax.Result)
    finally:
        llm.close()


def test_replica_events_are_the_local_engines(smollm2_path, four_adapters):
    """What a replica streams back is what Llama.submit gives in process:
    the same Text events and Result, for a request that travelled by pickle."""
    eng, _ = _engine(smollm2_path, four_adapters)
    llm = eng.llm
    try:
        req = _request(llm, "a", max_tokens=8)

        async def relay():
            return [ev async for batch in eng.events(pickle.loads(pickle.dumps(req))) for ev in batch]

        evs = asyncio.run(relay())
        want = llm.submit(req).result()
        assert isinstance(evs[-1], llamax.Result) and evs[-1].tokens == want.tokens
        assert "".join(e.text for e in evs[:-1]) == want.text
        bad = asyncio.run(_collect(eng, _request(llm, "zz")))
        assert len(bad) == 1 and bad[0]["error"][0] == 404
    finally:
        llm.close()


def _collect(eng, req):
    async def go():
        return [item async for item in eng.events(req)]
    return go()


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
