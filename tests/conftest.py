"""Shared fixtures: real models and files, fetched and cached once (tests/data.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import data  # noqa: E402

import llamax  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path():
    return data.smollm2()


@pytest.fixture(scope="session")
def model(smollm2_path):
    m = llamax.Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture
def ctx(model):
    c = llamax.Context(model, n_ctx=512, n_batch=512, n_threads=2)
    yield c
    c.close()


@pytest.fixture(scope="session")
def gen_dir(tmp_path_factory):
    """Generated adapters / control vectors / tiny models for this session."""
    return tmp_path_factory.mktemp("gen")


@pytest.fixture(scope="session")
def lora_paths(gen_dir, smollm2_path):
    from llamax import gguf_tools as gt
    return {
        "a": gt.make_lora(smollm2_path, gen_dir / "lora_a.gguf", rank=4, seed=1),
        "b": gt.make_lora(smollm2_path, gen_dir / "lora_b.gguf", rank=8, seed=2, targets=("attn_q", "ffn_up")),
    }


def run_py(code, timeout=300):
    """Run `code` in a fresh interpreter (crash-prone cases: a crash fails the
    test, not the run).  Returns the CompletedProcess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    # cwd away from the repo root: `python -c` puts cwd first on sys.path, and the
    # source folder llamax/ (without a built extension) must not shadow the
    # installed package
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=str(HERE / "core"))


def greedy(model, **kw):
    return llamax.Sampler(model, temperature=0.0, **kw)


def logits_after(ctx, tokens):
    ctx.kv_clear()
    ctx.decode(tokens, logits="all")
    return np.array(ctx.get_logits())
