"""llamax.llama_chat_format and llamax.llama_types, the drop-ins for
llama-cpp-python's modules of the same names.

The built-in formats and Jinja2ChatFormatter are compared byte for byte with
what llama-cpp-python 0.3.36 renders for the same messages, stored in
chat_format_reference.json (made by make_chat_format_reference.py).  No model
is loaded here.
"""
import copy
import json
import pathlib

import jinja2
import pytest

import llamax
from llamax import llama_chat_format as lcf
from llamax import llama_types

REF = json.loads(pathlib.Path(__file__).with_name("chat_format_reference.json").read_text(encoding="utf-8"))
CASES = sorted(REF["messages"])
FUNCTIONS = {  # registered name -> the function's name here (llama-cpp-python calls vicuna's `format`)
    "llama-2": "format_llama2", "llama-3": "format_llama3", "alpaca": "format_alpaca", "qwen": "format_qwen",
    "vicuna": "format_vicuna", "oasst_llama": "format_oasst_llama", "baichuan-2": "format_baichuan2",
    "baichuan": "format_baichuan", "openbuddy": "format_openbuddy", "redpajama-incite": "format_redpajama_incite",
    "snoozy": "format_snoozy", "phind": "format_phind", "intel": "format_intel", "open-orca": "format_open_orca",
    "mistrallite": "format_mistrallite", "zephyr": "format_zephyr", "pygmalion": "format_pygmalion",
    "chatml": "format_chatml", "mistral-instruct": "format_mistral_instruct", "chatglm3": "format_chatglm3",
    "openchat": "format_openchat", "saiga": "format_saiga", "gemma": "format_gemma",
}


def as_dict(r):
    return {"prompt": r.prompt, "stop": r.stop, "added_special": r.added_special}


def test_reference_covers_every_format():
    assert sorted(REF["formats"]) == sorted(FUNCTIONS)
    assert set(FUNCTIONS) <= set(lcf._FORMATS)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_builtin_format_matches_llama_cpp_python(name, case):
    expected = REF["formats"][name][case]
    assert "error" not in expected  # every reference case renders in llama-cpp-python
    messages = copy.deepcopy(REF["messages"][case])
    snapshot = copy.deepcopy(messages)
    formatter = lcf.chat_formatter(name)
    assert formatter is getattr(lcf, FUNCTIONS[name]) is lcf.get_chat_format(name)
    assert as_dict(formatter(messages=messages)) == expected
    # extra keywords, as a chat handler passes them, change nothing
    assert as_dict(formatter(messages=messages, tools=None, functions=None, tool_choice=None)) == expected
    assert messages == snapshot


def test_vicuna_also_under_llama_cpp_python_function_name():
    assert lcf.format is lcf.format_vicuna


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("key", sorted(REF["jinja2"]))
def test_jinja2_formatter_matches_llama_cpp_python(key, case):
    template_name, agp = key.split("/")
    expected = REF["jinja2"][key][case]
    fmt = lcf.Jinja2ChatFormatter(getattr(lcf, template_name), eos_token="</s>", bos_token="<s>",
                                  add_generation_prompt=agp == "True")
    messages = copy.deepcopy(REF["messages"][case])
    snapshot = copy.deepcopy(messages)
    if "error" in expected:
        # llama-cpp-python fails (raise_exception, str + list); llamax's sandbox says so in its own class
        with pytest.raises(llamax.ChatTemplateError):
            fmt(messages=messages)
    else:
        assert as_dict(fmt(messages=messages)) == expected
    assert messages == snapshot


def test_template_constants_and_guess():
    for name, text in REF["templates"].items():
        assert getattr(lcf, name) == text
    guess = lcf.guess_chat_format_from_gguf_metadata
    assert guess({"tokenizer.chat_template": lcf.CHATML_CHAT_TEMPLATE}) == "chatml"
    assert guess({"tokenizer.chat_template": lcf.MIXTRAL_INSTRUCT_CHAT_TEMPLATE}) == "mistral-instruct"
    assert guess({"tokenizer.chat_template": lcf.LLAMA3_INSTRUCT_CHAT_TEMPLATE}) == "llama-3"
    assert guess({"tokenizer.chat_template": "{{ messages }}"}) is None
    assert guess({}) is None


# -- llama-cpp-python's own tests (tests/test_llama_chat_format.py), same semantics ------------------

def test_mistral_instruct_matches_its_jinja2_template():
    reference = jinja2.Template(lcf.MIXTRAL_INSTRUCT_CHAT_TEMPLATE)
    messages = [
        llama_types.ChatCompletionRequestUserMessage(role="user", content="Instruction"),
        llama_types.ChatCompletionRequestAssistantMessage(role="assistant", content="Model answer"),
        llama_types.ChatCompletionRequestUserMessage(role="user", content="Follow-up instruction"),
    ]
    response = lcf.format_mistral_instruct(messages=messages)
    assert response.added_special is False  # no BOS in the prompt: the tokenizer adds it
    prompt = ("" if response.added_special else "<s>") + response.prompt
    assert prompt == reference.render(messages=messages, bos_token="<s>", eos_token="</s>")


MISTRAL_CONFIG = {
    "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "legacy": True, "tokenizer_class": "LlamaTokenizer", "use_default_system_prompt": False,
    "chat_template": lcf.MIXTRAL_INSTRUCT_CHAT_TEMPLATE,
}


def test_hf_tokenizer_config_to_chat_formatter():
    formatter = lcf.hf_tokenizer_config_to_chat_formatter(MISTRAL_CONFIG)
    messages = [llama_types.ChatCompletionRequestUserMessage(role="user", content="Hello, world!")]
    response = formatter(messages=messages)
    # an empty assistant turn stands for the generation prompt
    assert response.prompt == "<s>[INST] Hello, world! [/INST]</s>"
    assert response.stop == ["</s>", "<s>"] and response.added_special is True
    assert messages == [{"role": "user", "content": "Hello, world!"}]

    plain = lcf.hf_tokenizer_config_to_chat_formatter(MISTRAL_CONFIG, add_generation_prompt=False)
    assert plain(messages=messages).prompt == "<s>[INST] Hello, world! [/INST]"


def test_hf_tokenizer_config_added_token_dicts():
    config = dict(MISTRAL_CONFIG, bos_token={"content": "<s>", "special": True},
                  eos_token={"content": "</s>", "lstrip": False})
    response = lcf.hf_tokenizer_config_to_chat_formatter(config)(messages=[{"role": "user", "content": "Hi"}])
    assert response.prompt == "<s>[INST] Hi [/INST]</s>" and response.stop == ["</s>", "<s>"]


@pytest.mark.parametrize("config, error", [
    ({"bos_token": "<s>", "eos_token": "</s>"}, llamax.InvalidArgumentError),
    ({"chat_template": "x", "eos_token": "</s>"}, llamax.InvalidArgumentError),
    ({"chat_template": "x", "bos_token": 1, "eos_token": "</s>"}, llamax.ArgumentTypeError),
    ("not a dict", llamax.ArgumentTypeError),
])
def test_hf_tokenizer_config_refused(config, error):
    with pytest.raises(error):
        lcf.hf_tokenizer_config_to_chat_formatter(config)


# -- Jinja2ChatFormatter ------------------------------------------------------------------------

def test_jinja2_formatter_fields_and_variables():
    template = ("{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
                "{% if tools %}tools={{ tools | length }};{% endif %}{{ extra }}"
                "{% if add_generation_prompt %}>{% endif %}")
    fmt = lcf.Jinja2ChatFormatter(template, eos_token="</s>", bos_token="<s>", stop_token_ids=[2, 7])
    assert (fmt.template, fmt.eos_token, fmt.bos_token, fmt.add_generation_prompt) == (template, "</s>", "<s>", True)
    assert fmt.stop_token_ids == {2, 7}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = fmt(messages=[{"role": "user", "content": "hi"}], tools=tools, extra="X")
    assert r.prompt == "<s>user=hi;tools=1;X>"
    assert r.stop == ["</s>"] and r.added_special is True
    # stop_token_ids: a criterion on the last token
    assert r.stopping_criteria([5, 7], None) is True
    assert r.stopping_criteria([7, 5], None) is False
    assert lcf.Jinja2ChatFormatter(template, "</s>", "<s>")(messages=[{"role": "user", "content": "hi"}]) \
        .stopping_criteria is None


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",   # CVE-2024-34359's route out of the template
    "{% for i in range(10**9) %}{{ i }}{% endfor %}",   # runs past the time and size limits
    "{{ raise_exception('no system messages') }}",
])
def test_hostile_template_raises_chat_template_error(template):
    fmt = lcf.Jinja2ChatFormatter(template, eos_token="</s>", bos_token="<s>")
    with pytest.raises(llamax.ChatTemplateError):
        fmt(messages=[{"role": "user", "content": "hi"}])


def test_broken_template_fails_at_construction():
    with pytest.raises(llamax.ChatTemplateError):
        lcf.Jinja2ChatFormatter("{% for %}", eos_token="</s>", bos_token="<s>")


# -- the registry -------------------------------------------------------------------------------

def test_unknown_format_name():
    with pytest.raises(llamax.InvalidArgumentError, match="chatml") as e:
        lcf.chat_formatter("no-such-format")
    assert isinstance(e.value, ValueError)
    with pytest.raises(llamax.InvalidArgumentError):
        lcf.get_chat_format("no-such-format")


def test_register_chat_format():
    name = "test-echo"

    @lcf.register_chat_format(name)
    def echo(messages, **kwargs):
        return lcf.ChatFormatterResponse(prompt="|".join(m["content"] for m in messages))

    try:
        assert lcf.chat_formatter(name) is echo
        assert echo(messages=[{"role": "user", "content": "a"}]).prompt == "a"
        with pytest.raises(llamax.InvalidArgumentError, match="already"):
            lcf.register_chat_format(name)(echo)
        lcf.register_chat_format(name, overwrite=True)(lcf.format_chatml)
        assert lcf.chat_formatter(name) is lcf.format_chatml
    finally:
        del lcf._FORMATS[name]


def test_response_defaults():
    r = lcf.ChatFormatterResponse(prompt="p")
    assert (r.prompt, r.stop, r.stopping_criteria, r.added_special) == ("p", None, None, False)


# -- llama_types --------------------------------------------------------------------------------

def test_types_build_plain_dicts():
    m = llama_types.ChatCompletionRequestUserMessage(role="user", content="hi")
    assert m == {"role": "user", "content": "hi"} and type(m) is dict
    call = llama_types.ChatCompletionMessageToolCall(
        id="call_0", type="function",
        function=llama_types.ChatCompletionMessageToolCallFunction(name="f", arguments="{}"))
    a = llama_types.ChatCompletionRequestAssistantMessage(role="assistant", tool_calls=[call])
    assert a["tool_calls"][0]["function"]["name"] == "f"


def test_types_public_names():
    names = """JsonType EmbeddingUsage Embedding CreateEmbeddingResponse CompletionLogprobs CompletionChoice
    CompletionUsage CreateCompletionResponse ChatCompletionResponseFunctionCall ChatCompletionResponseMessage
    ChatCompletionFunction ChatCompletionTopLogprobToken ChatCompletionLogprobToken ChatCompletionLogprobs
    ChatCompletionResponseChoice CreateChatCompletionResponse ChatCompletionMessageToolCallChunkFunction
    ChatCompletionMessageToolCallChunk ChatCompletionStreamResponseDeltaEmpty
    ChatCompletionStreamResponseDeltaFunctionCall ChatCompletionStreamResponseDelta
    ChatCompletionStreamResponseChoice CreateChatCompletionStreamResponse ChatCompletionFunctions
    ChatCompletionFunctionCallOption ChatCompletionRequestResponseFormat ChatCompletionRequestMessageContentPartText
    ChatCompletionRequestMessageContentPartImageImageUrl ChatCompletionRequestMessageContentPartImage
    ChatCompletionRequestMessageContentPart ChatCompletionRequestSystemMessage ChatCompletionRequestUserMessage
    ChatCompletionMessageToolCallFunction ChatCompletionMessageToolCall ChatCompletionMessageToolCalls
    ChatCompletionRequestAssistantMessageFunctionCall ChatCompletionRequestAssistantMessage
    ChatCompletionRequestToolMessage ChatCompletionRequestFunctionMessage ChatCompletionRequestMessage
    ChatCompletionRequestFunctionCallOption ChatCompletionRequestFunctionCall ChatCompletionFunctionParameters
    ChatCompletionToolFunction ChatCompletionTool ChatCompletionNamedToolChoiceFunction ChatCompletionNamedToolChoice
    ChatCompletionToolChoiceOption EmbeddingData CompletionChunk Completion CreateCompletionStreamResponse
    ChatCompletionMessage ChatCompletionChoice ChatCompletion ChatCompletionChunkDeltaEmpty ChatCompletionChunkChoice
    ChatCompletionChunkDelta ChatCompletionChunk ChatCompletionStreamResponse ChatCompletionResponseFunction
    ChatCompletionFunctionCall""".split()  # noqa: SIM905 (a word list reads better as text)
    missing = [n for n in names if not hasattr(llama_types, n)]
    assert not missing
    opt = llama_types.ChatCompletionStreamResponseDelta.__optional_keys__
    assert opt == {"content", "function_call", "tool_calls", "role"}
    assert llama_types.CreateCompletionResponse.__optional_keys__ == {"usage"}
    assert set(llama_types.ChatCompletionLogprobToken.__required_keys__) == {"token", "logprob", "bytes",
                                                                             "top_logprobs"}
