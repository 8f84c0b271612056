"""llama-cpp-python's own tests (tests/compat/), run against llama-cpp-python
0.3.36 itself and against llamax, on the same local models: what the peer
passes here, and whether llamax passes the same.

    python3 tools/compat/peer_tests.py      # builds the peer once (tools/llamax_dev/peers.py)

Writes benchmarks/results/compat.{json,md}: each test's outcome on both.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from llamax_dev import ROOT, data, peers

OUT = ROOT / "benchmarks" / "results"
# llama-cpp-python's own test files (the folder's other tests are llamax's)
COPIED = ["test_llama.py", "test_llama_chat_format.py", "test_llama_grammar.py", "test_llama_speculative.py"]


def _outcomes(python: str, env: dict) -> dict[str, str]:
    """Run tests/compat under `python`; {test id: passed|failed|skipped (reason)}."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir", str(ROOT / "tests" / "compat"),
               "-o", "filterwarnings=", f"--junitxml={xml}"] + [str(ROOT / "tests" / "compat" / f) for f in COPIED]
        subprocess.run(cmd, cwd=ROOT, env=env, timeout=1800)
        out = {}
        for case in ET.parse(xml).iter("testcase"):
            tid = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                el = case.find("failure") if case.find("failure") is not None else case.find("error")
                out[tid] = "failed: " + (el.get("message") or "")[:160]
            elif case.find("skipped") is not None:
                out[tid] = "skipped: " + (case.find("skipped").get("message") or "")[:160]
            else:
                out[tid] = "passed"
        return out


def main() -> None:
    py = peers.ensure()
    subprocess.check_call([str(py), "-m", "pip", "install", "-q", "pytest>=7", "scipy>=1.10"])
    models = {"smollm2": str(data.smollm2()), "minilm": str(data.minilm("f16")), "mamba": str(data.tiny_mamba()),
              "vocab_dir": str(data.vocab_dir())}
    base = dict(os.environ, LLAMAX_COMPAT_MODELS=json.dumps(models), PYTHONPATH=str(ROOT / "tests"))
    base.pop("LLAMAX_COMPAT_PEER", None)
    peer = _outcomes(str(py), dict(base, LLAMAX_COMPAT_PEER="1"))
    ours = _outcomes(sys.executable, base)
    rows = []
    for tid in sorted(set(peer) | set(ours)):
        rows.append({"test": tid, "llama-cpp-python": peer.get(tid, "absent"), "llamax": ours.get(tid, "absent")})
    OUT.mkdir(exist_ok=True)
    (OUT / "compat.json").write_text(json.dumps({"peer": peers.describe(), "tests": rows}, indent=1))
    n_peer = sum(r["llama-cpp-python"] == "passed" for r in rows)
    n_both = sum(r["llama-cpp-python"] == "passed" and r["llamax"] == "passed" for r in rows)
    lines = [f"llama-cpp-python 0.3.36's tests on local models: the peer passes {n_peer}, llamax passes "
             f"{n_both} of those (and {sum(r['llamax'] == 'passed' for r in rows)} in all).", "",
             "| test | llama-cpp-python | llamax |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['test']} | {r['llama-cpp-python']} | {r['llamax']} |")
    (OUT / "compat.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
