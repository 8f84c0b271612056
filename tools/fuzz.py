"""Fuzz llamax with atheris (libFuzzer for Python).  A script, not a test.

    pip install atheris
    python tools/fuzz.py gguf      [-max_total_time=600] [libFuzzer options]
    python tools/fuzz.py tokenize  [-max_total_time=600]
    python tools/fuzz.py template  [-max_total_time=600]
    python tools/fuzz.py grammar   [-max_total_time=600]

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

- grammar: GBNF text, or a JSON schema turned into GBNF by llama-cpp-python's
  own converter (llama_cpp/llama_grammar.py in the pinned sdist), builds a
  Sampler and generates a few tokens under it on SmolLM2, greedy or
  random.  Only GrammarError may come out; dead ends, rejected tokens and
  parser limits must not crash.  (libFuzzer's -timeout flags grammars
  whose matching work grows without bound.)

Corpora and crash files go under $LLAMAX_FUZZ_DIR (default
~/.cache/llamax/fuzz/<target>).  Python exceptions are finds too: atheris
reports them with the input that raised.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def _fuzz_dir(target: str) -> Path:
    base = os.environ.get("LLAMAX_FUZZ_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "llamax" / "fuzz"
    d = root / target
    d.mkdir(parents=True, exist_ok=True)
    return d


# Coverage feedback.  llama.cpp is not instrumented (gcc has no
# -fsanitize=fuzzer), so on its own the fuzzer sees the same Python path for
# every rejected file.  Each distinct outcome (the error message with its
# numbers blanked) is mapped to one of many tiny instrumented functions:
# reaching a new parser stage is then new coverage, and the corpus keeps it.
_N_BUCKETS = 1024
_BUCKETS = []


def _make_buckets() -> None:
    # One function with an if-chain: every bucket is its own edge at its own
    # offset.  (Separate identical functions share atheris' edge ids.)  Made
    # before atheris.Setup: counters registered later may not be seen.
    import atheris
    ns: dict = {}
    src = "def bucket(k):\n" + "".join(f"    if k == {i}:\n        return {i}\n" for i in range(_N_BUCKETS))
    exec(compile(src, "<buckets>", "exec"), ns)
    _BUCKETS.append(atheris.instrument_func(ns["bucket"]))


def _feedback(outcome: str) -> None:
    import re
    import zlib
    key = re.sub(r"\d+", "#", outcome.split(": ", 1)[-1] if outcome.startswith("/") else outcome)
    _BUCKETS[0](zlib.crc32(key.encode()) % _N_BUCKETS)


def _tiny_files(tmp: Path) -> dict[str, Path]:
    """A 4 KB BPE vocabulary and a 48 KB one-layer model on it, plus a LoRA
    adapter and a control vector for that model: small valid seeds."""
    import gguf
    from gguf.constants import TokenType
    from llamax import gguf_tools as gt
    vocab = tmp / "tinyvocab.gguf"
    w = gguf.GGUFWriter(str(vocab), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(16)  # noqa: E702
    w.add_feed_forward_length(32); w.add_head_count(2); w.add_head_count_kv(1)  # noqa: E702
    w.add_layer_norm_rms_eps(1e-5); w.add_rope_dimension_count(8)  # noqa: E702
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")  # noqa: E702
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    toks = [chr(c) for c in cs] + ["\u0120t", "he", "\u0120the", "<s>", "</s>"]
    w.add_token_list(toks)
    w.add_token_types([TokenType.NORMAL] * (len(toks) - 2) + [TokenType.CONTROL] * 2)
    w.add_token_merges(["\u0120 t", "h e", "\u0120t he"])
    w.add_bos_token_id(len(toks) - 2); w.add_eos_token_id(len(toks) - 1)  # noqa: E702
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    model = gt.make_tiny_llama(tmp / "tinymodel.gguf", vocab, n_embd=16, n_layer=1, n_head=2, n_head_kv=1,
                               n_ff=32, n_ctx=64)
    lora = gt.make_lora(model, tmp / "tinylora.gguf", rank=1)
    cv = gt.make_control_vector(tmp / "tinycv.gguf", n_embd=16, layers=[1])
    return {"vocab": vocab, "model": Path(model), "lora": Path(lora), "cv": Path(cv)}


def _seed_gguf(corpus: Path, files: dict[str, Path]) -> None:
    if any(corpus.iterdir()):
        return
    for name, p in files.items():
        (corpus / f"{name}.gguf").write_bytes(p.read_bytes())


def target_gguf():
    import llamax
    tmp = Path(tempfile.mkdtemp())
    files = _tiny_files(tmp)
    base = llamax.Model(str(files["model"]))
    path = tmp / "input.gguf"

    def one(buf: bytes) -> None:
        path.write_bytes(buf)
        for kw in ({}, {"vocab_only": True}):
            try:
                m = llamax.Model(str(path), **kw)
            except llamax.LlamaxError as e:
                _feedback(f"model{kw}: {e}")
                continue
            _feedback(f"model{kw}: ok")
            try:
                if not kw:
                    with llamax.Context(m, n_ctx=32, n_threads=1) as c:
                        c.decode([0])
                m.tokenize("fuzz the tea")
            except llamax.LlamaxError as e:
                _feedback(f"use: {e}")
            finally:
                m.close()
        try:
            llamax.LoraAdapter(base, str(path)).close()
            _feedback("lora: ok")
        except llamax.LlamaxError as e:
            _feedback(f"lora: {e}")
        try:
            llamax.ControlVector.load(base, str(path))
            _feedback("cv: ok")
        except llamax.LlamaxError as e:
            _feedback(f"cv: {e}")

    return one, lambda corpus: _seed_gguf(corpus, files)


def target_tokenize():
    from llamax_dev import data
    import llamax
    models = [llamax.Model(str(data.smollm2()), vocab_only=True),
              llamax.Model(str(data.minilm("f16")), vocab_only=True)]

    def one(buf: bytes) -> None:
        which = buf[0] % 2 if buf else 0
        m = models[which]
        flags = buf[1] if len(buf) > 1 else 0
        raw = buf[2:]
        try:
            m.tokenize(raw)  # bytes: invalid UTF-8 must be a clean InvalidUtf8Error
        except llamax.InvalidUtf8Error:
            pass
        text = raw.decode("utf-8", "replace")  # then always a valid text, so the tokenizer runs
        toks = m.tokenize(text, add_special=bool(flags & 1), parse_special=bool(flags & 2))
        # feedback: which model, how many tokens, which first and last token
        _feedback(f"{which}:{len(toks).bit_length()}:{int(toks[0]) % 97 if len(toks) else -1}:"
                  f"{int(toks[-1]) % 89 if len(toks) else -1}")
        m.detokenize(toks, special=bool(flags & 4))
        m.detokenize_text(toks, errors="replace")
        flat, offs = m.tokenize_batch([text, text[: len(text) // 2]], add_special=bool(flags & 1),
                                      parse_special=bool(flags & 2), max_tokens=flags * 4, truncate=True)
        n0 = int(offs[1] - offs[0])
        if flags == 0:
            assert list(flat[offs[0]:offs[1]]) == list(toks) or (len(toks) == 0 and n0 == 1)
        else:
            assert n0 <= max(flags * 4, 1) or flags * 4 == 0
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
        from llamax_dev import data
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


def target_grammar():
    import importlib.util
    import json

    from llamax_dev import data
    import llamax
    # llama-cpp-python's converter, from the pinned sdist (standard library only)
    sdist = data.llama_build.source_dir().parent.parent
    spec = importlib.util.spec_from_file_location("lcp_llama_grammar", sdist / "llama_cpp" / "llama_grammar.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    m = llamax.Model(str(data.smollm2()))
    c = llamax.Context(m, n_ctx=256, n_threads=1)
    prompt = m.tokenize("Output:")

    import signal

    def _too_slow(*_):
        raise TimeoutError

    def to_gbnf(schema) -> str:
        # llama-cpp-python's converter loops forever on some patterns (e.g.
        # "^[A-Z]{2}|0-9]+$", found here): that is its bug, not llamax's, so
        # it gets 2 s and the input is skipped
        old = signal.signal(signal.SIGALRM, _too_slow)
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        try:
            return conv.json_schema_to_gbnf(json.dumps(schema))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def one(buf: bytes) -> None:
        flags = buf[0] if buf else 0
        text = buf[1:].decode("utf-8", "replace")
        if flags & 1:
            try:
                gbnf = to_gbnf(json.loads(text))
            except Exception:  # noqa: BLE001 (the converter's own refusals are not llamax's)
                _feedback("schema-refused")
                return
        else:
            gbnf = text
        kw = {"temperature": 0.0} if not flags & 2 else {"temperature": 1.0, "seed": flags}
        try:
            s = llamax.Sampler(m, grammar=gbnf, **kw)
        except llamax.GrammarError as e:
            _feedback("parse:" + str(e)[:50])
            return
        c.kv_clear()
        try:
            out, finish = c.generate(prompt, s, max_tokens=8)
            _feedback(f"gen:{finish}:{len(out)}")
        except llamax.GrammarError as e:
            _feedback("gen-error:" + str(e)[:30])
        try:  # the same sampler after the run: reset and sample again
            s.reset()
            c.kv_clear()
            c.generate(prompt, s, max_tokens=2)
        except llamax.GrammarError:
            pass

    def seed(corpus: Path) -> None:
        if any(corpus.iterdir()):
            return
        gbnf = ['root ::= "yes" | "no"', 'root ::= [a-z]+ ("," [a-z]+)*', r'root ::= [\x00]',
                'root ::= obj\nobj ::= "{" ws (str ws ":" ws val ("," ws str ws ":" ws val)*)? "}"\n'
                'val ::= obj | str | [0-9]+\nstr ::= "\\"" [a-z]* "\\""\nws ::= [ ]?',
                'root ::= x\nx ::= x "a" | "b"', "root ::= (" * 3]
        schemas = [{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                    "required": ["a"]},
                   {"type": "array", "items": {"enum": ["x", "y", 3]}, "minItems": 1, "maxItems": 3},
                   {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/n"}], "$defs": {"n": {"type": "null"}}},
                   {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"}]
        for i, g in enumerate(gbnf):
            (corpus / f"g{i}").write_bytes(bytes([2 * (i % 2)]) + g.encode())
        for i, sch in enumerate(schemas):
            (corpus / f"s{i}").write_bytes(bytes([1 + 2 * (i % 2)]) + json.dumps(sch).encode())

    return one, seed


TARGETS = {"gguf": target_gguf, "tokenize": target_tokenize, "template": target_template,
           "grammar": target_grammar}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(__doc__)
        sys.exit(2)
    import atheris
    name = sys.argv[1]
    with atheris.instrument_imports():
        import llamax  # noqa: F401  (the Python layers: coverage for the fuzzer)
        import llamax.templates  # noqa: F401
    _make_buckets()
    one, seed = TARGETS[name]()
    d = _fuzz_dir(name)
    corpus = d / "corpus"
    corpus.mkdir(exist_ok=True)
    seed(corpus)
    args = [sys.argv[0], str(corpus), f"-artifact_prefix={d}/", "-max_len=131072", "-rss_limit_mb=8192",
            "-timeout=30"] + sys.argv[2:]
    atheris.Setup(args, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
