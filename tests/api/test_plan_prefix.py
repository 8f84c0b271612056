"""llamax.request.plan_prefix: how much cached KV a request keeps, as a pure
function of the context's slot, the prompt, its key and the policy.  No
model: a pool slot is plain data (its context is not touched)."""
import numpy as np
import pytest

from llamax.pool import _Slot
from llamax.request import PrefixPolicy, plan_prefix

EXACT = PrefixPolicy(cache=True, exact=True, chunk=4)
ANY = PrefixPolicy(cache=True, exact=False, chunk=4)
OFF = PrefixPolicy(cache=False, exact=True, chunk=4)


def slot(held, key="k", logits_n=-1, exact_n=None):
    s = _Slot(ctx=None)
    s.tokens = np.asarray(held, np.int32)
    s.key = key
    s.logits_n = logits_n
    s.exact_n = len(held) // 4 * 4 if exact_n is None else exact_n
    return s


def toks(n, tail=()):
    return np.asarray(list(range(n)) + list(tail), np.int32)


def test_another_key_keeps_nothing():
    assert plan_prefix(slot(toks(12), key="other"), toks(12, [99]), "k", EXACT) == 0
    assert plan_prefix(slot(toks(12), key=None), toks(12, [99]), "k", ANY) == 0


def test_exact_keeps_whole_chunks_of_what_was_decoded_in_chunks():
    s = slot(toks(11))          # 11 held, exact_n 8
    assert plan_prefix(s, toks(11, [50, 51]), "k", EXACT) == 8
    s = slot(toks(11), exact_n=4)  # only the first chunk was decoded as a whole chunk
    assert plan_prefix(s, toks(11, [50]), "k", EXACT) == 4
    assert plan_prefix(slot(toks(3)), toks(3, [7]), "k", EXACT) == 0  # under one chunk


def test_any_prefix_keeps_the_common_prefix():
    assert plan_prefix(slot(toks(11)), toks(11, [50, 51]), "k", ANY) == 11
    diverged = np.asarray([0, 1, 2, 77, 4, 5], np.int32)
    assert plan_prefix(slot(toks(11)), diverged, "k", ANY) == 3


def test_at_least_one_token_is_decoded_unless_saved_logits_serve():
    same = toks(12)
    assert plan_prefix(slot(same), same, "k", ANY) == 11       # no saved logits: decode the last token
    assert plan_prefix(slot(same), same, "k", EXACT) == 8      # whole chunks below n - 1
    assert plan_prefix(slot(same, logits_n=12), same, "k", EXACT) == 12   # sample from the saved logits
    assert plan_prefix(slot(same, logits_n=12), same, "k", OFF) == 12     # an exact repeat, cache off


def test_live_logits_and_cache_prompt_false():
    same = toks(12)
    live = PrefixPolicy(cache=True, exact=True, chunk=4, live_logits=True)
    assert plan_prefix(slot(same, logits_n=12), same, "k", live) == 8  # logprobs: the live buffer
    no = PrefixPolicy(cache=True, exact=False, chunk=4, cache_prompt=False)
    assert plan_prefix(slot(same, logits_n=12), same, "k", no) == 0
    assert plan_prefix(slot(toks(11)), toks(11, [5]), "k", no) == 0


def test_cache_off_keeps_nothing_but_a_repeat():
    assert plan_prefix(slot(toks(11)), toks(11, [50]), "k", OFF) == 0


@pytest.mark.parametrize("policy", [EXACT, ANY, OFF])
def test_pure(policy):
    s = slot(toks(9), logits_n=9)
    before = (s.tokens.copy(), s.key, s.logits_n, s.exact_n)
    prompt = toks(9, [3])
    keep = plan_prefix(s, prompt, "k", policy)
    assert 0 <= keep <= len(prompt)
    assert np.array_equal(s.tokens, before[0]) and (s.key, s.logits_n, s.exact_n) == before[1:]
    assert plan_prefix(s, prompt, "k", policy) == keep
