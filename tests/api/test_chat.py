"""Chat: assistant prefill on SmolLM2's ChatML template, chat templates by
name and as strings, and hostile templates (run in a subprocess each)."""
import copy
import re

import pytest

import llamax
from conftest import run_py

from .conftest import forget_cache, same_usage

G = dict(temperature=0)
QUESTION = {"role": "user", "content": "Name the first 5 planets."}
PARTIAL = "The first 5 are:\n1. Mercury\n2."


def content(r):
    return r["choices"][0]["message"]["content"]


def stream_content(chunks):
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def prompt_tokens(llm, text):
    """Tokens of a rendered chat prompt, as the chat path tokenizes it."""
    return llm.tokenize(text, add_bos=False, special=True)


# -- assistant prefill ------------------------------------------------------------------------

def test_prefill_seamless_continuation(llm):
    messages = [QUESTION, {"role": "assistant", "content": PARTIAL}]
    snapshot = copy.deepcopy(messages)
    ids = [id(m) for m in messages]
    r = llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=16, **G)
    # the caller's list and dicts are untouched
    assert messages == snapshot and [id(m) for m in messages] == ids and len(messages) == 2

    cont = content(r)
    assert r["choices"][0]["message"]["role"] == "assistant"
    # one space at the seam ("2." + " Venus" here), neither lost nor doubled
    assert re.match(r" \S", cont) and "  " not in (PARTIAL + cont)[len(PARTIAL) - 2:len(PARTIAL) + 3], cont
    # the reply is the continuation only: no re-sent partial, no end-of-turn marker in between
    assert not cont.startswith(PARTIAL) and "<|im_end|>" not in cont

    # the prompt was rendered with the generation prompt and the partial text appended
    rendered = llm.apply_chat_template([QUESTION], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    toks = prompt_tokens(llm, rendered + PARTIAL)
    assert r["usage"]["prompt_tokens"] == len(toks)
    # ... and the continuation is what the model writes after exactly that text
    plain = llm.create_completion(toks, max_tokens=16, **G)
    assert plain["choices"][0]["text"] == cont
    assert r["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    full = rendered + PARTIAL + cont
    assert llm.detokenize(prompt_tokens(llm, full), special=True).decode() == full


def test_prefill_mid_word(llm):
    """A partial that ends inside a word continues the word, with no space."""
    messages = [QUESTION, {"role": "assistant", "content": "The first 5 are:\n1. Mercury\n2. Ven"}]
    cont = content(llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=8, **G))
    assert cont.startswith("us"), cont


def test_prefill_stream(llm):
    messages = [QUESTION, {"role": "assistant", "content": PARTIAL}]
    snapshot = copy.deepcopy(messages)
    ref = llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=16, **G)
    chunks = list(llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=16,
                                             stream=True, **G))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert stream_content(chunks) == content(ref)
    assert chunks[-1]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    same_usage(chunks[-1]["usage"], ref["usage"])
    assert messages == snapshot


def test_prefill_with_adapter_and_stop(llm):
    """Prefill goes through the same request path: adapters and stop strings apply."""
    messages = [QUESTION, {"role": "assistant", "content": PARTIAL}]
    toks = prompt_tokens(llm, llm.apply_chat_template([QUESTION]) + PARTIAL)
    coder = [{"name": "coder", "scale": 1.0}]
    r = llm.create_chat_completion(messages=messages, assistant_prefill=True, active_loras=coder,
                                   max_tokens=16, **G)
    assert content(r) == llm.create_completion(toks, active_loras=coder, max_tokens=16, **G)["choices"][0]["text"]
    full = content(llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=16, **G))
    assert "\n" in full, full  # (the list goes on: "3. ...")
    s = llm.create_chat_completion(messages=messages, assistant_prefill=True, stop=["\n"], max_tokens=16, **G)
    assert content(s) == full[:full.index("\n")] and s["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("messages", [
    [QUESTION],                                                    # last message is the user's
    [QUESTION, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More"}],
    [{"role": "system", "content": "Be brief."}],
    [{"role": "assistant", "content": "Only a partial"}],          # nothing before the partial
    [QUESTION, {"role": "assistant", "content": ["not", "a", "string"]}],
])
def test_prefill_needs_a_final_assistant_message(llm, messages):
    snapshot = copy.deepcopy(messages)
    with pytest.raises(llamax.InvalidArgumentError):
        llm.create_chat_completion(messages=messages, assistant_prefill=True, max_tokens=4,
                                   active_loras=[{"name": "coder", "scale": 1.0}])
    assert messages == snapshot
    assert all(e["in_use"] == 0 for e in llm.list_loras())


# -- chat templates --------------------------------------------------------------------------------

HI = [{"role": "user", "content": "Say hello."}]


def test_gguf_template_is_used_by_default(llm):
    rendered = llm.apply_chat_template(HI)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")
    r = llm.create_chat_completion(HI, max_tokens=8, **G)
    toks = prompt_tokens(llm, rendered)
    assert r["usage"]["prompt_tokens"] == len(toks)
    assert content(r) == llm.create_completion(toks, max_tokens=8, **G)["choices"][0]["text"]


def test_chat_format_chatml(smollm2_path):
    with llamax.Llama(str(smollm2_path), n_ctx=256, n_threads=1, chat_format="chatml") as m:
        assert m.chat_format == "chatml"
        rendered = m.apply_chat_template(HI)
        # llama-cpp-python's "chatml": an empty system turn, not the GGUF template's default system prompt
        assert rendered == ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n"
                            "<|im_start|>assistant\n")
        r = m.create_chat_completion(HI, max_tokens=8, **G)
        toks = prompt_tokens(m, rendered)
        assert r["usage"]["prompt_tokens"] == len(toks)
        forget_cache(m)
        assert content(r) and content(r) == m.create_completion(toks, max_tokens=8, **G)["choices"][0]["text"]


def test_chat_template_string(smollm2_path):
    src = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
           "{{ raise_exception('no system messages') }}{% endif %}"
           "{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
           "{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}"
           "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    with llamax.Llama(str(smollm2_path), n_ctx=256, n_threads=1, chat_template=src) as m:
        rendered = m.apply_chat_template(HI)
        assert rendered == "<|im_start|>USER: Say hello.\nASSISTANT:"
        assert m.apply_chat_template(HI, add_generation_prompt=False) == "<|im_start|>USER: Say hello.\n"
        assert m.apply_chat_template(HI, tools=[{"name": "f"}]).endswith('TOOLS: [{"name": "f"}]\nASSISTANT:')
        r = m.create_chat_completion(HI, max_tokens=8, **G)
        toks = prompt_tokens(m, rendered)
        assert r["usage"]["prompt_tokens"] == len(toks)
        forget_cache(m)
        assert content(r) == m.create_completion(toks, max_tokens=8, **G)["choices"][0]["text"]
        # the template's own raise_exception is a ChatTemplateError, and the model still works after it
        with pytest.raises(llamax.ChatTemplateError, match="no system messages"):
            m.create_chat_completion([{"role": "system", "content": "x"}] + HI, max_tokens=2)
        forget_cache(m)
        assert content(m.create_chat_completion(HI, max_tokens=8, **G)) == content(r)


def test_template_helpers():
    t = llamax.ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}",
                            bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": "é"}]).split("|")
    assert out[:3] == ["<s>", "</s>", '{"role": "user", "content": "é"}']
    assert re.fullmatch(r"\d{4}", out[3])


def test_template_argument_errors(smollm2_path):
    with pytest.raises(llamax.InvalidArgumentError, match="chat_format"):
        llamax.Llama(str(smollm2_path), n_threads=1, chat_format="no-such-format")
    with pytest.raises(llamax.InvalidArgumentError):
        llamax.Llama(str(smollm2_path), n_threads=1, chat_format="chatml", chat_template="{{ 1 }}")
    with pytest.raises(llamax.ChatTemplateError, match="compile"):
        llamax.Llama(str(smollm2_path), n_threads=1, chat_template="{% for %}")
    assert issubclass(llamax.ChatTemplateError, llamax.LlamaxError)


# -- hostile templates: each in its own interpreter, so a crash or hang fails only its test ------

HOSTILE = {
    "subclasses": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "cve_2024_34359": (
        '{% for x in ().__class__.__base__.__subclasses__() %}{% if "warning" in x.__name__ %}'
        '{{ x()._module.__builtins__[\'__import__\'](\'os\').popen("touch PWNED").read() }}'
        '{%endif%}{% endfor %}', "unsafe"),
    "nested_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "took longer than"),
    "huge_output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "exceeds"),
    "raise_exception": ("{{ raise_exception('no') }}", "raised: no"),
    # one expression that would allocate ~10 GB before any output check
    "string_bomb": ("{{ 'x' * 10**10 }}", "larger than its output limit"),
    "power_bomb": ("{{ 2 ** (2 ** 40) }}", "huge power"),
    "concat_bomb": ("{% set s = 'x' * 4000000 %}{{ s + s }}", "larger than its output limit"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_template(case, smollm2_path, tmp_path):
    src, expect = HOSTILE[case]
    pwned = tmp_path / "pwned"
    src = src.replace("PWNED", str(pwned))
    n_calls = 1 if case == "nested_loops" else 3   # each of those spends the whole time budget
    r = run_py(f"""
        import llamax
        llm = llamax.Llama({str(smollm2_path)!r}, n_ctx=256, n_threads=1, chat_template={src!r})
        calls = [lambda: llm.create_chat_completion([{{"role": "user", "content": "hi"}}], max_tokens=4),
                 lambda: list(llm.create_chat_completion([{{"role": "user", "content": "hi"}}],
                                                         max_tokens=4, stream=True)),
                 lambda: llm.apply_chat_template([{{"role": "user", "content": "hi"}}])]
        for call in calls[:{n_calls}]:
            try:
                call()
                print("RENDERED")
            except llamax.ChatTemplateError as e:
                print("ChatTemplateError|" + str(e).replace("\\n", " ")[:300])
        # the model is still usable afterwards
        print("AFTER|" + llm("Hello", max_tokens=2, temperature=0)["choices"][0]["text"])
    """, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == n_calls + 1, r.stdout
    for line in lines[:-1]:
        assert line.startswith("ChatTemplateError|"), r.stdout
        assert expect in line, line
    assert lines[-1].startswith("AFTER|") and len(lines[-1]) > len("AFTER|")
    assert not pwned.exists()


def test_cve_payload_runs_outside_a_sandbox(tmp_path):
    """The CVE payload is live: in plain jinja2 it creates the file.  (So the
    test above shows the sandbox stops it, not that the payload is broken.)"""
    pwned = tmp_path / "pwned"
    src = HOSTILE["cve_2024_34359"][0].replace("PWNED", str(pwned))
    r = run_py(f"""
        import jinja2
        jinja2.Environment().from_string({src!r}).render()
    """, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert pwned.exists()


def test_template_loop_controls_and_generation_tag():
    """{% break %}/{% continue %}, {% generation %} and `tools` defined as None:
    what transformers' environment gives templates."""
    t = llamax.ChatTemplate(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
        "{% if tools is none %}(no tools){% endif %}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert t.render(msgs) == "[a](no tools)"
    assert t.render(msgs, tools=[{"type": "function"}]) == "[a]"
