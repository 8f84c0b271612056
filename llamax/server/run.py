"""Run the server: uvicorn on the app, the model loaded in a thread while
``/health`` says 503, one line on stdout when it is ready, clean stops on
SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import uvicorn

from llamax.server.app import build_app
from llamax.server.backends.local import LocalBackend
from llamax.server.config import ServerConfig


async def _announce(server: uvicorn.Server, backend, cfg: ServerConfig) -> None:
    while not (server.started and backend.loaded.is_set()):
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    if backend.load_error is not None:   # (not llm is None: --sleep-idle-seconds may have let it go already)
        print(f"llamax: the model failed to load: {backend.load_error}", file=sys.stderr, flush=True)
        server.should_exit = True
        return
    port = cfg.port
    for s in server.servers:
        for sock in s.sockets:
            port = sock.getsockname()[1]
            break
    what, how = backend.summary()
    hosts = hosts_of(cfg.host)
    first = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]
    also = "".join(f", also on {h}" for h in hosts[1:])
    print(f"llamax: {what} at http://{first}:{port}/v1 ({how}{also})", flush=True)


def hosts_of(host: str) -> list[str]:
    """``--host``: one address, or several, comma-separated (llama-server's
    list); an IPv6 address with or without brackets."""
    return [h.strip().strip("[]") for h in host.split(",") if h.strip()]


def listen(hosts: list[str], port: int) -> list[socket.socket]:
    """Sockets listening on each address, on one port (port 0: the first
    one's free port, then that one everywhere)."""
    out: list[socket.socket] = []
    try:
        for h in hosts:
            family = socket.AF_INET6 if ":" in h else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((h, port))
            port = s.getsockname()[1]
            s.listen(2048)
            s.set_inheritable(True)
    except OSError:
        for s in out:
            s.close()
        raise
    return out


def _reload(tenancy) -> None:
    """SIGHUP: read the tenants file again (a bad one is logged, the old one kept)."""
    try:
        n = tenancy.reload()
    except ValueError as e:
        print(f"llamax: the tenants file was not reloaded (the old one stays): {e}", file=sys.stderr, flush=True)
    else:
        print(f"llamax: tenants reloaded ({n})", flush=True)


def serve(cfg: ServerConfig) -> int:
    """``python -m llamax serve``: one model (LocalBackend) on uvicorn until SIGINT/SIGTERM."""
    return serve_backend(LocalBackend(cfg))


def serve_backend(backend) -> int:
    """Serve ``backend`` (its ``cfg`` says where and how) until SIGINT/SIGTERM."""
    cfg = backend.cfg
    app = build_app(backend)
    if not cfg.verbose:
        logging.getLogger("llamax").setLevel(logging.WARNING)
    ucfg = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="info" if cfg.verbose else "warning",
                          access_log=cfg.verbose, timeout_graceful_shutdown=cfg.shutdown_timeout,
                          lifespan="on")
    server = uvicorn.Server(ucfg)
    hosts = hosts_of(cfg.host)
    socks = None
    if len(hosts) > 1:
        try:
            socks = listen(hosts, cfg.port)
        except OSError as e:
            print(f"llamax: cannot listen on {cfg.host} port {cfg.port}: {e.strerror or e}", file=sys.stderr,
                  flush=True)
            return 1

    async def main():
        tenancy = app.state.tenancy
        if tenancy.path is not None and hasattr(signal, "SIGHUP"):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload, tenancy)
        watch = asyncio.ensure_future(_announce(server, backend, cfg))
        try:
            await server.serve(sockets=socks)
        finally:
            watch.cancel()

    # uvicorn re-raises the signal that stopped it once it has shut down
    # gracefully, through the handler that was there before it: make that
    # one quiet, so that a clean stop exits with status 0
    stops = []
    previous = {sig: signal.signal(sig, lambda s, f: stops.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:  # uvicorn[standard]'s loop when it is there (uvloop)
            import uvloop
            run = uvloop.run
        except ImportError:
            run = asyncio.run
        run(main())
    finally:
        if app.state.tenancy.usage_log is not None:
            app.state.tenancy.usage_log.close()
        for sig, h in previous.items():
            signal.signal(sig, h)
    if backend.load_error is not None:
        return 1
    if stops:
        print(f"llamax: stopped ({signal.Signals(stops[0]).name})", flush=True)
    return 0 if server.started else 1
