"""Fuzz llamax with atheris (libFuzzer for Python).  A script, not a test.

    pip install atheris
    python tools/fuzz.py gguf      [-max_total_time=600] [libFuzzer options]
    python tools/fuzz.py tokenize  [-max_total_time=600]
    python tools/fuzz.py template  [-max_total_time=600]

Targets:
- gguf: model loading from bytes.  The input is written to a file and
  loaded with llamax.Model (full load, then vocab_only), then a LoRA
  adapter and a control vector are loaded from the same bytes against the
  real model.  Every failure must be a LlamaxError; anything else (an
  exception of another type, or a crash/abort of the process) is a find.
  Seeds: llama.cpp's ggml-vocab-*.gguf files, a tiny model, a LoRA and a
  control vector written by llamax.gguf_tools.
- tokenize: tokenize / detokenize round trips on SmolLM2 (BPE) and
  all-MiniLM-L6-v2 (WordPiece), from arbitrary bytes, with and without
  special-token parsing; batched tokenization must equal one-at-a-time.
- template: the sandboxed chat template renders arbitrary template source
  over arbitrary messages; only ChatTemplateError / InvalidArgumentError may
  come out, within the render deadline.

Corpora and crash files go under $LLAMAX_FUZZ_DIR (default
~/.cache/llamax/fuzz/<target>).  Python exceptions are finds too: atheris
reports them with the input that raised.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _fuzz_dir(target: str) -> Path:
    base = os.environ.get("LLAMAX_FUZZ_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "llamax" / "fuzz"
    d = root / target
    d.mkdir(parents=True, exist_ok=True)
    return d


def _seed_gguf(corpus: Path) -> None:
    import data
    from llamax import gguf_tools as gt
    if any(corpus.iterdir()):
        return
    for p in sorted(data.vocab_dir().glob("ggml-vocab-*.gguf")):
        if p.stat().st_size <= 2 << 20:
            (corpus / p.name).write_bytes(p.read_bytes())
    tmp = Path(tempfile.mkdtemp())
    smol = data.smollm2()
    tiny = gt.make_tiny_llama(tmp / "tiny.gguf", smol, n_embd=16, n_layer=1, n_head=2, n_head_kv=1, n_ff=32)
    if Path(tiny).stat().st_size <= 8 << 20:
        (corpus / "tiny.gguf").write_bytes(Path(tiny).read_bytes())
    lora = gt.make_lora(smol, tmp / "lora.gguf", rank=1, layers=[0])
    (corpus / "lora.gguf").write_bytes(Path(lora).read_bytes())
    cv = gt.make_control_vector(tmp / "cv.gguf", n_embd=576, layers=[1, 2])
    (corpus / "cv.gguf").write_bytes(Path(cv).read_bytes())


def target_gguf():
    import data
    import llamax
    smol = llamax.Model(str(data.smollm2()))
    path = Path(tempfile.mkdtemp()) / "input.gguf"

    def one(buf: bytes) -> None:
        path.write_bytes(buf)
        for kw in ({}, {"vocab_only": True}):
            try:
                m = llamax.Model(str(path), **kw)
            except llamax.LlamaxError:
                continue
            try:
                if not kw:
                    with llamax.Context(m, n_ctx=32, n_threads=1) as c:
                        c.decode([0])
                m.tokenize("fuzz")
            except llamax.LlamaxError:
                pass
            finally:
                m.close()
        try:
            llamax.LoraAdapter(smol, str(path)).close()
        except llamax.LlamaxError:
            pass
        try:
            llamax.ControlVector.load(smol, str(path))
        except llamax.LlamaxError:
            pass

    return one, _seed_gguf


def target_tokenize():
    import data
    import llamax
    models = [llamax.Model(str(data.smollm2()), vocab_only=True),
              llamax.Model(str(data.minilm("f16")), vocab_only=True)]

    def one(buf: bytes) -> None:
        m = models[buf[0] % 2] if buf else models[0]
        flags = buf[1] if len(buf) > 1 else 0
        text = buf[2:]
        try:
            toks = m.tokenize(text, add_special=bool(flags & 1), parse_special=bool(flags & 2))
        except llamax.InvalidUtf8Error:
            return
        m.detokenize(toks, special=bool(flags & 4))
        m.detokenize_text(toks, errors="replace")
        s = text.decode("utf-8")
        flat, offs = m.tokenize_batch([s, s[: len(s) // 2]], add_special=bool(flags & 1),
                                      parse_special=bool(flags & 2))
        assert list(flat[offs[0]:offs[1]]) == list(toks) or (len(toks) == 0 and offs[1] - offs[0] == 1)
        for t in toks[:64]:
            m.token_to_piece(int(t), special=bool(flags & 8))

    def seed(corpus: Path) -> None:
        if not any(corpus.iterdir()):
            for i, s in enumerate(["hello world", "Café crème 東京 😀", "<|im_start|>user\nhi<|im_end|>",
                                   "[CLS] a [SEP] " + "b" * 120, "\t\n  x"]):
                (corpus / f"s{i}").write_bytes(bytes([i % 2, i]) + s.encode())

    return one, seed


def target_template():
    import llamax
    from llamax import ChatTemplate, ChatTemplateError

    def one(buf: bytes) -> None:
        src = buf.decode("utf-8", "replace")
        cut = src.find("\x00")
        tmpl, content = (src, "hi") if cut < 0 else (src[:cut], src[cut + 1:])
        msgs = [{"role": "system", "content": content[:50]}, {"role": "user", "content": content},
                {"role": "assistant", "content": content[::-1]}]
        try:
            ChatTemplate(tmpl).render(msgs, add_generation_prompt=True)
        except (ChatTemplateError, llamax.InvalidArgumentError):
            pass

    def seed(corpus: Path) -> None:
        if any(corpus.iterdir()):
            return
        import data
        m = llamax.Model(str(data.smollm2()), vocab_only=True)
        (corpus / "smollm2").write_bytes(m.chat_template().encode())
        m.close()
        for i, s in enumerate(["{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                               "{{ messages[0]['content'] | upper }}{% if add_generation_prompt %}>{% endif %}",
                               "{% set x = namespace(n=0) %}{% for m in messages %}{% set x.n = x.n + 1 %}"
                               "{% endfor %}{{ x.n }}",
                               "{{ raise_exception('no') }}", "{{ ''.__class__ }}"]):
            (corpus / f"t{i}").write_bytes(s.encode())

    return one, seed


TARGETS = {"gguf": target_gguf, "tokenize": target_tokenize, "template": target_template}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(__doc__)
        sys.exit(2)
    import atheris
    name = sys.argv[1]
    with atheris.instrument_imports():
        import llamax  # noqa: F401  (the Python layers: coverage for the fuzzer)
        import llamax.chat  # noqa: F401
    one, seed = TARGETS[name]()
    d = _fuzz_dir(name)
    corpus = d / "corpus"
    corpus.mkdir(exist_ok=True)
    seed(corpus)
    args = [sys.argv[0], str(corpus), f"-artifact_prefix={d}/", "-max_len=65536", "-rss_limit_mb=8192",
            "-timeout=30"] + sys.argv[2:]
    atheris.Setup(args, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
