"""llama.cpp's own server test suite (``tools/server/tests`` of the pinned
tree) against ``python -m llamax serve`` -- or against llama-server itself,
for the baseline -- with this project's models in place of the suite's
Hugging Face ones (issue #52 item 5).

    python3 tools/llama_server_suite.py                       # llamax, every file
    python3 tools/llama_server_suite.py --target llama-server # the baseline
    python3 tools/llama_server_suite.py test_completion.py test_basic.py -k props
    python3 tools/llama_server_suite.py --compare A.json B.json  # what differs

How: the suite starts its server as ``$LLAMA_SERVER_BIN_PATH`` with
llama-server's command line.  That is set to a small launcher written here,
which swaps the model (``--hf-repo``/``--hf-file``/``--model``/``--model-url``:
a BERT-family embedding model -> all-MiniLM-L6-v2 f16, anything else ->
SmolLM2-135M-Instruct) and passes every other argument on unchanged: to
``python -m llamax serve`` (which must take llama-server's flags itself) or
to llama-server (built from the same tree by benchmarks/server_peers.py).
The suite's one-off model download (``ServerPreset.load_all``) is skipped:
nothing is fetched.  Tests marked slow are left out, as the suite's CI does.

Prints passed / failed / skipped per file and the totals; ``--json FILE``
keeps every test's outcome, for ``--compare``.  Many of the suite's
assertions are about its tiny test model's own words (``match_regex``): those
fail on both servers with SmolLM2, which is why the number that matters is
the tests that pass on llama-server and fail on llamax (``--compare``).
Needs the suite's own requirements (``requests``, ``wget``, ``filelock``,
``aiohttp``, ``openai``): installed with pip when missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

LAUNCHER = r'''#!{python}
"""llama-server's command line, with this project's models, to {target}."""
import os, sys

args = sys.argv[1:]
repo = file = model = None
rest = []
i = 0
while i < len(args):
    a = args[i]
    if a in ("--hf-repo", "-hf", "-hfr"):
        repo = args[i + 1]; i += 2; continue
    if a in ("--hf-file", "-hff"):
        file = args[i + 1]; i += 2; continue
    if a in ("--model", "-m", "--model-url", "-mu"):
        model = args[i + 1]; i += 2; continue
    rest.append(a)
    i += 1
name = " ".join(x for x in (repo, file, model) if x).lower()
embedding = any(k in name for k in ("bert", "bge", "minilm", "nomic-embed", "jina-embeddings"))
path = {minilm!r} if embedding else {smol!r}
if {target!r} == "llamax":
    cmd = [{python!r}, "-m", "llamax", "serve", path] + rest + {extra!r}
else:
    cmd = [{target!r}, "--model", path] + rest
sys.stdout.flush()
os.execv(cmd[0], cmd)
'''

PLUGIN = '''"""Skips the suite's one-off model download (the launcher swaps models in)."""
import utils

utils.ServerPreset.load_all = staticmethod(lambda: None)
'''

NEEDS = {"requests": "requests", "wget": "wget", "filelock": "filelock", "aiohttp": "aiohttp", "openai": "openai"}


def _ensure_requirements() -> None:
    missing = [pkg for mod, pkg in NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"installing the suite's requirements: {' '.join(missing)}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *missing])


def _llama_server() -> str:
    spec = importlib.util.spec_from_file_location("server_peers", ROOT / "benchmarks" / "server_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.llama_server())


def _suite_dir() -> Path:
    from llamax_dev.buildsys import llama_build
    return llama_build.source_dir() / "tools" / "server" / "tests"


def _outcomes(xml_path: Path) -> dict[str, str]:
    out = {}
    if not xml_path.exists():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out[name] = "failed"
        elif case.find("skipped") is not None:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def run(target: str, files: list[str], k: str | None, timeout: int, extra: tuple = (),
        log: str | None = None) -> dict[str, str]:
    _ensure_requirements()
    from llamax_dev import data
    tests = _suite_dir()
    exe = "llamax" if target == "llamax" else _llama_server()
    work = Path(tempfile.mkdtemp(prefix="llamax-suite-"))
    launcher = work / "llama-server"
    launcher.write_text(LAUNCHER.format(python=sys.executable, target=exe, smol=str(data.smollm2()),
                                        minilm=str(data.minilm("f16")), extra=list(extra)))
    launcher.chmod(0o755)
    (work / "llamax_suite_plugin.py").write_text(PLUGIN)
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(launcher), LLAMA_CACHE=str(work / "cache"),
               PYTHONPATH=os.pathsep.join([str(work), str(tests), os.environ.get("PYTHONPATH", "")]))
    names = files or sorted(p.name for p in (tests / "unit").glob("test_*.py"))
    outcomes: dict[str, str] = {}
    print(f"{'file':34} {'passed':>7} {'failed':>7} {'skipped':>8}", flush=True)
    for name in names:
        xml = work / f"{name}.xml"
        cmd = [sys.executable, "-m", "pytest", f"unit/{name}", "-m", "not slow", "-q", "-p", "llamax_suite_plugin",
               "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "junit_family=xunit1", "--tb=line", "-rf"]
        if k:
            cmd += ["-k", k]
        try:
            out = subprocess.run(cmd, cwd=tests, env=env, timeout=timeout, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True).stdout
            if log:
                with open(log, "a") as f:
                    f.write(f"==== {name}\n{out[-20000:]}\n")
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {timeout} s", flush=True)
        got = _outcomes(xml)
        outcomes.update(got)
        c = {s: sum(1 for v in got.values() if v == s) for s in ("passed", "failed", "skipped")}
        print(f"{name:34} {c['passed']:7} {c['failed']:7} {c['skipped']:8}", flush=True)
    total = {s: sum(1 for v in outcomes.values() if v == s) for s in ("passed", "failed", "skipped")}
    print(f"{'total (' + target + ')':34} {total['passed']:7} {total['failed']:7} {total['skipped']:8}")
    return outcomes


def compare(a_path: str, b_path: str) -> None:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    ta, tb = a["target"], b["target"]
    only_a = sorted(t for t, v in a["tests"].items() if v == "passed" and b["tests"].get(t) == "failed")
    only_b = sorted(t for t, v in b["tests"].items() if v == "passed" and a["tests"].get(t) == "failed")
    print(f"pass on {ta}, fail on {tb}: {len(only_a)}")
    for t in only_a:
        print("  " + t)
    print(f"pass on {tb}, fail on {ta}: {len(only_b)}")
    for t in only_b:
        print("  " + t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="test files of tools/server/tests/unit (default: all)")
    ap.add_argument("--target", default="llamax", help="llamax (default) or llama-server")
    ap.add_argument("-k", help="pytest's -k expression")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per file (default 1800)")
    ap.add_argument("--json", help="write every test's outcome here")
    ap.add_argument("--log", help="append each file's pytest output (failures, one line each) here")
    ap.add_argument("--any-model", action="store_true",
                    help="start llamax with --any-model: the suite's bodies name models the server does not "
                         "have (\"test\", \"gpt-4.1\"), which llamax answers with a 404 unless told otherwise")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="tests that pass on one, fail on the other")
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    if a.target not in ("llamax", "llama-server"):
        ap.error("--target is llamax or llama-server")
    outcomes = run(a.target, a.files, a.k, a.timeout, ("--any-model",) if a.any_model else (), a.log)
    if a.json:
        Path(a.json).write_text(json.dumps({"target": a.target, "tests": outcomes}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
