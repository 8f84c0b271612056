"""A thinking budget (issue #35 item 4): ``max_reasoning_tokens`` closes the
reply's ``<think>`` section after that many tokens -- the next tokens are
``reasoning_budget_message`` and ``</think>``, then the reply goes on.

Checked on SmolLM2 through a template that opens ``<think>`` in its
generation prompt (the section is open from the first token) and through
one that doesn't (the reply opens it), on every token loop: the one-context
native loop, the batcher (``n_parallel``), the Python loop (a logits
processor) and prompt-lookup speculative decoding.  A budgeted reply is the
unbudgeted one token for token up to the budget (the same run: what the
budget adds is only the forced close), on every CPU."""
import pytest

import llamax
from llamax.llama_speculative import LlamaPromptLookupDecoding
from llamax_dev.chat_templates import THINKING

from .conftest import make_llama

# Slow tier (`pytest tests -m slow`; .ci/run runs it): thinking budgets over long generations (~18 s).
# Moved whole to keep the README's test command within 12 minutes (docs/testing.md).
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France? Think step by step."}]
# the same conversation, through a template that leaves opening the section to the reply
PLAIN = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KW = dict(temperature=0, cache_prompt=False)


def tokens(r):
    """The generated tokens' texts (from the answer's logprobs)."""
    return [t["token"] for t in r["choices"][0]["logprobs"]["content"]]


def message(r):
    return r["choices"][0]["message"]


LOOPS = {
    "one context": dict(),
    "batcher": dict(n_parallel=3),
    "speculative": dict(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4)),
}


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k == "speculative" else k
                                        for k in LOOPS])
def thinking(request, smollm2_path):
    m = make_llama(smollm2_path, chat_template=THINKING, **LOOPS[request.param])
    yield m
    m.close()


@pytest.mark.parametrize("budget,note", [(0, None), (5, None), (7, " Time to answer.")])
def test_the_budget_closes_the_section(thinking, budget, note):
    free = thinking.create_chat_completion(ASK, max_tokens=budget + 24, logprobs=True, **KW)
    # unbudgeted, this model thinks past budget + 24 tokens: the section stays open
    assert "</think>" not in "".join(tokens(free)) and message(free)["content"] == ""
    r = thinking.create_chat_completion(ASK, max_tokens=budget + 24, logprobs=True, max_reasoning_tokens=budget,
                                        reasoning_budget_message=note, **KW)
    got, want = tokens(r), tokens(free)
    forced = [thinking.detokenize([t]).decode() for t in
              thinking.tokenize(((note or "") + "</think>").encode(), add_bos=False, special=True)]
    assert got[:budget] == want[:budget]
    assert got[budget:budget + len(forced)] == forced
    assert len(got) == r["usage"]["completion_tokens"]  # forced tokens count as generated
    assert len(got) == budget + 24 or r["choices"][0]["finish_reason"] == "stop"
    msg = message(r)
    thought = ("".join(want[:budget]) + (note or "")).strip() or None
    assert msg.get("reasoning_content") == thought  # (absent when empty)
    assert msg["content"] == "".join(got[budget + len(forced):]).lstrip()
    # streamed: the same split
    deltas = [c["choices"][0]["delta"] for c in thinking.create_chat_completion(
        ASK, max_tokens=budget + 24, max_reasoning_tokens=budget, reasoning_budget_message=note, stream=True, **KW)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (thought or "")
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]


def test_a_section_closed_within_the_budget_is_left_alone(smollm2_path):
    """The section ends by itself before the budget: nothing is forced.
    (A grammar writes it: a short thought, then the answer.)"""
    g = 'root ::= "Paris is in France." "\\n</think>\\n\\n" "It is Paris."'
    with make_llama(smollm2_path, chat_template=THINKING) as m:
        a = m.create_chat_completion(ASK, grammar=g, max_tokens=40, **KW)
        b = m.create_chat_completion(ASK, grammar=g, max_tokens=40, max_reasoning_tokens=30, **KW)
        assert message(a) == message(b) == {"role": "assistant", "content": "It is Paris.",
                                            "reasoning_content": "Paris is in France."}


def test_a_section_the_reply_opens(smollm2_path):
    """No section in the prompt: the budget counts from the reply's own
    ``<think>`` (here written under a grammar that also lets the section
    close: the forced close is text the grammar allows); a reply that does
    not open one is left alone."""
    g = 'root ::= "<think>" [^<]* "</think>" [^<]*'
    with make_llama(smollm2_path, chat_template=PLAIN) as m:
        free = m.create_chat_completion(ASK, grammar=g, max_tokens=30, logprobs=True, **KW)
        r = m.create_chat_completion(ASK, grammar=g, max_tokens=30, logprobs=True, max_reasoning_tokens=4, **KW)
        want, got = tokens(free), tokens(r)
        opener = next(i for i in range(len(want)) if "".join(want[:i + 1]).lstrip().startswith("<think>"))
        assert got[:opener + 1 + 4] == want[:opener + 1 + 4]
        assert "".join(got[opener + 1 + 4:]).startswith("</think>")
        assert "".join(want[:opener + 1 + 4 + 3]).count("</think>") == 0  # (the model alone had not closed it)
        # no section: the budget changes nothing
        a = m.create_chat_completion(ASK, max_tokens=24, logprobs=True, **KW)
        b = m.create_chat_completion(ASK, max_tokens=24, logprobs=True, max_reasoning_tokens=0, **KW)
        assert tokens(a) == tokens(b) and "<think>" not in "".join(tokens(a))


def test_the_python_token_loop_honours_the_budget(smollm2_path):
    with make_llama(smollm2_path, chat_template=THINKING) as m:
        kw = dict(max_tokens=20, logprobs=True, max_reasoning_tokens=3, **KW)
        native = m.create_chat_completion(ASK, **kw)
        python = m.create_chat_completion(ASK, logits_processor=llamax.LogitsProcessorList([lambda ids, s: s]), **kw)
        assert tokens(native) == tokens(python) and "".join(tokens(native)[3:]).startswith("</think>")


def test_a_grammar_that_forbids_the_close_is_a_grammar_error(smollm2_path):
    """Started open, a grammar without ``</think>``: the forced close is a
    dead end the grammar can't take, a GrammarError (the process goes on)."""
    with make_llama(smollm2_path, chat_template=THINKING) as m:
        with pytest.raises(llamax.GrammarError, match="grammar"):
            m.create_chat_completion(ASK, grammar='root ::= [a-zA-Z .\\n]+', max_tokens=20, max_reasoning_tokens=2,
                                     **KW)
        r = m.create_chat_completion(ASK, max_tokens=4, **KW)
        assert r["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("kw,err", [
    (dict(max_reasoning_tokens=-1), llamax.InvalidArgumentError),
    (dict(max_reasoning_tokens="8"), llamax.ArgumentTypeError),
    (dict(max_reasoning_tokens=2.5), llamax.ArgumentTypeError),
    (dict(max_reasoning_tokens=True), llamax.ArgumentTypeError),
    (dict(reasoning_budget_message="Enough."), llamax.InvalidArgumentError),
    (dict(max_reasoning_tokens=4, reasoning_budget_message=b"Enough."), llamax.ArgumentTypeError),
])
def test_bad_budgets_are_typed_errors(smollm2_path, kw, err):
    with make_llama(smollm2_path, chat_template=THINKING) as m:
        with pytest.raises(err, match="max_reasoning_tokens|reasoning_budget_message"):
            m.create_chat_completion(ASK, max_tokens=4, **kw)


def test_sampler_budget_keywords(model):
    """The budget is a sampler of the chain (llamax.Sampler): checked there too."""
    s = llamax.Sampler(model, reasoning_budget=3, reasoning_started_open=True, reasoning_budget_message="ok")
    assert s.params["reasoning_budget"] == 3 and s.params["reasoning_tags"] == ("<think>", "</think>")
    for kw, err in [(dict(reasoning_budget=-2), llamax.InvalidArgumentError),
                    (dict(reasoning_budget=1, reasoning_tags=("<think>",)), llamax.ArgumentTypeError),
                    (dict(reasoning_budget=1, reasoning_tags=("", "</think>")), llamax.ArgumentTypeError),
                    (dict(reasoning_budget=1, reasoning_started_open=1), llamax.ArgumentTypeError),
                    (dict(reasoning_started_open=True), llamax.InvalidArgumentError)]:
        with pytest.raises(err):
            llamax.Sampler(model, **kw)
