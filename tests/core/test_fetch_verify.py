"""Nothing fetched runs before its hash is checked (issue #30, item 10).

Wheels go through ``pip download --only-binary :all: --require-hashes``; the
sdist is fetched by URL from where pip would look (pip's own ``pip download``
would run its build backend).  Here against a package index on loopback
(PEP 503 HTML and PEP 691 JSON) and find-links folders, with a sdist whose
build backend leaves a mark when anything runs it."""
from __future__ import annotations

import base64
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


@pytest.fixture
def pkgs(tmp_path):
    """A sdist whose build backend writes ``ran`` when imported, and a wheel."""
    src = tmp_path / "src" / "evilpkg-1.0"
    src.mkdir(parents=True)
    ran = tmp_path / "ran"
    (src / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                        'backend-path = ["."]\n')
    (src / "backend.py").write_text(
        f"open({str(ran)!r}, 'a').write('imported\\n')\n"
        "import os\n"
        "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
        "def prepare_metadata_for_build_wheel(d, config_settings=None):\n"
        "    di = os.path.join(d, 'evilpkg-1.0.dist-info'); os.makedirs(di)\n"
        "    open(os.path.join(di, 'METADATA'), 'w').write('Metadata-Version: 2.1\\nName: evilpkg\\nVersion: 1.0\\n')\n"
        "    return 'evilpkg-1.0.dist-info'\n")
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: evilpkg\nVersion: 1.0\n")
    files = tmp_path / "files"
    files.mkdir()
    with tarfile.open(files / "evilpkg-1.0.tar.gz", "w:gz") as tf:
        tf.add(src, arcname="evilpkg-1.0")
    di = "goodwheel-1.0.dist-info"
    with zipfile.ZipFile(files / "goodwheel-1.0-py3-none-any.whl", "w") as z:
        z.writestr("goodwheel/__init__.py", "")
        z.writestr(f"{di}/METADATA", "Metadata-Version: 2.1\nName: goodwheel\nVersion: 1.0\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    return {"dir": files, "ran": ran, "sdist": files / "evilpkg-1.0.tar.gz",
            "wheel": files / "goodwheel-1.0-py3-none-any.whl"}


class _Index:
    """A package index on loopback: /simple/<project>/ (HTML, or JSON when
    ``json_api``), /files/<name>; ``hashes`` are what the pages list."""

    def __init__(self, files: Path, json_api=False, hashes=True, auth=None):
        self.files, self.json_api, self.hashes, self.auth = files, json_api, hashes, auth
        self.requests: list[tuple[str, str | None]] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Authorization")))
                if index.auth and self.headers.get("Authorization") != index.auth:
                    return self._send(401, b"", "text/plain")
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


# -- the sdist: by URL, never through pip's metadata step -----------------------------------------

@pytest.mark.parametrize("json_api", [False, True], ids=["pep503-html", "pep691-json"])
def test_sdist_fetched_by_url_and_its_backend_never_runs(tmp_path, pkgs, index, pip_env, json_api):
    idx = index(json_api=json_api)
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    got = _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", _sha(pkgs["sdist"]), sdist=True, progress=False)
    assert got == tmp_path / "cache" / "dl" / "evilpkg-1.0.tar.gz"
    assert got.read_bytes() == pkgs["sdist"].read_bytes()
    assert not pkgs["ran"].exists(), "the sdist's build backend ran"
    assert [p for p, _ in idx.requests] == ["/simple/evilpkg/", "/files/evilpkg-1.0.tar.gz"]
    assert _left_in_cache(tmp_path) == ["evilpkg-1.0.tar.gz"]


def test_what_pip_download_would_have_done(tmp_path, pkgs, index, pip_env):
    """Why the sdist does not go through pip: pip download, even in hash
    mode with the right hash, prepares the sdist's metadata, i.e. runs its
    build backend (pip 23-25).  If this ever fails, pip stopped doing it."""
    idx = index()
    req = tmp_path / "req.txt"
    req.write_text(f"evilpkg==1.0 --hash=sha256:{_sha(pkgs['sdist'])}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--no-binary",
                        ":all:", "-r", str(req), "-d", str(tmp_path / "pip-out"), "--index-url", idx.url + "/simple"],
                       capture_output=True, text=True, timeout=300, env=_fetch._pip_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert pkgs["ran"].exists()


def test_sdist_with_other_bytes_is_refused_and_not_kept(tmp_path, pkgs, index, pip_env):
    pin = "0" * 64
    idx = index(hashes=False)   # the page lists no hash: the bytes are fetched, then refused
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    with pytest.raises(_fetch.FetchError) as e:
        _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", pin, sdist=True, progress=False,
                            instead="do something else")
    msg = str(e.value)
    assert f"sha256 {_sha(pkgs['sdist'])}, not the pinned {pin}" in msg and "do something else" in msg
    assert str(tmp_path / "cache" / "dl") in msg
    assert _left_in_cache(tmp_path) == [] and not pkgs["ran"].exists()


def test_an_index_that_lists_another_hash_is_not_downloaded_from(tmp_path, pkgs, index, pip_env):
    idx = index(json_api=True)
    idx.listed["evilpkg-1.0.tar.gz"] = "f" * 64
    pip_env.setenv("PIP_INDEX_URL", idx.url + "/simple")
    with pytest.raises(_fetch.FetchError, match="the index lists sha256 f{64}"):
        _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", _sha(pkgs["sdist"]), sdist=True, progress=False)
    assert [p for p, _ in idx.requests] == ["/simple/evilpkg/"]


def test_find_links_extra_indexes_and_unreachable_ones(tmp_path, pkgs, index, pip_env):
    """find-links folders first; an index without the project (404) or
    unreachable does not stop the next one; credentials in an index URL are
    sent, and never printed."""
    pin = _sha(pkgs["sdist"])
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", f"{tmp_path / 'nothing-here'} {pkgs['dir']}")
    assert _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", pin, sdist=True, progress=False).is_file()
    os.unlink(tmp_path / "cache" / "dl" / "evilpkg-1.0.tar.gz")

    pip_env.delenv("PIP_NO_INDEX")
    pip_env.delenv("PIP_FIND_LINKS")
    empty = tmp_path / "empty-files"
    empty.mkdir()
    no_project = _Index(empty)
    token = "Basic " + base64.b64encode(b"me:s3cret").decode()
    private = index(auth=token)
    try:
        dead = f"http://127.0.0.1:{_free_port()}/simple"
        pip_env.setenv("PIP_INDEX_URL", no_project.url + "/simple")
        pip_env.setenv("PIP_EXTRA_INDEX_URL", f"{dead} {private.url.replace('//', '//me:s3cret@')}/simple")
        got = _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", pin, sdist=True, progress=False)
        assert got.read_bytes() == pkgs["sdist"].read_bytes()
        assert {a for _, a in private.requests} == {token}
        # failing: the message names what was tried, without the password
        os.unlink(got)
        with pytest.raises(_fetch.FetchError) as e:
            _fetch.pip_download("evilpkg==1.0", "evilpkg-1.0.tar.gz", "1" * 64, sdist=True, progress=False)
        assert "s3cret" not in str(e.value) and dead in str(e.value)
    finally:
        no_project.close()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pip_settings_merge_as_pip_does(tmp_path, pip_env):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://global.invalid/simple\nfind-links = /a /b\ntimeout = 7\n"
                    "[download]\nindex-url = http://download.invalid/simple\n"
                    "[install]\nindex-url = http://install.invalid/simple\n")
    pip_env.setenv("PIP_CONFIG_FILE", str(conf))
    s = _fetch.pip_settings()
    assert s["index-url"] == "http://download.invalid/simple" and s["find-links"] == "/a /b" and s["timeout"] == "7"
    pip_env.setenv("PIP_INDEX_URL", "http://env.invalid/simple")
    assert _fetch.pip_settings()["index-url"] == "http://env.invalid/simple"


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
