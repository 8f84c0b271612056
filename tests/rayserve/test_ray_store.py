"""Adapters from a store on Ray Serve (issue #51 item 4): a Ray cluster of
two nodes on this machine (Ray's own multi-node test cluster), two replicas,
one per node, and the store on a real S3-compatible server process on
loopback (moto's server mode).  The ingress looks names up; each replica
fetches what it runs into its own disk tier; requests for one adapter go
where it is held, and spill to the other replica when that one is busy."""
from __future__ import annotations

import asyncio
import json
import logging
import os

import httpx
import pytest

from llamax import gguf_tools as gt

from .conftest import free_port
from server.test_adapter_store_s3 import AWS, Moto

# Slow tier (`pytest tests -m slow`; .ci/run runs it): a two-node Ray cluster (~60 s).
pytestmark = pytest.mark.slow

NAMES = ["a0", "a1", "a2"]


@pytest.fixture(scope="module")
def cluster(smollm2_path, gen_dir, tmp_path_factory):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from llamax.server.ray import RayOptions, ServerConfig, deploy

    moto = Moto()
    saved = {k: os.environ.get(k) for k in [*AWS, "AWS_ENDPOINT_URL"]}
    # (the nodes' processes, and so the replicas, inherit the AWS configuration)
    os.environ.update(AWS, AWS_ENDPOINT_URL=moto.url)
    c = None
    try:
        d = gen_dir / "ray-store"
        d.mkdir(exist_ok=True)
        s3 = moto.client()
        s3.create_bucket(Bucket="shared")
        for i, n in enumerate(NAMES):
            s3.upload_file(str(gt.make_lora(smollm2_path, d / f"{n}.gguf", rank=4, seed=70 + i, std=0.05)),
                           "shared", f"adapters/{n}.gguf")
        s3.put_object(Bucket="shared", Key="adapters/corrupt.gguf", Body=b"GGUF" + b"\1" * 3000)
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        c.add_node(num_cpus=1)
        ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        cache = tmp_path_factory.mktemp("ray-store-cache")
        cfg = ServerConfig(model=str(smollm2_path), alias="smol", parallel=2, n_ctx=512, threads=1, max_queue=16,
                           adapter_store="s3://shared/adapters", adapter_cache_dir=str(cache),
                           adapter_store_ttl=3600)
        deploy(cfg, RayOptions(replicas=2, max_sets=2, max_adapters=2, replica_cpus=1))
        yield f"http://127.0.0.1:{port}", cache
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            if c is not None:
                c.shutdown()
            moto.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def ask(c, model, n=4):
    return c.post("/v1/completions", json={"model": model, "prompt": "The capital of France is", "max_tokens": n,
                                           "temperature": 0, "logprobs": 1})


def held_by(cache) -> dict[str, set[str]]:
    """replica -> the adapters in its disk tier."""
    out: dict[str, set[str]] = {}
    for r in cache.iterdir():
        out[r.name.removeprefix("replica-")] = {json.loads((e / "entry.json").read_text())["name"]
                                                for e in r.iterdir() if (e / "entry.json").is_file()}
    return out


def test_each_replica_fetches_what_it_runs_into_its_own_disk_tier(cluster):
    url, cache = cluster
    with httpx.Client(base_url=url, timeout=120) as c:
        base = ask(c, "smol").json()["choices"][0]["logprobs"]["token_logprobs"]
        served: dict[str, set[str]] = {}
        for n in NAMES:
            r = ask(c, n)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["logprobs"]["token_logprobs"] != base
            served.setdefault(r.headers["x-llamax-replica"], set()).add(n)
        disks = held_by(cache)
        for replica, names in served.items():
            assert names <= disks.get(replica, set()), (served, disks)
        # by adapter, not only by whole set: a set whose adapters one replica
        # holds (in sets of their own) goes there (3 adapters on 2 replicas:
        # one holds two of them)
        replica, pair = next((r, sorted(ns)[:2]) for r, ns in served.items() if len(ns) >= 2)
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                                                "active_loras": [{"name": n, "scale": 0.5} for n in pair]})
            assert r.status_code == 200, r.text
            assert r.headers["x-llamax-replica"] == replica, (pair, served)
        assert ask(c, "nope").status_code == 404
        r = ask(c, "corrupt")
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_invalid", r.text
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert {"a0", "a1", "a2", "corrupt"} <= set(ids)


def test_a_hot_adapter_spills_to_another_replica(cluster):
    """Many concurrent requests for one adapter: more than one replica
    serves it (Ray's router sends the adapter's requests where it is held
    while that replica has room), each fetching it into its own disk tier."""
    url, cache = cluster

    async def many():
        async with httpx.AsyncClient(base_url=url, timeout=300) as ac:
            return await asyncio.gather(*[ac.post("/v1/completions", json={
                "model": "a1", "prompt": f"Story {i}:", "max_tokens": 24, "temperature": 0}) for i in range(12)])

    rs = asyncio.run(many())
    assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200][:2]
    replicas = {r.headers["x-llamax-replica"] for r in rs}
    assert len(replicas) == 2, replicas
    disks = held_by(cache)
    assert all("a1" in disks[r] for r in replicas), disks
