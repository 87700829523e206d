"""Output parsers for Qwen3-family models, streaming and non-streaming alike.

* ``ReasoningParser`` (``--reasoning-parser qwen3``): text inside ``<think>…</think>`` becomes
  ``reasoning_content``. Qwen3 thinking templates often open ``<think>`` inside the prompt, so the
  parser can start inside the reasoning block (``start_in_reasoning``); otherwise reasoning starts only
  when the output begins with ``<think>``. Whitespace right after ``</think>`` is dropped.
* ``Qwen3CoderToolParser`` (``--tool-call-parser qwen3_coder``): Qwen3-Coder's XML-ish tool calls

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE
      </parameter>
      </function>
      </tool_call>

  become OpenAI ``tool_calls`` (``arguments`` is a JSON string; values are converted with the tool's
  JSON schema: strings stay strings, other types are parsed as JSON where possible).

Both parsers take text deltas (``feed``) and ``finish()``; the non-streaming answer is the same parser
run over the whole text, so streamed and non-streamed results agree.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """Splits output text into (reasoning, content) deltas."""

    def __init__(self, start_in_reasoning: bool = False):
        self.mode = "reasoning" if start_in_reasoning else "detect"
        self.buf = ""
        self.strip_leading = False  # drop whitespace at the start of the content after </think>

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        if self.mode == "detect":
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.mode, self.buf = "reasoning", stripped[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(stripped):
                return "", ""  # could still become <think>
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            if THINK_CLOSE in self.buf:
                reasoning, rest = self.buf.split(THINK_CLOSE, 1)
                self.mode, self.buf, self.strip_leading = "content", rest, True
            else:
                hold = _held_prefix(self.buf, THINK_CLOSE)
                reasoning, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                return reasoning, ""
        if self.mode == "content":
            content, self.buf = self.buf, ""
            if self.strip_leading:
                content = content.lstrip()
                self.strip_leading = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self.buf = self.buf, ""
        if self.mode == "reasoning":
            return buf, ""
        if self.mode == "detect":
            return "", buf
        return "", buf.lstrip() if self.strip_leading else buf


def _convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return raw
    if kind in ("integer", "number"):
        try:
            return int(raw) if kind == "integer" else float(raw) if any(c in raw for c in ".eE") else int(raw)
        except ValueError:
            pass
    if kind == "boolean" and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parse_qwen3_coder_call(body: str, tools: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The text between ``<tool_call>`` and ``</tool_call>`` → an OpenAI tool call (None if malformed)."""
    match = _FUNCTION.search(body)
    if not match:
        return None
    name = match.group(1).strip()
    schema_props: dict[str, Any] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            schema_props = (fn.get("parameters") or {}).get("properties") or {}
    args = {}
    for param in _PARAMETER.finditer(match.group(2)):
        key = param.group(1).strip()
        args[key] = _convert_value(_strip_one_newline(param.group(2)), schema_props.get(key))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


class Qwen3CoderToolParser:
    """Content deltas → (content delta, completed tool calls). Text from the first ``<tool_call>`` on is
    held back; each complete call is emitted whole (OpenAI streaming allows the full arguments in one
    delta). Text after the last call is content again."""

    def __init__(self, tools: Sequence[dict[str, Any]] | None):
        self.tools = list(tools or [])
        self.buf = ""
        self.in_call = False
        self.calls: list[dict[str, Any]] = []

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                idx = self.buf.find(TOOL_OPEN)
                if idx < 0:
                    hold = _held_prefix(self.buf, TOOL_OPEN)
                    content += self.buf[: len(self.buf) - hold]
                    self.buf = self.buf[len(self.buf) - hold:]
                    break
                content += self.buf[:idx]
                self.buf, self.in_call = self.buf[idx + len(TOOL_OPEN):], True
            idx = self.buf.find(TOOL_CLOSE)
            if idx < 0:
                break
            call = parse_qwen3_coder_call(self.buf[:idx], self.tools)
            if call is not None:
                calls.append(call)
            else:
                content += TOOL_OPEN + self.buf[: idx + len(TOOL_CLOSE)]
            self.buf, self.in_call = self.buf[idx + len(TOOL_CLOSE):], False
        if self.calls or calls:
            content = content.strip() if not content.strip() else content  # whitespace between calls
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        buf, self.buf = self.buf, ""
        if self.in_call:  # an unterminated call (e.g. cut by max_tokens): parse what is there
            call = parse_qwen3_coder_call(buf, self.tools)
            if call is not None and "</function>" in buf:
                self.calls.append(call)
                return "", [call]
            return TOOL_OPEN + buf, []
        return buf, []


def parse_full(
    text: str, reasoning: bool, tools: Sequence[dict[str, Any]] | None, start_in_reasoning: bool = False
) -> tuple[str | None, str, list[dict[str, Any]]]:
    """Non-streaming: whole text → (reasoning_content or None, content, tool_calls)."""
    r_parts, c_parts, calls = [], [], []
    rp = ReasoningParser(start_in_reasoning) if reasoning else None
    tp = Qwen3CoderToolParser(tools) if tools is not None else None
    pieces = [rp.feed(text), rp.finish()] if rp else [("", text)]
    for r, c in pieces:
        r_parts.append(r)
        if tp:
            c, new = tp.feed(c)
            calls += new
        c_parts.append(c)
    if tp:
        c, new = tp.finish()
        c_parts.append(c)
        calls += new
    content = "".join(c_parts)
    if calls:
        content = content.strip()
    return ("".join(r_parts) if rp else None), content, calls
