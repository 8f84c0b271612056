"""The README's two commands are what CI runs, verbatim, and they work from
the root of a checkout (the way every newcomer runs them)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _command(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1]
    m = re.search(r"```bash\n(.+?)\n```", section, re.S)
    assert m, f"no bash block under '## {heading}'"
    lines = m.group(1).strip().splitlines()
    assert len(lines) == 1, f"the README's '{heading}' command should be one line: {lines}"
    return lines[0]


def test_ci_runs_both_readme_commands_verbatim():
    main = _command("Install and run (set-up + main job)")
    tests = _command("Test (set-up + tests)")
    assert main.endswith("python3 -m llamax demo") and tests.endswith("pytest tests")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert main in ci and tests in ci
    assert ci.index(main) < ci.index(tests)


def test_llamax_imports_from_the_checkout_root():
    """``python -m llamax`` from the root imports the source folder: the
    README's install must leave it complete (the compiled extension in place)."""
    r = subprocess.run([sys.executable, "-c", "import llamax, llamax._core, sys; print(llamax.__file__)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == (ROOT / "llamax" / "__init__.py").resolve()


def test_help_from_the_checkout_root():
    r = subprocess.run([sys.executable, "-m", "llamax", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "demo" in r.stdout


def test_source_folder_without_extension_says_what_to_do(tmp_path):
    """A copy of the source folder without the compiled extension (what a
    plain ``pip install .`` leaves in the checkout) raises an ImportError that
    names the fix, not a bare ModuleNotFoundError."""
    import shutil
    pkg = tmp_path / "llamax"
    shutil.copytree(ROOT / "llamax", pkg, ignore=shutil.ignore_patterns("*.so", "*.cpp", "__pycache__"))
    # -S: no site-packages (nor an editable install's finder), only this folder
    r = subprocess.run([sys.executable, "-S", "-c", "import llamax"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert "ImportError" in r.stderr and "pip install -e ." in r.stderr, r.stderr
