"""Shared fixtures: real models and files, fetched and cached once (llamax_dev.data)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import llamax
from llamax_dev import TOOLS, data  # tools/llamax_dev (pyproject.toml: pythonpath)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def smollm2_path():
    return data.smollm2()


@pytest.fixture(scope="session")
def minilm_f32():
    """all-MiniLM-L6-v2 as f32 GGUF, the weights embedding services should use on CPU."""
    return data.minilm("f32")


@pytest.fixture(scope="session")
def minilm_f16():
    """all-MiniLM-L6-v2 as f16 GGUF (converted once, cached: llamax_dev.data)."""
    return data.minilm("f16")


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


def run_py(code, timeout=300, env=None):
    """Run `code` in a fresh interpreter (crash-prone cases: a crash fails the
    test, not the run), with `env` added to the environment.  Returns the
    CompletedProcess."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(TOOLS), env.get("PYTHONPATH", "")])
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


# -- "does this adapter / control vector change the model?" ---------------------------------
#
# Tests show an adapter's effect on numbers, never by comparing greedy
# answers: whether a seeded random adapter flips a greedy token within N
# tokens depends on the CPU's kernels (an AVX-512 machine gave the base
# model's answer where an AVX2 one did not).  The measure is the first
# generated token's top-20 log-probabilities, and both sides of a comparison
# are always computed on the same machine in the same run, where a cold
# request is bit-for-bit repeatable (tests assert that too).  Across
# machines the numbers themselves differ: the base model's first-token
# logprobs differ by up to 0.47 between an AVX2 and an AVX-512 build of the
# same Q4_1 model, so no test compares a number with one from another CPU.
# Measured on both builds (tools/adapter_effects.py; README, "Tests on every CPU"): the test adapters
# move the top-20 first-token logprobs by 0.37-1.21; EFFECT is far below
# that and far above float rounding.
TOP = 20
EFFECT = 0.01
LOGPROBS_CHAT = dict(logprobs=True, top_logprobs=TOP)   # keywords for create_chat_completion
LOGPROBS_COMPLETION = dict(logprobs=TOP)                # ... and for create_completion / __call__


def first_top(result) -> dict:
    """{token text: logprob} of the first generated token's top alternatives,
    from a completion or chat result made with logprobs."""
    lp = result["choices"][0]["logprobs"]
    assert lp is not None, "make the request with LOGPROBS_CHAT / LOGPROBS_COMPLETION"
    if "content" in lp:   # chat
        return {a["token"]: a["logprob"] for a in lp["content"][0]["top_logprobs"]}
    return dict(lp["top_logprobs"][0])


def effect(a, b) -> float:
    """How far apart two results' first-token distributions are: the largest
    |difference in logprob| over the tokens in both top lists (inf if none)."""
    ta, tb = first_top(a), first_top(b)
    common = set(ta) & set(tb)
    return max(abs(ta[k] - tb[k]) for k in common) if common else float("inf")


def assert_changed(result, reference):
    e = effect(result, reference)
    assert e > EFFECT, f"first-token logprobs moved by {e:.4f}, not more than {EFFECT}"


def assert_distinct(results):
    """Every pair of results differs in its first-token distribution."""
    for i in range(len(results)):
        for j in range(i + 1, len(results)):
            e = effect(results[i], results[j])
            assert e > EFFECT, f"results {i} and {j}: first-token logprobs differ by only {e:.4f}"


def assert_same_embeddings(got, want, min_cosine=0.9999, max_share=0.01):
    """Each row of ``got`` is the embedding of the same input as that row of
    ``want``, computed in another batch (or alone): llama.cpp's attention
    sums an input's keys in an order that depends on where the input sits
    in its batch, so on some kernel sets the bits differ (AVX2: by up to
    0.022 on a SmolLM2 vector, as issue #29 reported).  The tolerance comes from the same
    run, not from one CPU: cosine >= ``min_cosine``, and each row's distance
    to its own reference at most ``max_share`` of the distance between the
    two closest different references."""
    got, want = np.atleast_2d(np.asarray(got, np.float64)), np.atleast_2d(np.asarray(want, np.float64))
    assert got.shape == want.shape, (got.shape, want.shape)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= min_cosine, f"cosine {cos.min():.6f} < {min_cosine}"
    dist = np.linalg.norm(got - want, axis=1)
    if len(want) > 1:
        apart = np.linalg.norm(want[:, None, :] - want[None, :, :], axis=2)
        nearest = apart[~np.eye(len(want), dtype=bool)].min()
        assert nearest > 0, "two references are the same vector: use different inputs"
        assert dist.max() <= max_share * nearest, \
            f"a row is {dist.max():.4g} from its reference, more than {max_share} of {nearest:.4g} between inputs"


@pytest.fixture(scope="session")
def adapters(gen_dir, smollm2_path):
    """The servers' adapters: two strong enough to move SmolLM2's logits, a
    control vector, an adapter for another base model, and the folder
    runtime loads may read from."""
    from llamax import gguf_tools as gt
    d = gen_dir / "server"
    lora_dir = d / "loras"
    lora_dir.mkdir(parents=True)
    out = {
        "coder": gt.make_lora(smollm2_path, d / "coder.gguf", rank=8, seed=11, std=0.05),
        "writer": gt.make_lora(smollm2_path, d / "writer.gguf", rank=8, seed=12, std=0.05,
                               targets=("attn_q", "ffn_up")),
        "calm": gt.make_control_vector(d / "calm.gguf", 576, range(2, 20), seed=3, std=0.5),
        "runtime": gt.make_lora(smollm2_path, lora_dir / "runtime.gguf", rank=4, seed=13, std=0.05),
        "lora_dir": lora_dir,
    }
    tiny = gt.make_tiny_llama(d / "tiny.gguf", smollm2_path)
    out["foreign"] = gt.make_lora(tiny, lora_dir / "foreign.gguf", rank=4, seed=14)
    (lora_dir / "sub").mkdir()
    os.symlink(d / "coder.gguf", lora_dir / "sub" / "escape.gguf")  # points outside the folder
    return out


# Variants of a check the default tier already runs in another variant (issue
# #29 item 3: the default tier within 12 minutes on 2 cores): the slow tier
# runs these too.  Each line: a test id as pytest prints it, and the variant
# the default tier keeps.  (Tests that are slow whatever their parameters are
# marked where they are defined.)
SLOW_VARIANTS = {
    # tool calls: SmolLM2's own template (generic) and Hermes', 2-20 s each on AVX2
    "tests/api/test_tool_calls.py::test_required_and_named_calls_always_validate[generic-coder+translator]",
    "tests/api/test_tool_calls.py::test_required_and_named_calls_always_validate[hermes-base]",
    "tests/api/test_tool_calls.py::test_required_and_named_calls_always_validate[hermes-coder+translator]",
    # (kept: [generic-base])
    "tests/api/test_tool_calls.py::test_streamed_deltas_join_to_the_whole_answer[generic-True]",
    "tests/api/test_tool_calls.py::test_streamed_deltas_join_to_the_whole_answer[generic-False]",
    "tests/api/test_tool_calls.py::test_streamed_deltas_join_to_the_whole_answer[hermes-True]",
    # (kept: [hermes-False])
    "tests/api/test_tool_calls.py::test_auto_answers_in_words_or_with_valid_calls[generic]",   # (kept: hermes)
    "tests/api/test_tool_calls.py::test_agent_loop_three_steps[hermes]",                       # (kept: generic)
    "tests/api/test_tool_calls.py::test_legacy_functions_and_function_call[hermes]",           # (kept: generic)
    # a short prompt preempting a long prompt's chunks, with and without aligned prefixes (kept: False)
    "tests/core/test_batcher.py::test_a_short_prompt_preempts_a_long_prompt_chunk[True]",
    # neighbours not stalled by a long request, 1 and 4 slots (kept: parallel4-long_prompt and the short kinds)
    "tests/server/test_neighbours.py::test_neighbours_are_not_stalled[parallel1-long_prompt]",
    "tests/server/test_neighbours.py::test_neighbours_are_not_stalled[parallel1-long_completion]",
    "tests/server/test_neighbours.py::test_neighbours_are_not_stalled[parallel4-long_completion]",
}


@pytest.hookimpl(tryfirst=True)   # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    ids = {item.nodeid for item in items}
    files = {i.split("::")[0] for i in ids}
    stale = sorted(v for v in SLOW_VARIANTS if v.split("::")[0] in files and v not in ids)
    if stale:   # a renamed test or parameter: the list would silently keep it in the default tier
        raise pytest.UsageError(f"tests/conftest.py SLOW_VARIANTS names tests that do not exist: {stale}")
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
