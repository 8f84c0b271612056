"""What the HTTP body fuzzer (tests/server/test_fuzz_http.py) found, kept
as concrete bodies: each one got a 5xx (or a dropped connection) before
its fix, and must now get the status and error code it names, an OpenAI
error body, valid UTF-8, and leave no traceback in the server's log."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from . import http_fuzz

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

# (id, route, body, status, error code or None, what the answer must hold)
FINDS = [
    # Token ids past int64: numpy's OverflowError in the server's range check
    # (detokenize, completions) and in Llama's embedding inputs was a 500.
    ("detokenize_past_int64", "/detokenize", {"tokens": [2**63]}, 400, "invalid_token", None),
    ("detokenize_past_uint64", "/detokenize", {"tokens": [1, 2**64]}, 400, "invalid_token", None),
    ("completion_token_past_int64", "/v1/completions", {"prompt": [1, 2**64], "max_tokens": 1}, 400,
     "invalid_token", None),
    ("completion_prompts_past_int64", "/v1/completions", {"prompt": [[1], [1, 2**63]], "max_tokens": 1}, 400,
     "invalid_token", None),
    ("embedding_token_past_int64", "/v1/embeddings", {"input": [1, 2**64]}, 400, "invalid_token", None),
    ("embedding_inputs_past_int64", "/v1/embeddings", {"input": [[1, 2], [1, 2**63]]}, 400, "invalid_token", None),
    # A lone surrogate ("\ud800" in the body's JSON) echoed in an answer:
    # UnicodeEncodeError while encoding the answer, a 500 and a dropped
    # keep-alive connection.  Now escaped in the JSON the server writes.
    ("template_lone_surrogate", "/apply-template", {"messages": [{"role": "user", "content": "\ud800"}]}, 200, None,
     lambda a: "\ud800" in a["prompt"]),
    ("template_lone_surrogate_role", "/apply-template", {"messages": [{"role": "user\udfff", "content": "x"}]}, 200,
     None, lambda a: isinstance(a["prompt"], str)),
    # JSON schemas (response_format) whose keywords allOf / oneOf / enum read
    # before the converter checked their type: TypeError in planning, a 500.
    ("schema_properties_not_object_in_oneof", "/v1/chat/completions",
     dict(CHAT, response_format={"type": "json_object", "schema": {"oneOf": [{"properties": True}], "maximum": 1}}),
     400, "invalid_value", None),
    ("schema_properties_not_object_in_allof", "/v1/chat/completions",
     dict(CHAT, response_format={"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"allOf": [{"properties": True}, {"type": "object"}]}}}), 400, "invalid_value", None),
    ("schema_type_not_a_name_with_enum", "/v1/chat/completions",
     dict(CHAT, response_format={"type": "json_object",
                                 "schema": {"type": "array", "items": {"type": 5, "enum": [1]}}}),
     400, "invalid_value", None),
    ("schema_type_not_a_name_in_allof", "/v1/chat/completions",
     dict(CHAT, response_format={"type": "json_object", "schema": {"allOf": [{"type": 5}, {"type": "string"}]}}),
     400, "invalid_value", None),
    # A Responses reasoning item whose summary (or content) is not a list:
    # TypeError while listing its parts, a 500 (found by CI's slow fuzz run).
    ("responses_reasoning_summary_not_a_list", "/v1/responses",
     {"input": [{"type": "reasoning", "summary": 0}, {"role": "user", "content": "hi"}], "max_output_tokens": 1},
     400, None, lambda a: "input[0].summary" in a["error"]["message"]),
    ("responses_reasoning_content_an_object", "/v1/responses",
     {"input": [{"type": "reasoning", "content": {"text": "x"}}, {"role": "user", "content": "hi"}],
      "max_output_tokens": 1}, 400, None, lambda a: "input[0].content" in a["error"]["message"]),
    # More sequences (prompts x n) than the server ever admits at once was a
    # 503 queue_full with Retry-After: a retry can never succeed.
    ("more_sequences_than_admitted", "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "n": 16,
                                                         "max_tokens": 1}, 400, "too_many_sequences", None),
]


@pytest.mark.parametrize("route, body, status, code, holds", [f[1:] for f in FINDS], ids=[f[0] for f in FINDS])
def test_find(server, route, body, status, code, holds):
    seen = len(server.err)
    with httpx.Client(base_url=server.url, timeout=http_fuzz.BOUND + 5) as c:
        t0 = time.monotonic()
        r = c.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
        http_fuzz.check_answer(r, time.monotonic() - t0)
        assert r.status_code == status, r.text
        answer = http_fuzz.strict_json(r.content.decode())
        if code is not None:
            assert answer["error"]["code"] == code, answer
        if holds is not None:
            assert holds(answer), answer
        assert c.get("/health").status_code == 200
    time.sleep(0.2)  # the server's log reader thread
    log = "".join(server.err[seen:])
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


@pytest.mark.parametrize("route", ["/lora-adapters", "/v1/chat/completions", "/tokenize"])
def test_deeply_nested_json_is_a_400(server, locked, route):
    """Arrays nested 20,000 deep: json.loads raises RecursionError, which the
    hand-read body of POST /lora-adapters (an admin route: the ``locked``
    server) let through as a 500 (found by the slow HTTP fuzz run); the
    model-validated routes already answered 400."""
    from .conftest import ADMIN
    srv, headers = (locked, {"Authorization": f"Bearer {ADMIN}"}) if route == "/lora-adapters" else (server, {})
    seen = len(srv.err)
    deep = "[" * 20_000 + "]" * 20_000  # 40 KB: under the locked server's 64 KiB body limit
    with httpx.Client(base_url=srv.url, timeout=http_fuzz.BOUND + 5, headers=headers) as c:
        r = c.post(route, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert "error" in http_fuzz.strict_json(r.content.decode())
        assert c.get("/health").status_code == 200
    time.sleep(0.2)
    log = "".join(srv.err[seen:])
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
