"""The batcher's per-step decisions as plain data (csrc/batch_plan.h): which
state group runs, and which tokens go into the decode.  Their unit tests
(tests/core/batch_plan_test.cpp) need no model and no llama.cpp: they are
built here with the C++ compiler that built the extension, and run."""
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cxx() -> list[str]:
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shlex.split(cxx)


def test_batch_plan_unit_tests(tmp_path):
    exe = tmp_path / "batch_plan_test"
    build = subprocess.run([*_cxx(), "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}",
                            str(ROOT / "tests/core/batch_plan_test.cpp"), str(ROOT / "csrc/batch_plan.cpp"),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr + run.stdout
    assert run.stdout.strip().endswith("0 failed") and not run.stderr


def test_the_batcher_decides_through_them():
    """Batcher::step calls the two functions, and no copy of their logic
    stays in it (the round robin's and the prompt order's own lines)."""
    src = (ROOT / "csrc/batcher.cpp").read_text()
    step = src[src.index("void Batcher::step("):src.index("bool Batcher::decode(")]
    assert "plan::pick_group(" in step and "plan::compose_batch(" in step
    for gone in ("stable_sort", "quantum_left", "% n_slots_", "prompt_step_ tokens"):
        assert gone not in step, gone
