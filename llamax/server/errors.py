"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``
with the status code that fits, and the mapping from llamax's exceptions."""
from __future__ import annotations

import llamax
from llamax.templates import ChatTemplateError

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 501: "not_supported_error", 503: "unavailable_error",
}


class APIError(Exception):
    """An error the server answers with: status code, message, param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, type: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type or _TYPES.get(status, "server_error")
        self.extra = extra  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)

    def body(self) -> dict:
        e = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.extra:
            e.update(self.extra)
        return {"error": e}

    def anthropic_body(self) -> dict:
        """Anthropic's error shape (the routes of its Messages API)."""
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


# Anthropic's error types by status (docs.anthropic.com, "Errors")
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 501: "invalid_request_error",
    503: "overloaded_error", 504: "timeout_error",
}


# Every llamax exception class -> (status, code).  An exception gets its own
# class's row, else the row of the nearest base in its MRO (a subclass made
# elsewhere); tests/server/test_error_table.py checks that every
# LlamaxError subclass has a row of its own, so none falls through to 500
# by accident.
BY_CLASS: dict[type, tuple[int, str]] = {
    llamax.LlamaxError: (500, "internal_error"),
    llamax.UnknownAdapterError: (404, "adapter_not_found"),
    llamax.ContextOverflowError: (400, "context_length_exceeded"),
    llamax.AdapterInUseError: (503, "adapters_busy"),
    llamax.AdapterMismatchError: (400, "adapter_mismatch"),
    llamax.InvalidGGUFError: (400, "invalid_file"),
    llamax.PeftError: (400, "invalid_adapter"),
    llamax.LoadError: (400, "load_failed"),
    ChatTemplateError: (400, "chat_template_error"),
    llamax.GrammarError: (400, "grammar_error"),
    llamax.ControlVectorError: (400, "invalid_control_vector"),
    llamax.TokenError: (400, "invalid_token"),
    llamax.InvalidUtf8Error: (400, "invalid_utf8"),
    llamax.ArgumentTypeError: (400, "invalid_type"),
    llamax.InvalidArgumentError: (400, "invalid_value"),
    llamax.OutOfMemoryError: (503, "out_of_memory"),
    llamax.KVCacheFullError: (503, "kv_cache_full"),
    llamax.CancelledError: (503, "cancelled"),       # the server is stopping
    llamax.ClosedError: (503, "cancelled"),
    llamax.ContextBusyError: (503, "context_busy"),  # a context another thread holds: try again
    llamax.DecodeError: (500, "decode_error"),       # llama_decode failed: the server's fault, not the request's
    llamax.ViewsExportedError: (500, "internal_error"),
    llamax.FetchError: (500, "fetch_failed"),
    llamax.ShadowingError: (500, "internal_error"),   # (the process's setup, never a request's doing)
}


# llama-server's error types where it has its own (its clients read them);
# the code stays OpenAI's
_TYPE_OF_CODE = {"context_length_exceeded": "exceed_context_size_error"}


def from_exception(exc: BaseException) -> APIError | None:
    """The APIError for an exception llamax raises (its class's row in
    BY_CLASS, or its nearest base's); None for anything else."""
    if isinstance(exc, APIError):
        return exc
    for cls in type(exc).__mro__:
        row = BY_CLASS.get(cls)
        if row is None:
            continue
        status, code = row
        msg = str(exc)
        if isinstance(exc, KeyError) and exc.args:
            msg = str(exc.args[0])  # KeyError's str() adds quotes
        if status == 500:
            msg = f"{type(exc).__name__}: {msg}"
        headers = {"Retry-After": "1"} if status == 503 else None
        return APIError(status, msg, code=code, headers=headers, type=_TYPE_OF_CODE.get(code))
    return None
