"""``python -m llamax.server``: llamax's server with llama-cpp-python's server
settings (``--model``, ``--n_ctx``, ``--config_file`` with several models;
see :mod:`llamax.server.settings`).  ``python -m llamax serve`` takes
llamax's own flags."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from llamax.server.settings import parse
    try:
        cfgs = parse(argv)
    except (ValueError, OSError) as e:
        print(f"python -m llamax.server: {e}", file=sys.stderr)
        return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"python -m llamax.server needs the server extra ({e.name} is missing): pip install 'llamax[server]'",
              file=sys.stderr)
        return 2
    from llamax.server.run import serve_backend
    if len(cfgs) == 1:
        from llamax.server.backends.local import LocalBackend
        return serve_backend(LocalBackend(cfgs[0]))
    from llamax.server.backends.multi import MultiBackend
    return serve_backend(MultiBackend(cfgs))


if __name__ == "__main__":
    sys.exit(main())
