"""The adapter store's tiers under pressure, and new versions (issue #51):
a server whose disk tier holds four adapters, memory two and the LoRA table
two, asked for six; and a store file replaced while a request runs with
it.  The server runs --deterministic, so an answer is the same whoever
shares its batch: a request that ran through evictions or an update is
compared with the same request run alone."""
from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from llamax import gguf_tools as gt

from .conftest import Server, eos_ban
from .test_adapter_store import metric

# Slow tier (`pytest tests -m slow`; .ci/run runs it): the store's tiers evicting around a running request (~25 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow

N = 6
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("tier-store")
    for i in range(N):
        gt.make_lora(smollm2_path, root / f"a{i}.gguf", rank=8, seed=100 + i, std=0.05)
    gt.make_lora(smollm2_path, root / "v2.bin", rank=8, seed=200, std=0.05)  # the next version of a0, kept aside
    size = (root / "a0.gguf").stat().st_size
    cache = tmp_path_factory.mktemp("tier-cache")
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "4", "--n-ctx", "512", "--metrics", "--deterministic",
                "--adapter-store", root, "--adapter-cache-dir", cache, "--adapter-cache-bytes", str(int(size * 4.5)),
                "--max-loaded-adapters", "2", "--max-lora-slots", "2", "--adapter-store-ttl", "1"])
    yield s, root, cache
    rc = s.stop()
    assert rc == 0, "".join(s.err)[-3000:]
    assert "Traceback" not in "".join(s.err), "".join(s.err)[-3000:]


def complete(c, model, n=8, stream=False, **extra):
    return c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0,
                                           "stream": stream, "logprobs": 1, **extra})


def answer(r) -> tuple:
    """The text and its tokens' logprobs."""
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["text"], tuple(ch["logprobs"]["token_logprobs"])


def streamed(server, model, n, out: dict, started: threading.Event, eos: int):
    """A stream read slowly to its end (so it is still running while the
    main thread makes the tiers evict): its text and finish reason."""
    parts, finish = [], None
    with httpx.Client(base_url=server.url, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": n,
                                                       "temperature": 0, "stream": True,
                                                       "logit_bias": eos_ban(eos)}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"]
                if ch:
                    parts.append(ch[0]["text"])
                    finish = ch[0].get("finish_reason") or finish
                    started.set()
                    time.sleep(0.05)
    out["text"], out["finish"] = "".join(parts), finish


def test_eviction_never_breaks_a_running_request(setup, smollm2_path):
    s, root, cache = setup
    import llamax
    eos = llamax.Model(smollm2_path).token_eos
    with httpx.Client(base_url=s.url, timeout=300) as c:
        alone = answer(complete(c, "a0", n=150, logit_bias=eos_ban(eos)))
        others = {f"a{i}": answer(complete(c, f"a{i}")) for i in range(1, N)}
        assert len(set(others.values())) == N - 1       # six different adapters
        out, started = {}, threading.Event()
        t = threading.Thread(target=streamed, args=(s, "a0", 150, out, started, eos))
        t.start()
        assert started.wait(60)
        # every other adapter, twice over, while a0's stream runs: each tier evicts
        for _ in range(2):
            for i in range(1, N):
                assert answer(complete(c, f"a{i}")) == others[f"a{i}"]
        # a0's disk entry is still there: the running request holds it
        assert t.is_alive(), "the stream ended before the other adapters were asked for: make it longer"
        held = [json.loads((e / "entry.json").read_text())["name"] for e in cache.iterdir()
                if (e / "entry.json").is_file()]
        assert "a0" in held, held
        t.join(300)
        assert out["finish"] == "length" and out["text"] == alone[0]
        m = c.get("/metrics").text
        for tier in ("disk", "memory", "table"):
            assert metric(m, "llamax:adapter_tier_evictions_total", f'{{tier="{tier}"}}') > 0, tier
        assert metric(m, "llamax:adapter_disk_bytes") <= int((root / "a0.gguf").stat().st_size * 4.5)
        assert metric(m, "llamax:adapter_tier_resident", '{tier="memory"}') <= 2
        assert metric(m, "llamax:adapter_tier_resident", '{tier="disk"}') <= 4
        # evicted adapters come back from the store, the same
        for i in range(N):
            assert answer(complete(c, f"a{i}")) == (others.get(f"a{i}") or answer(complete(c, f"a{i}")))


def test_a_new_version_is_picked_up_after_the_ttl(setup, smollm2_path):
    s, root, cache = setup
    import llamax
    eos = llamax.Model(smollm2_path).token_eos
    with httpx.Client(base_url=s.url, timeout=300) as c:
        v1_long = answer(complete(c, "a5", n=60, logit_bias=eos_ban(eos)))
        v1 = answer(complete(c, "a5"))
        out, started = {}, threading.Event()
        t = threading.Thread(target=streamed, args=(s, "a5", 60, out, started, eos))
        t.start()
        assert started.wait(60)
        before = metric(c.get("/metrics").text, "llamax:adapter_store_updates_total")
        shutil.copyfile(root / "v2.bin", root / "a5.gguf.tmp")
        (root / "a5.gguf.tmp").replace(root / "a5.gguf")
        time.sleep(1.2)  # past --adapter-store-ttl
        v2 = answer(complete(c, "a5"))
        assert v2 != v1
        assert metric(c.get("/metrics").text, "llamax:adapter_store_updates_total") == before + 1
        t.join(300)
        assert out["text"] == v1_long[0]    # the running request kept the version it started with
        assert answer(complete(c, "a5")) == v2
