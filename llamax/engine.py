"""The engine's typed surface: what every front hands the engine, and what
it hands back.

``Llama.prepare_completion`` / ``prepare_chat_completion`` (in process), the
server's local backend (through them) and the Ray replicas all build one
:class:`GenerationRequest` and call :meth:`Engine.submit` (``Llama.submit``),
which checks it, resolves and pins its adapters and returns a
:class:`~llamax.request.RequestHandle`.  The handle yields :class:`Text`
events (the reply's text, with its tokens and their logprobs) and then one
:class:`Result` (finish reason, usage, all tokens); the OpenAI shapes are
made from those by ``llamax.formatters``.

Where a field is
- declared and validated for its type: here (``__post_init__`` of the frozen
  dataclasses), and ``llamax.sampling`` for the sampling fields;
- checked against the model (token ids, adapter names, grammar text):
  ``Llama.submit``;
- used: ``llamax.request`` (the token loop, the batcher's sequence).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax.cancel import CancelToken
from llamax.sampling import SamplingParams

if TYPE_CHECKING:
    from llamax.request import RequestHandle

__all__ = ["AdapterSet", "Engine", "GenerationRequest", "GrammarSpec", "ReasoningBudget", "Result", "Share",
           "Text"]


def id63(text: str) -> int:
    """A stable 63-bit id of a text (BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little") >> 1


def _scale(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{where} must be a finite number")
    return float(value)


def parse_loras(specs) -> tuple[tuple[str, float], ...]:
    """``[{"name": str, "scale": float}, ...]`` (``active_loras``, on the
    wire and as a keyword) as ``((name, scale), ...)``, checked: names are
    str and appear once, scales are finite numbers (1.0 when left out)."""
    if specs is None:
        return ()
    if isinstance(specs, (str, bytes, dict)) or not hasattr(specs, "__iter__"):
        raise ArgumentTypeError("active_loras must be a list of {'name': str, 'scale': float}")
    out = []
    seen = set()
    for i, s in enumerate(specs):
        if not isinstance(s, dict):
            raise ArgumentTypeError(f"active_loras[{i}] must be a dict with 'name' and 'scale'")
        unknown = set(s) - {"name", "scale"}
        if unknown:
            raise ArgumentTypeError(f"active_loras[{i}] has unknown keys {sorted(unknown)}")
        name = s.get("name")
        if not isinstance(name, str):
            raise ArgumentTypeError(f"active_loras[{i}]['name'] must be a str")
        scale = _scale(s.get("scale", 1.0), f"active_loras[{i}]['scale']")
        if name in seen:
            raise InvalidArgumentError(f"adapter {name!r} appears twice in active_loras")
        seen.add(name)
        out.append((name, scale))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class VectorRef:
    """A loaded control vector by name, scaled, optionally over another
    layer range than its own (``layer_start``/``layer_end``; checked against
    the model by the engine)."""

    name: str
    scale: float = 1.0
    layer_start: int | None = None
    layer_end: int | None = None


def parse_vectors(specs) -> tuple[VectorRef, ...]:
    """``[{"name", "scale", "layer_start", "layer_end"}, ...]``
    (``control_vectors``) as :class:`VectorRef`\\ s, checked for shape."""
    if specs is None:
        return ()
    if not isinstance(specs, (list, tuple)):
        raise ArgumentTypeError("control_vectors must be a list of {'name', 'scale', ...}")
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ArgumentTypeError(f"control_vectors[{i}] must be a dict with a 'name'")
        unknown = set(spec) - {"name", "scale", "layer_start", "layer_end"}
        if unknown:
            raise ArgumentTypeError(f"control_vectors[{i}] has unknown keys {sorted(unknown)}")
        out.append(VectorRef(spec["name"], spec.get("scale", 1.0), spec.get("layer_start"), spec.get("layer_end")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class AdapterSet:
    """What a request runs under besides the base model: LoRA adapters by
    name with their scales, in order (``loras``; None: the engine's default
    set, e.g. ``Llama(lora_path=)``'s adapter or the server's
    ``--lora-scaled``; ``()``: the pure base model), named control vectors
    (``vectors``) and llama-cpp-python's one-off ``control_vector`` (a
    :class:`llamax.ControlVector`, or ``{"data", "layer_start",
    "layer_end"}``).  Names are resolved, and adapters pinned, by the
    engine when the request is submitted.  Make one from the keyword/wire
    shapes with :meth:`of`."""

    loras: tuple[tuple[str, float], ...] | None = None
    vectors: tuple[VectorRef, ...] = ()
    control_vector: Any = None

    def __post_init__(self):
        if self.loras is not None:
            object.__setattr__(self, "loras", parse_loras([{"name": n, "scale": s} for n, s in self.loras]))
        if not all(isinstance(v, VectorRef) for v in self.vectors):
            raise ArgumentTypeError("AdapterSet.vectors must be VectorRefs (AdapterSet.of takes the dicts)")
        object.__setattr__(self, "vectors", tuple(self.vectors))

    @classmethod
    def of(cls, active_loras=None, control_vectors=None, control_vector=None) -> AdapterSet:
        """From ``prepare_*``'s keywords (and the request body's fields):
        ``active_loras=[{"name", "scale"}, ...]`` (None: the default set),
        ``control_vectors=[{"name", "scale", ...}, ...]``, ``control_vector``."""
        return cls(None if active_loras is None else parse_loras(active_loras), parse_vectors(control_vectors),
                   control_vector)

    @property
    def names(self) -> tuple[str, ...]:
        """The LoRA adapters' names, in order (none for the default set)."""
        return tuple(n for n, _ in self.loras or ())

    def active_loras(self) -> list[dict] | None:
        """The LoRA part in the keyword/wire shape (None: the default set)."""
        return None if self.loras is None else [{"name": n, "scale": s} for n, s in self.loras]


@dataclasses.dataclass(frozen=True)
class Share:
    """Who a request runs for, as the batcher orders waiting requests:
    free slots go to the highest ``priority`` first, then to the tenant
    holding the fewest slots per unit of ``weight`` (see
    :class:`llamax.Batcher`); ``max_slots``: at most that many of the
    tenant's requests hold slots at once, the others wait.  ``Llama.prepare_*(share=Share("acme", 2.0))``."""

    tenant: str
    weight: float = 1.0
    priority: int = 0
    max_slots: int | None = None   # at most this many of the tenant's requests run at once (per batcher)

    def __post_init__(self):
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ArgumentTypeError("Share.tenant must be a non-empty str")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or \
                not (0 < self.weight < 1e9):
            raise InvalidArgumentError(f"Share.weight must be a number > 0 (and < 1e9), not {self.weight!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or \
                not (-2**31 <= self.priority < 2**31):
            raise InvalidArgumentError(f"Share.priority must be an int32, not {self.priority!r}")
        if self.max_slots is not None and (isinstance(self.max_slots, bool) or not isinstance(self.max_slots, int)
                                           or not 1 <= self.max_slots < 2**31):
            raise InvalidArgumentError(f"Share.max_slots must be None or an int >= 1, not {self.max_slots!r}")

    @property
    def tenant_id(self) -> int:
        """The tenant as the batcher knows it (63 bits of its name's hash; never 0)."""
        return id63("tenant:" + self.tenant) or 1


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What constrains a reply: GBNF text (or a :class:`llamax.LlamaGrammar`)
    and, for a lazy grammar (tool calls), the literal texts that switch it
    on anywhere (``triggers``) or only where the output begins
    (``start_triggers``)."""

    grammar: Any
    triggers: tuple[str, ...] | None = None
    start_triggers: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ReasoningBudget:
    """A bound on the reply's ``<think>`` section: after ``tokens`` tokens
    in it, the section is closed for the model (``message`` first, if any);
    ``started_open``: the prompt opened it."""

    tokens: int
    message: str | None = None
    started_open: bool = False


def _token_array(tokens) -> np.ndarray:
    """The prompt as a 1-D int32 array: an int32 array as it is, a list (or
    other integer array) copied; anything else refused by name."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not len(tokens) or tokens.dtype.kind not in "iu":
            raise ArgumentTypeError(f"GenerationRequest.tokens must be a non-empty 1-D array of token ids, "
                                    f"not a {tokens.ndim}-D {tokens.dtype} array of {tokens.size}")
        if tokens.dtype == np.int32:
            return tokens
        if len(tokens) and (tokens.min() < -2**31 or tokens.max() >= 2**31):
            raise InvalidArgumentError("GenerationRequest.tokens holds a token id outside int32")
        return tokens.astype(np.int32)
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ArgumentTypeError(f"GenerationRequest.tokens must be a non-empty list of token ids (ints) or a "
                                f"1-D int32 array, not {type(tokens).__name__}" + ("" if tokens else " (empty)"))
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ArgumentTypeError(f"GenerationRequest.tokens must hold ints (token ids), not {type(t).__name__}")
        if not -2**31 <= t < 2**31:
            raise InvalidArgumentError(f"token id {t} is outside int32")
    return np.array(tokens, dtype=np.int32)


@dataclasses.dataclass(frozen=True, eq=False)  # (no ==: the prompt is an array)
class GenerationRequest:
    """One generation, typed: what every front hands the engine
    (:meth:`Engine.submit`), which checks it against the model, resolves
    and pins its adapters, and runs it.  The fields without a default are
    what a front must decide (a fork whose chat path dropped the adapters
    is the failure this prevents: it fails when it is called, not
    silently); the others are options of the in-process API.  Picklable
    without ``cancel`` and the per-token hooks (what a Ray replica is sent)."""

    tokens: np.ndarray                 # the prompt: int32 token ids (a list is taken; checked against the vocabulary by submit)
    sampling: SamplingParams           # every sampling field (llamax.sampling: declared once)
    adapters: AdapterSet               # AdapterSet(): the default set
    max_tokens: int | None = None      # None or <= 0: until the context is full
    logprobs: int | None = None        # top alternatives per generated token (None: no logprobs)
    stop: Any = None                   # str, list of str, or None
    grammar: GrammarSpec | None = None
    share: Share | None = None         # who it runs for (the batcher's fair share of slots)
    cache_salt: str | None = None      # the prefix cache's scope (None: shared)
    cache_prompt: bool = True          # False: reuse no cached prefix
    reasoning_budget: ReasoningBudget | None = None
    cancel: CancelToken | None = None  # the caller's token (cancel() from any thread)
    logits_processor: Any = None       # llama-cpp-python's lists: Python per token (None: the native loop)
    stopping_criteria: Any = None
    timings: bool = False              # True: the Result times the prompt and the generation (a callback per token)

    def __post_init__(self):
        object.__setattr__(self, "tokens", _token_array(self.tokens))
        if not isinstance(self.sampling, SamplingParams):
            raise ArgumentTypeError(f"sampling must be a llamax.SamplingParams, not {type(self.sampling).__name__}")
        if not isinstance(self.adapters, AdapterSet):
            raise ArgumentTypeError(f"adapters must be a llamax.AdapterSet, not {type(self.adapters).__name__}")
        for name, typ in (("grammar", GrammarSpec), ("share", Share), ("reasoning_budget", ReasoningBudget),
                          ("cancel", CancelToken)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, typ):
                raise ArgumentTypeError(f"{name} must be a llamax.{typ.__name__} or None, not {type(v).__name__}")

    def __getstate__(self):
        if self.cancel is not None or self.logits_processor is not None or self.stopping_criteria is not None:
            raise TypeError("a GenerationRequest with a cancel token or per-token Python hooks stays in its process")
        return self.__dict__.copy()

    def __setstate__(self, state):
        self.__dict__.update(state)


class Text:
    """An event of a running request: a piece of the reply's text, with the
    tokens read since the previous piece and, when the request asked for
    them, their logprobs (``(logprob, [(token, logprob), ...])`` each).
    The text of a token cut by a stop string, or held while it may start
    one, comes in a later piece (or never): ``text`` is what is final."""

    __slots__ = ("text", "tokens", "logprobs")

    def __init__(self, text: str, tokens: list | tuple = (), logprobs: list | tuple = ()):
        self.text = text
        self.tokens = tokens
        self.logprobs = logprobs

    def __repr__(self):
        return f"Text({self.text!r}, tokens={list(self.tokens)!r})"


class Result:
    """The last event of a request: its text and tokens (past a stop string
    cut off), ``finish_reason`` (``stop`` or ``length``) and the stop string
    that ended it (``stop_string``, None at an end of generation), the prompt's
    length and how much of it came from the cache, the tokens' logprobs
    (when asked for) and, with a batcher, how long it waited for a slot."""

    __slots__ = ("text", "tokens", "n_prompt", "n_cached", "finish_reason", "logprobs", "queue_seconds",
                 "stop_string", "prompt_seconds", "gen_seconds")

    def __init__(self):
        self.text = ""
        self.tokens: list[int] = []
        self.n_prompt = 0
        self.n_cached = 0  # prompt tokens whose KV was reused
        self.queue_seconds: float | None = None  # batched: how long it waited for a slot
        self.finish_reason = "length"
        self.stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
        # with GenerationRequest.timings (or when the tokens are read one by one): from the start
        # of its run (past any queue) to its first token, and from there to its end
        self.prompt_seconds: float | None = None
        self.gen_seconds: float | None = None
        self.logprobs: list = []  # per token: (logprob, [(token, logprob), ...])

    def usage(self) -> dict:
        """OpenAI's usage block (with the cached prompt tokens)."""
        return {"prompt_tokens": self.n_prompt, "completion_tokens": len(self.tokens),
                "total_tokens": self.n_prompt + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.n_cached}}

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)

    def __repr__(self):
        return f"Result(finish_reason={self.finish_reason!r}, tokens={len(self.tokens)}, text={self.text[:40]!r})"


@runtime_checkable
class Engine(Protocol):
    """What every front calls: ``llamax.Llama`` is one (``Llama.submit``)."""

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Check ``request``, resolve and pin its adapters, and return its
        handle (nothing runs until the handle is iterated or awaited)."""
        ...
