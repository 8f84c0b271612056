"""PEFT LoRA adapters in llamax: converted (llamax.peft, ``python -m llamax
convert-lora``, ``Llama.load_lora(name, PEFT_DIR)``), checked against what
PEFT computes in PyTorch, and refused with a message when they can't be."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from llamax_dev import data
import llamax
from llamax import gguf_tools as gt
from llamax import peft

# Slow tier (`pytest tests -m slow`; .ci/run runs it): PEFT in PyTorch, in the cached tool venv (~1.5 min).
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TOKENS = [1, 504, 3000, 77, 12, 9000, 42]
# llama.cpp and PyTorch sum in other orders: the base models' logits differ
# by ~4e-3 (max over the vocabulary, logits up to ~5); the adapters move them
# by ~1-6, and a wrong conversion (e.g. no query/key permutation) by ~4
TOL = 0.02


@pytest.fixture(scope="module")
def ref(gen_dir, smollm2_path):
    """A tiny F32 llama and PEFT adapters for it, with PyTorch's logits."""
    d = gen_dir / "peft"
    d.mkdir()
    tiny = gt.make_tiny_llama(d / "tiny.gguf", smollm2_path, seed=3)
    py = data.tool_venv(peft=True)
    subprocess.run([str(py), str(HERE / "peft_reference.py"), str(tiny), str(d), json.dumps(TOKENS)],
                   check=True, capture_output=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return d


def logits(model, adapter=None, scale=1.0):
    ctx = llamax.Context(model, n_ctx=64, n_threads=1)
    try:
        if adapter is not None:
            ctx.set_adapters([(adapter, scale)])
        ctx.decode(TOKENS, logits="all")
        return np.array(ctx.get_logits())
    finally:
        ctx.close()


@pytest.mark.parametrize("variant", ["plain", "patterns"])
def test_converted_adapter_gives_pefts_logits(ref, variant, tmp_path):
    """plain: safetensors, r=4 on all seven linear modules; patterns: rsLoRA,
    rank_pattern, alpha_pattern, saved as torch's .bin."""
    model = llamax.Model(ref / "tiny.gguf")
    base = np.load(ref / "base_logits.npy")
    expected = np.load(ref / variant / "logits.npy")
    assert np.abs(logits(model) - base).max() < TOL          # the same base model on both sides
    out = peft.convert(ref / variant, ref / "tiny.gguf", tmp_path / "a.gguf")
    got = logits(model, llamax.LoraAdapter(model, out))
    assert np.abs(expected - base).max() > 1.0               # the adapter matters...
    assert np.abs(got - expected).max() < TOL                # ...and llamax applies what PEFT does


def test_load_lora_takes_a_peft_directory(ref, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMAX_CACHE_DIR", str(tmp_path))
    llm = llamax.Llama(str(ref / "tiny.gguf"), n_ctx=64, n_threads=1)
    try:
        llm.load_lora("plain", ref / "plain")
        (cached,) = (tmp_path / "peft").iterdir()
        stamp = cached.stat().st_mtime_ns
        llm.register_lora("again", ref / "plain")          # the same content: converted once
        assert [p.name for p in (tmp_path / "peft").iterdir()] == [cached.name]
        assert cached.stat().st_mtime_ns == stamp
        toks = llm.tokenize(b"Hello there", add_bos=False)
        a = llm.create_completion(toks, max_tokens=1, temperature=0.0, logprobs=5,
                                  active_loras=[{"name": "plain", "scale": 1.0}])
        b = llm.create_completion(toks, max_tokens=1, temperature=0.0, logprobs=5,
                                  active_loras=[{"name": "again", "scale": 1.0}])
        assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
        with pytest.raises(llamax.PeftError, match="adapter_config.json"):
            llm.load_lora("empty", tmp_path)                # a directory, but not an adapter
    finally:
        llm.close()


def test_convert_lora_command(ref, tmp_path):
    out = tmp_path / "plain.gguf"
    p = subprocess.run([sys.executable, "-m", "llamax", "convert-lora", str(ref / "plain"), "--base",
                        str(ref / "tiny.gguf"), "-o", str(out), "--dtype", "f16"],
                       capture_output=True, text=True, timeout=120, cwd=str(HERE))
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout and out.is_file()
    model = llamax.Model(ref / "tiny.gguf")
    f16 = logits(model, llamax.LoraAdapter(model, out))
    assert np.abs(f16 - np.load(ref / "plain" / "logits.npy")).max() < 0.05
    p = subprocess.run([sys.executable, "-m", "llamax", "convert-lora", str(tmp_path), "--base",
                        str(ref / "tiny.gguf"), "-o", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, timeout=120, cwd=str(HERE))
    assert p.returncode == 2 and "adapter_config.json" in p.stderr


def _variant(ref, tmp_path, config=None, weights=None):
    """A copy of the plain adapter with its config changed and/or its weights replaced."""
    d = tmp_path / "a"
    shutil.copytree(ref / "plain", d)
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (d / "adapter_model.safetensors").unlink()
        weights(d)
    return d


def _safetensors(path, tensors: dict):
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = np.ascontiguousarray(v, np.float32).tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _evil_bin(d):
    with zipfile.ZipFile(d / "adapter_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": _Evil()}))


@pytest.mark.parametrize("case,match", [
    (dict(config={"peft_type": "IA3"}), "only LoRA"),
    (dict(config={"use_dora": True}), "DoRA"),
    (dict(config={"bias": "all"}), "biases"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"lora_alpha": -1}), "lora_alpha must be a positive number"),
    (dict(weights=lambda d: None), "no adapter_model.safetensors or adapter_model.bin"),
    (dict(weights=lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x05junk")), "not a safetensors"),
    (dict(weights=_evil_bin), "only tensors are read"),
    (dict(weights=lambda d: _safetensors(d / "adapter_model.safetensors", {
        "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 8))})), "embeddings"),
    (dict(weights=lambda d: _safetensors(d / "adapter_model.safetensors", {
        "base_model.model.model.layers.0.mlp.extra_proj.lora_A.weight": np.zeros((4, 64)),
        "base_model.model.model.layers.0.mlp.extra_proj.lora_B.weight": np.zeros((256, 4))})),
     "no tensor in the base"),
    (dict(weights=lambda d: _safetensors(d / "adapter_model.safetensors", {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 64))})),
     "needs lora_A and lora_B"),
    (dict(weights=lambda d: _safetensors(d / "adapter_model.safetensors", {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.zeros((64,))})), "DoRA"),
])
def test_bad_adapters_are_refused_with_the_reason(ref, tmp_path, case, match):
    d = _variant(ref, tmp_path, **case)
    with pytest.raises(llamax.PeftError, match=match):
        peft.convert(d, ref / "tiny.gguf", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_an_adapter_for_another_model_is_refused(ref, tmp_path, smollm2_path, lora_paths):
    with pytest.raises(llamax.PeftError, match="another model"):
        peft.convert(ref / "plain", smollm2_path, tmp_path / "out.gguf")   # SmolLM2 is 576 wide, not 64
    with pytest.raises(llamax.PeftError, match="an adapter, not a base model"):
        peft.convert(ref / "plain", lora_paths["a"], tmp_path / "out.gguf")
    with pytest.raises(llamax.PeftError, match="not a readable GGUF"):
        peft.convert(ref / "plain", ref / "plain" / "adapter_config.json", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
