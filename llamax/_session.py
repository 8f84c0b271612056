"""llama-cpp-python's stateful token API on ``Llama``: one session context.

``eval``, ``sample``, ``generate``, ``reset``, ``n_tokens``, ``input_ids``,
``scores``, ``save_state`` / ``load_state`` and ``set_cache`` work as in
llama-cpp-python, on the first context of the pool (the *session*
context).  The session is the pure base model; the pool's requests may use
that context too, and what its KV holds is shared both ways (a completion
after ``eval`` reuses the evaluated prefix, as in llama-cpp-python) but only
under the state it was computed under: tokens evaluated by the session are
never reused by a request with adapters, and the reverse.

Saved states (:class:`llamax.llama_cache.LlamaState`) carry the model and
the state (adapters, control vector) they were computed under; a cache
(:meth:`set_cache`) finds them only for requests of the same state.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import numpy.typing as npt

from llamax._core import Sampler, State
from llamax._errors import ArgumentTypeError, ContextOverflowError, InvalidArgumentError, TokenError
from llamax._validate import check_int
from llamax.llama_cache import BASE_STATE, BaseLlamaCache, LlamaState
from llamax.pool import _lcp, _Pool, _Slot
from llamax.request import apply_processors, check_processors, grammar_text

__all__ = ["LogitsProcessor", "LogitsProcessorList", "StoppingCriteria", "StoppingCriteriaList",
           "MinTokensLogitsProcessor"]

# llama-cpp-python's type names for the per-token hooks (lm-format-enforcer imports LogitsProcessor):
# (input_ids, scores) -> new scores, and (input_ids, logits) -> stop?
LogitsProcessor = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], npt.NDArray[np.single]]
StoppingCriteria = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], bool]

_DEFAULT_SEED = 0xFFFFFFFF


class LogitsProcessorList(list):
    """Callables ``(input_ids, scores) -> scores`` applied in order to each
    token's logits before sampling (llama-cpp-python's name and contract)."""

    def __call__(self, input_ids, scores):
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(list):
    """Callables ``(input_ids, logits) -> bool``; generation stops when any is true."""

    def __call__(self, input_ids, logits) -> bool:
        return any(criterion(input_ids, logits) for criterion in self)


class MinTokensLogitsProcessor:
    """Bans the end-of-sequence token until ``min_tokens`` tokens were generated."""

    def __init__(self, min_tokens: int, token_eos: int):
        self.min_tokens = min_tokens
        self.token_eos = token_eos
        self.prompt_tokens = None

    def __call__(self, input_ids, scores):
        if self.prompt_tokens is None:
            self.prompt_tokens = len(input_ids)
        if len(input_ids) - self.prompt_tokens < self.min_tokens:
            scores[self.token_eos] = -np.inf
        return scores


def state_fingerprint(state: State) -> str:
    """What a state's KV depends on besides the model and the tokens: its
    adapters (file, scale) and control vector (layers, values).  ``""`` for
    the base model."""
    if state.is_base:
        return BASE_STATE
    h = hashlib.sha256()
    h.update(json.dumps([[a.path, float(s)] for a, s in state.adapters]).encode())
    cv = state.control_vector
    if cv is not None:
        h.update(f"cv:{cv.layer_start}:{cv.layer_end}".encode())
        h.update(np.ascontiguousarray(cv.data).tobytes())
    return h.hexdigest()


class _SessionMixin:
    """The stateful API of :class:`llamax.Llama` (mixed in)."""

    _model: object
    _pool: object

    def _session_init(self, logits_all: bool, draft_model) -> None:
        self._logits_all = logits_all
        self.draft_model = draft_model
        self.cache: Optional[BaseLlamaCache] = None
        self._scores_buf: Optional[np.ndarray] = None
        self._scores_n = 0        # logits_all: rows [0, _scores_n) hold those positions' logits
        self._last_row = -1       # the position whose logits the last eval left in the scores
        self._requires_eval = True
        self._held = threading.local()  # the slot this thread's running request holds
        self._base_state = State(self._native_model)
        st = os.stat(self.model_path) if os.path.exists(self.model_path) else None
        self._model_key = json.dumps([os.path.abspath(self.model_path), st.st_size if st else 0,
                                      self._native_model.n_vocab, self._native_model.n_embd, self._native_model.n_layer,
                                      self._ctx_kwargs["n_ctx"]])

    # -- the session context -------------------------------------------------------

    def _session_slot(self) -> _Slot:
        self._check_open()
        if not isinstance(self._pool, _Pool):
            raise InvalidArgumentError("eval/sample/generate/save_state/load_state need n_parallel=1 (one request "
                                       "per context); with n_parallel > 1 use create_completion")
        if not self._pool.slots:
            raise InvalidArgumentError("this Llama has no generation context (vocab_only=True or n_contexts=0)")
        return self._pool.slots[0]

    class _Held:
        __slots__ = ("llm", "slot", "own")

        def __init__(self, llm, slot, own):
            self.llm, self.slot, self.own = llm, slot, own

        def __enter__(self):
            return self.slot

        def __exit__(self, *exc):
            if self.own:
                self.llm._pool.release(self.slot)

    def _hold_session(self):
        """The session slot, held by this thread (it may hold it already:
        a cache hit inside a running request loads the state)."""
        slot = self._session_slot()
        if getattr(self._held, "slot", None) is slot:
            return self._Held(self, slot, False)
        self._pool.acquire_slot(slot)
        return self._Held(self, slot, True)

    def _session_tokens(self, slot: _Slot) -> np.ndarray:
        return slot.tokens if slot.key == self._base_state.id else np.empty(0, np.int32)

    @property
    def n_tokens(self) -> int:
        """Tokens the session context holds (evaluated, in its KV)."""
        return len(self._session_tokens(self._session_slot()))

    @n_tokens.setter
    def n_tokens(self, value: int) -> None:
        value = check_int(value, "n_tokens")
        with self._hold_session() as slot:
            have = self._session_tokens(slot)
            if not 0 <= value <= len(have):
                raise InvalidArgumentError(f"n_tokens={value} must be in [0, {len(have)}] (it can only shrink)")
            if value < len(have):
                if not slot.ctx.kv_remove(0, int(value), -1):
                    # a recurrent model's memory can't be cut at a position: start over
                    slot.ctx.kv_clear()
                    value = 0
                slot.tokens = have[:value]
                slot.key = self._base_state.id
                slot.logits_n = -1
                slot.exact_n = min(slot.exact_n, int(value))
                self._scores_n = min(self._scores_n, int(value))
                if self._last_row >= value:
                    self._last_row = -1

    @property
    def input_ids(self) -> np.ndarray:
        """The session's tokens in an ``n_ctx`` array (the first ``n_tokens`` are real; a copy)."""
        out = np.zeros(self.n_ctx(), np.intc)
        have = self._session_tokens(self._session_slot())
        out[: len(have)] = have
        return out

    @property
    def _input_ids(self) -> np.ndarray:
        return np.asarray(self._session_tokens(self._session_slot()), np.intc)

    @property
    def scores(self) -> np.ndarray:
        """``(n_ctx, n_vocab)`` float32: row i holds the logits after position
        i (every evaluated position with ``logits_all=True``, else the last)."""
        if self._scores_buf is None:
            # zero pages are not committed until written
            self._scores_buf = np.zeros((self.n_ctx(), self.n_vocab()), np.float32)
        return self._scores_buf

    @property
    def _scores(self) -> np.ndarray:
        return self.scores[: self.n_tokens, :]

    @property
    def eval_tokens(self):
        from collections import deque
        return deque(self._input_ids.tolist(), maxlen=self.n_ctx())

    @property
    def eval_logits(self):
        from collections import deque
        return deque(self._scores.tolist(), maxlen=self.n_ctx() if self._logits_all else 1)

    def set_seed(self, seed: int) -> None:
        """Seed the draws of later requests that give no seed (and of sample())."""
        seed = check_int(seed, "seed", 0, error=InvalidArgumentError, msg="seed must be a non-negative int")
        with self._rng_lock:
            self._seed = seed
            self._rng = random.Random(seed)

    def set_cache(self, cache: Optional[BaseLlamaCache]) -> None:
        """Keep a state per completion in ``cache`` and load the best one
        before a prompt that shares more with it than with the context."""
        if cache is not None and not isinstance(cache, BaseLlamaCache):
            raise ArgumentTypeError("cache must be a llamax.LlamaRAMCache / LlamaDiskCache (a BaseLlamaCache) or None")
        if cache is not None and not isinstance(self._pool, _Pool):
            raise InvalidArgumentError("set_cache needs n_parallel=1 (the batcher keeps its own prefix cache)")
        self.cache = cache

    def reset(self) -> None:
        """Forget the session's tokens (the next eval starts at position 0)."""
        self.n_tokens = 0
        self._requires_eval = True

    # -- eval / sample ------------------------------------------------------------------

    def _check_token_list(self, tokens, what="tokens") -> np.ndarray:
        if isinstance(tokens, (str, bytes)):
            raise ArgumentTypeError(f"{what} must be a sequence of token ids (tokenize() text first)")
        try:
            arr = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"{what} must be a flat sequence of ints") from None
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ArgumentTypeError(f"{what} must be a flat sequence of ints")
        if arr.size and (arr.min() < 0 or arr.max() >= self._native_model.n_vocab):
            raise TokenError(f"{what} has an id outside [0, n_vocab={self._native_model.n_vocab})")
        return arr.astype(np.int32)

    def eval(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` after the session's ``n_tokens`` (anything the
        context held past ``n_tokens`` is dropped first)."""
        self._eval(self._check_token_list(tokens), self._logits_all)

    def _eval(self, toks: np.ndarray, all_rows: bool) -> None:
        with self._hold_session() as slot:
            ctx = slot.ctx
            base = self._base_state
            have = self._session_tokens(slot)
            if slot.key != base.id:
                ctx.kv_clear()
                slot.key = base.id
                slot.tokens = have = np.empty(0, np.int32)
                slot.exact_n = 0
            n0 = len(have)
            if n0 + len(toks) > ctx.n_ctx_seq:
                raise ContextOverflowError(f"{n0} tokens held and {len(toks)} more do not fit in n_ctx={ctx.n_ctx_seq}")
            ctx.set_state(base)
            ctx.kv_remove(0, n0, -1)
            slot.logits_n = -1
            scores = self.scores
            nb = ctx.n_batch
            for i in range(0, len(toks), nb):
                part = toks[i:i + nb]
                p0 = n0 + i
                try:
                    ctx.decode(part, pos=np.arange(p0, p0 + len(part), dtype=np.int32),
                               logits="all" if all_rows else "last")
                except BaseException:
                    slot.tokens = np.concatenate([have, toks[:i]]).astype(np.int32)
                    ctx.kv_remove(0, p0, -1)
                    raise
                rows = ctx.get_logits()
                if all_rows:
                    scores[p0:p0 + len(part)] = rows
                    self._scores_n = p0 + len(part)
                else:
                    scores[p0 + len(part) - 1] = rows[-1]
                del rows
                self._last_row = p0 + len(part) - 1
            slot.tokens = np.concatenate([have, toks]).astype(np.int32)
            if not all_rows:
                self._scores_n = min(self._scores_n, n0)
            if len(toks):
                self._requires_eval = False

    def _make_sampler(self, *, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, temp=0.80, repeat_penalty=1.0,
                      frequency_penalty=0.0, presence_penalty=0.0, mirostat_mode=0, mirostat_tau=5.0,
                      mirostat_eta=0.1, grammar=None) -> Sampler:
        if temp is None:
            temp = 0.8
        if temp < 0:  # llama-cpp-python: a plain draw from the softmax
            temp, top_k, top_p, min_p, typical_p = 1.0, 0, 1.0, 0.0, 1.0
        return Sampler(self._native_model, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                       repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                       presence_penalty=presence_penalty, penalty_last_n=self.last_n_tokens_size,
                       seed=None if self._seed == _DEFAULT_SEED else self._seed & 0xFFFFFFFF,
                       grammar=grammar_text(grammar), mirostat=0 if mirostat_mode is None else mirostat_mode,
                       mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)

    def _row(self, idx: int) -> np.ndarray:
        n = self.n_tokens
        if n == 0:
            raise InvalidArgumentError("nothing evaluated: eval() tokens before sample()")
        if not 0 <= idx < n:
            raise InvalidArgumentError(f"idx={idx} must be in [0, n_tokens={n})")
        if idx < self._scores_n or idx == self._last_row:
            return self.scores[idx]
        raise InvalidArgumentError(f"no logits for position {idx}: eval() it again (logits are kept for every "
                                   "position only with logits_all=True)")

    def _sample_with(self, sampler: Sampler, idx: int, logits_processor=None) -> int:
        row = self._row(idx)
        if logits_processor is not None:
            row = apply_processors(logits_processor, self._input_ids[: idx + 1], row.copy(), self._native_model.n_vocab)
        with self._hold_session() as slot:
            return sampler.sample_logits(slot.ctx, row)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
               mirostat_eta: float = 0.1, mirostat_tau: float = 5.0, penalize_nl: bool = True,
               logits_processor=None, grammar=None, idx: Optional[int] = None) -> int:
        """Sample a token from the logits after position ``idx`` (default:
        the last evaluated).  ``tfs_z`` and ``penalize_nl`` are accepted and
        have no effect, as in llama-cpp-python 0.3 (llama.cpp dropped them)."""
        check_processors(logits_processor, None)
        sampler = self._make_sampler(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                                     repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                     presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                                     mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
        try:
            return self._sample_with(sampler, self.n_tokens - 1 if idx is None else idx, logits_processor)
        finally:
            sampler.close()

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None,
                 grammar=None) -> Iterator[int]:
        """Tokens after ``tokens``, one per step, forever (the caller stops).

        With ``reset=True`` the session reuses the longest prefix it holds
        of ``tokens`` (all of it when nothing changed since it evaluated
        exactly these).  ``generator.send(more_tokens)`` appends tokens to
        decode after the yielded one.  This is the per-token Python loop;
        create_completion runs the loop natively."""
        toks = self._check_token_list(tokens).tolist()
        if not toks and self.n_tokens == 0:
            raise InvalidArgumentError("generate() needs at least one token")
        check_processors(logits_processor, stopping_criteria)
        sampler = self._make_sampler(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                                     repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                     presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                                     mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, grammar=grammar)
        return self._generate(toks, sampler, reset, logits_processor, stopping_criteria)

    def _generate(self, toks, sampler, reset, logits_processor, stopping_criteria):
        try:
            if reset and self.n_tokens > 0:
                held = self._input_ids
                lp = _lcp(held, np.asarray(toks, np.int32))
                whole = lp == len(toks)
                if whole and len(held) == len(toks) and not self._requires_eval and self._last_row == len(toks) - 1:
                    reset, toks, reuse = False, [], 0
                else:
                    reuse = lp - 1 if whole else lp
                if reuse > 0:
                    self.n_tokens = reuse
                    if self.n_tokens == reuse:  # (a recurrent model may have had to start over)
                        reset = False
                        toks = toks[reuse:]
                    self._requires_eval = True
            if reset:
                self.reset()
            draft = self.draft_model
            sample_idx = self.n_tokens + len(toks) - 1
            while True:
                self._eval(np.asarray(toks, np.int32), self._logits_all or draft is not None)
                while sample_idx < self.n_tokens:
                    token = self._sample_with(sampler, sample_idx, logits_processor)
                    sample_idx += 1
                    if stopping_criteria is not None and stopping_criteria(self._input_ids[:sample_idx],
                                                                           self.scores[sample_idx - 1]):
                        return
                    more = yield token
                    toks = [token] + (list(self._check_token_list(more, "sent tokens")) if more is not None else [])
                    held = self._session_tokens(self._session_slot())
                    if sample_idx < len(held) and token != held[sample_idx]:
                        self.n_tokens = sample_idx  # a draft the model did not take: drop it and what follows
                        self._requires_eval = True
                        break
                    if sample_idx < len(held):
                        toks = []  # the draft is in the KV already
                if draft is not None and toks:
                    room = self.n_ctx() - self.n_tokens - len(toks)
                    if room > 0:
                        ids = np.concatenate([self._input_ids, np.asarray(toks, np.intc)])
                        guess = np.asarray(draft(ids), dtype=np.int64)[:room]
                        toks = toks + [int(t) for t in guess if 0 <= t < self._native_model.n_vocab]
        finally:
            sampler.close()

    # -- saved states ----------------------------------------------------------------

    def _save_from(self, slot: _Slot) -> LlamaState:
        """The state of a held slot: its tokens and KV, under the state it has."""
        ctx = slot.ctx
        known = slot.key is not None and slot.key == ctx.state.id
        tokens = slot.tokens if known else np.empty(0, np.int32)
        data = ctx.state_get(0) if len(tokens) else b""
        ids = np.zeros(max(self.n_ctx(), len(tokens)), np.intc)
        ids[: len(tokens)] = tokens
        n = len(tokens)
        session = slot.key == self._base_state.id and slot is self._pool.slots[0]
        if session and self._logits_all and self._scores_n >= n:
            scores = self.scores[:n].copy()
        elif session and n and self._last_row == n - 1:
            scores = self.scores[n - 1:n].copy()
        else:
            scores = np.zeros((0, self._native_model.n_vocab), np.float32)
        with self._rng_lock:
            rng = self._rng.getstate()
            seed = self._seed
        st = LlamaState(ids, scores, n, data, len(data), seed, state_key=state_fingerprint(ctx.state) if known else
                        BASE_STATE, model_key=self._model_key, exact_n=min(slot.exact_n, n))
        st.rng_state = rng
        return st

    def _load_into(self, slot: _Slot, state: LlamaState, as_state: State) -> None:
        """Put a saved state into a held slot, as computed under ``as_state``."""
        if not isinstance(state, LlamaState):
            raise ArgumentTypeError(f"load_state takes a LlamaState (from save_state), not {type(state).__name__}")
        if state.model_key != self._model_key:
            raise InvalidArgumentError("this state was saved from another model or context size")
        if state.state_key != state_fingerprint(as_state):
            raise InvalidArgumentError("this state was computed under other adapters or another control vector")
        tokens = state.tokens
        ctx = slot.ctx
        if len(tokens) > ctx.n_ctx_seq:
            raise ContextOverflowError(f"the state holds {len(tokens)} tokens, more than n_ctx={ctx.n_ctx_seq}")
        slot.key = None
        slot.tokens = np.empty(0, np.int32)
        slot.logits_n = -1
        slot.exact_n = 0
        ctx.set_state(as_state)
        ctx.state_set(state.llama_state if len(tokens) else b"")
        slot.key = as_state.id
        slot.tokens = tokens.astype(np.int32)
        slot.exact_n = min(int(state.exact_n), len(tokens))

    def save_state(self) -> LlamaState:
        """The session context's tokens, KV, logits and seed."""
        with self._hold_session() as slot:
            return self._save_from(slot)

    def load_state(self, state: LlamaState) -> None:
        """Restore a :meth:`save_state` result into the session context (the
        next generate() re-evaluates the last token for fresh logits)."""
        if not isinstance(state, LlamaState):
            raise ArgumentTypeError(f"load_state takes a LlamaState (from save_state), not {type(state).__name__}")
        with self._hold_session() as slot:
            self._load_into(slot, state, self._base_state)
            n = state.n_tokens
            sc = np.asarray(state.scores, np.float32)
            self._scores_n = 0
            self._last_row = -1
            if n and sc.ndim == 2 and sc.shape[1] == self._native_model.n_vocab:
                if sc.shape[0] == n:
                    self.scores[:n] = sc
                    self._scores_n = n
                    self._last_row = n - 1
                elif sc.shape[0] == 1:
                    self.scores[n - 1] = sc[0]
                    self._last_row = n - 1
            self._requires_eval = True
            with self._rng_lock:
                if isinstance(state.seed, int):
                    self._seed = state.seed
                rng = getattr(state, "rng_state", None)
                if rng is not None:
                    self._rng.setstate(rng)
                elif isinstance(state.seed, int):
                    self._rng = random.Random(state.seed)

    # -- the prompt cache, around a request ------------------------------------------------

    def _cache_before(self, slot: _Slot, req) -> None:
        """A cache hit that shares more of the prompt than the held slot does: load it."""
        cache = self.cache
        key = state_fingerprint(req.state)
        item = cache.lookup(req.tokens, key)
        if item is None or item.state_key != key or item.model_key != self._model_key:
            return
        own = _lcp(slot.tokens, req.tokens) if slot.key == req.key else 0
        if _lcp(item.tokens, req.tokens) <= own:
            return
        self._held.slot = slot
        try:
            if slot is self._pool.slots[0] and key == BASE_STATE:
                self.load_state(item)
            else:
                self._load_into(slot, item, req.state)
        finally:
            self._held.slot = None

    def _cache_after(self, slot: _Slot) -> None:
        state = self._save_from(slot)
        if state.n_tokens:
            self.cache.store(state.tokens.tolist(), state)

    # -- helpers llama-cpp-python has --------------------------------------------------------

    @property
    def _is_recurrent(self) -> bool:  # (llama-cpp-python's private name; Model.is_recurrent)
        return self._native_model.is_recurrent

    @property
    def _is_hybrid(self) -> bool:
        return self._native_model.is_hybrid

    def token_nl(self) -> int:
        nl = self._native_model.special_tokens["nl"]
        if nl < 0:
            toks = self._native_model.tokenize(b"\n", add_special=False, parse_special=False)
            nl = int(toks[-1]) if len(toks) else -1
        return nl

    @staticmethod
    def logits_to_logprobs(logits, axis: int = -1) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float32)
        m = np.max(logits, axis=axis, keepdims=True)
        with np.errstate(divide="ignore"):
            return logits - m - np.log(np.sum(np.exp(logits - m), axis=axis, keepdims=True))

    @staticmethod
    def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
        return _lcp(np.asarray(a, np.int64), np.asarray(b, np.int64))
