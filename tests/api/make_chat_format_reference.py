"""Write chat_format_reference.json: what llama-cpp-python renders for each of
its chat formats, the reference test_chat_format.py compares llamax with.

Run it with a Python that has llama-cpp-python (0.3.36) installed, from a
directory where ``import llama_cpp`` finds the installed package:

    cd /tmp && /path/to/llama-cpp-python-venv/bin/python /path/to/tests/api/make_chat_format_reference.py

It only calls the formatter functions (no model is loaded).
"""
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).with_name("chat_format_reference.json")

# Registered name -> the function's name in llama_cpp.llama_chat_format.
FORMATS = {
    "llama-2": "format_llama2", "llama-3": "format_llama3", "alpaca": "format_alpaca", "qwen": "format_qwen",
    "vicuna": "format", "oasst_llama": "format_oasst_llama", "baichuan-2": "format_baichuan2",
    "baichuan": "format_baichuan", "openbuddy": "format_openbuddy", "redpajama-incite": "format_redpajama_incite",
    "snoozy": "format_snoozy", "phind": "format_phind", "intel": "format_intel", "open-orca": "format_open_orca",
    "mistrallite": "format_mistrallite", "zephyr": "format_zephyr", "pygmalion": "format_pygmalion",
    "chatml": "format_chatml", "mistral-instruct": "format_mistral_instruct", "chatglm3": "format_chatglm3",
    "openchat": "format_openchat", "saiga": "format_saiga", "gemma": "format_gemma",
}

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
MESSAGES = {
    "system_user": [SYSTEM, {"role": "user", "content": "Hello, world!"}],
    "user_assistant_user": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "system_two_turns": [
        SYSTEM,
        {"role": "user", "content": "Name a planet."},
        {"role": "assistant", "content": "Mars."},
        {"role": "user", "content": "Another one, please."},
    ],
    # Edge cases: braces and newlines in text, an empty assistant turn,
    # content parts (no plain text), a tool result.
    "edges": [
        {"role": "user", "content": "Fill {system_message} and {0}.\nTwo lines."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "parts"}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_0"},
        {"role": "user", "content": "Last."},
    ],
    # Role spellings some formats match literally (open-orca, saiga).
    "other_roles": [
        {"role": "system", "content": "Sys."},
        {"role": "User", "content": "Hi."},
        {"role": "Assistant", "content": "Hello."},
        {"role": "user", "content": "Hey."},
        {"role": "bot", "content": "Yes?"},
    ],
}

TEMPLATES = ["CHATML_CHAT_TEMPLATE", "MISTRAL_INSTRUCT_CHAT_TEMPLATE", "MIXTRAL_INSTRUCT_CHAT_TEMPLATE",
             "LLAMA3_INSTRUCT_CHAT_TEMPLATE"]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def response(r):
    return {"prompt": r.prompt, "stop": r.stop, "added_special": r.added_special}


def attempt(formatter, messages):
    try:
        return response(formatter(messages=messages))
    except Exception as e:  # noqa: BLE001 (the reference records which inputs llama-cpp-python refuses)
        return {"error": type(e).__name__}


def main():
    import llama_cpp
    import llama_cpp.llama_chat_format as lcf

    ref = {"llama_cpp_python": llama_cpp.__version__, "messages": MESSAGES, "formats": {}, "jinja2": {},
           "templates": {name: getattr(lcf, name) for name in TEMPLATES}}
    for name, attr in FORMATS.items():
        ref["formats"][name] = {case: attempt(getattr(lcf, attr), msgs) for case, msgs in MESSAGES.items()}
    for name in TEMPLATES:
        for agp in (True, False):
            fmt = lcf.Jinja2ChatFormatter(getattr(lcf, name), add_generation_prompt=agp, **TOKENS)
            ref["jinja2"][f"{name}/{agp}"] = {case: attempt(fmt, msgs) for case, msgs in MESSAGES.items()}
    OUT.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} (llama-cpp-python {llama_cpp.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
