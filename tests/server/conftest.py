"""Fixtures of the server tests: a real ``python -m llamax serve`` process on
a free loopback port, with the real model and generated adapters.

Two servers for the whole session: ``server`` (open, as most people run it
on their own machine) and ``locked`` (API keys, an admin key, runtime
adapter loading from a folder, a small queue, a short request timeout and a
small body limit).  Tests that stop a server start their own.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest


HERE = Path(__file__).resolve().parent
THREADS = "1"  # the suite's client shares the machine's 2 cores with the server


class Server:
    def __init__(self, args, env=None, command=None):
        # command: the whole argument list after the interpreter (python -m llamax.server's settings)
        cmd = [sys.executable, *map(str, command)] if command is not None else \
            [sys.executable, "-m", "llamax", "serve", *map(str, args), "--port", "0", "--threads", THREADS]
        e = dict(os.environ)
        e.update(env or {})
        # cwd away from the repo root: `-m` puts cwd first on sys.path
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                                     cwd=str(HERE), start_new_session=True)
        self.lines: list[str] = []
        self.url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.kill()
            out, err = self.proc.communicate(timeout=30)
            raise RuntimeError(f"the server did not start: {''.join(self.lines)}{out}\n{err}")
        # keep draining stderr so that the server never blocks on a full pipe
        self.err: list[str] = []
        self._readers = [threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True),
                         threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)]
        for t in self._readers:
            t.start()

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the server did not stop within {timeout} s of {sig!r}")
            finally:
                self._close_pipes()
        return self.proc.returncode

    def _close_pipes(self):
        for t in self._readers:
            t.join(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture(scope="session")
def server(smollm2_path, adapters):
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "4", "--n-ctx", "1024",
                "--lora", f"coder={adapters['coder']}", "--lora", adapters["writer"],
                "--control-vector", f"calm={adapters['calm']}", "--metrics"])
    yield s
    s.stop()


ADMIN = "admin-secret"
KEYS = ("user-key-1", "user-key-2")


@pytest.fixture(scope="session")
def locked(smollm2_path, adapters):
    s = Server([smollm2_path, "--alias", "smol", "--parallel", "2", "--n-ctx", "2048", "--max-queue", "1",
                "--api-key", KEYS[0], "--admin-api-key", ADMIN, "--allow-runtime-lora",
                "--lora-dir", adapters["lora_dir"], "--request-timeout", "4", "--max-body-bytes", "65536"],
               env={"LLAMAX_API_KEY": KEYS[1]})
    yield s
    s.stop()


@pytest.fixture
def served_models():
    """What GET /v1/models lists on ``server``."""
    return {"smol", "coder", "writer"}


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture
def oai(server):
    # closed after the test: a client left to the garbage collector leaves its
    # pooled socket open, a ResourceWarning (an error here) whenever gc finds it
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def eos_ban(model_eos: int) -> dict:
    """logit_bias that keeps a generation going (for cancellation tests)."""
    return {str(model_eos): -100.0}
