"""Nothing fetched runs before its hash is checked (issue #30, item 10), and
what runs is pinned.

Everything goes through ``pip download --require-hashes``: wheels with
``--only-binary :all:``; the sdist with ``--no-build-isolation`` and its
build backend's pinned wheels on ``PYTHONPATH`` (pip prepares an sdist's
metadata, i.e. runs its backend, after the hash matched; left to itself it
would first install the backend's unpinned requirements).  Here against a
package index on loopback (PEP 503 HTML and PEP 691 JSON), with a sdist
whose build backend leaves a mark, saying where it was imported from,
when anything runs it."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from llamax import _fetch


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wheel(path: Path, name: str, files: dict[str, str]) -> Path:
    di = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    return path / f"{name}-1.0-py3-none-any.whl"


@pytest.fixture
def pkgs(tmp_path):
    """A sdist whose build backend (the ``markbackend`` wheel) writes to
    ``ran`` where it was imported from, and which also asks for
    ``unpinned`` (on the index too); a plain wheel."""
    src = tmp_path / "src" / "evilpkg-1.0"
    src.mkdir(parents=True)
    ran = tmp_path / "ran"
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["markbackend", "unpinned"]\n'
                                        'build-backend = "markbackend"\n')
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: evilpkg\nVersion: 1.0\n")
    files = tmp_path / "files"
    files.mkdir()
    with tarfile.open(files / "evilpkg-1.0.tar.gz", "w:gz") as tf:
        tf.add(src, arcname="evilpkg-1.0")
    backend = _wheel(files, "markbackend", {"markbackend.py": (
        f"import os\nopen({str(ran)!r}, 'a').write(os.path.dirname(os.path.abspath(__file__)) + ' '\n"
        "                   + os.environ.get('LLAMAX_TEST_MARK', '-') + '\\n')\n"
        "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
        "def prepare_metadata_for_build_wheel(d, config_settings=None):\n"
        "    di = os.path.join(d, 'evilpkg-1.0.dist-info'); os.makedirs(di)\n"
        "    open(os.path.join(di, 'METADATA'), 'w').write('Metadata-Version: 2.1\\nName: evilpkg\\nVersion: 1.0\\n')\n"
        "    return 'evilpkg-1.0.dist-info'\n")})
    unpinned = _wheel(files, "unpinned", {"unpinned.py": ""})
    wheel = _wheel(files, "goodwheel", {"goodwheel/__init__.py": ""})
    return {"dir": files, "ran": ran, "sdist": files / "evilpkg-1.0.tar.gz", "wheel": wheel,
            "backend": [("markbackend==1.0", backend.name, _sha(backend))], "unpinned": unpinned}


class _Index:
    """A package index on loopback: /simple/<project>/ (HTML, or JSON when
    ``json_api``), /files/<name>; ``hashes`` are what the pages list."""

    def __init__(self, files: Path, json_api=False, hashes=True):
        self.files, self.json_api, self.hashes = files, json_api, hashes
        self.requests: list[tuple[str, str | None]] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Authorization")))
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2:
                    names = [p.name for p in index.files.iterdir()
                             if p.name.replace("_", "-").startswith(parts[1] + "-")]
                    if not names:
                        return self._send(404, b"", "text/plain")
                    return self._page(names, "json" in (self.headers.get("Accept") or ""))
                if parts[0] == "files" and len(parts) == 2 and (index.files / parts[1]).is_file():
                    return self._send(200, (index.files / parts[1]).read_bytes(), "application/octet-stream")
                self._send(404, b"", "text/plain")

            def _page(self, names, wants_json):
                if index.json_api and wants_json:
                    body = {"meta": {"api-version": "1.0"}, "name": "x", "files": [
                        {"filename": n, "url": f"../../files/{n}",
                         "hashes": {"sha256": index.sha(n)} if index.hashes else {}} for n in names]}
                    return self._send(200, json.dumps(body).encode(), "application/vnd.pypi.simple.v1+json")
                links = "".join(f'<a href="/files/{n}' + (f'#sha256={index.sha(n)}' if index.hashes else "")
                                + f'">{n}</a>\n' for n in names)
                self._send(200, f"<html><body>{links}</body></html>".encode(), "text/html")

            def _send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.listed: dict[str, str] = {}

    def sha(self, name: str) -> str:
        return self.listed.get(name) or _sha(self.files / name)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def index(pkgs):
    made = []

    def make(**kw):
        made.append(_Index(pkgs["dir"], **kw))
        return made[-1]
    yield make
    for i in made:
        i.close()


@pytest.fixture
def pip_env(tmp_path, monkeypatch):
    """pip configured through the environment only (no pip.conf), as a user would."""
    monkeypatch.setenv("LLAMAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _left_in_cache(tmp_path) -> list[str]:
    dl = tmp_path / "cache" / "dl"
    return sorted(p.name for p in dl.iterdir()) if dl.is_dir() else []


# -- the sdist: pip download with its pinned backend -------------------------------------------

@pytest.mark.parametrize("json_api", [False, True], ids=["pep503-html", "pep691-json"])
def test_sdist_through_pip_with_its_pinned_backend_only(tmp_path, pkgs, index, pip_env, json_api):
    idx = index(json_api=json_api)
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    got = _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", _sha(pkgs["sdist"]), sdist=True,
                              backend=pkgs["backend"], backend_env={"LLAMAX_TEST_MARK": "seen"}, progress=False)
    assert got == tmp_path / "cache" / "dl" / "evilpkg-1.0.tar.gz"
    assert got.read_bytes() == pkgs["sdist"].read_bytes()
    # the backend ran (pip prepared the metadata), from the pinned wheel unpacked in the cache's temp folder
    ran = [line.split() for line in pkgs["ran"].read_text().splitlines()]
    assert ran and all(Path(r).parent.parent == tmp_path / "cache" / "dl" and mark == "seen" for r, mark in ran), ran
    assert "/simple/unpinned/" not in [p for p, _ in idx.requests]   # no build isolation: nothing unpinned
    assert _left_in_cache(tmp_path) == sorted(["evilpkg-1.0.tar.gz", pkgs["backend"][0][1]])
    # cached now: no pip, no backend
    os.unlink(pkgs["ran"])
    idx.requests.clear()
    assert _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", _sha(pkgs["sdist"]), sdist=True,
                               backend=pkgs["backend"], progress=False) == got
    assert idx.requests == [] and not pkgs["ran"].exists()


def test_sdist_with_other_bytes_is_refused_before_its_backend_runs(tmp_path, pkgs, index, pip_env):
    pin = "0" * 64
    idx = index(hashes=False)   # the page lists no hash: pip fetches the bytes, then refuses them
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    with pytest.raises(_fetch.FetchError) as e:
        _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", pin, sdist=True, backend=pkgs["backend"],
                            progress=False, instead="do something else")
    msg = str(e.value)
    assert f"sha256 {_sha(pkgs['sdist'])}, not the pinned {pin} (pip refused it)" in msg
    assert "do something else" in msg and str(tmp_path / "cache" / "dl") in msg
    assert "/files/evilpkg-1.0.tar.gz" in [p for p, _ in idx.requests]
    assert not pkgs["ran"].exists(), "the backend ran on unverified bytes"
    assert _left_in_cache(tmp_path) == [pkgs["backend"][0][1]]


def test_a_backend_with_other_bytes_stops_before_the_sdist(tmp_path, pkgs, index, pip_env):
    idx = index()
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    (req, name, _), = pkgs["backend"]
    with pytest.raises(_fetch.FetchError, match="pip refused it"):
        _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", _sha(pkgs["sdist"]), sdist=True,
                            backend=[(req, name, "3" * 64)], progress=False)
    assert "/files/evilpkg-1.0.tar.gz" not in [p for p, _ in idx.requests]
    assert not pkgs["ran"].exists() and _left_in_cache(tmp_path) == []


def test_an_sdist_needs_its_backend_pinned(tmp_path, pkgs, pip_env):
    with pytest.raises(ValueError, match="build backend pinned"):
        _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", _sha(pkgs["sdist"]), sdist=True, progress=False)
    assert _left_in_cache(tmp_path) == []


# -- wheels: pip in hash-checking mode, binaries only -------------------------------------------

def test_wheel_through_pip_with_the_pinned_hash(tmp_path, pkgs, index, pip_env):
    idx = index()
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    pin = _sha(pkgs["wheel"])
    got = _fetch.pip_download("goodwheel==1.0", pkgs["wheel"].name, pin, progress=False)
    assert got.read_bytes() == pkgs["wheel"].read_bytes() and _left_in_cache(tmp_path) == [pkgs["wheel"].name]
    os.unlink(got)
    with pytest.raises(_fetch.FetchError) as e:
        _fetch.pip_download("goodwheel==1.0", pkgs["wheel"].name, "2" * 64, progress=False)
    assert f"has sha256 {pin}, not the pinned {'2' * 64} (pip refused it)" in str(e.value)
    assert _left_in_cache(tmp_path) == []


def test_a_wheel_fetch_never_falls_back_to_building_an_sdist(tmp_path, pkgs, index, pip_env):
    idx = index()
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    with pytest.raises(_fetch.FetchError):
        _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0-py3-none-any.whl", _sha(pkgs["sdist"]), progress=False)
    assert not pkgs["ran"].exists() and _left_in_cache(tmp_path) == []
    assert "/files/evilpkg-1.0.tar.gz" not in [p for p, _ in idx.requests]
