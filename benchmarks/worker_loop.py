"""The JSON-lines loop of the benchmark workers (peer_worker.py, st_worker.py,
ort_worker.py), which run in other venvs: standard library only.  The
worker's script folder is on sys.path, so they import it by name."""
import json
import sys


def serve(ready: dict, ops: dict) -> None:
    """Print `ready` (with "ready": true), then answer each request on stdin
    with ops[request["op"]](request), one JSON line each; an exception is
    answered as {"error": ...} and the orchestrator decides."""
    print(json.dumps({"ready": True, **ready}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = ops[req.get("op", "embed")](req)
        except Exception as e:  # reported, the orchestrator decides
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
