"""The OpenAI wire protocol: request parsing and validation, error objects, server-sent events.

Everything here is pure (no engine, no HTTP server): ``parse_options`` turns a completion / chat
request body into ``RequestOptions`` or raises ``APIError`` (an OpenAI error object with the field at
fault), ``normalize_messages`` prepares chat messages for HF chat templates.
"""

from __future__ import annotations

import dataclasses
import json
import math

from starlette.responses import JSONResponse

from dspine_jax.serve.engine import SlotParams


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def sse_error(message: str) -> str:
    return sse({"error": {"message": message, "type": "server_error"}})


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ----------------------------------------------------------------------------------------------
# Request validation


def number_field(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a number, got {value!r}", param=name)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise APIError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value!r}", param=name)
    if hi is not None and value > hi:
        raise APIError(400, f"'{name}' must be <= {hi}, got {value!r}", param=name)
    return float(value)


def integer_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    return value


@dataclasses.dataclass
class RequestOptions:
    max_tokens: int | None
    max_tokens_param: str  # the field the client set it with (max_tokens or max_completion_tokens)
    params: SlotParams
    stops: list[str]
    stream: bool
    include_usage: bool
    drafter: str | None = None  # a server holding several drafters: which one (``--draft NAME=DIR``)


def parse_options(body: dict, chat: bool) -> RequestOptions:
    n = integer_field(body, "n")
    if n is not None and n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    temperature = number_field(body, "temperature", 1.0, lo=0.0, hi=100.0)
    top_p = number_field(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = integer_field(body, "top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    if top_k < 0:
        raise APIError(400, f"'top_k' must be -1, 0 (disabled) or positive, got {top_k}", param="top_k")
    seed = integer_field(body, "seed")
    max_param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer_field(body, max_param)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'{max_param}' must be >= 1, got {max_tokens}", param=max_param)
    for name in ("presence_penalty", "frequency_penalty"):
        if number_field(body, name, 0.0) != 0.0:
            raise APIError(400, f"'{name}' is not supported (must be 0)", param=name)
    if body.get("logprobs") not in (None, False, 0) or body.get("best_of") not in (None, 1):
        raise APIError(400, "logprobs and best_of are not supported", param="logprobs")
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        stops = list(stop)
    else:
        raise APIError(400, "'stop' must be a string or a list of at most 16 strings", param="stop")
    stops = [s for s in stops if s]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    drafter = body.get("drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise APIError(400, "'drafter' must be a string (a drafter's name)", param="drafter")
    return RequestOptions(
        max_tokens=max_tokens, max_tokens_param=max_param,
        params=SlotParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed), stops=stops, stream=stream,
        include_usage=bool(options.get("include_usage")), drafter=drafter,
    )


def normalize_messages(messages: list) -> list[dict]:
    """OpenAI messages → what HF chat templates expect (tool-call arguments as dicts, content strings)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported", param="messages")
                texts.append(part["text"])
            m["content"] = "".join(texts)
        elif content is None:
            m["content"] = ""
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                calls.append({**call, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out
