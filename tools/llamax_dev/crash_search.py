"""Property-based search for crashes: random constructor and request
parameters of Model, Context, Sampler, Llama and Embedder (and long texts on
each of llama.cpp's vocabularies), each example run
in its own interpreter, whose outcome must be "works" or "a typed
LlamaxError" -- never a signal (abort, segfault), a hang, or another
exception.

Used by tests/hardening/test_crash_search.py (a short run in CI) and by
tools/find_crashes.py (long runs, counts in the README).  The worker side
is ``python tools/llamax_dev/crash_search.py '<json spec>'``: it runs one
scenario and prints ``OUTCOME ok``, ``OUTCOME typed <class>`` or
``OUTCOME untyped <class>``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Boundary-heavy value sets: llama.cpp's asserts sit at powers of two, 64-
# and 256-multiples, and at relations between these values.
SIZES = [0, 1, 2, 3, 31, 32, 63, 64, 65, 100, 127, 128, 255, 256, 257, 511, 512, 513, 1000, 1024, 2048]
SEQS = [1, 2, 3, 4, 7, 8, 63, 64, 65, 128, 255, 256, 257]
TOKENS = [0, 1, 2, 3, 100, 1000, 49151, 49152, -1, 2**31 - 1]
GRAMMARS = [
    None,
    'root ::= "yes" | "no"',
    'root ::= [a-z ]+ "."',
    r'root ::= [\x00]',                          # nothing matches
    'root ::= "{" ws "\\"a\\"" ws ":" ws [0-9]+ ws "}"\nws ::= [ \\t\\n]*',
    "root ::= " + "(" * 200 + '"a"' + ")" * 200,
    'root ::= x\nx ::= x "a" | "b"',              # left recursion
    "root ::= (",                                # a syntax error
    'root ::= "a"{0,3000}',                      # over llama.cpp's repetition limit
]
TEXTS = ["", " ", "Hello", "The quick brown fox jumps over the lazy dog. " * 40, "<|im_start|>user\nhi<|im_end|>",
         "\u00e9\u00e8 \u4f60\u597d \U0001f600", "\ud800 lone", "word " * 700, "\x00nul"]

VOCABS = ["aquila", "baichuan", "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4",
          "gpt-2", "gpt-neox", "llama-bpe", "llama-spm", "mpt", "nomic-bert-moe", "phi-3", "qwen2", "qwen35",
          "refact", "starcoder"]
RUN_PIECES = ["a", "A", "1", " ", "\n", "\t", "\r\n", ".", "<", "\u00e9", "\u4e2d", "\U0001f600", "\u200b",
              "\u0301", "'s", " a", "a1", "<s>", "<|endoftext|>", "[CLS]", "\x00"]


def strategies():
    """The hypothesis strategy of one scenario spec (a JSON-able dict)."""
    from hypothesis import strategies as st

    size = st.sampled_from(SIZES)
    sampler = st.fixed_dictionaries({}, optional={
        "temperature": st.sampled_from([0.0, 1e-30, 0.5, 1.0, 100.0, -1.0]),
        "top_k": st.sampled_from([0, 1, 40, 2**31 - 1]),
        "top_p": st.sampled_from([0.0, 0.5, 1.0]),
        "min_p": st.sampled_from([0.0, 0.05, 1.0]),
        "typical_p": st.sampled_from([0.0, 0.5, 1.0]),
        "repeat_penalty": st.sampled_from([1.0, 1.1, 1e-6, 1e6]),
        "frequency_penalty": st.sampled_from([0.0, 1.0, -100.0]),
        "presence_penalty": st.sampled_from([0.0, 2.0]),
        "penalty_last_n": st.sampled_from([0, 1, 64, 1 << 20]),
        "seed": st.sampled_from([0, 1, 2**32 - 1]),
        "grammar": st.sampled_from(GRAMMARS),
        "logit_bias": st.sampled_from([None, {}, {"2": -1e9}, {"0": 1e9}, "ban-all", {"49151": float("-inf")}]),
    })
    ops = st.lists(st.one_of(
        st.tuples(st.just("decode"), st.sampled_from([1, 2, 7, 64, 65, 128, 257, 513, 1025]),
                  st.sampled_from(["last", "all", "seqs"]), st.sampled_from([None, 0, 100, 600, 5000])),
        st.tuples(st.just("generate"), st.sampled_from([0, 1, 8, 40]), st.sampled_from([0, 1, 3])),
        st.tuples(st.just("logits")),
        st.tuples(st.just("sample"), st.sampled_from([-1, 0, 1, -2])),
        st.tuples(st.just("kv"), st.sampled_from(["clear", "remove", "copy", "keep", "pos_max"]),
                  st.sampled_from([-2, -1, 0, 1, 3]), st.sampled_from([-1, 0, 1, 5]),
                  st.sampled_from([-1, 0, 2, 100])),
        st.tuples(st.just("embed"), st.sampled_from([1, 2, 65]), st.sampled_from([1, 3, 200, 600])),
        st.tuples(st.just("accept"), st.sampled_from(TOKENS)),
    ), max_size=4)
    context = st.fixed_dictionaries({
        "kind": st.just("context"),
        "model": st.sampled_from(["smol", "minilm"]),
        "ctx": st.fixed_dictionaries({}, optional={
            "n_ctx": size, "n_batch": size, "n_ubatch": size, "n_seq_max": st.sampled_from(SEQS),
            "n_threads": st.sampled_from([1, 2]), "embeddings": st.booleans(),
            "pooling": st.sampled_from([None, "none", "mean", "cls", "last", "rank"]),
            "flash_attn": st.sampled_from([None, True, False]), "kv_unified": st.booleans()}),
        "sampler": sampler,
        "ops": ops,
    })
    request = st.fixed_dictionaries({}, optional={
        "max_tokens": st.sampled_from([None, 0, 1, 16, 100]),
        "temperature": st.sampled_from([0.0, 0.7]),
        "top_k": st.sampled_from([0, 1, 50]),
        "stop": st.sampled_from([None, "", ".", ["\n", "The"], ["x" * 300]]),
        "logprobs": st.sampled_from([None, 0, 1, 20, 50000]),
        "echo": st.booleans(),
        "seed": st.sampled_from([None, 0, 7]),
        "grammar": st.sampled_from(GRAMMARS),
        "repeat_penalty": st.sampled_from([1.0, 1.3]),
    })
    llama = st.fixed_dictionaries({
        "kind": st.just("llama"),
        "model": st.sampled_from(["smol", "minilm"]),
        "ctor": st.fixed_dictionaries({}, optional={
            "n_ctx": size, "n_batch": size, "n_ubatch": size, "n_threads": st.sampled_from([1, 2]),
            "n_contexts": st.sampled_from([0, 1, 2]), "embedding": st.booleans(),
            "pooling": st.sampled_from([None, "mean", "cls", "last", "none"]),
            "prefix_cache": st.booleans(), "chat_format": st.sampled_from([None, "chatml", "llama-3"])}),
        "call": st.sampled_from(["completion", "chat", "stream", "embed", "chat_stream", "tokenize"]),
        "text": st.sampled_from(TEXTS),
        "request": request,
    })
    embedder = st.fixed_dictionaries({
        "kind": st.just("embedder"),
        "ctor": st.fixed_dictionaries({}, optional={
            "n_ctx": st.sampled_from([None] + SIZES), "max_seq_length": st.sampled_from([None, 1, 16, 128, 512, 600]),
            "pooling": st.sampled_from([None, "mean", "cls", "last", "none"]), "n_threads": st.sampled_from([1, 2])}),
        "texts": st.lists(st.sampled_from(TEXTS), min_size=0, max_size=6),
        "batch_size": st.sampled_from([1, 2, 32, 0]),
        "normalize": st.booleans(),
    })
    vocab = st.fixed_dictionaries({
        "kind": st.just("vocab"),
        "vocab": st.sampled_from(VOCABS),
        # runs of one character class: llama.cpp's regex pre-tokenizers and
        # byte fallback are where length turns into stack depth or quadratic work
        "runs": st.lists(st.tuples(st.sampled_from(RUN_PIECES), st.sampled_from([1, 3, 1000, 30000, 120000])),
                         min_size=1, max_size=3),
        "add_special": st.booleans(), "parse_special": st.booleans(), "special": st.booleans(),
    })
    return st.one_of(context, llama, embedder, vocab)


def run(spec: dict, timeout: float = 120.0) -> tuple[str, str]:
    """Run one scenario in a fresh interpreter: (outcome, detail).  outcome is
    'ok', 'typed', or a failure: 'untyped', 'crash', 'hang'."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")  # tools/: llamax_dev
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)], capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=str(HERE))
    except subprocess.TimeoutExpired:
        return "hang", f"no result in {timeout:.0f} s"
    lines = [x for x in r.stdout.splitlines() if x.startswith("OUTCOME ")]
    if r.returncode != 0 or not lines:
        return "crash", f"exit {r.returncode}: {r.stderr[-3000:]}"
    parts = lines[-1].split(" ", 2)
    return parts[1], (parts[2] if len(parts) > 2 else "") + ("\n" + r.stderr[-3000:] if parts[1] == "untyped" else "")


# -- the worker ---------------------------------------------------------------------------------

def _paths():
    from llamax_dev import data
    return {"smol": str(data.smollm2()), "minilm": str(data.minilm())}


def _sampler_kwargs(model, kw):
    kw = dict(kw)
    if kw.get("logit_bias") == "ban-all":
        kw["logit_bias"] = {t: float("-inf") for t in range(model.n_vocab)}
    elif isinstance(kw.get("logit_bias"), dict):
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    return kw


def _context_scenario(spec, llamax, np):
    m = llamax.Model(_paths()[spec["model"]])
    c = llamax.Context(m, **{"n_threads": 1, **spec["ctx"]})  # (2 threads stall on a busy 2-core machine)
    s = llamax.Sampler(m, **_sampler_kwargs(m, spec["sampler"]))
    rng = np.random.default_rng(0)
    views = []
    for op in spec["ops"]:
        if op[0] == "decode":
            _, n, mode, pos0 = op
            toks = rng.integers(10, 1000, n).astype(np.int32)
            kw = {}
            if mode == "seqs":
                kw["seq_ids"] = (np.arange(n) % c.n_seq_max).astype(np.int32)
                kw["logits"] = "last"
            else:
                kw["logits"] = mode
            if pos0 is not None:
                kw["pos"] = np.arange(pos0, pos0 + n, dtype=np.int32)
            c.decode(toks, **kw)
        elif op[0] == "generate":
            _, n_max, n_prompt = op
            c.generate(rng.integers(10, 1000, n_prompt).astype(np.int32), s, max_tokens=n_max)
        elif op[0] == "logits":
            views.append(c.get_logits())
            views.append(c.get_embeddings())
        elif op[0] == "sample":
            s.sample(c, op[1])
        elif op[0] == "kv":
            _, what, a, b, p = op
            if what == "clear":
                c.kv_clear()
            elif what == "remove":
                c.kv_remove(a, b, p)
            elif what == "copy":
                c.kv_copy(max(a, 0), max(b, 0), -1 if p < 0 else p, p + 5 if p >= 0 else -1)
            elif what == "keep":
                c.kv_keep(a)
            else:
                c.seq_pos_max(a)
        elif op[0] == "embed":
            _, n_inputs, length = op
            toks = rng.integers(1000, 2000, n_inputs * length).astype(np.int32)
            c.embed(toks, np.arange(0, n_inputs * length + 1, length, dtype=np.int64))
        elif op[0] == "accept":
            s.accept(op[1])
    for v in views:  # read every view: no freed memory may be behind one
        float(np.asarray(v, dtype=np.float64).sum())


def _llama_scenario(spec, llamax):
    llm = llamax.Llama(_paths()[spec["model"]], **{"n_threads": 1, **spec["ctor"]})
    req = dict(spec["request"])
    text = spec["text"]
    call = spec["call"]
    if call == "tokenize":
        llm.detokenize(llm.tokenize(text.encode("utf-8", "surrogatepass")))
    elif call == "embed":
        llm.embed_array([text, text[:10]])
    elif call in ("chat", "chat_stream"):
        req.pop("echo", None)
        lp = req.pop("logprobs", None)
        if lp is not None:
            req["logprobs"], req["top_logprobs"] = True, min(lp, 20)
        r = llm.create_chat_completion([{"role": "user", "content": text}], stream=call == "chat_stream", **req)
        if call == "chat_stream":
            list(r)
    else:
        r = llm.create_completion(text, stream=call == "stream", **req)
        if call == "stream":
            list(r)
    llm.close()


def _vocab_scenario(spec, llamax):
    from llamax_dev import data
    m = llamax.Model(data.vocab_dir() / f"ggml-vocab-{spec['vocab']}.gguf", vocab_only=True)
    text = "".join(piece * n for piece, n in spec["runs"])
    toks = m.tokenize(text, add_special=spec["add_special"], parse_special=spec["parse_special"])
    m.detokenize(toks, special=spec["special"])
    m.tokenize_batch([text, text[:100]], add_special=spec["add_special"], parse_special=spec["parse_special"])


def _embedder_scenario(spec, llamax):
    e = llamax.Embedder(_paths()["minilm"], **{"n_threads": 1, **spec["ctor"]})
    e.encode(spec["texts"], batch_size=spec["batch_size"], normalize_embeddings=spec["normalize"])


def _worker(spec):
    import numpy as np
    import llamax
    try:
        if spec["kind"] == "context":
            _context_scenario(spec, llamax, np)
        elif spec["kind"] == "llama":
            _llama_scenario(spec, llamax)
        elif spec["kind"] == "vocab":
            _vocab_scenario(spec, llamax)
        else:
            _embedder_scenario(spec, llamax)
    except llamax.LlamaxError as e:
        print(f"OUTCOME typed {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    except Exception as e:  # noqa: BLE001 (the finding)
        import traceback
        traceback.print_exc()
        print(f"OUTCOME untyped {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    print("OUTCOME ok", flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
