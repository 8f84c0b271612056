"""n_gpu_layers, the GPU report, and what changes when layers are offloaded.

On a CPU build (CI) the offload tests check that asking for GPU layers is
harmless and exact (everything runs on the CPU).  tools/device_check.sh runs
the whole of tests/core and tests/api with LLAMAX_N_GPU_LAYERS=-1 on a CUDA
build and an H200, with LLAMAX_EXPECT_GPU=1 so that a build that silently
fell back to the CPU fails there instead of passing.  The out-of-memory
tests need a GPU (device memory is what they exhaust): they are skipped here
and run there.
"""
import os

import numpy as np
import pytest

import llamax

from conftest import logits_after, run_py

ON_GPU = llamax.supports_gpu_offload()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU build on a GPU machine: tools/device_check.sh")


def test_gpu_report_tells_the_truth():
    devs = llamax.gpu_devices()
    assert ON_GPU == bool(devs)
    for d in devs:
        assert d["name"] and d["memory_total"] >= d["memory_free"] > 0
    if os.environ.get("LLAMAX_EXPECT_GPU") == "1":
        assert ON_GPU, f"LLAMAX_EXPECT_GPU=1 but llama.cpp found no GPU: {llamax.system_info()}"


def test_n_gpu_layers_validation(smollm2_path):
    for bad in (-2, 1 << 31):
        with pytest.raises(llamax.InvalidArgumentError, match="n_gpu_layers"):
            llamax.Model(smollm2_path, n_gpu_layers=bad)
    with pytest.raises(llamax.ArgumentTypeError, match="n_gpu_layers"):
        llamax.Model(smollm2_path, n_gpu_layers=1.5)


def test_n_gpu_layers_from_the_environment(smollm2_path):
    out = run_py(f"""
        import llamax
        m = llamax.Model({str(smollm2_path)!r})
        print(m.n_gpu_layers, llamax.Model({str(smollm2_path)!r}, n_gpu_layers=0).n_gpu_layers)
        llm = llamax.Llama({str(smollm2_path)!r}, n_ctx=64)
        print(llm._native_model.n_gpu_layers)
    """, env={"LLAMAX_N_GPU_LAYERS": "-1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-1", "0", "-1"]
    out = run_py(f"""
        import llamax
        try:
            llamax.Model({str(smollm2_path)!r})
        except llamax.InvalidArgumentError as e:
            print("refused:", e)
    """, env={"LLAMAX_N_GPU_LAYERS": "all"})
    assert out.returncode == 0, out.stderr
    assert "refused: LLAMAX_N_GPU_LAYERS='all'" in out.stdout


def test_offloaded_model_computes_the_same_logits(smollm2_path):
    """All layers asked on the GPU against none.  Without a GPU both run on
    the CPU and agree exactly; on a GPU, its kernels' rounding differs, so
    the rows agree closely and pick the same top token."""
    toks = None
    rows = {}
    for ngl in (0, -1):
        with llamax.Model(smollm2_path, n_gpu_layers=ngl) as m:
            toks = m.tokenize("The capital of France is")
            with llamax.Context(m, n_ctx=64, n_threads=2) as c:
                rows[ngl] = logits_after(c, toks)[-1]
    cpu, off = rows[0], rows[-1]
    if not ON_GPU:
        np.testing.assert_array_equal(off, cpu)
    else:
        assert int(np.argmax(off)) == int(np.argmax(cpu))
        cos = float(off @ cpu / (np.linalg.norm(off) * np.linalg.norm(cpu)))
        assert cos > 0.999, cos


def test_embedder_takes_n_gpu_layers(smollm2_path):
    # SmolLM2 mean-pooled: the device check carries no second model
    e0 = llamax.Embedder(smollm2_path, n_gpu_layers=0, pooling="mean", n_ctx=512)
    e1 = llamax.Embedder(smollm2_path, n_gpu_layers=-1, pooling="mean", n_ctx=512)
    try:
        a, b = e0.encode(["a sentence to embed"]), e1.encode(["a sentence to embed"])
        cos = float(a[0] @ b[0] / (np.linalg.norm(a[0]) * np.linalg.norm(b[0])))
        assert cos > (0.9999 if ON_GPU else 1 - 1e-6), cos
    finally:
        e0.close()
        e1.close()


# -- a GPU's memory runs out ----------------------------------------------------

def _fill_gpu(leave_bytes: int):
    torch = pytest.importorskip("torch", reason="fills device memory with torch (on the device image)")
    free, _ = torch.cuda.mem_get_info()
    return torch.empty(max(free - leave_bytes, 0), dtype=torch.uint8, device="cuda")


@needs_gpu
def test_model_too_big_for_the_gpu_is_out_of_memory(smollm2_path):
    blob = _fill_gpu(32 << 20)  # SmolLM2's weights are 94 MiB
    try:
        with pytest.raises(llamax.OutOfMemoryError, match="n_gpu_layers=-1"):
            llamax.Model(smollm2_path, n_gpu_layers=-1)
    finally:
        del blob
    with llamax.Model(smollm2_path, n_gpu_layers=-1) as m:  # and the process goes on
        assert m.tokenize("still here")


@needs_gpu
def test_kv_cache_too_big_for_the_gpu_is_out_of_memory(smollm2_path):
    with llamax.Model(smollm2_path, n_gpu_layers=-1) as m:
        blob = _fill_gpu(16 << 20)  # a 8192-token KV cache is 188 MiB
        try:
            with pytest.raises(llamax.OutOfMemoryError):
                llamax.Context(m, n_ctx=8192)
        finally:
            del blob
        with llamax.Context(m, n_ctx=256) as c:
            c.decode(m.tokenize("still here"))
