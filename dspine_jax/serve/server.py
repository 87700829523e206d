"""OpenAI-compatible HTTP server (Starlette + uvicorn) over the continuous-batching engine.

Threads: uvicorn's event loop handles HTTP; one worker thread owns the ``EngineCore`` (every JAX call
happens there). A request is validated and tokenized in the handler, queued (bounded: 429 when full),
admitted into a free slot between engine steps (prefill), and fed text deltas from the worker through
an ``asyncio.Queue`` (``loop.call_soon_threadsafe``). Detokenization and stop strings are handled per
request in the worker, so a stop string frees the slot in the same step. A client that disconnects
(streaming or not) marks its request cancelled; the worker frees the slot before the next step.

Startup: the app answers as soon as it listens. The worker thread first runs the loader (weights,
tokenizer, engine, compilation of every shape); until it returns, ``GET /health`` is 503
``{"status": "starting"}`` and every ``/v1/*`` request gets an immediate 503 with ``Retry-After`` (not a
wait: a client is never held for minutes, and OpenAI clients retry 503s). Then ``/health`` is 200
``{"status": "ok"}``; a loader that fails leaves 503 ``{"status": "failed", "error": …}``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dspine_jax.serve.engine import EngineCore, SlotParams
from dspine_jax.serve.metrics import Metrics
from dspine_jax.serve.parsers import Qwen3CoderToolParser, ReasoningParser, parse_full

RETRY_AFTER_S = 5  # what a 503 "starting" tells clients to wait before retrying

# Builds the engine core and its tokenizer; runs on the engine thread while the server says "starting".
Loader = Callable[[], tuple[EngineCore, Any]]
Handler = Callable[[Request], Awaitable[Response]]


def _sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def _sse_error(message: str) -> str:
    return _sse({"error": {"message": message, "type": "server_error"}})


class StartupError(Exception):
    """A loader failure whose message is meant for the user as is (no traceback)."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ----------------------------------------------------------------------------------------------
# Requests and incremental detokenization


class TextStream:
    """Incremental detokenization with stop strings: never returns text past a stop string, and holds
    back a tail that could still become one (or an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""

    def feed(self, new_ids: list[int]) -> tuple[str, bool]:
        self.ids += new_ids
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = self.text
        best = -1
        for s in self.stops:
            idx = text.find(s, max(0, self.sent - len(s) + 1))
            if idx >= 0 and (best < 0 or idx < best):
                best = idx
        if best >= 0:
            out = text[self.sent:best] if best > self.sent else ""
            self.sent = max(self.sent, best)
            return out, True
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        out = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, False

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


@dataclasses.dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SlotParams
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    endpoint: str
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False
    slot: int | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_generated: int = 0
    stream: TextStream | None = None

    def emit(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class QueueFull(Exception):
    pass


class AsyncEngine:
    """Owns the EngineCore in a worker thread; a bounded waiting queue in front of it.

    The worker first runs ``load``: meanwhile ``state`` is "starting"; then "ready" (``ready`` is set), or
    "failed" with ``error`` set and ``on_failure(error)`` called (the CLI stops listening)."""

    def __init__(self, load: Loader, metrics: Metrics, max_queue: int):
        self.load, self.metrics, self.max_queue = load, metrics, max_queue
        self.core: EngineCore | None = None
        self.tokenizer: Any = None
        self.state = "starting"
        self.error: str | None = None
        self.ready = threading.Event()
        self.on_failure: Callable[[str], None] | None = None
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.active: dict[int, GenRequest] = {}
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="dspine-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.ready.is_set():  # a loader cannot be interrupted: leave it to die with the (daemon) thread
            self.thread.join(timeout=30)

    def submit(self, req: GenRequest) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            req.stream = TextStream(self.tokenizer, req.stops)
            self.waiting.append(req)
            self.metrics.queued = len(self.waiting)
            self.cond.notify_all()

    def cancel(self, req: GenRequest) -> None:
        with self.cond:
            req.cancelled = True
            self.cond.notify_all()

    # -- worker thread
    def _finish(self, req: GenRequest, reason: str, status: str = "ok") -> None:
        if req.slot is not None:
            self.active.pop(req.slot, None)
            try:
                self.core.release(req.slot)
            finally:
                req.slot = None
        if status == "ok":
            req.emit(("done", reason, req.num_generated))
        self.metrics.request(req.endpoint, status)
        self.metrics.latency.observe(time.monotonic() - req.arrival)

    def _fail(self, req: GenRequest, exc: BaseException) -> None:
        traceback.print_exception(exc)
        req.emit(("error", f"internal error while generating: {type(exc).__name__}: {exc}"))
        try:
            self._finish(req, "error", status="error")
        except Exception as e:  # a failed release must not take the worker down
            traceback.print_exception(e)

    def _deliver(self, req: GenRequest, tokens: list[int], reason: str | None) -> None:
        """New tokens for ``req``: text delta, stop strings, completion."""
        if req.first_token_time is None and tokens:
            req.first_token_time = time.monotonic()
            self.metrics.ttft.observe(req.first_token_time - req.arrival)
        req.num_generated += len(tokens)
        with self.metrics.lock:
            self.metrics.generation_tokens += len(tokens)
        delta, hit = req.stream.feed(tokens)
        if hit:
            if delta:
                req.emit(("text", delta))
            self._finish(req, "stop")
            return
        if reason is not None:
            delta += req.stream.flush()
        if delta:
            req.emit(("text", delta))
        if reason is not None:
            self._finish(req, reason)

    def _start(self) -> bool:
        """Run the loader; True once the engine can serve."""
        try:
            self.core, self.tokenizer = self.load()
            self.metrics.set_max_acceptance(self.core.max_verify)
        except Exception as e:
            if not isinstance(e, StartupError):
                traceback.print_exception(e)
            self.error, self.state = str(e) or type(e).__name__, "failed"
            if self.on_failure is not None:
                self.on_failure(self.error)
            return False
        self.state = "ready"
        self.ready.set()
        return True

    def _run(self) -> None:
        if not self._start():
            return
        core = self.core
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and not self.active:
                    self.cond.wait(timeout=1.0)
                if self.stopping:
                    return
            try:
                self._iteration(core)
            except Exception as e:  # never let the worker die: fail what is in flight, start clean
                traceback.print_exception(e)
                for req in list(self.active.values()):
                    req.slot = None  # the reset below frees every slot
                    req.emit(("error", f"internal error while generating: {type(e).__name__}: {e}"))
                    self.metrics.request(req.endpoint, "error")
                self.active.clear()
                try:
                    core.reset()
                except Exception as e2:
                    traceback.print_exception(e2)

    def _iteration(self, core: EngineCore) -> None:
        for req in list(self.active.values()):
            if req.cancelled:
                self._finish(req, "cancelled", status="cancelled")
        # Admit waiting requests into free slots.
        while True:
            with self.cond:
                slot = core.free_slot()
                if slot is None or not self.waiting:
                    break
                req = self.waiting.popleft()
                self.metrics.queued = len(self.waiting)
            if req.cancelled:
                self._finish(req, "cancelled", status="cancelled")
                continue
            try:
                first, reason = core.add(slot, req.prompt_ids, req.max_tokens, req.params)
            except Exception as e:
                try:
                    core.release(slot)
                finally:
                    self._fail(req, e)
                continue
            req.slot = slot
            self.active[slot] = req
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(req.prompt_ids)
            try:
                self._deliver(req, [first], reason)
            except Exception as e:
                self._fail(req, e)
        self.metrics.running = len(self.active)
        if core.num_running() == 0:
            return
        start = time.perf_counter()
        result = core.step()
        self.metrics.record_step(result.accepted, time.perf_counter() - start)
        for slot, tokens in result.tokens.items():
            req = self.active.get(slot)
            if req is None:
                continue
            try:
                self._deliver(req, tokens, result.finished.get(slot))
            except Exception as e:
                self._fail(req, e)
        self.metrics.running = len(self.active)


# ----------------------------------------------------------------------------------------------
# Request validation


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
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


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    return value


@dataclasses.dataclass
class Sampling:
    max_tokens: int | None
    max_tokens_param: str  # the field the client set it with (max_tokens or max_completion_tokens)
    params: SlotParams
    stops: list[str]
    stream: bool
    include_usage: bool


def parse_sampling(body: dict, chat: bool) -> Sampling:
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    temperature = _number(body, "temperature", 1.0, lo=0.0, hi=100.0)
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _integer(body, "top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    if top_k < 0:
        raise APIError(400, f"'top_k' must be -1, 0 (disabled) or positive, got {top_k}", param="top_k")
    seed = _integer(body, "seed")
    max_param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_param)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"'{max_param}' must be >= 1, got {max_tokens}", param=max_param)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
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
    return Sampling(
        max_tokens=max_tokens, max_tokens_param=max_param,
        params=SlotParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed), stops=stops, stream=stream,
        include_usage=bool(options.get("include_usage")),
    )


def _normalize_messages(messages: list) -> list[dict]:
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


# ----------------------------------------------------------------------------------------------
# The app


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


class Server:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.metrics = engine.metrics
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # -- helpers
    async def _json(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, "", self.config.model_name):
            raise APIError(400, f"model {model!r} is not served here; available: {self.config.model_name!r}",
                           param="model", code="model_not_found")
        return body

    def _check_length(self, prompt_ids: list[int], s: Sampling, prompt_param: str) -> int:
        """The completion budget: ``max_tokens`` if the context holds it after the prompt, else a 400 that
        names the field at fault (the prompt, or ``max_tokens`` with its cap); unset → all the room left."""
        ctx, n = self.engine.core.context_length, len(prompt_ids)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        vocab = self.engine.core.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=prompt_param)
        room = ctx - n
        if room < 1:
            raise APIError(400, f"The prompt has {n} tokens, but this model's maximum context length is {ctx} "
                           f"tokens (prompt + completion), leaving no room for a completion. Please shorten the "
                           f"{prompt_param}.", param=prompt_param, code="context_length_exceeded")
        if s.max_tokens is None:
            return room
        if s.max_tokens > room:
            raise APIError(400, f"'{s.max_tokens_param}' is {s.max_tokens}, but at most {room} completion tokens "
                           f"fit: this model's maximum context length is {ctx} tokens and the prompt has {n}. "
                           f"Please set {s.max_tokens_param} <= {room}.",
                           param=s.max_tokens_param, code="context_length_exceeded")
        return s.max_tokens

    def _submit(self, s: Sampling, prompt_ids: list[int], endpoint: str) -> GenRequest:
        max_tokens = self._check_length(prompt_ids, s, "messages" if endpoint == "chat" else "prompt")
        req = GenRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, params=s.params, stops=s.stops,
                         loop=asyncio.get_running_loop(), endpoint=endpoint)
        try:
            self.engine.submit(req)
        except QueueFull:
            self.metrics.request(endpoint, "rejected")
            raise APIError(429, "the server is at capacity (request queue full); retry later",
                           type_="rate_limit_error", code="queue_full") from None
        return req

    async def _events(self, req: GenRequest, request: Request):
        """Yield engine events; cancel the request if the client goes away."""
        done = False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(req.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield event
                if event[0] in ("done", "error"):
                    done = True
                    return
        finally:
            if not done:
                self.engine.cancel(req)

    async def _guard(self, req: GenRequest, body):
        """Stream ``body``; however it ends (done, client gone, cancelled), make sure the slot is freed."""
        try:
            async for piece in body:
                yield piece
        finally:
            self.engine.cancel(req)  # no-op for a request that already finished

    def _usage(self, req: GenRequest) -> dict:
        p, c = len(req.prompt_ids), req.num_generated
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # -- endpoints
    async def health(self, request: Request):
        engine = self.engine
        if engine.state == "ready":
            alive = engine.thread.is_alive()
            return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)
        body = {"status": engine.state} | ({"error": engine.error} if engine.error else {})
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    def _when_ready(self, handler: Handler) -> Handler:
        """``handler`` once the engine is ready; before that an immediate 503 the client can retry."""
        async def gated(request: Request) -> Response:
            engine = self.engine
            if engine.state == "ready":
                return await handler(request)
            if engine.state == "starting":
                message = "the server is starting (loading and compiling the model); retry when GET /health is 200"
            else:
                message = f"the engine failed to start: {engine.error}"
            response = APIError(503, message, type_="server_error", code=f"server_{engine.state}").response()
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        return gated

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "dspine_jax",
            "max_model_len": self.engine.core.context_length,
        }]})

    async def metrics_endpoint(self, request: Request):
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _collect(self, req: GenRequest, request: Request) -> tuple[str, str] | Response:
        """Non-streaming: the whole generated text and its finish reason, or the response to send instead
        (an engine error, or 499 when the client went away)."""
        parts, finish = [], None
        async for ev in self._events(req, request):
            if ev[0] == "text":
                parts.append(ev[1])
            elif ev[0] == "done":
                finish = ev[1]
            else:
                return APIError(500, ev[1], type_="server_error").response()
        if finish is None:  # client went away
            return JSONResponse({}, status_code=499)
        return "".join(parts), finish

    def _stream_end(self, req: GenRequest, sampling: Sampling, head: dict) -> list[str]:
        """The events after a stream's last choice: the usage chunk (if asked for) and ``[DONE]``."""
        usage = [_sse({**head, "choices": [], "usage": self._usage(req)})] if sampling.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    async def completions(self, request: Request):
        try:
            body = await self._json(request)
            s = parse_sampling(body, chat=False)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                prompt_ids = list(prompt)
            else:
                raise APIError(400, "'prompt' must be a non-empty string or list of token ids (one prompt)", param="prompt")
            req = self._submit(s, prompt_ids, "completions")
        except APIError as e:
            if e.status == 400:
                self.metrics.request("completions", "invalid")
            return e.response()
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.config.model_name

        if s.stream:
            head = {"id": rid, "object": "text_completion", "created": created, "model": model}

            async def gen():
                async for ev in self._events(req, request):
                    if ev[0] == "text":
                        yield _sse({**head, "choices": [{"index": 0, "text": ev[1], "logprobs": None, "finish_reason": None}]})
                    elif ev[0] == "done":
                        yield _sse({**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": ev[1]}]})
                        for line in self._stream_end(req, s, head):
                            yield line
                    else:
                        yield _sse_error(ev[1])
            return StreamingResponse(self._guard(req, gen()), media_type="text/event-stream")

        collected = await self._collect(req, request)
        if not isinstance(collected, tuple):
            return collected
        text, finish = collected
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": self._usage(req),
        })

    async def chat_completions(self, request: Request):
        try:
            body = await self._json(request)
            s = parse_sampling(body, chat=True)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise APIError(400, "'messages' is required: a non-empty list of messages", param="messages")
            messages = _normalize_messages(messages)
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise APIError(400, "'tools' must be a list", param="tools")
            if body.get("tool_choice") == "none":
                tools = None
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions")
            try:
                prompt_text = self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
                )
            except Exception as e:  # template errors are the request's fault (bad roles, ordering, …)
                raise APIError(400, f"could not render the chat template: {e}", param="messages") from None
            prompt_ids = self.tokenizer.encode(prompt_text, add_special_tokens=False)
            req = self._submit(s, prompt_ids, "chat")
        except APIError as e:
            if e.status == 400:
                self.metrics.request("chat", "invalid")
            return e.response()
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.model_name
        use_reasoning = self.config.reasoning_parser is not None
        start_in_reasoning = use_reasoning and prompt_text.rstrip().endswith("<think>")
        use_tools = self.config.tool_call_parser is not None and bool(tools)

        if s.stream:
            rp = ReasoningParser(start_in_reasoning) if use_reasoning else None
            tp = Qwen3CoderToolParser(tools) if use_tools else None
            state = {"tool_index": 0}

            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

            def chunk(delta: dict, finish=None) -> str:
                return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

            def pieces(reasoning: str, content: str, calls: list) -> list[str]:
                out = []
                if reasoning:
                    out.append(chunk({"reasoning_content": reasoning}))
                if content:
                    out.append(chunk({"content": content}))
                for call in calls:
                    out.append(chunk({"tool_calls": [{"index": state["tool_index"], **call}]}))
                    state["tool_index"] += 1
                return out

            def process(text: str | None) -> list[str]:
                """``text`` delta, or None to flush at the end."""
                pairs = ([rp.feed(text)] if text is not None else [rp.finish()]) if rp else [("", text or "")]
                out = []
                for r, c in pairs:
                    calls = []
                    if tp:
                        c, calls = tp.feed(c)
                    out += pieces(r, c, calls)
                if text is None and tp:
                    c, calls = tp.finish()
                    out += pieces("", c, calls)
                return out

            async def gen():
                yield chunk({"role": "assistant", "content": ""})
                async for ev in self._events(req, request):
                    if ev[0] == "text":
                        for piece in process(ev[1]):
                            yield piece
                    elif ev[0] == "done":
                        for piece in process(None):
                            yield piece
                        finish = "tool_calls" if state["tool_index"] and ev[1] == "stop" else ev[1]
                        yield chunk({}, finish)
                        for line in self._stream_end(req, s, head):
                            yield line
                    else:
                        yield _sse_error(ev[1])
            return StreamingResponse(self._guard(req, gen()), media_type="text/event-stream")

        collected = await self._collect(req, request)
        if not isinstance(collected, tuple):
            return collected
        text, finish = collected
        reasoning, content, calls = parse_full(text, use_reasoning, tools if use_tools else None, start_in_reasoning)
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
            if finish == "stop":
                finish = "tool_calls"
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": self._usage(req),
        })

    def app(self) -> Starlette:
        async def not_found(request: Request, exc):
            return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

        async def server_error(request: Request, exc):
            traceback.print_exception(exc)
            return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error").response()

        async def method_not_allowed(request: Request, exc):
            return APIError(405, f"method {request.method} not allowed on {request.url.path}").response()

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self._when_ready(self.models), methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/v1/completions", self._when_ready(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._when_ready(self.chat_completions), methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed,
                                                            500: server_error, Exception: server_error})


def build_app(load: Loader, config: ServerConfig, max_queue: int = 64) -> tuple[Starlette, AsyncEngine]:
    """Wire an engine into an app. ``engine.start()`` starts the engine thread, which runs ``load`` (→ core,
    tokenizer) first; the app serves requests once it returns (see the module doc)."""
    engine = AsyncEngine(load, Metrics(), max_queue)
    return Server(engine, config).app(), engine
