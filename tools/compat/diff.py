"""The same calls on llama-cpp-python 0.3.36 and on llamax, field by field.

    python3 tools/compat/diff.py      # the peer is built once (tools/llamax_dev/peers.py)

Both libraries run tools/llamax_dev/compat_diff_worker.py, the same code: in the
peer's venv with ``import llama_cpp``, in ours with ``import llamax as
llama_cpp``; each a JSON-lines worker, one request per case, the two in
parallel (n_threads=1 each).  Every difference is printed as
``case: field: peer=... llamax=...``.

Writes benchmarks/results/compat_diff.{json,md}, and, from the peer's answers,
tests/compat/diff_reference.json: the fields that don't depend on the CPU's
arithmetic (ids, counts, shapes, key sets, prompt_tokens, exception type
names; not greedy texts, not floats), which tests/compat/test_diff_reference.py
checks llamax against without the peer.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

from llamax_dev import ROOT, data, peers
from llamax_dev import compat_diff_worker as cw

OUT = ROOT / "benchmarks" / "results"
REFERENCE = ROOT / "tests" / "compat" / "diff_reference.json"


def models() -> dict:
    return {"smollm2": str(data.smollm2()), "minilm": str(data.minilm("f16")), "vocab_dir": str(data.vocab_dir()),
            "adapters": cw.adapter_files()}


def stored(fields: dict) -> dict:
    """the fields that go into the reference (no g:, f:, i: prefix)"""
    return {k: v for k, v in fields.items() if not k.startswith(("g:", "f:", "i:"))}


def _close(a, b, tol) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
            return a == b or (math.isnan(a) and math.isnan(b))
        return abs(a - b) <= tol
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    return a == b


def _max_abs(a, b) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) if math.isfinite(a) and math.isfinite(b) else None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        ds = [d for d in (_max_abs(x, y) for x, y in zip(a, b)) if d is not None]
        return max(ds) if ds else None
    return None


_MISSING = "<absent>"


def compare(peer: dict, ours: dict) -> list[dict]:
    """[{field, peer, llamax}] for each field that differs (i: fields are not compared)"""
    diffs = []
    for k in list(peer) + [k for k in ours if k not in peer]:
        if k.startswith("i:"):
            continue
        a, b = peer.get(k, _MISSING), ours.get(k, _MISSING)
        same = _close(a, b, cw.FLOAT_TOL) if k.startswith("f:") else a == b
        if not same:
            d = {"field": k, "peer": a, "llamax": b}
            if k.startswith("f:"):
                d["max_abs_diff"] = _max_abs(a, b)
            diffs.append(d)
    return diffs


def _short(v, n=160) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


class _Both:
    """The two workers, sent each request before either answer is read (they run side by side).
    A worker that dies (a segfault in the library) is the case's answer ({"crashed": ...}) and is
    started again for the next case."""

    def __init__(self, env_models: dict):
        script = cw.__file__
        base = dict(os.environ, LLAMAX_DIFF_MODELS=json.dumps(env_models))
        self._spawn = {
            "peer": lambda: peers.Worker(peers.ensure(), script, env=dict(base, LLAMAX_DIFF_LIB="llama_cpp")),
            "ours": lambda: peers.Worker(sys.executable, script, env=dict(base, LLAMAX_DIFF_LIB="llamax")),
        }
        self.w = {k: spawn() for k, spawn in self._spawn.items()}
        self.info = {k: w.info for k, w in self.w.items()}

    def __call__(self, name: str) -> tuple[dict, dict]:
        for w in self.w.values():
            w.p.stdin.write(json.dumps({"op": "case", "name": name}) + "\n")
        answers = []
        for k, w in self.w.items():
            line = w.p.stdout.readline()
            if not line:
                rc = w.p.wait(60)
                answers.append({"crashed": f"signal {-rc}" if rc < 0 else f"exit {rc}"})
                self.w[k] = self._spawn[k]()
                continue
            out = json.loads(line)
            if "error" in out:  # a bug of the worker itself, not a library's answer
                raise RuntimeError(f"{w.name} ({name}): {out['error']}")
            answers.append(out["fields"])
        return answers[0], answers[1]

    def close(self):
        for w in self.w.values():
            w.close()


def main() -> None:
    t0 = time.perf_counter()
    both = _Both(models())
    print(f"peer: llama_cpp {both.info['peer']['version']}; ours: llamax {both.info['ours']['version']}", flush=True)
    rows = []
    try:
        for name in cw.CASES:
            peer, ours = both(name)
            diffs = compare(peer, ours)
            for d in diffs:
                extra = f" (max |diff| {d['max_abs_diff']:.2e})" if d.get("max_abs_diff") is not None else ""
                print(f"{name}: {d['field']}: peer={_short(d['peer'])} llamax={_short(d['llamax'])}{extra}", flush=True)
            # (the answers without their floats: a differing float field is in diffs)
            rows.append({"case": name, "same": not diffs, "diffs": diffs,
                         "peer": {k: v for k, v in peer.items() if not k.startswith("f:")},
                         "llamax": {k: v for k, v in ours.items() if not k.startswith("f:")}})
    finally:
        both.close()
    n_diff = sum(not r["same"] for r in rows)
    summary = f"{len(rows)} calls, {n_diff} differ"
    print(summary + f" ({time.perf_counter() - t0:.0f} s)")

    OUT.mkdir(exist_ok=True)
    (OUT / "compat_diff.json").write_text(json.dumps(
        {"peer": peers.describe(), "float_tolerance": cw.FLOAT_TOL, "summary": summary, "cases": rows}, indent=1,
        ensure_ascii=False))
    lines = ["# llamax against llama-cpp-python 0.3.36, call by call", "",
             f"{summary}.  The same calls (tools/llamax_dev/compat_diff_worker.py) on both; floats compared "
             f"with tolerance {cw.FLOAT_TOL}.  `g:` fields follow a greedy output, `f:` fields are floats.", "",
             "| case | same | differing fields |", "|---|---|---|"]
    for r in rows:
        fields = "; ".join(f"`{d['field']}`: peer={_short(d['peer'], 60)} llamax={_short(d['llamax'], 60)}"
                           for d in r["diffs"]).replace("|", "\\|")
        lines.append(f"| {r['case']} | {'yes' if r['same'] else '**no**'} | {fields} |")
    (OUT / "compat_diff.md").write_text("\n".join(lines) + "\n")

    ref = {"about": "llama-cpp-python 0.3.36's answers to tools/llamax_dev/compat_diff_worker.py's cases, the "
                    "fields that don't depend on the CPU's arithmetic; written by tools/compat/diff.py, checked by "
                    "tests/compat/test_diff_reference.py",
           "peer": both.info["peer"]["version"],
           "cases": {r["case"]: stored(r["peer"]) for r in rows}}
    # one line per case, so that a change shows as the case's line in a diff
    cases = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in ref["cases"].items())
    head = "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in ref.items() if k != "cases")
    REFERENCE.write_text("{\n" + head + ' "cases": {\n' + cases + "\n }\n}\n")
    print(f"wrote {OUT / 'compat_diff.json'}, {OUT / 'compat_diff.md'}, {REFERENCE}")


if __name__ == "__main__":
    main()
