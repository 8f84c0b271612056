"""Float weights packed once for llamax's own kernels (csrc/packed_gemm.cpp,
third_party/patches/0010): the kernels against a double-precision
reference, which weights get packed, agreement with the OpenBLAS and ggml
paths, the budget, threads, and the LLAMAX_SGEMM / LLAMAX_PACKED_BUDGET_MB
settings."""
import json
import os
import platform
import threading

import numpy as np
import pytest

from llamax_dev import data
import llamax
from conftest import run_py
from llamax import _core

# Slow tier (`pytest tests -m slow`; .ci/run runs it): the packed embedding kernels against the reference (~23 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow

N_EMBD = 384


def cosines(a, b):
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


ISAS = _core._packed_isas()
CAPPED_AT = os.environ.get("LLAMAX_PACKED_ISA", "")
X86 = platform.machine().lower() in ("x86_64", "amd64")
# BF16 weights on the BF16 kernels: CPUs with AVX512_BF16 (checked against
# /proc/cpuinfo by test_bf16_kernels_follow_the_cpu_flags)
BF16 = _core._packed_config()["bf16"]
# the kernel sets to check: (isa, BF16 kernels)
KERNELS = [(isa, False) for isa in ISAS] + ([("avx512", True)] if BF16 else [])
# The kernels are x86-64 (AVX2 / AVX-512); elsewhere (Apple silicon's Metal
# build) embedding contexts keep OpenBLAS / ggml, which the embedding suite
# covers, and test_this_cpu_has_packed_kernels checks that nothing claims
# otherwise.
needs_kernels = pytest.mark.skipif(not X86, reason="llamax's packed kernels are x86-64 only")


@pytest.fixture
def restore_packed():
    before = _core._packed_config()
    yield
    _core._packed_config(enabled=before["enabled"], isa=before["isa"], budget=before["budget"], bf16=True)


def test_this_cpu_has_packed_kernels():
    info = llamax.sgemm_info()
    if not X86:
        assert ISAS == [] and info["packed"] is None, info
        return
    # every x86-64 machine this project runs on has AVX2 + FMA at least
    assert "avx2" in ISAS, ISAS
    assert info["packed"] is not None and info["packed"]["isa"] in ISAS, info
    assert info["packed"]["budget"] == 2048 << 20


@pytest.mark.parametrize("isa,bf16", KERNELS)
@pytest.mark.parametrize("M,N,K,threads", [
    (1, 1, 1, 1), (1, 33, 7, 2), (12, 32, 384, 1), (13, 100, 385, 3), (6, 16, 16, 4),
    (37, 384, 1536, 2), (300, 65, 600, 2), (5, 17, 513, 5), (200, 48, 20, 2),
    # more threads than twice the panels: rows are split too
    (300, 65, 600, 16), (37, 384, 384, 32), (5, 17, 13, 8), (130, 1536, 64, 64),
    (14, 40, 2049, 2), (3, 33, 1, 1),
    # BF16 panels in L2-sized groups (8-10 panels at these K): several groups
    (13, 700, 1000, 1), (30, 1000, 2049, 2),
])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernels_match_a_double_reference(isa, bf16, M, N, K, threads, bias, restore_packed):
    """Every row count up to a kernel's height, last panels of 1-31 real
    columns, K blocked (> 512; > 1024 for BF16), odd K (a BF16 pair half
    padding), BF16 panels in several cache groups, more threads than panels
    (rows split), strided rows, a fused
    bias row; the columns past N are never written, and the last rows alone
    give the same bits as in the whole product.  BF16: against a reference
    from the bf16-rounded weights and activations."""
    _core._packed_config(isa=isa)
    err = _core._packed_self_check(M, N, K, threads, seed=M * 7 + N, bias=bias, bf16=bf16)
    assert 0 <= err < 1e-5, err


@needs_kernels
def test_embedder_packs_the_weights_when_made(sentences):
    path = data.minilm("f16")
    nr = 32 if _core._packed_config()["isa"] == "avx512" else 16
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        assert e.llama._native_model.packed_weight_bytes == _matmul_weight_bytes(path, nr)
        e.encode(sentences[:4])
        assert e.llama._native_model.packed_weight_bytes == _matmul_weight_bytes(path, nr)


@needs_kernels
def test_kernel_bench_runs_and_bad_shapes_are_refused():
    r = _core._packed_bench(14, 64, 96, seconds=0.02)
    assert r["packed"] > 0 and r["sgemm"] is None
    for bad in ((0, 8, 8), (8, 100000, 8), (8, 8, -1)):
        with pytest.raises(llamax.InvalidArgumentError, match="must be in"):
            _core._packed_bench(*bad)
        with pytest.raises(llamax.InvalidArgumentError, match="must be in"):
            _core._packed_self_check(*bad)
    with pytest.raises(llamax.InvalidArgumentError, match="threads"):
        _core._packed_self_check(4, 4, 4, threads=0)
    with pytest.raises(llamax.ArgumentTypeError):
        _core._packed_bench(4, 4, 4, sgemm_address=-1)


def test_bf16_kernels_follow_the_cpu_flags(restore_packed):
    """BF16 kernels exactly where Linux reports avx512f, avx512bw and
    avx512_bf16 (AVX2-only EPYCs: none; BF16 weights are widened to float
    panels there), and only with the AVX-512 kernels."""
    flags = set()
    if X86 and platform.system() == "Linux":
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        # (LLAMAX_PACKED_ISA=avx2, CI's baseline run: the AVX2 kernels only, as on an AVX2-only CPU)
        want = {"avx512f", "avx512bw", "avx512_bf16"} <= flags and CAPPED_AT != "avx2"
        assert BF16 == want, sorted(f for f in flags if "512" in f)
    if not BF16:
        assert _core._packed_self_check(4, 4, 4, bf16=True) == -1
        with pytest.raises(llamax.InvalidArgumentError, match="no BF16 kernels"):
            _core._packed_bench(4, 4, 4, seconds=0.01, bf16=True)
    if "avx2" in ISAS:
        _core._packed_config(isa="avx2")
        assert _core._packed_config()["bf16"] is False  # the AVX2 kernels have no BF16 set
        assert _core._packed_self_check(4, 4, 4, bf16=True) == -1
    _core._packed_config(isa="", bf16=False)
    assert _core._packed_config()["bf16"] is False
    _core._packed_config(bf16=True)
    assert _core._packed_config()["bf16"] == BF16
    with pytest.raises(llamax.ArgumentTypeError, match="bf16 must be a bool"):
        _core._packed_config(bf16="yes")


def test_unknown_isa_is_refused(restore_packed):
    with pytest.raises(llamax.InvalidArgumentError, match="can't run it"):
        _core._packed_config(isa="neon")
    with pytest.raises(llamax.InvalidArgumentError, match=">= 0"):
        _core._packed_config(budget=-1)
    with pytest.raises(llamax.ArgumentTypeError):
        _core._packed_config(enabled=1)


def _matmul_weight_bytes(path, nr, bf16=False):
    """float32 bytes of the model's matrix-product weights packed in panels
    of nr columns (the token embeddings are looked up, not multiplied);
    bf16: pairs of bf16, half as many bytes (K rounded up to even)."""
    import gguf
    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2 and t.shape[1] > 1:
            k, n = (int(x) for x in t.shape)  # gguf lists ne0 (K) first
            total += -(-n // nr) * nr * (-(-k // 2) if bf16 else k) * 4
    return total


@needs_kernels
@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_embedding_contexts_pack_the_model_weights_once(kind, sentences):
    path = data.minilm(kind)
    nr = 32 if _core._packed_config()["isa"] == "avx512" else 16
    want = _matmul_weight_bytes(path, nr)
    # the 36 matrices of the six layers (Q, K, V, output, FFN up and down)
    assert want == 6 * (4 * 384 * 384 + 2 * 384 * 1536) * 4
    with llamax.Model(path) as m:
        assert m.packed_weight_bytes == 0
        with llamax.Context(m, n_ctx=64, n_threads=2) as gen:
            assert not gen.packed_weights  # generation keeps ggml's kernels
            gen.decode(m.tokenize("a generation context"))
        assert m.packed_weight_bytes == 0
        with llamax.Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=8, n_threads=2,
                            embeddings=True, pooling="mean") as c:
            assert c.packed_weights
            c.set_threads(1)  # new threadpools keep it
            assert c.packed_weights
            toks, offs = m.tokenize_batch(sentences[:8])
            first = np.array(c.embed(toks, offs))
            assert m.packed_weight_bytes == want
            again = np.array(c.embed(toks, offs))
            assert m.packed_weight_bytes == want  # packed once
        assert np.array_equal(first, again)


@needs_kernels
def test_packed_weights_agree_with_openblas_and_ggml(sentences, tmp_path):
    """The same inputs with LLAMAX_SGEMM=openblas and =ggml (other processes):
    batches and single inputs, f32 and f16 weights."""
    outs = {}
    for mode in ("openblas", "ggml"):
        r = run_py(f"""
            import json
            import numpy as np
            import llamax
            texts = json.loads({json.dumps(sentences)!r})
            out = []
            for kind in ("f32", "f16"):
                from llamax_dev import data
                with llamax.Embedder(data.minilm(kind), max_seq_length=256, n_threads=2) as e:
                    assert llamax.sgemm_info()["packed"] is None
                    out.append(np.concatenate([e.encode(texts, batch_size=64), e.encode(texts[:6], batch_size=1)]))
                    assert e.llama._native_model.packed_weight_bytes == 0
            np.save({str(tmp_path / (mode + ".npy"))!r}, np.concatenate(out))
        """, env={"LLAMAX_SGEMM": mode})
        assert r.returncode == 0, r.stderr
        outs[mode] = np.load(tmp_path / (mode + ".npy"))
    got = []
    for kind in ("f32", "f16"):
        with llamax.Embedder(data.minilm(kind), max_seq_length=256, n_threads=2) as e:
            got.append(np.concatenate([e.encode(sentences, batch_size=64), e.encode(sentences[:6], batch_size=1)]))
            assert e.llama._native_model.packed_weight_bytes > 0
    got = np.concatenate(got)
    for mode, ref in outs.items():
        assert got.shape == ref.shape == (2 * (len(sentences) + 6), N_EMBD)
        cos = cosines(got, ref)
        assert cos.min() > 0.99999, (mode, int(np.argmin(cos)), cos.min())


@needs_kernels
def test_avx2_kernels_agree_with_the_best(sentences, restore_packed):
    """On an AVX-512 machine the AVX2 kernels (panels of 16) run too, so both
    kernel sets are checked on every CI machine."""
    path = data.minilm("f32")
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        best = e.encode(sentences, batch_size=32)
        _core._packed_config(isa="avx2")  # for models packed from now on
        again = e.encode(sentences, batch_size=32)  # this one keeps its kernels
        with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e2:
            avx2 = e2.encode(sentences, batch_size=32)
    assert np.array_equal(best, again)
    cos = cosines(best, avx2)
    assert cos.min() > 0.99999, cos.min()


@needs_kernels
def test_bias_add_is_fused_with_the_product_bit_identically(sentences, tmp_path):
    """Each projection's ADD of its bias runs inside the product (patch 0010);
    with ggml's fusions off (another process) the numbers are the same bits."""
    path = data.minilm("f32")
    r = run_py(f"""
        import json
        import numpy as np
        import llamax
        from llamax import _core
        texts = json.loads({json.dumps(sentences[:12])!r})
        with llamax.Embedder({str(path)!r}, max_seq_length=256, n_threads=2) as e:
            v = np.concatenate([e.encode(texts, batch_size=6), e.encode(texts[:2], batch_size=1)])
            assert _core._packed_config()["fused_products"] == 0
        np.save({str(tmp_path / "unfused.npy")!r}, v)
    """, env={"GGML_CPU_DISABLE_FUSION": "1"})
    assert r.returncode == 0, r.stderr
    before = _core._packed_config()["fused_products"]
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        got = np.concatenate([e.encode(sentences[:12], batch_size=6), e.encode(sentences[:2], batch_size=1)])
    # 5 decodes (the constructor's warm-up and 4) x 6 layers x (Q, K, V,
    # output, FFN up, FFN down), each with a bias
    assert _core._packed_config()["fused_products"] - before == 5 * 6 * 6
    assert np.array_equal(got, np.load(tmp_path / "unfused.npy"))


@needs_kernels
@pytest.mark.filterwarnings("ignore::llamax.OversubscriptionWarning")  # 7 threads on fewer cores, on purpose
def test_thread_counts_give_the_same_bits(sentences, monkeypatch):
    """7 threads split the 12 panels of a 384-wide output by rows too; every
    row's product, and so every embedding, is the same bits as with 2."""
    path = data.minilm("f32")
    monkeypatch.setenv("LLAMAX_OVERSUBSCRIBE", "1")  # keep the 7 threads
    out = {}
    for threads in (2, 7):
        with llamax.Embedder(path, max_seq_length=256, n_threads=threads) as e:
            out[threads] = e.encode(sentences[:12], batch_size=6)
    assert np.array_equal(out[2], out[7])


@needs_kernels
def test_budget_leaves_weights_to_openblas(sentences, restore_packed):
    path = data.minilm("f32")
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        full = e.encode(sentences[:10])
    _core._packed_config(budget=3 * 384 * 384 * 4)  # three 384 x 384 matrices, then no more
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        part = e.encode(sentences[:10])
        assert e.llama._native_model.packed_weight_bytes == 3 * 384 * 384 * 4
    _core._packed_config(budget=0)
    with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
        none = e.encode(sentences[:10])
        assert e.llama._native_model.packed_weight_bytes == 0
    assert cosines(full, part).min() > 0.99999
    assert cosines(full, none).min() > 0.99999


@needs_kernels
def test_contexts_of_one_model_pack_it_together(sentences):
    """Two embedding contexts of one model in two threads from the first
    product on: each weight is packed once, by one of them, and both get the
    answer either gets alone afterwards."""
    path = data.minilm("f16")
    nr = 32 if _core._packed_config()["isa"] == "avx512" else 16
    with llamax.Model(path) as m:
        toks, offs = m.tokenize_batch(sentences[:16])
        ctxs = [llamax.Context(m, n_ctx=1024, n_batch=1024, n_ubatch=1024, n_seq_max=16, n_threads=1,
                               embeddings=True, pooling="mean") for _ in range(2)]
        go = threading.Barrier(2)
        out = [None, None]

        def work(i):
            go.wait()
            out[i] = np.array(ctxs[i].embed(toks, offs))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert m.packed_weight_bytes == _matmul_weight_bytes(path, nr)
        want = np.array(ctxs[0].embed(toks, offs))
        for c in ctxs:
            c.close()
    assert out[0].shape == (16, N_EMBD)
    assert np.array_equal(out[0], want) and np.array_equal(out[1], want)


@pytest.mark.parametrize("name,value,says", [
    ("LLAMAX_PACKED_BUDGET_MB", "lots", "expected a whole number of MiB >= 0"),
    ("LLAMAX_PACKED_BF16", "maybe", "expected 1 (BF16 weights on the BF16 kernels"),
    ("LLAMAX_PACKED_ISA", "sse2", "expected avx2 (the AVX2 kernels, as on an AVX2-only CPU)"),
])
def test_bad_setting_is_refused_at_the_first_embedding_context(name, value, says):
    r = run_py("""
        import llamax
        from llamax_dev import data
        try:
            llamax.Embedder(data.minilm("f32"))
        except llamax.InvalidArgumentError as e:
            print("refused:", e)
    """, timeout=120, env={name: value})
    assert r.returncode == 0, r.stderr
    assert f"refused: {name}={value!r}: {says}" in r.stdout


@needs_kernels
def test_bf16_weights_pack_as_bf16_where_the_cpu_multiplies_them(sentences, st_reference, restore_packed):
    """A BF16 GGUF: half the packed bytes and bf16 activations on CPUs with
    AVX512_BF16, float panels elsewhere and with the BF16 kernels turned
    off; either way within 0.9999 of sentence-transformers and of each
    other, and a batch gives each input what it gives alone."""
    path = data.minilm("bf16")
    nr = 32 if _core._packed_config()["isa"] == "avx512" else 16
    out = {}
    for use in (True, False):
        _core._packed_config(bf16=use)
        with llamax.Embedder(path, max_seq_length=256, n_threads=2) as e:
            assert e.llama._native_model.packed_weight_bytes == _matmul_weight_bytes(path, nr, bf16=use and BF16)
            out[use] = e.encode(sentences, batch_size=32)
            alone = np.concatenate([e.encode([t], batch_size=1) for t in sentences[:8]])
        assert cosines(out[use][:8], alone).min() > 0.99999
        ref = st_reference / np.linalg.norm(st_reference, axis=1, keepdims=True)
        cos = cosines(out[use], ref)
        assert cos.min() >= 0.9999, (use, int(np.argmin(cos)), cos.min())
    cos = cosines(out[True], out[False])
    assert cos.min() > 0.9999, cos.min()
    if not BF16:
        assert np.array_equal(out[True], out[False])


@needs_kernels
def test_packed_bf16_setting_widens_bf16_weights():
    """LLAMAX_PACKED_BF16=0: BF16 weights go to float panels on every CPU."""
    r = run_py("""
        import llamax
        from llamax_dev import data
        with llamax.Embedder(data.minilm("bf16"), n_threads=2) as e:
            print("bf16:", llamax.sgemm_info()["packed"]["bf16"], e.llama._native_model.packed_weight_bytes)
    """, timeout=120, env={"LLAMAX_PACKED_BF16": "0"})
    assert r.returncode == 0, r.stderr
    nr = 32 if _core._packed_config()["isa"] == "avx512" else 16
    assert f"bf16: False {_matmul_weight_bytes(data.minilm('bf16'), nr)}" in r.stdout


@needs_kernels
def test_packed_isa_avx2_runs_an_avx2_cpus_kernels():
    """LLAMAX_PACKED_ISA=avx2 (set before the process starts): the AVX2
    kernels only, no BF16 kernels (a BF16 file is widened to float panels),
    whatever this CPU has."""
    r = run_py("""
        import json, llamax
        from llamax_dev import data
        from llamax import _core
        e = llamax.Embedder(data.minilm("bf16"))
        v = e.encode(["a cat sat on the mat"])
        print(json.dumps({"isas": _core._packed_isas(), "info": llamax.sgemm_info()["packed"],
                          "shape": list(v.shape)}))
    """, timeout=120, env={"LLAMAX_PACKED_ISA": "avx2"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["isas"] == ["avx2"] and out["info"]["isa"] == "avx2" and out["info"]["bf16"] is False, out
    assert out["shape"] == [1, N_EMBD]
