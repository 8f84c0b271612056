"""The Ray Serve application on a local Ray cluster (``ray.init(num_cpus=2)``):
two replicas of SmolLM2, at most two adapter sets (and two adapters loaded) each, the server tests'
adapters and control vector plus five tenant adapters (t0..t4).

One cluster for the module that uses it (about 20 s to start and stop on
two cores); the tests in it are few and bounded in time.
"""
from __future__ import annotations

import contextlib
import logging
import socket

import pytest

from llamax import gguf_tools as gt
from server.conftest import http, oai  # noqa: F401  (the server tests' clients, on ``server`` below)

TENANTS = [f"t{i}" for i in range(5)]
REPLICAS = 2
MAX_SETS = 2


class RayServer:
    def __init__(self, url: str, cfg):
        self.url = url
        self.cfg = cfg

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve():
    """A local Ray cluster (2 CPUs) with Serve on a free loopback port; the
    port.  Shut down on exit."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(smollm2_path, adapters, gen_dir):
    from llamax.server.ray import RayOptions, ServerConfig, deploy

    d = gen_dir / "ray"
    d.mkdir(exist_ok=True)
    tenants = [(n, str(gt.make_lora(smollm2_path, d / f"{n}.gguf", rank=4, seed=40 + i, std=0.05)))
               for i, n in enumerate(TENANTS)]
    with local_serve() as port:
        cfg = ServerConfig(model=str(smollm2_path), alias="smol", parallel=4, n_ctx=1024, threads=1,
                           loras=[("coder", str(adapters["coder"])), ("writer", str(adapters["writer"])), *tenants],
                           control_vectors=[("calm", str(adapters["calm"]))])
        deploy(cfg, RayOptions(replicas=REPLICAS, max_sets=MAX_SETS, max_adapters=MAX_SETS))
        yield RayServer(f"http://127.0.0.1:{port}", cfg)


# the names the server tests' fixtures have, so that their checks run here too

@pytest.fixture(scope="module")
def server(ray_server):
    return ray_server


@pytest.fixture
def served_models():
    return {"smol", "coder", "writer", *TENANTS}
