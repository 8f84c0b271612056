"""A token's logits are the same arithmetic decoded alone or as a row of a
batch, at any thread count (patches 0015-0016).

ggml's flash attention splits a lone query row's cache over the threads
once it has 512 cells or more, and sums every row of a batch over the
whole cache in order; llamax's thread pools turn that split off, and then
every row sums the cache in fixed 256-cell chunks merged in order (a lone
row's chunks over the threads, a batch's rows one thread each).  That is
what lets greedy speculative decoding (drafts verified in one batch) give
plain greedy decoding's answer (tests/api/test_compat_api.py).  Each check
compares two ways of computing the same rows in one run, so it holds on
any CPU: the weights' products (vec_dot per row on this Q4_1 model) and
the row-local ops never depended on the batch."""
import numpy as np
import pytest

import llamax

N_PROMPT = 520   # past 512 cells: where ggml would split a lone row's cache
N_ROWS = 9


def _tokens(model):
    rng = np.random.default_rng(11)
    return np.concatenate([[model.token_bos], rng.integers(100, 20000, N_PROMPT + N_ROWS - 1)]).astype(np.int32)


def _rows(model, tokens, *, threads, batched):
    """The logits of the last N_ROWS tokens after the prompt, decoded one by
    one or in one batch."""
    with llamax.Context(model, n_ctx=1024, n_threads=threads) as ctx:
        for i in range(0, N_PROMPT, 260):
            ctx.decode(tokens[i:i + 260], pos=np.arange(i, i + 260, dtype=np.int32), logits="last")
        tail = tokens[N_PROMPT:]
        pos = np.arange(N_PROMPT, N_PROMPT + N_ROWS, dtype=np.int32)
        if batched:
            ctx.decode(tail, pos=pos, logits="all")
            return ctx.get_logits().copy()
        out = []
        for t, p in zip(tail, pos):
            ctx.decode(np.array([t], np.int32), pos=np.array([p], np.int32), logits="last")
            out.append(ctx.get_logits()[-1].copy())
        return np.stack(out)


@pytest.fixture(scope="module")
def rows(model):
    """(threads, batched) -> the rows' logits."""
    tokens = _tokens(model)
    return {(t, b): _rows(model, tokens, threads=t, batched=b) for t in (1, 2) for b in (False, True)}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_lone_row_is_a_batch_row(model, rows, threads):
    alone, batch = rows[threads, False], rows[threads, True]
    assert alone.shape == batch.shape == (N_ROWS, model.n_vocab)
    np.testing.assert_array_equal(alone, batch)   # exact: the same arithmetic, not a tolerance


def test_a_lone_row_does_not_depend_on_the_thread_count(rows):
    np.testing.assert_array_equal(rows[1, False], rows[2, False])
