"""The sampling fields are declared once (llamax.sampling.SamplingParams);
the wire protocol, both prepare_* signatures, the server's translation and
the native Sampler are checked against that declaration both ways, so a
field added in one place and forgotten in another fails here by name."""
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import llamax
from llamax.sampling import CHAT_DEFAULTS, SAMPLING_FIELDS, SamplingParams, field_sampler, field_wire
from llamax.server import protocol, translate

ROOT = Path(__file__).resolve().parents[2]

# fields of SamplingFields that are not sampling: what a request is, asks
# for, or how it is delivered
NOT_SAMPLING = {
    "model", "active_loras", "lora", "control_vectors", "user", "cache_salt", "max_tokens", "stop", "n", "stream",
    "stream_options", "grammar", "cache_prompt", "deterministic", "metadata", "store", "service_tier",
    # llama-server's: max_tokens' other name, a grammar's source, what the answer carries, a slot hint
    "n_predict", "json_schema", "timings_per_token", "return_progress", "id_slot",
}
# Sampler keywords that are not per-request sampling fields: the grammar and
# reasoning budget are request parts of their own, penalty_last_n a Llama setting
SAMPLER_NOT_SAMPLING = {
    "model", "penalty_last_n", "grammar", "grammar_root", "grammar_triggers", "grammar_start_triggers",
    "reasoning_budget", "reasoning_started_open", "reasoning_tags", "reasoning_budget_message",
}
NAMES = [f.name for f in SAMPLING_FIELDS]


def _sampler_keywords() -> set:
    """Sampler.__init__'s keywords, read from the stub (tests/core/test_stubs.py
    checks the stub against the compiled class)."""
    tree = ast.parse((ROOT / "llamax" / "_core.pyi").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Sampler")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}


def test_table_is_the_dataclass():
    assert len(SAMPLING_FIELDS) == 13
    assert NAMES == [f.name for f in dataclasses.fields(SamplingParams)]


def test_protocol_has_every_field_and_no_other_sampling_field():
    declared = set(protocol.SamplingFields.model_fields)
    wire = {field_wire(f) for f in SAMPLING_FIELDS}
    assert wire <= declared, f"protocol.SamplingFields lacks {sorted(wire - declared)}"
    unknown = declared - wire - NOT_SAMPLING
    assert not unknown, (f"protocol.SamplingFields has {sorted(unknown)}, which is neither a SamplingParams field "
                         "nor listed as not sampling here")


def test_sampler_takes_every_field_and_has_no_other_sampling_keyword():
    kws = _sampler_keywords()
    want = {field_sampler(f) for f in SAMPLING_FIELDS}
    assert want <= kws, f"Sampler lacks {sorted(want - kws)}"
    extra = kws - want - SAMPLER_NOT_SAMPLING
    assert not extra, f"Sampler takes {sorted(extra)}, which SamplingParams does not declare"


def test_the_real_sampler_takes_the_defaults(model):
    s = llamax.Sampler(model, **SamplingParams().sampler_kwargs())
    p = s.params
    assert p["temperature"] == pytest.approx(0.8) and p["top_k"] == 40
    s.close()


@pytest.mark.parametrize("method", ["prepare_completion", "prepare_chat_completion"])
def test_prepare_signatures_have_every_field_with_its_default(method):
    sig = inspect.signature(getattr(llamax.Llama, method))
    for f in SAMPLING_FIELDS:
        assert f.name in sig.parameters, f"Llama.{method} has no keyword {f.name}"
        want = CHAT_DEFAULTS.get(f.name, f.default) if method == "prepare_chat_completion" else f.default
        assert sig.parameters[f.name].default == want, (method, f.name, sig.parameters[f.name].default, want)


def test_translate_fills_every_field_from_the_wire():
    body = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.5, top_k=7,
                                          top_p=0.5, min_p=0.1, typical_p=0.9, repeat_penalty=1.1,
                                          frequency_penalty=0.3, presence_penalty=-0.2, seed=11,
                                          logit_bias={"5": -1.0}, mirostat=2, mirostat_tau=4.0, mirostat_eta=0.2)
    kw = translate.sampling(body, 1024, None)
    got = SamplingParams.from_keywords(kw)
    assert got == SamplingParams(temperature=0.5, top_k=7, top_p=0.5, min_p=0.1, typical_p=0.9, repeat_penalty=1.1,
                                 frequency_penalty=0.3, presence_penalty=-0.2, seed=11, logit_bias={5: -1.0},
                                 mirostat_mode=2, mirostat_tau=4.0, mirostat_eta=0.2)
    # a body that sets none gets the table's defaults (llama-server's)
    empty = protocol.CompletionRequest(prompt="x")
    assert SamplingParams.from_keywords(translate.sampling(empty, 1024, 16)) == SamplingParams()


def test_params_are_frozen_and_the_callers_mapping_untouched():
    kw = {f.name: f.default for f in SAMPLING_FIELDS}
    bias = {3: 1.0}
    kw["logit_bias"] = bias
    before = dict(kw)
    p = SamplingParams.from_keywords(kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    p.sampler_kwargs(seed=5)
    assert kw == before and bias == {3: 1.0}
    assert p.sampler_kwargs(seed=5)["seed"] == 5 and p.sampler_kwargs()["mirostat"] == 0
    assert SamplingParams(mirostat_mode=None).sampler_kwargs()["mirostat"] == 0


@pytest.mark.parametrize("name,value", [
    ("temperature", float("nan")), ("top_k", -5), ("top_p", 1.5), ("min_p", -0.1), ("typical_p", 2.0),
    ("repeat_penalty", -1.0), ("frequency_penalty", float("nan")), ("presence_penalty", float("inf")),
    ("mirostat_mode", 3), ("mirostat_tau", -1.0),
])
def test_a_bad_value_is_refused_by_name_through_llama(base_llm, name, value):
    with pytest.raises(llamax.LlamaxError, match=field_sampler(next(f for f in SAMPLING_FIELDS if f.name == name))):
        base_llm.create_completion("Hello", max_tokens=1, **{name: value})
