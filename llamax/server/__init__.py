"""llamax's OpenAI-compatible server (``pip install "llamax[server]"``,
``python -m llamax serve MODEL.gguf``; docs/server.md).

The layers, each importing only from those before it (tests/test_layers.py
holds them to it):

- ``config`` (options; standard library only), ``protocol`` (request
  bodies), ``errors`` (exceptions to HTTP), ``files`` (runtime loads'
  file checks);
- ``http`` (JSON answers, error handlers, API keys, body limit),
  ``translate`` (bodies to ``Llama.prepare_*`` keywords), ``adapters``
  (the adapter table), ``streaming`` (answers and SSE, ``n`` merged),
  ``metrics`` (Prometheus text), ``settings`` (llama-cpp-python's server
  settings and config file, for ``python -m llamax.server``);
- ``routes`` (the one route table; its backend comes from ``app.state``),
  ``app`` (``build_app``);
- ``backends.local`` (one model in this process), ``backends.multi``
  (several, chosen by ``model``) and ``backends.ray``
  (registry, replica, ingress: a replica runs the local app, the ingress
  is the routes' backend at the front);
- ``run`` (uvicorn), ``ray`` (deploy on Ray Serve), ``cli`` (``python -m
  llamax serve``), ``__main__`` (``python -m llamax.server``).

``ServerConfig``, ``LocalBackend`` and ``build_app`` are importable from
here (loaded on first use, so ``python -m llamax --help`` needs no extra).
"""
from __future__ import annotations

__all__ = ["ServerConfig", "LocalBackend", "build_app"]


def __getattr__(name: str):
    if name == "ServerConfig":
        from llamax.server.config import ServerConfig
        return ServerConfig
    if name == "LocalBackend":
        from llamax.server.backends.local import LocalBackend
        return LocalBackend
    if name == "build_app":
        from llamax.server.app import build_app
        return build_app
    raise AttributeError(f"module 'llamax.server' has no attribute {name!r}")
