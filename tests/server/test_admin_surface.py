"""What the server reads for an admin and what it tells everyone else
(issue #30, items 8 and 11): runtime loads open their file once, inside
--lora-dir, and llama.cpp reads that descriptor (a name swapped under a load
can't make it read another file); paths and load errors are for admin keys.
Real servers on loopback, real clients."""
from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
import uvicorn

import llamax
from llamax.server import LocalBackend, ServerConfig, build_app
from llamax.server.errors import APIError
from llamax.server.files import open_inside

from .conftest import ADMIN, KEYS, Server
from .test_http import CHAT, err

A = {"Authorization": f"Bearer {ADMIN}"}
U = {"Authorization": f"Bearer {KEYS[0]}"}


def load(c: httpx.Client, path, name="x", **kw) -> httpx.Response:
    # json.dumps escapes what UTF-8 can't carry (a lone surrogate arrives as \\ud800)
    body = json.dumps({"lora_name": name, "lora_path": str(path), **kw})
    return c.post("/v1/load_lora_adapter", content=body, headers={**A, "Content-Type": "application/json"})


def lp(c: httpx.Client, model: str) -> dict:
    """SmolLM2's top-20 logprobs for one token under ``model`` (an adapter's name)."""
    body = dict(CHAT, model=model, logprobs=True, top_logprobs=20, max_tokens=1, cache_prompt=False)
    r = c.post("/v1/chat/completions", json=body, headers=A)
    assert r.status_code == 200, r.text
    return {a["token"]: a["logprob"] for a in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


@pytest.fixture
def own_dir(tmp_path, adapters):
    """A --lora-dir of this test's own: the runtime adapter (a hard link), and
    outside it the coder adapter, which loads fine on this model too."""
    d = tmp_path / "loras"
    d.mkdir()
    os.link(adapters["runtime"], d / "runtime.gguf")
    return d


def serve(smollm2_path, lora_dir, *extra) -> Server:
    return Server([smollm2_path, "--alias", "smol", "--parallel", "1", "--n-ctx", "512",
                   "--api-key", KEYS[0], "--admin-api-key", ADMIN, "--allow-runtime-lora",
                   "--lora-dir", lora_dir, *extra])


def open_fds(pid: int, under) -> list[str]:
    """The files below ``under`` that process ``pid`` holds open."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)):
            out.append(target)
    return out


# -- item 8: what a runtime load may name --------------------------------------------------------

@pytest.mark.parametrize("path, code, why", [
    ("runtime\x00.gguf", "invalid_path", "NUL"),
    ("\x00", "invalid_path", "NUL"),
    ("a" * 5000, "invalid_path", "longer"),
    ("runtime.gguf\ud800", "invalid_request", "unicode"),   # refused by the body's model already
])
def test_bad_path_text_is_a_400_naming_the_field(locked, path, code, why):
    """A NUL byte used to be a 500 (ValueError from realpath)."""
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        body = err(load(c, path), 400, code)
        assert body["param"] == "lora_path" and why in body["message"], body
        assert body["type"] == "invalid_request_error"


def test_refused_paths(smollm2_path, adapters, own_dir, tmp_path):
    os.symlink(own_dir / "runtime.gguf", own_dir / "inside-link.gguf")   # points inside: still refused
    (own_dir / "dir.gguf").mkdir()
    os.mkfifo(own_dir / "pipe.gguf")                                      # opening must not wait for a writer
    (own_dir / "real").mkdir()
    os.link(adapters["runtime"], own_dir / "real" / "a.gguf")
    os.symlink(own_dir / "real", own_dir / "linked")                      # a symlinked folder on the way
    s = serve(smollm2_path, own_dir)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for p in ("inside-link.gguf", "linked/a.gguf", own_dir / "linked" / "a.gguf"):
                body = err(load(c, p), 400, "path_not_allowed")
                assert "symbolic link" in body["message"] and body["param"] == "lora_path", body
            for p in ("../loras/runtime.gguf", "real/../runtime.gguf", tmp_path / "elsewhere.gguf", "/"):
                err(load(c, p), 400, "path_not_allowed")
            t0 = time.monotonic()
            for p in ("dir.gguf", "pipe.gguf", ".", str(own_dir)):
                err(load(c, p), 400, "invalid_path")
            assert time.monotonic() - t0 < 10
            err(load(c, "real/missing.gguf"), 404, "file_not_found")
            err(load(c, "runtime.gguf/x"), 404, "file_not_found")
            # what is allowed: relative, absolute by the folder as given, nested
            assert load(c, "runtime.gguf", "r1").status_code == 200
            assert load(c, own_dir / "runtime.gguf", "r2").status_code == 200
            assert load(c, "./real//a.gguf", "r3").status_code == 200
            paths = {e["name"]: e["path"] for e in c.get("/lora-adapters", headers=A).json()}
            assert paths == {"r1": str(own_dir / "runtime.gguf"), "r2": str(own_dir / "runtime.gguf"),
                             "r3": str(own_dir / "real" / "a.gguf")}
            assert open_fds(s.proc.pid, own_dir) == []   # loaded, and the descriptors closed
            # a load's error names the file as the request did, not /proc/self/fd/N
            (own_dir / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 300)
            body = err(load(c, "junk.gguf"), 400)
            assert "/proc/" not in body["message"] and body["param"] == "lora_path", body
    finally:
        assert s.stop() == 0


@pytest.mark.slow  # slow tier: a race, run for seconds
def test_a_name_swapped_during_loads_never_reads_outside(smollm2_path, adapters, own_dir):
    """While loads run, another thread keeps replacing the name with a symlink
    to an adapter outside the folder (which would load fine) and back.  Each
    load is refused (it met the symlink) or has the inside file's effect."""
    name = own_dir / "race.gguf"
    os.link(adapters["runtime"], name)
    s = serve(smollm2_path, own_dir)
    stop = threading.Event()

    def swap():
        i = 0
        while not stop.is_set():
            tmp = own_dir / f".swap{i % 2}"
            if i % 2:
                os.link(adapters["runtime"], tmp)
            else:
                os.symlink(adapters["coder"], tmp)
            os.replace(tmp, name)
            i += 1
            time.sleep(0.0005)

    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert load(c, adapters["lora_dir"] / "runtime.gguf", "ref").status_code == 400  # another folder
            assert load(c, "runtime.gguf", "inside").status_code == 200
            inside = lp(c, "inside")
            t = threading.Thread(target=swap, daemon=True)
            t.start()
            outcomes = {}
            try:
                for i in range(30):
                    r = load(c, "race.gguf", f"race{i}")
                    code = r.status_code if r.status_code == 200 else r.json()["error"]["code"]
                    outcomes[code] = outcomes.get(code, 0) + 1
                    if r.status_code == 200:
                        assert lp(c, f"race{i}") == inside, f"load {i} read another file"
                    else:
                        assert code in ("path_not_allowed", "file_not_found"), r.text
            finally:
                stop.set()
                t.join()
            assert outcomes.get(200, 0) > 0, outcomes   # the race was run, not only refused
    finally:
        assert s.stop() == 0


def test_on_demand_loads_read_the_descriptor_held_since_the_load(smollm2_path, adapters, own_dir):
    """--max-loaded-adapters: an adapter loaded at runtime is read again when
    a request needs it after eviction, from the descriptor opened at the load
    (held while it is registered, closed when it is unloaded)."""
    s = serve(smollm2_path, own_dir, "--max-loaded-adapters", "1")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert load(c, "runtime.gguf", "rt").status_code == 200
            assert load(c, "runtime.gguf", "other").status_code == 200
            first = lp(c, "rt")
            assert open_fds(s.proc.pid, own_dir) == [str(own_dir / "runtime.gguf")] * 2
            # the name now points outside: "rt" is evicted by "other", then loaded again
            os.replace(own_dir / "runtime.gguf", own_dir / "moved.gguf")
            os.symlink(adapters["coder"], own_dir / "runtime.gguf")
            lp(c, "other")
            listing = {e["name"]: e["loaded"] for e in c.get("/lora-adapters", headers=A).json()}
            assert listing == {"rt": False, "other": True}
            assert lp(c, "rt") == first
            for n in ("rt", "other"):
                assert c.post("/v1/unload_lora_adapter", json={"lora_name": n}, headers=A).status_code == 200
            assert open_fds(s.proc.pid, own_dir) == []
    finally:
        assert s.stop() == 0


def test_open_inside_reads_the_opened_file_whatever_the_name_says(model, adapters, own_dir):
    """The building block, in-process: after the name is replaced by a symlink
    out of the folder, the opened descriptor's path still loads the inside
    file (the foreign adapter outside would fail against this model)."""
    os.symlink(adapters["foreign"], own_dir / "foreign-link.gguf")
    with pytest.raises(llamax.LlamaxError):
        llamax.LoraAdapter(model, own_dir / "foreign-link.gguf").close()   # by name: the foreign file
    f = open_inside(str(own_dir), "runtime.gguf", param="lora_path")
    with f:
        os.replace(own_dir / "foreign-link.gguf", own_dir / "runtime.gguf")
        assert f.path == f"/proc/self/fd/{f.fd}" and f.unchanged()
        a = llamax.LoraAdapter(model, f.path)   # the inside file, through the descriptor
        a.close()
    assert f.fd == -1
    with pytest.raises(APIError) as e:
        open_inside(str(own_dir), "runtime.gguf", param="lora_path")
    assert e.value.code == "path_not_allowed"


# -- item 11: what a user key sees ---------------------------------------------------------------

def _mentions(obj, needles) -> list[str]:
    text = json.dumps(obj)
    return [n for n in needles if n in text]


def test_paths_are_for_admin_keys(locked, adapters, smollm2_path):
    secrets = [str(adapters["lora_dir"]), os.path.dirname(smollm2_path), "/proc/"]
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        assert load(c, "runtime.gguf", "seen").status_code == 200
        try:
            for headers in (U, {"X-Api-Key": KEYS[1]}):
                models = c.get("/v1/models", headers=headers).json()
                assert _mentions(models, secrets) == [], models
                cards = {m["id"]: m for m in models["data"]}
                assert cards["smol"]["root"] == "smol" and cards["seen"]["root"] == "seen"
                card = c.get("/v1/models/seen", headers=headers).json()
                assert card["root"] == "seen" and _mentions(card, secrets) == []
                listing = c.get("/lora-adapters", headers=headers).json()
                assert [e["name"] for e in listing] == ["seen"] and "path" not in listing[0]
            models = c.get("/v1/models", headers=A).json()
            cards = {m["id"]: m for m in models["data"]}
            assert cards["smol"]["root"] == str(smollm2_path)
            assert cards["seen"]["root"] == str(adapters["lora_dir"] / "runtime.gguf")
            assert c.get("/lora-adapters", headers=A).json()[0]["path"] == str(adapters["lora_dir"] / "runtime.gguf")
        finally:
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "seen"}, headers=A).status_code == 200


def test_open_server_shows_no_paths(http, adapters, smollm2_path):
    """No keys at all: nobody presents an admin key, so nobody sees paths."""
    models = http.get("/v1/models").json()
    assert _mentions(models, [str(adapters["coder"]), str(smollm2_path)]) == [], models
    assert all("path" not in e for e in http.get("/lora-adapters").json())


class _InThread:
    """build_app on uvicorn in a thread, on a free loopback port."""

    def __init__(self, engine: LocalBackend):
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


def test_health_says_only_that_loading_failed(tmp_path, caplog):
    secret = tmp_path / "secret-folder"
    secret.mkdir()
    bad = secret / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    cfg = ServerConfig(model=str(bad), alias="m", api_keys=[KEYS[0]], admin_api_keys=[ADMIN], threads=1)
    engine = LocalBackend(cfg)
    with caplog.at_level("ERROR", logger="llamax.server"):
        engine.load()
    assert engine.llm is None
    assert any("failed to load" in r.getMessage() and str(bad) in r.getMessage() for r in caplog.records)
    srv = _InThread(engine)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for headers in ({}, U):
                for route in ("/health", "/v1/models"):
                    r = c.get(route, headers=headers)
                    if route != "/health" and not headers:
                        err(r, 401)
                        continue
                    body = err(r, 503, "load_failed")
                    assert "secret-folder" not in r.text and "model.gguf" not in r.text, r.text
                    assert body["message"].startswith("the model failed to load"), body
            for route in ("/health", "/v1/models"):
                body = err(c.get(route, headers=A), 503, "load_failed")
                assert str(bad) in body["message"], body   # the admin key gets the reason
    finally:
        srv.stop()
