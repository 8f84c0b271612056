"""The long property-based crash search (tools/llamax_dev/crash_search.py).

    python tools/find_crashes.py -n 2000 [--seed S] [--timeout 120]

Every example runs in its own interpreter; the outcome must be "works" or a
typed LlamaxError.  Prints the outcome counts and every failing spec (JSON,
to re-run with ``python tools/llamax_dev/crash_search.py '<spec>'``)."""
import argparse
import collections
import json
import sys
import time

from hypothesis import HealthCheck, Phase, given, settings

from llamax_dev import crash_search


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=500, help="examples to run")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per example before it counts as a hang")
    args = ap.parse_args()
    counts = collections.Counter()
    failures = []
    t0 = time.time()

    @settings(max_examples=args.n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(spec=crash_search.strategies())
    def search(spec):
        outcome, detail = crash_search.run(spec, timeout=args.timeout)
        counts[outcome] += 1
        if outcome not in ("ok", "typed"):
            failures.append((outcome, detail, spec))
            print(f"FAIL {outcome}: {detail[:300]}\n  spec: {json.dumps(spec)}", flush=True)
        n = sum(counts.values())
        if n % 50 == 0:
            print(f"{n} examples, {dict(counts)}, {time.time() - t0:.0f} s", flush=True)

    if args.seed is not None:
        from hypothesis import seed
        search = seed(args.seed)(search)
    search()
    print(f"done: {sum(counts.values())} examples in {time.time() - t0:.0f} s: {dict(counts)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
