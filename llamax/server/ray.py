"""llamax on Ray Serve: the OpenAI-compatible server as three deployments,
with adapter affinity across replicas.

- :class:`AdapterDirectory` (one replica, ``backends/ray/registry.py``): the application's adapter table
  (name → id, path on storage every node sees), the default set, and which
  replica holds what.  Registered once for the whole application; every
  other deployment reads it, so replicas can't drift apart.
- :class:`LlamaReplica` (``--replicas`` of them, ``backends/ray/replica.py``): one ``llamax.Llama``,
  the engine: the ingress calls it with a typed ``llamax.GenerationRequest``
  and it streams back ``llamax.Text``/``llamax.Result`` events.  Every
  registered adapter is registered with its Llama, which loads one the
  first time a request names it and keeps at most ``max_adapters`` loaded
  (its own LRU: an adapter a running request holds is never the one
  unloaded).  An adapter set is also Ray Serve's "multiplexed model", so
  that Ray's router sends a set where it is loaded (``max_sets`` keys per
  replica).
- :class:`Ingress` (one replica, ``backends/ray/ingress.py``): the single-process
  server's serving code (auth, parsing, adapters, tenants, admission, OpenAI
  shaping) over a vocabulary-only front Llama that tokenizes and renders
  the chat template, and submits each request to a replica
  (``Llama(engine=RemoteEngine)``); the model and adapter routes; the
  canonical key of each request's adapter set, sent as the multiplexed
  model id (a set naming more than ``max_adapters`` adapters is refused
  here, before any replica loads anything).  Ray's router then sends the
  request to a replica that holds the set; requests for the base model
  carry none and spread over all replicas.  The answer carries
  ``x-llamax-replica``.

The key is the set's adapter *names* (``coder`` or ``coder+translator``),
not their scales: a scale is a per-request number that costs nothing to
change, while memory is per adapter, so ``coder@0.5`` and ``coder@1`` are
one multiplexed model.

Ray keeps some state per multiplexed model id (the router's fallback
table, a gauge series per replica), for as long as it runs: only the first
``max_affinity_sets`` distinct sets get an id; later ones are served
without affinity (whichever replica gets one loads its adapters on demand).

Needs the ``ray`` extra: ``pip install "llamax[ray]"``.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from ray import serve

from llamax import usable_cores
from llamax.server.backends.ray.ingress import REPLICA_HEADER, Ingress
from llamax.server.backends.ray.registry import AdapterDirectory
from llamax.server.backends.ray.replica import LlamaReplica
from llamax.server.config import RayOptions, ServerConfig, add_arguments, ray_options, server_config

__all__ = ["RayOptions", "ServerConfig", "build", "app_builder", "deploy", "run", "APP_NAME", "REPLICA_HEADER"]

APP_NAME = "llamax"


def build(cfg: ServerConfig, opts: RayOptions):
    """The Ray Serve application (deploy it with ``serve.run``)."""
    if opts.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if opts.max_sets < 1:
        raise ValueError("--max-adapter-sets must be at least 1")
    if opts.max_adapters < 1:
        raise ValueError("--max-loaded-adapters must be at least 1")
    if opts.max_affinity_sets < 1:
        raise ValueError("max_affinity_sets must be at least 1")
    public = dataclasses.asdict(cfg)
    # a replica serves what the ingress has checked: no keys, no body limit
    # of its own, its adapters from the registry, loaded by Ray's multiplexing
    threads = cfg.threads or max(1, usable_cores() // opts.replicas)
    if sum(1 for v in cfg.lora_scales.values() if v != 0.0) > opts.max_adapters:
        raise ValueError(f"--lora-scaled puts {len(cfg.lora_scales)} adapters in the default set but "
                         f"--max-loaded-adapters is {opts.max_adapters}")
    inner = dict(public, api_keys=[], admin_api_keys=[], allow_runtime_lora=False, lora_dir=None, loras=[],
                 lora_scales={}, max_loaded_adapters=None, metrics=False, max_body_bytes=1 << 62, threads=threads,
                 tenants=None, usage_log=None)  # (tenants: the ingress' file; each request's tenant is passed on)
    registry = AdapterDirectory.bind(list(cfg.loras), [{"name": n, "scale": s} for n, s in cfg.lora_scales.items()
                                                      if s != 0.0])
    ongoing = opts.max_ongoing_requests or cfg.n_contexts * cfg.parallel + cfg.max_queue
    # past the running requests, --max-queue wait at the ingress (then 503
    # queue_full), as in the single-process server, not an unbounded queue
    # by adapter: a set's holders while they have a free sequence, then the least loaded replica
    router = {}
    if opts.affinity:
        from ray.serve.config import RequestRouterConfig
        router["request_router_config"] = RequestRouterConfig(
            request_router_class="llamax.server.backends.ray.router:AdapterRouter",
            request_router_kwargs={"saturation": cfg.n_contexts * cfg.parallel})
    replica = serve.deployment(LlamaReplica, name="LlamaReplica", num_replicas=opts.replicas,
                               max_ongoing_requests=ongoing, max_queued_requests=max(1, cfg.max_queue),
                               ray_actor_options={"num_cpus": opts.replica_cpus}, **router).bind(
                                   inner, registry, opts.max_sets, opts.max_adapters)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(public, registry, replica, opts.affinity, max_adapters=opts.max_adapters,
                        max_affinity_sets=opts.max_affinity_sets)


def app_builder(args: dict):
    """An application builder for ``serve run`` and Serve config files: the
    options of ``python -m llamax serve``, by their long names
    (``serve run llamax.server.ray:app_builder model=/shared/smol.gguf
    replicas=4 lora=coder=/shared/coder.gguf``; in a config file's
    ``args``, a repeatable option may be a list).  Serve's own
    ``http_options`` say where it listens, not ``host``/``port``."""
    import argparse

    args = dict(args)
    if "model" not in args:
        raise ValueError("app_builder needs model=PATH (a path every node can read)")
    argv = [str(args.pop("model"))]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        for item in (v if isinstance(v, list) else [v]):
            if item is True or (isinstance(item, str) and item.lower() == "true" and k in _SWITCHES):
                argv.append(flag)
            elif item is False or (isinstance(item, str) and item.lower() == "false" and k in _SWITCHES):
                continue
            else:
                argv += [flag, str(item)]
    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(f"llamax.server.ray:app_builder: {message}")

    p = Parser(prog="llamax.server.ray:app_builder")
    add_arguments(p)
    ns = p.parse_args(argv)
    return build(server_config(ns), ray_options(ns))


_SWITCHES = {"allow_runtime_lora", "metrics", "verbose"}


def deploy(cfg: ServerConfig, opts: RayOptions, *, name: str = APP_NAME) -> None:
    """Deploy on the connected Ray cluster (with Serve's HTTP proxy
    started); returns once every replica has loaded the model and checked
    every registered adapter against it (a bad file stops the start)."""
    serve.run(build(cfg, opts), name=name, route_prefix="/")


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(cfg: ServerConfig, opts: RayOptions, address: str | None = None) -> int:
    """``python -m llamax serve MODEL --replicas R``: start a local Ray
    cluster (or join ``address``), deploy, print the URL, and take
    everything down again on SIGINT/SIGTERM."""
    import signal
    import sys
    import threading

    import ray

    port = cfg.port or _free_port(cfg.host)
    quiet = not cfg.verbose
    if address:
        ray.init(address=address, log_to_driver=not quiet, logging_level=logging.WARNING if quiet else logging.INFO)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, int(opts.replicas * opts.replica_cpus + 0.999)),
                 include_dashboard=False, log_to_driver=not quiet,
                 logging_level=logging.WARNING if quiet else logging.INFO)
    stop = threading.Event()
    got = []

    def on_signal(sig, frame):
        got.append(sig)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        serve.start(http_options={"host": cfg.host, "port": port},
                    logging_config={"log_level": "INFO" if cfg.verbose else "WARNING",
                                    "enable_access_log": cfg.verbose})
        if not stop.is_set():
            deploy(cfg, opts)
            print(f"llamax: serving {cfg.alias!r} at http://{cfg.host}:{port}/v1 (Ray Serve: {opts.replicas} "
                  f"replica(s) x {cfg.n_contexts} context(s) x {cfg.parallel} sequences, at most "
                  f"{opts.max_adapters} adapter(s) in {opts.max_sets} set(s) per replica, {len(cfg.loras)} "
                  "adapter(s))", flush=True)
            stop.wait()
    except Exception as e:
        print(f"llamax: the Ray Serve application failed to start: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        try:
            if address:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
            for s, h in previous.items():
                signal.signal(s, h)
    if got and code == 0:
        print(f"llamax: stopped ({signal.Signals(got[0]).name})", flush=True)
    return code
