"""The JSON-lines loop of the workers (benchmarks/peer_worker.py, st_worker.py,
ort_worker.py; compat_diff_worker.py), which run in other venvs: standard
library only.  peers.Worker puts tools/ on their PYTHONPATH, so they import
it as llamax_dev.worker_loop."""
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
