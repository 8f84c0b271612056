"""The OpenAI shaping of a request (llamax.formatters), outside the closures
it used to live in: one formatter per prepared request, the same objects
whether the answer is whole or streamed."""
from llamax.formatters import ChatFormatter, CompletionFormatter

from .conftest import same_usage

G = dict(temperature=0.0, max_tokens=8)
MSGS = [{"role": "user", "content": "Name a color."}]


def _joined(chunks, key):
    return "".join(c["choices"][0][key] if key == "text" else c["choices"][0]["delta"].get("content") or ""
                   for c in chunks)


def test_completion_whole_and_streamed_agree(base_llm):
    p = base_llm.prepare_completion("The sky is", logprobs=2, echo=True, **G)
    assert isinstance(p._fmt, CompletionFormatter)
    whole = p.run()
    chunks = list(base_llm.prepare_completion("The sky is", logprobs=2, echo=True, stream=True, **G).stream())
    assert _joined(chunks, "text") == whole["choices"][0]["text"]
    assert chunks[0]["choices"][0]["text"] == "The sky is"  # the echoed prompt first
    # text offsets run on across the pieces as in the whole answer
    streamed = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    same_usage(chunks[-1]["usage"], whole["usage"])


def test_chat_whole_and_streamed_agree(base_llm):
    p = base_llm.prepare_chat_completion(MSGS, logprobs=True, top_logprobs=1, **G)
    assert isinstance(p._fmt, ChatFormatter)
    whole = p.run()
    chunks = list(base_llm.prepare_chat_completion(MSGS, logprobs=True, top_logprobs=1, stream=True, **G).stream())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert _joined(chunks, "delta") == whole["choices"][0]["message"]["content"]
    tokens = [e["token"] for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert tokens == [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_a_formatter_is_its_requests_own(base_llm):
    a = base_llm.prepare_completion("One", logprobs=1, stream=True, **G)
    b = base_llm.prepare_completion("Two", logprobs=1, stream=True, **G)
    assert a._fmt is not b._fmt and a._fmt.cid != b._fmt.cid
    list(a.stream())
    assert b._fmt.offset == len("Two")  # a's stream moved a's offset only
    b.close()
