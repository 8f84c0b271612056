"""Leak cycles: resident memory after a warm-up must not grow by 1% or more
over many create/free cycles, and objects must be freed when their last
reference goes, without close() and without the garbage collector.

Each cycle runs in a fresh interpreter.  CI runs short cycles; the full
counts of the issue (200 model loads, 2,000 LoRA loads, 20,000 control-vector
set/clear, 1,000 Llama create/close, 10,000 requests) run with
LLAMAX_LEAK_SCALE=1 (tools/hardening_long.sh).
"""
import json
import os
import textwrap

import pytest

from conftest import run_py

# Slow tier (`pytest tests -m slow`; .ci/run runs it): leak cycles (~1.5 min).
pytestmark = pytest.mark.slow

SCALE = float(os.environ.get("LLAMAX_LEAK_SCALE", "0.05"))

PRE = textwrap.dedent(r'''
    import ctypes, gc, json, os, sys, weakref
    import numpy as np
    import llamax
    from llamax import gguf_tools as gt
    from llamax_dev import data  # run_py puts tools/ on PYTHONPATH
    SMOL = str(data.smollm2())
    WORK = os.environ["LEAK_DIR"]
    libc = ctypes.CDLL("libc.so.6")

    def rss_kib():
        gc.collect()
        libc.malloc_trim(0)  # freed heap goes back to the OS: what stays is live
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    def cycles(fn, n, warm):
        for _ in range(warm):
            fn()
        r0 = rss_kib()
        for _ in range(n):
            fn()
        r1 = rss_kib()
        print("LEAK-RESULT " + json.dumps({"n": n, "rss0_kib": r0, "rss1_kib": r1,
                                          "growth": (r1 - r0) / r0}))
''')

CYCLES = {
    "model_load_close": (200, '''
        def fn():
            llamax.Model(SMOL).close()
        cycles(fn, N, WARM)'''),
    "lora_load_unload": (2000, '''
        p = gt.make_lora(SMOL, os.path.join(WORK, "leak_lora.gguf"), rank=4, seed=1)
        llm = llamax.Llama(SMOL, n_ctx=64, n_threads=1)
        def fn():
            llm.load_lora("x", p)
            llm.unload_lora("x")
        cycles(fn, N, WARM)'''),
    "control_vector_set_clear": (20000, '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_ctx=64, n_threads=1)
        rows = np.random.default_rng(0).standard_normal((10, m.n_embd)).astype(np.float32)
        cv = llamax.ControlVector.from_rows(m, rows, 5, 14)
        def fn():
            c.set_control_vector(cv)
            c.set_control_vector(None)
        cycles(fn, N, WARM)'''),
    "control_vector_create": (20000, '''
        m = llamax.Model(SMOL)
        rows = np.random.default_rng(0).standard_normal((10, m.n_embd)).astype(np.float32)
        def fn():
            llamax.ControlVector.from_rows(m, rows, 5, 14)
        cycles(fn, N, WARM)'''),
    "llama_create_close": (1000, '''
        def fn():
            llamax.Llama(SMOL, n_ctx=64, n_threads=1).close()
        cycles(fn, N, WARM)'''),
    "llama_dropped_without_close": (1000, '''
        def fn():
            llm = llamax.Llama(SMOL, n_ctx=64, n_threads=1)
            llm("Hi", max_tokens=1)
            ref = weakref.ref(llm)
            del llm
            assert ref() is None, "a Llama outlived its last reference"  # (no cycle holds it)
        # (the compiled jinja2 chat template is a cycle inside jinja2 itself:
        # template -> its render function's globals -> template; that part is
        # pure Python memory and goes with the collector, as for any jinja2 user)
        cycles(fn, N, WARM)'''),
    "model_context_dropped_without_close": (200, '''
        def fn():
            m = llamax.Model(SMOL)
            c = llamax.Context(m, n_ctx=64, n_threads=1)
            c.decode(m.tokenize("Hi"))
            v = c.get_logits()
            refs = [weakref.ref(m), weakref.ref(c)]
            del m, c, v
            assert all(r() is None for r in refs), "a Model or Context outlived its last reference"
        gc.disable()
        cycles(fn, N, WARM)'''),
    "requests": (10000, '''
        llm = llamax.Llama(SMOL, n_ctx=64, n_threads=1, embedding=True)
        p = gt.make_lora(SMOL, os.path.join(WORK, "req_lora.gguf"), rank=4, seed=2)
        llm.load_lora("a", p)
        i = [0]
        def fn():
            i[0] += 1
            k = i[0] % 4
            if k == 0:
                llm(f"Hi {i[0] % 7}", max_tokens=1, temperature=0.0)
            elif k == 1:
                llm("Hello", max_tokens=1, active_loras=[{"name": "a", "scale": 0.5}])
            elif k == 2:
                list(llm("Hey", max_tokens=1, stream=True))
            else:
                llm.embed_array(["one", "two"])
        cycles(fn, N, WARM)'''),
}


@pytest.fixture(scope="module")
def leak_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("leaks")


@pytest.mark.parametrize("name", sorted(CYCLES))
def test_no_growth(name, leak_dir, smollm2_path):
    full, body = CYCLES[name]
    n = max(10, int(full * SCALE))
    warm = max(50, n // 5)  # caches (jinja2, numpy, the allocator) fill up first
    code = PRE + f"N, WARM = {n}, {warm}\n" + textwrap.dedent(body)
    r = run_py(f"import os; os.environ['LEAK_DIR'] = {str(leak_dir)!r}\n" + code, timeout=3600)
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout.split("LEAK-RESULT ", 1)[1].splitlines()[0])
    print(f"\n{name}: {n} cycles, RSS {res['rss0_kib']} -> {res['rss1_kib']} KiB ({100 * res['growth']:+.2f}%)")
    assert res["growth"] < 0.01, res
