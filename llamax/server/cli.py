"""``python -m llamax serve MODEL.gguf [options]``.

Imports only the standard library until it runs, so ``python -m llamax
--help`` works without the ``server`` extra."""
from __future__ import annotations

import sys

from llamax.server.config import add_arguments, ray_options, server_config

__all__ = ["add_arguments", "run"]


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"python -m llamax serve needs the server extra ({e.name} is missing): "
              "pip install 'llamax[server]'", file=sys.stderr)
        return 2
    opts = None
    try:
        cfg = server_config(args)
        if args.replicas is not None and cfg.sleep_idle_seconds is not None:
            raise ValueError("--sleep-idle-seconds is for the single-process server (Ray Serve scales replicas "
                             "itself)")
        if args.replicas is not None and "," in cfg.host:
            raise ValueError("--host with several addresses is for the single-process server (Ray Serve's proxy "
                             "listens on one)")
        if args.replicas is None and args.ray_address:
            raise ValueError("--ray-address needs --replicas")
        if args.replicas is None and args.max_adapter_sets is not None:
            raise ValueError("--max-adapter-sets needs --replicas")
        if args.replicas is not None:
            try:
                from ray import serve as _  # noqa: F401
            except ImportError:
                print("python -m llamax serve --replicas needs the ray extra: pip install 'llamax[ray]'",
                      file=sys.stderr)
                return 2
            opts = ray_options(args)
    except ValueError as e:
        print(f"python -m llamax serve: {e}", file=sys.stderr)
        return 2
    if opts is None:
        from llamax.server.run import serve
        return serve(cfg)
    from llamax.server.ray import run as run_ray
    return run_ray(cfg, opts, args.ray_address)
