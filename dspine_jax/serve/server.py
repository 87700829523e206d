"""OpenAI-compatible HTTP server (Starlette + uvicorn) over the continuous-batching engine.

Threads: uvicorn's event loop handles HTTP; one worker thread owns the ``EngineCore`` (every JAX call
happens there). A request is validated (``protocol.py``) and tokenized in the handler, then handed to
the scheduler (``scheduler.py``: queued — 429 when full —, admitted between engine steps, streamed back).
A client that disconnects (streaming or not) marks its request cancelled; the worker frees the slot
before the next step. This module holds the routes only.

Startup: the app answers as soon as it listens. The worker thread first runs the loader (weights,
tokenizer, engine, compilation of every shape); until it returns, ``GET /health`` is 503
``{"status": "starting"}`` and every ``/v1/*`` request gets an immediate 503 with ``Retry-After`` (not a
wait: a client is never held for minutes, and OpenAI clients retry 503s). Then ``/health`` is 200
``{"status": "ok"}``; a loader that fails leaves 503 ``{"status": "failed", "error": …}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dspine_jax.serve.metrics import Metrics
from dspine_jax.serve.parsers import Qwen3CoderToolParser, ReasoningParser, parse_full
from dspine_jax.serve.protocol import (
    APIError,
    RequestOptions,
    normalize_messages,
    parse_options,
    sse,
    sse_error,
)
from dspine_jax.serve.scheduler import AsyncEngine, GenRequest, Loader, QueueFull

RETRY_AFTER_S = 5  # what a 503 "starting" tells clients to wait before retrying

Handler = Callable[[Request], Awaitable[Response]]


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

    def _check_length(self, prompt_ids: list[int], s: RequestOptions, prompt_param: str) -> int:
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

    def _submit(self, s: RequestOptions, prompt_ids: list[int], endpoint: str) -> GenRequest:
        max_tokens = self._check_length(prompt_ids, s, "messages" if endpoint == "chat" else "prompt")
        req = GenRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, params=s.params, stops=s.stops,
                         loop=asyncio.get_running_loop(), endpoint=endpoint, drafter=self._drafter(s.drafter))
        try:
            self.engine.submit(req)
        except QueueFull:
            self.metrics.request(endpoint, "rejected")
            raise APIError(429, "the server is at capacity (request queue full); retry later",
                           type_="rate_limit_error", code="queue_full") from None
        return req

    def _drafter(self, asked: str | None) -> str | None:
        """The request's drafter: its ``drafter`` field (checked), else the server's first; None when the server
        holds one drafter (or none)."""
        names = getattr(self.engine.core, "names", None)  # (``DrafterEngines``)
        if names is None:
            if asked is not None:
                raise APIError(400, "this server holds one drafter: 'drafter' chooses between several (start it "
                               "with --draft NAME=DIR for each)", param="drafter")  # fmt: skip
            return None
        if asked is not None and asked not in names:
            raise APIError(400, f"unknown drafter {asked!r}; this server holds {', '.join(names)}", param="drafter")
        return asked or names[0]

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
            body = {"status": "ok" if alive else "engine stopped", "warmup": engine.core.warmup_progress()}
            return JSONResponse(body, status_code=200 if alive else 503)
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
                message = f"the engine failed: {engine.error}"  # (to start, or later: a peer process was lost)
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
            else:  # ("error", message[, status])
                return APIError(ev[2] if len(ev) > 2 else 500, ev[1], type_="server_error").response()
        if finish is None:  # client went away
            return JSONResponse({}, status_code=499)
        return "".join(parts), finish

    def _sse(self, req: GenRequest, request: Request, options: RequestOptions, head: dict,
             on_text: Callable[[str], list[str]], on_done: Callable[[str], list[str]],
             opening: list[str] = ()) -> StreamingResponse:
        """A streamed request's SSE body (both endpoints): ``opening``, the events ``on_text`` makes of each text
        delta, then ``on_done``'s and the stream's end when it finishes, or an error event if it fails."""
        async def events():
            for line in opening:
                yield line
            async for ev in self._events(req, request):
                if ev[0] == "text":
                    lines = on_text(ev[1])
                elif ev[0] == "done":
                    lines = on_done(ev[1]) + self._stream_end(req, options, head)
                else:
                    lines = [sse_error(ev[1])]
                for line in lines:
                    yield line

        return StreamingResponse(self._guard(req, events()), media_type="text/event-stream")

    def _stream_end(self, req: GenRequest, sampling: RequestOptions, head: dict) -> list[str]:
        """The events after a stream's last choice: the usage chunk (if asked for) and ``[DONE]``."""
        usage = [sse({**head, "choices": [], "usage": self._usage(req)})] if sampling.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    async def completions(self, request: Request):
        try:
            body = await self._json(request)
            s = parse_options(body, chat=False)
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

            def choice(text: str, finish: str | None) -> list[str]:
                return [sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})]

            return self._sse(req, request, s, head, lambda text: choice(text, None), lambda reason: choice("", reason))

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
            s = parse_options(body, chat=True)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise APIError(400, "'messages' is required: a non-empty list of messages", param="messages")
            messages = normalize_messages(messages)
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
                return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

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

            def done(reason: str) -> list[str]:
                out = process(None)
                return out + [chunk({}, "tool_calls" if state["tool_index"] and reason == "stop" else reason)]

            return self._sse(req, request, s, head, process, done, opening=[chunk({"role": "assistant", "content": ""})])

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
