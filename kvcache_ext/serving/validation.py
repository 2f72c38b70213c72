"""The checks a request body passes before it reaches transformers' handlers and the engine.

Every field of a chat completion (``/v1/chat/completions``), a text completion
(``/v1/completions``) or a response (``/v1/responses``) is either checked (type and range), or
refused unless it has the value that asks for nothing (``n`` 1, ``frequency_penalty`` 0, ...),
or unknown: a bad body raises ``InvalidRequest``, which the server answers with HTTP 400 and
OpenAI's error shape naming the field, the value and what is accepted. The fields that change
sampling come back as a ``Sampling`` (``kvcache_ext.serving.sampling`` serves them per request).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("system", "developer", "user", "assistant", "tool")
# What transformers' own server takes beyond OpenAI's fields (chat template options).
TEMPLATE_OPTIONS = "chat_template_kwargs"


class InvalidRequest(ValueError):
    """A request the server refuses before it runs: ``param`` is the field (None: the body)."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.param, self.message, self.code, self.status = param, message, code, status

    def body(self) -> dict:
        return error_body(self.message, "invalid_request_error", self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def shown(value) -> str:
    """A value as the client sent it (JSON), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Sampling:
    """A request's sampling fields (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


# --- one field ------------------------------------------------------------------------------------
def integer(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be an integer >= {low}")
    return value


def number(name: str, value, low: float, high: float, low_included: bool = True) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or not (low <= value <= high) or (not low_included and value == low):
        side = "[" if low_included else "("
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be a number in {side}{low}, {high}]")
    return float(value)


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be true or false")
    return value


def text(name: str, value, nonempty: bool = False) -> str:
    if not isinstance(value, str) or (nonempty and not value):
        what = "a non-empty string" if nonempty else "a string"
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be {what}")
    return value


def mapping(name: str, value) -> dict:
    if not isinstance(value, dict):
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be an object")
    return value


def stream_options(name: str, value) -> dict:
    """Usage always comes with a stream's last chunk: ``include_usage`` asks for nothing more."""
    mapping(name, value)
    for key, option in value.items():
        if key != "include_usage":
            raise InvalidRequest(name, f"{name}.{key} is not served; {name} takes include_usage only")
        boolean(f"{name}.include_usage", option)
    return value


def parts(name: str, content, part_types: tuple[str, ...]) -> None:
    """A message's content: a string, or a list of text parts (the model reads text only)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(name, f"{name} is {shown(content)}: it must be a string or a list of text parts")
    for i, part in enumerate(content):
        where = f"{name}[{i}]"
        if not isinstance(part, dict) or part.get("type") not in part_types:
            raise InvalidRequest(where, f"{where} is {shown(part)}: this server's model reads text only; a part "
                                        f"must be an object of type {' or '.join(part_types)}")
        text(f"{where}.text", part.get("text"))


def message(name: str, value, part_types: tuple[str, ...]) -> None:
    mapping(name, value)
    if value.get("role") not in ROLES:
        raise InvalidRequest(f"{name}.role", f"{name}.role is {shown(value.get('role'))}: it must be one of "
                                             f"{', '.join(ROLES)}")
    content = value.get("content")
    if content is None and value["role"] == "assistant" and value.get("tool_calls"):
        return      # an assistant turn that only called tools
    parts(f"{name}.content", content, part_types)


def messages(name: str, value) -> list:
    if not isinstance(value, list) or not value:
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be a non-empty list of messages "
                                   "({\"role\": ..., \"content\": ...})")
    for i, item in enumerate(value):
        message(f"{name}[{i}]", item, ("text",))
    return value


def response_input(name: str, value) -> None:
    """A response's input: a string, or a list of messages and items of earlier responses."""
    if isinstance(value, str):
        text(name, value, nonempty=True)
        return
    if not isinstance(value, list) or not value:
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be a non-empty string or a non-empty list")
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        mapping(where, item)
        if "role" in item:
            message(where, item, ("input_text", "output_text", "text"))
        elif item.get("type") in ("input_text", "output_text", "text"):
            text(f"{where}.text", item.get("text"))
        elif item.get("type") not in ("function_call", "function_call_output", "reasoning"):
            raise InvalidRequest(where, f"{where} is {shown(item)}: it must be a message (with a role), a text "
                                        "part, or a function_call, function_call_output or reasoning item")


def model_name(name: str, value) -> str:
    return text(name, value, nonempty=True)


def tools(name: str, value) -> list:
    if not isinstance(value, list):
        raise InvalidRequest(name, f"{name} is {shown(value)}: it must be a list of tools")
    return value


# --- the fields of each endpoint ------------------------------------------------------------------
SAMPLING = {
    "temperature": lambda n, v: number(n, v, 0.0, 2.0),
    "top_p": lambda n, v: number(n, v, 0.0, 1.0, low_included=False),
    "top_k": lambda n, v: integer(n, v, 1),
}
COMMON = {"model": model_name, "stream": boolean, "user": text, **SAMPLING}

# Refused unless null or the value that asks for nothing: field -> (those values, why).
ONE_CHOICE = ((1,), "one choice per request is served; send the request once per choice")
NO_PENALTY = ((0, 0.0), "the engine applies no penalty per request")
NOT_SERVED = {
    "n": ONE_CHOICE,
    "best_of": ONE_CHOICE,
    "frequency_penalty": NO_PENALTY,
    "presence_penalty": NO_PENALTY,
    "logit_bias": (({},), "the engine applies no logit bias per request"),
    "logprobs": ((False, 0), "log probabilities are not returned"),
    "top_logprobs": ((0,), "log probabilities are not returned"),
    "echo": ((False,), "the prompt is not echoed"),
    "seed": ((), "requests share the engine's random generator in a batch, so a seed cannot make one request's "
                 "samples repeat; use temperature 0 for an answer that repeats"),
    "stop": (("", []), "stop sequences are not served: an answer ends at the model's end of sequence or at "
                       "max_tokens"),
    "response_format": (({"type": "text"},), "only text answers are served"),
    "tool_choice": (("auto",), "the model chooses whether to call a tool (auto)"),
    "parallel_tool_calls": ((True,), "tool calls are not limited"),
    "store": ((False,), "responses are not stored"),
    "generation_config": ((), "a generation config is the server's; give max_tokens, temperature, top_p, top_k"),
}
FOR_EVERY_ENDPOINT = ("audio", "modalities", "prediction", "reasoning_effort", "service_tier", "metadata",
                      "web_search_options", "function_call", "functions", "background", "include",
                      "max_tool_calls", "previous_response_id", "prompt_cache_key", "reasoning", "safety_identifier",
                      "truncation", "text", "conversation")

CHAT = {**COMMON, "messages": messages, "max_tokens": lambda n, v: integer(n, v, 1),
        "max_completion_tokens": lambda n, v: integer(n, v, 1), "stream_options": stream_options, "tools": tools,
        TEMPLATE_OPTIONS: mapping}
COMPLETION = {**COMMON, "prompt": lambda n, v: text(n, v, nonempty=True), "max_tokens": lambda n, v: integer(n, v, 1),
              "suffix": text, "stream_options": stream_options}
RESPONSE = {**COMMON, "input": response_input, "instructions": text,
            "max_output_tokens": lambda n, v: integer(n, v, 1), "tools": tools, TEMPLATE_OPTIONS: mapping}
REQUIRED = {"chat": ("messages",), "completion": ("prompt",), "response": ("input",)}
FIELDS = {"chat": CHAT, "completion": COMPLETION, "response": RESPONSE}


def check_request(endpoint: str, body) -> Sampling:
    """Raises ``InvalidRequest`` for the first bad field of ``body`` (a request to ``endpoint``:
    "chat", "completion" or "response"); else its sampling fields."""
    if not isinstance(body, dict):
        raise InvalidRequest(None, f"the body is {shown(body)}: it must be a JSON object", "invalid_body")
    fields = FIELDS[endpoint]
    for name in REQUIRED[endpoint]:
        if body.get(name) is None:
            raise InvalidRequest(name, f"{name} is missing: a request to this endpoint needs it", "missing_field")
    for name, value in body.items():
        if value is None and name not in REQUIRED[endpoint]:
            continue       # null: as if not given
        if name in fields:
            fields[name](name, value)
        elif name in NOT_SERVED:
            accepted, why = NOT_SERVED[name]
            if not any(value == a and type(value) is type(a) for a in accepted):
                allowed = f" (accepted: {', '.join(shown(a) for a in accepted)}, or null)" if accepted else ""
                raise InvalidRequest(name, f"{name} is {shown(value)}: not served, {why}{allowed}", "unsupported_value")
        elif name in FOR_EVERY_ENDPOINT:
            raise InvalidRequest(name, f"{name} is {shown(value)}: not served by this server", "unsupported_field")
        else:
            raise InvalidRequest(name, f"unrecognized field {name!r}; this endpoint takes "
                                       f"{', '.join(sorted(fields))}", "unknown_field")
    return Sampling(**{name: body.get(name) for name in SAMPLING})
