"""Long texts tokenize without crashing and without quadratic work.

Three llama.cpp defects, fixed in llamax (README, "Reliability"):

* BPE vocabularies whose pre-tokenizer regex llama.cpp runs with std::regex
  (DeepSeek, Falcon, GPT-NeoX, Aquila, ...) overflowed the stack on a run of
  ~26k characters of one class (SIGSEGV).  ``tokenize_safe`` in the shim runs
  long BPE texts on a thread with a stack sized from the text.
* SPM byte-fallback characters (newline, tab) were quadratic:
  third_party/patches/0001-spm-byte-fallback-linear.patch.
* Many special tokens in one text (parse_special) were quadratic:
  third_party/patches/0002-special-token-partition-linear.patch.

Each case runs in its own interpreter: a crash is reported as a failure
here, not as the death of the test run.  The timeout is a hang detector
with a wide margin (the fixed code takes well under a second for each case,
the quadratic one minutes), not a speed assertion.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamax_dev import data

# Slow tier (`pytest tests -m slow`; .ci/run runs it): megabyte-long texts (~12 s).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# (vocabulary, run of characters): each crashed or stalled before the fixes.
RUNS = [
    ("deepseek-llm", "a"), ("deepseek-llm", " "), ("deepseek-llm", "1"),
    ("deepseek-coder", "中"), ("deepseek-coder", "."),
    ("falcon", "<"), ("gpt-neox", "1"), ("aquila", "."),
    ("llama-spm", "\n"), ("llama-spm", "\t"),
]


def _run(body: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("vocab,ch", RUNS, ids=[f"{v}-{c!r}" for v, c in RUNS])
def test_long_run_round_trips(vocab, ch):
    path = data.vocab_dir() / f"ggml-vocab-{vocab}.gguf"
    r = _run(f"""
        import llamax
        m = llamax.Model({str(path)!r}, vocab_only=True)
        text = {ch!r} * 200_000
        toks = m.tokenize(text, add_special=False)
        assert len(toks) > 0
        back = m.detokenize(toks).decode("utf-8")
        # SPM adds its leading space marker; everything else is exact
        assert back.lstrip(" ") == text.lstrip(" "), (len(back), len(text))
        # the batch path (embeddings) takes the same road
        flat, offs = m.tokenize_batch([text, "x"], add_special=False)
        assert flat[: offs[1]].tolist() == toks.tolist()
        print("ok", len(toks))
    """)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.startswith("ok")


def test_spm_newlines_are_linear_and_exact():
    path = data.vocab_dir() / "ggml-vocab-llama-spm.gguf"
    r = _run(f"""
        import llamax
        m = llamax.Model({str(path)!r}, vocab_only=True)
        nl = m.tokenize("\\n", add_special=False).tolist()[-1]
        toks = m.tokenize("\\n" * 2_000_000, add_special=False).tolist()
        # the space marker SPM adds, then one byte token per newline
        assert toks[1:] == [nl] * 2_000_000, toks[:5]
        print("ok")
    """, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"


def test_refused_stack_is_a_typed_error():
    """A text too long for any stack the system will map raises
    OutOfMemoryError naming the size, instead of crashing.  Address space
    is capped with RLIMIT_AS so the refusal happens on every machine."""
    path = data.vocab_dir() / "ggml-vocab-deepseek-llm.gguf"
    r = _run(f"""
        import resource, llamax
        m = llamax.Model({str(path)!r}, vocab_only=True)
        cap = 4 << 30
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        try:
            m.tokenize("a" * (8 << 20))
        except llamax.OutOfMemoryError as e:
            assert "smaller pieces" in str(e) and "MiB stack" in str(e), e
            print("ok")
        else:
            raise SystemExit("no error")
    """)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout} {r.stderr[-2000:]}"


@pytest.mark.parametrize("vocab,special", [("gpt-2", "<|endoftext|>"), ("llama-bpe", "<|eot_id|>"),
                                           ("aquila", "<|endoftext|>")])
def test_many_special_tokens(vocab, special):
    """Special-token partitioning (third_party/patches/0002): 150k special
    tokens in one text were minutes of uncancellable work; the split must
    still equal tokenizing the text between them on its own."""
    path = data.vocab_dir() / f"ggml-vocab-{vocab}.gguf"
    r = _run(f"""
        import random, llamax
        m = llamax.Model({str(path)!r}, vocab_only=True)
        sp = {special!r}
        sid = m.tokenize(sp, add_special=False, parse_special=True).tolist()
        assert len(sid) == 1, sid
        toks = m.tokenize(sp * 150_000, add_special=False, parse_special=True).tolist()
        assert toks == sid * 150_000
        rng = random.Random(7)
        words = ["ab", "12x", "Hello,", "q"]
        parts = [rng.choice(words + [sp]) for _ in range(3000)]
        # words separated by the special token tokenize as if alone
        text = sp.join(p for p in parts if p != sp)
        got = m.tokenize(text, add_special=False, parse_special=True).tolist()
        exp = []
        for i, p in enumerate(q for q in parts if q != sp):
            if i:
                exp += sid
            exp += m.tokenize(p, add_special=False).tolist()
        assert got == exp
        print("ok")
    """, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
