"""Tenants in the batcher: who gets a free slot (weighted fair share,
priority, the reserve that keeps a slot for a newcomer), and a prefix cache
scoped by salt.  Orders are read from ``BatchSequence.admit_order``, the
batcher's own count, so nothing here depends on timing."""
import time

import pytest

import llamax

from conftest import greedy

A, B, C = 101, 202, 303


def batcher(model, slots=4, **kw):
    ctx = llamax.Context(model, n_ctx=256 * slots, n_seq_max=slots, kv_unified=False, n_threads=2)
    return ctx, llamax.Batcher(ctx, **kw)


def first_token(seq):
    toks = seq.next()
    assert toks, "the sequence ended before its first token"
    return toks


def generating(b, model, toks, n=3, max_tokens=300, tenant=A):
    """n sequences of `tenant`, each past its first token."""
    seqs = [b.submit(toks, greedy(model), max_tokens=max_tokens, ignore_eos=True, tenant=tenant) for _ in range(n)]
    for s in seqs:
        first_token(s)
    return seqs


def test_fifo_without_tenants(model):
    """No tenant ids: first come, first served (today's order)."""
    toks = model.tokenize("Once upon a time")
    ctx, b = batcher(model)
    with ctx, b:
        flood = [b.submit(toks, greedy(model), max_tokens=12, ignore_eos=True) for _ in range(8)]
        late = b.submit(toks, greedy(model), max_tokens=4, ignore_eos=True)
        for s in flood + [late]:
            s.result()
        assert late.admit_order == 9
        assert sorted(s.admit_order for s in flood) == list(range(1, 9))


def test_a_tenant_with_one_request_is_next(model):
    """Tenant A floods 8 sequences into 4 slots; B's one request gets the
    next free slot, ahead of A's waiting ones (A holds more slots)."""
    toks = model.tokenize("Once upon a time")
    ctx, b = batcher(model)
    with ctx, b:
        flood = [b.submit(toks, greedy(model), max_tokens=12 + 4 * i, ignore_eos=True, tenant=A)
                 for i in range(8)]
        late = b.submit(toks, greedy(model), max_tokens=4, ignore_eos=True, tenant=B)
        for s in flood + [late]:
            s.result()
        assert late.admit_order <= 5, late.admit_order
        # A's own sequences keep their order
        orders = [s.admit_order for s in flood]
        assert orders == sorted(orders)


def test_weights_split_the_slots(model):
    """Two tenants flooding: slots go by slots held per unit of weight, so a
    tenant of weight 3 gets about 3 of every 4 slots while both wait."""
    toks = model.tokenize("1, 2, 3,")
    ctx, b = batcher(model, slots=4)
    with ctx, b:
        heavy = [b.submit(toks, greedy(model), max_tokens=6, ignore_eos=True, tenant=A, weight=3.0)
                 for _ in range(12)]
        light = [b.submit(toks, greedy(model), max_tokens=6, ignore_eos=True, tenant=B, weight=1.0)
                 for _ in range(12)]
        for s in heavy + light:
            s.result()
        first8 = sorted(heavy + light, key=lambda s: s.admit_order)[:8]
        n_heavy = sum(s in heavy for s in first8)
        # FIFO would give all 8 to A (submitted first); equal weights 4 and 4
        assert 5 <= n_heavy <= 7, n_heavy


def test_priority_goes_first(model):
    toks = model.tokenize("Hello my name is")
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        running = [b.submit(toks, greedy(model), max_tokens=40, ignore_eos=True, tenant=A) for _ in range(2)]
        for s in running:
            first_token(s)  # both admitted
        waiting = [b.submit(toks, greedy(model), max_tokens=4, ignore_eos=True, tenant=B) for _ in range(3)]
        urgent = b.submit(toks, greedy(model), max_tokens=4, ignore_eos=True, tenant=C, priority=5)
        for s in running + waiting + [urgent]:
            s.result()
        assert urgent.admit_order == 3
        assert [s.admit_order for s in waiting] == [4, 5, 6]


def test_reserve_keeps_a_slot_for_a_newcomer(model):
    """reserve_slots=1: a lone tenant flooding 4 slots holds 3; another
    tenant's request takes the 4th at once, before any of the flood ends."""
    toks = model.tokenize("The capital of France is")
    ctx, b = batcher(model, slots=4, reserve_slots=1)
    with ctx, b:
        flood = [b.submit(toks, greedy(model), max_tokens=200, ignore_eos=True, tenant=A) for _ in range(6)]
        for s in flood[:3]:
            first_token(s)
        assert sorted(s.admit_order for s in flood[:3]) == [1, 2, 3]
        assert all(s.admit_order == 0 for s in flood[3:])  # the 4th slot is the reserve
        assert flood[3].queue_seconds is None and flood[0].queue_seconds >= 0
        late = b.submit(toks, greedy(model), max_tokens=4, ignore_eos=True, tenant=B)
        first_token(late)
        assert late.admit_order == 4
        assert all(not s.done for s in flood[:3])  # no slot was freed for it
        late.result()
        for s in flood[:3]:
            s.cancel()
        for s in flood:
            s.result()
        assert sorted(s.admit_order for s in flood[3:]) == [5, 6, 7]


def test_a_newcomer_tenant_is_decoded_as_if_alone(model):
    """With a reserve, another tenant's first short prompt gets a decode of
    its own: its first token (and logprobs) are those of the prompt decoded
    alone, bit for bit, while the flood keeps generating."""
    toks = model.tokenize("The capital of France is")
    late_toks = model.tokenize("Water boils at")
    ctx, b = batcher(model, slots=4, reserve_slots=1)
    with ctx, b:
        flood = generating(b, model, toks)
        late = b.submit(late_toks, greedy(model), max_tokens=1, logprobs=3, tenant=B)
        got, _ = late.result()
        lp = late.logprobs[0]
        st = b.stats()
        assert all(not s.done for s in flood)
        for s in flood:
            s.cancel()
    assert st["n_newcomer_steps"] >= 1
    # the seconds: the newcomer's steps are part of the decoding, and the
    # decoding is more than them (the flood's decodes)
    assert 0 < st["newcomer_s"] < st["decode_s"]
    assert st["newcomer_s"] + st["preempted_s"] <= st["decode_s"]
    ctx2, b2 = batcher(model, slots=4)
    with ctx2, b2:
        alone = b2.submit(late_toks, greedy(model), max_tokens=1, logprobs=3)
        want, _ = alone.result()
        st2 = b2.stats()
        assert st2["n_newcomer_steps"] == 0 and st2["newcomer_s"] == 0 and st2["preempted_s"] == 0
        assert st2["decode_s"] > 0
        assert got.tolist() == want.tolist()
        assert lp == alone.logprobs[0]


@pytest.mark.parametrize("preempt", ["1", "0"])
def test_newcomer_preemption_and_its_switch(model, monkeypatch, preempt):
    """A newcomer tenant arriving while the flood's decode is in flight
    aborts it (redone after the newcomer's own step); with
    LLAMAX_NEWCOMER_PREEMPT=0 (read when the batcher is made) it waits for
    that decode instead and still gets its step.  Either way its first
    token is the one it gets alone.  (The default's >= 1 preemption relies
    on an arrival landing inside a decode, which the flood keeps running
    back to back: up to 4 rounds of six arrivals, until one has; a fresh
    clone once saw none in one round, on a loaded 2-core machine.  The
    switch's 0 holds whatever the timing.)  Each arrival waits a part of
    the mean decode first: submitted the moment the previous newcomer is
    done, it can win the race against the flood's next decode every time
    (CI saw 24 such arrivals and no preemption: 50 decodes, 2 a newcomer),
    and then it preempts nothing.  Waiting picks no outcome: it only gives
    the flood's decode a chance to be in flight."""
    monkeypatch.setenv("LLAMAX_NEWCOMER_PREEMPT", preempt)
    toks = model.tokenize("The capital of France is")
    late_toks = model.tokenize("Water boils at")
    ctx, b = batcher(model, slots=4, reserve_slots=1)
    got = []
    with ctx, b:
        flood = generating(b, model, toks, max_tokens=400)
        for _ in range(4 if preempt == "1" else 1):
            for part in (0.1, 0.3, 0.5, 0.2, 0.4, 0.6):
                st = b.stats()
                time.sleep(part * st["decode_s"] / max(st["n_decodes"], 1))
                got.append(b.submit(late_toks, greedy(model), max_tokens=2, ignore_eos=True,
                                    tenant=B).result()[0][0])
            st = b.stats()
            if st["n_preempted"]:
                break
        assert all(not s.done for s in flood)
        for s in flood:
            s.cancel()
    ctx2, b2 = batcher(model, slots=4)
    with ctx2, b2:
        want = b2.submit(late_toks, greedy(model), max_tokens=2, ignore_eos=True).result()[0][0]
    assert got == [want] * len(got)
    assert st["n_newcomer_steps"] >= len(got)
    if preempt == "1":
        assert st["n_preempted"] >= 1 and st["preempted_s"] > 0, st
    else:
        assert st["n_preempted"] == 0 and st["preempted_s"] == 0, st


def test_reserve_holds_for_sequences_without_a_tenant(model):
    """Sequences without a tenant id count as one tenant: with a reserve,
    they too leave the last slot free while they hold their share."""
    toks = model.tokenize("The capital of France is")
    ctx, b = batcher(model, slots=2, reserve_slots=1)
    with ctx, b:
        seqs = [b.submit(toks, greedy(model), max_tokens=30, ignore_eos=True) for _ in range(2)]
        first_token(seqs[0])
        first_token(seqs[0])  # a step later: the second still waits
        assert seqs[1].admit_order == 0
        for s in seqs:
            s.result()
        assert seqs[1].admit_order == 2


def test_fair_share_arguments_are_checked(model):
    toks = model.tokenize("Hi")
    ctx, b = batcher(model, slots=2)
    with ctx, b:
        for kw, err in [(dict(tenant=-1), llamax.InvalidArgumentError),
                        (dict(tenant="a"), llamax.ArgumentTypeError),
                        (dict(weight=0.0), llamax.InvalidArgumentError),
                        (dict(weight=float("nan")), llamax.InvalidArgumentError),
                        (dict(weight="1"), llamax.ArgumentTypeError),
                        (dict(priority=2**31), llamax.InvalidArgumentError),
                        (dict(cache_salt=2**63), llamax.InvalidArgumentError)]:
            with pytest.raises(err):
                b.submit(toks, greedy(model), max_tokens=1, **kw)
    with pytest.raises(llamax.InvalidArgumentError, match="reserve_slots"):
        ctx2 = llamax.Context(model, n_ctx=256, n_seq_max=1, kv_unified=False, n_threads=2)
        with ctx2:
            llamax.Batcher(ctx2, reserve_slots=-1)


@pytest.mark.parametrize("align", [True, False])
def test_cache_salt_scopes_the_prefix_cache(model, align):
    """Equal salts share cached prefixes; another salt decodes the whole
    prompt (a cache hit would tell it the other tenant's prompt)."""
    prompt = model.tokenize("You are a helpful assistant. " * 12 + "Say hi.")
    assert len(prompt) > 64
    ctx, b = batcher(model, slots=3, prefix_chunk=16 if align else 1, prefix_align=align)
    with ctx, b:
        def run(salt):
            s = b.submit(prompt, greedy(model), max_tokens=2, ignore_eos=True, cache_salt=salt)
            s.result()
            return s.n_cached

        assert run(7) == 0
        assert run(9) == 0      # another salt: nothing reused
        assert run(7) > 48      # the same salt: its own prompt's cells
        assert run(0) == 0      # the shared scope is a scope of its own
        assert run(9) > 48
