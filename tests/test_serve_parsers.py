"""Qwen3 reasoning / Qwen3-Coder tool-call parsers on model-shaped text, streamed and whole."""

from __future__ import annotations

import json
import random

import pytest

from dspine_jax.serve.parsers import Qwen3CoderToolParser, ReasoningParser, parse_full
from dspine_jax.serve.protocol import normalize_messages
from dspine_jax.serve.scheduler import TextStream

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}}, "zip": {"type": "string"},
        }, "required": ["city"]},
    },
}]

THINKING = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**."
CODER_CALL = (
    "I'll check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    "<parameter=tags>\n[\"wind\", \"rain\"]\n</parameter>\n<parameter=zip>\n02139\n</parameter>\n</function>\n"
    "</tool_call>"
)
TWO_CALLS = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>"
)


def chunks(text: str, seed: int):
    rng, i = random.Random(seed), 0
    while i < len(text):
        n = rng.randint(1, 5)
        yield text[i : i + n]
        i += n


def stream_reasoning(text: str, start_in_reasoning=False, seed=0):
    p = ReasoningParser(start_in_reasoning)
    r, c = [], []
    for piece in list(chunks(text, seed)) + [None]:
        a, b = p.feed(piece) if piece is not None else p.finish()
        r.append(a)
        c.append(b)
    return "".join(r), "".join(c)


def test_reasoning_whole_and_streamed():
    reasoning, content, calls = parse_full(THINKING, reasoning=True, tools=None)
    assert reasoning == "\nThe user wants 2+2. That is 4.\n"
    assert content == "The answer is **4**." and calls == []
    for seed in range(5):
        assert stream_reasoning(THINKING, seed=seed) == (reasoning, content)


def test_reasoning_opened_in_prompt_and_absent():
    # Qwen3 thinking templates end the prompt with "<think>\n": the output starts inside the block.
    text = "Let me think. 2+2=4.\n</think>\n\n4"
    assert parse_full(text, True, None, start_in_reasoning=True)[:2] == ("Let me think. 2+2=4.\n", "4")
    assert stream_reasoning(text, start_in_reasoning=True) == ("Let me think. 2+2=4.\n", "4")
    # No think block at all: everything is content.
    assert parse_full("Just an answer <b>", True, None)[:2] == ("", "Just an answer <b>")
    assert stream_reasoning("Just an answer <b>") == ("", "Just an answer <b>")
    # Unfinished reasoning (cut by max_tokens) stays reasoning.
    assert stream_reasoning("<think>still thinking </thi") == ("still thinking </thi", "")
    # A short output that is a prefix of "<think>" is content.
    assert stream_reasoning("<th") == ("", "<th")


def test_qwen3_coder_tool_call():
    _, content, calls = parse_full(CODER_CALL, reasoning=False, tools=TOOLS)
    assert content == "I'll check the weather."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": "San Francisco", "days": 3, "metric": True, "tags": ["wind", "rain"], "zip": "02139"}


def test_qwen3_coder_streamed_equals_whole():
    for text in (CODER_CALL, TWO_CALLS, "no tools here < tool", THINKING + "\n" + CODER_CALL):
        reasoning = text.startswith("<think>")
        r_whole, c_whole, calls_whole = parse_full(text, reasoning, TOOLS)
        for seed in range(4):
            rp = ReasoningParser() if reasoning else None
            tp = Qwen3CoderToolParser(TOOLS)
            content, calls = [], []
            for piece in list(chunks(text, seed)) + [None]:
                pairs = ([rp.feed(piece)] if piece is not None else [rp.finish()]) if rp else [("", piece or "")]
                for _, c in pairs:
                    c, new = tp.feed(c)
                    content.append(c)
                    calls += new
            c, new = tp.finish()
            content.append(c)
            calls += new
            strip = "".join(content).strip() if calls else "".join(content)
            assert strip == c_whole
            assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [
                (x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls_whole]
    _, _, calls = parse_full(TWO_CALLS, False, TOOLS)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "Europe/Paris"}  # no schema: JSON or string


def test_unterminated_tool_call_is_content():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    _, content, calls = parse_full(text, False, TOOLS)
    assert calls == [] and content == text


class WordTok:
    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids)


@pytest.mark.parametrize("stops,expect", [(["END"], "hello wor"), (["o w"], "hell"), ([], "hello world!\ufffd")])
def test_text_stream_stop_strings(stops, expect):
    words = ["hel", "lo", " wor", "EN", "D", "ld", "!", "\ufffd"]
    ids = [0, 1, 2, 3, 4, 5, 6, 7] if stops == ["END"] else [0, 1, 2, 5, 6, 7]
    ts = TextStream(WordTok(words), stops)
    out, hit = "", False
    for i in ids:
        delta, hit = ts.feed([i])
        out += delta
        if hit:
            break
    if not hit:
        out += ts.flush()
    assert out == expect


def testnormalize_messages_for_templates():
    msgs = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    assert msgs[0]["content"] == "ab" and msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
