"""python -m llamax: the demo (the README's main job) and the command list."""
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(*args, timeout=600):
    # cwd away from the repo root, so the installed package is what runs
    return subprocess.run([sys.executable, "-m", "llamax", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(HERE), env=dict(os.environ))


def test_help_lists_commands():
    r = _run("--help")
    assert r.returncode == 0
    assert "demo" in r.stdout and "bench" in r.stdout


def test_bench_needs_a_checkout(tmp_path):
    r = _run("bench", "--repo", str(tmp_path))
    assert r.returncode == 2
    assert "checkout" in r.stderr


def test_demo_runs_three_users_and_checks_the_base_answer():
    r = _run("demo", "--threads", "2", "--max-tokens", "16")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for who in ("user A", "user B", "user C"):
        assert who in out
    assert "shout@1.0" in out and "json@1.0" in out and "none (base model)" in out
    assert "trained for SmolLM2" in out
    # the trained adapters do what they were trained for (on any CPU: these are large effects)
    blocks = out.split("\nuser ")
    a = next(b for b in blocks if b.startswith("A:"))
    b = next(b for b in blocks if b.startswith("B:"))
    c = next(b for b in blocks if b.startswith("C:"))
    assert int(re.search(r"capital letters: (\d+)%", a).group(1)) >= 80
    assert "starts as {\"answer\": ...}: yes" in b and "starts as {\"answer\": ...}: no" in c
    assert "tok/s" in out and "adapter-set swap" in out
    assert "equals a fresh base model's answer: yes" in out
