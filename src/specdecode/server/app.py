"""The FastAPI application: OpenAI's completions and chat completions, streaming or not, over the worker.

Every request is scheduled into the one batched engine (:mod:`specdecode.server.worker`); the handler
turns its accepted tokens into text as they come (:class:`~specdecode.generator.TextAssembler`:
incremental detokenisation, stop strings held back until resolved), so the concatenated stream is the
non-streamed text and every token a step accepted goes out in one delta.  Bad input of any kind is a 4xx
with an OpenAI-style error object; a client that goes away cancels its sequence, which frees its cache
slot before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from specdecode.constraints import Constraint, parse_constraint
from specdecode.drafters.base import Drafter
from specdecode.engine import DecodeOutcome
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator, TextAssembler
from specdecode.server.metrics import ServerMetrics, speculative_summary
from specdecode.server.openapi import api_document, completion_responses, reset_responses
from specdecode.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    _Common,
    error_body,
    finish_reason,
    usage,
)
from specdecode.server.tools import (
    ToolCallStream,
    constrain_to_tool_calls,
    forced_call_schema,
    forced_calls,
    template_tools,
)
from specdecode.server.worker import EngineWorker, QueueFull, Submission, Update
from specdecode.stats import GenerationStats
from specdecode.types import TokenLogprob
from specdecode.verify.registry import verifiers

UNAUTHENTICATED = ("/health",)
#: The response header naming the request's fields this server ignored (vLLM names them in its log only).
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"

log = logging.getLogger("specdecode.server")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


@dataclass
class ServerConfig:
    model_name: str
    max_batch_size: int = 8
    max_queue: int = 64
    api_key: str | None = None
    drain_s: float = 30.0
    # False: the caller steps the engine with ``service.worker.drive()`` in the thread that loaded the model,
    # which is faster than a thread of its own (see specdecode.server.worker).
    engine_thread: bool = True
    # True: a field the server does not know is a 400 (by default it is ignored, named in the log and a header).
    strict_api: bool = False
    prefix_caching: bool = True  # automatic prefix caching (specdecode.prefix_cache)
    # /v1/verify (specdecode.server.sled): sessions kept open at once, and how long one may stay idle.
    max_verify_sessions: int = 8
    verify_idle_s: float = 60.0


class Service:
    """What the handlers share: the generator (tokenizer, defaults), the drafters, the worker, the metrics."""

    def __init__(self, generator: SpeculativeGenerator, drafters: dict[str, Drafter], config: ServerConfig) -> None:
        self.generator = generator
        self.drafters = drafters
        self.config = config
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(
            generator,
            config.max_batch_size,
            config.max_queue,
            prefix_caching=config.prefix_caching,
            on_step=self.metrics.record_load,
            on_finish=lambda sub, stats, reason: self.metrics.record_finished(
                len(sub.prompt_ids), stats, finish_reason(reason)
            ),
        )

    def verifiers(self) -> list[str]:
        """The verifiers a request may choose here: every registered one this model can run (``judge`` needs a
        trained judge)."""
        usable = []
        for name in verifiers():
            try:
                self.generator.config_for(verifier=name)
            except SpecDecodeError:
                continue
            usable.append(name)
        return usable

    def drafter_for(self, body: _Common) -> Drafter:
        name = body.speculative.drafter if body.speculative else None
        if name is None:
            return self.generator.drafter
        if name not in self.drafters:
            raise ApiError(
                400,
                f"drafter {name!r} is not served here; choose from {', '.join(sorted(self.drafters))}",
                param="speculative.drafter",
            )
        return self.drafters[name]

    @staticmethod
    def constraint(body: _Common) -> Constraint | None:
        """The request's structured output (one field at most), each field's problem a 400 that names it."""
        fields = body.constraint_fields()
        if len(fields) > 1:
            raise ApiError(400, f"ask for one structured output, got {', '.join(fields)}", param=list(fields)[1])
        for param, asked in fields.items():
            try:
                return parse_constraint(asked)
            except SpecDecodeError as exc:
                raise ApiError(400, f"{param}: {exc}", param=param) from exc
        return None

    def submission(self, body: _Common, chat: bool) -> Submission:
        if body.model is not None and body.model != self.config.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.config.model_name!r}",
                kind="not_found_error",
                param="model",
            )
        if self.config.strict_api and (ignored := body.ignored_fields()):
            raise ApiError(400, f"{ignored[0]}: unsupported field", param=ignored[0])
        generator = self.generator
        if chat and body.tools and not generator.renders_tools:  # also with tool_choice "none", as the document says
            why = f"tools: the chat template of model {generator.target.name!r} does not render tools"
            raise ApiError(400, why, param="tools")
        prompt = [m.for_template() for m in body.messages] if chat else body.prompt
        tools = template_tools(body.offered_tools) if chat else None
        try:
            prompt_ids = generator.encode_prompt(prompt, chat=chat, tools=tools)
            room = generator.target.backend.max_context - len(prompt_ids)
            asked = body.max_completion_tokens or body.max_tokens
            max_new_tokens = min(asked, room) if asked else room
            config = generator.config_for(
                max_new_tokens=max_new_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0) if body.top_k is not None else None,
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=body.logit_bias,
                seed=body.seed,
                coupled=body.coupled,
                verifier=body.verifier,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                # More than the request may generate cannot be asked for: all it may generate, then.
                min_tokens=min(body.min_tokens, max_new_tokens) if body.min_tokens is not None else None,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
                logprobs=body.logprobs_top,
                num_draft_tokens=body.speculative.num_draft_tokens if body.speculative else None,
                constraint=self.constraint(body),
            )
        except SpecDecodeError as exc:
            raise ApiError(400, str(exc)) from exc
        return Submission(prompt_ids, config, self.drafter_for(body), asyncio.get_running_loop())

    def choices(self, body: _Common, chat: bool) -> list[Submission]:
        """The request's ``n`` sequences: one prompt, read by each (the engine shares no cache between sequences),
        and each its own random stream: choice i is seeded with seed + i when the request has a seed, as vLLM
        seeds them; so greedy choices are all alike."""
        room = self.config.max_queue + self.config.max_batch_size  # as the API document says (server/openapi.py)
        if body.n > room:
            why = f"n: {body.n} choices cannot all wait in this server's queue (at most {room})"
            raise ApiError(400, why, param="n")
        first = self.submission(body, chat)
        if chat and body.forced_tool_choice:
            schema = forced_call_schema(body.offered_tools, body.tool_choice, body.parallel)
            try:
                first.config = constrain_to_tool_calls(first.config, schema, body.tool_choice)
            except SpecDecodeError as exc:
                raise ApiError(400, str(exc), param="tool_choice") from exc
        submissions = [first]
        for index in range(1, body.n):
            config, seed = first.config, first.config.sampling.seed
            if seed is not None:
                config = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, seed=seed + index))
            submissions.append(Submission(first.prompt_ids, config, first.drafter, first.loop))
        return submissions


def uvicorn_config(app: FastAPI, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for the app: the fastest event loop and HTTP parser it finds (uvloop and httptools,
    which the ``server`` extra installs; asyncio and h11 otherwise) and no access log.  The event loop shares
    two cores with the engine, and serving ``smollm2-135m`` at concurrency 8 uvloop and httptools decoded at least
    as fast as asyncio and h11 (``docs/results/serve-uvloop-bf16-smollm2-135m``)."""
    return uvicorn.Config(app, loop="auto", http="auto", access_log=False, **options)


def freeze_startup_heap() -> None:
    """Exempt what is alive once the models are loaded from Python's cyclic garbage collector.

    The libraries, the tokenizer and the model leave some million objects behind; a full collection scans
    them all, over a hundred milliseconds on a small CPU, a pause in whatever thread triggered it — the engine's,
    between two steps of every running request, a few times a minute under load.  Frozen, they are never
    scanned again (they live as long as the server anyway); what serving allocates is collected as before."""
    gc.collect()
    gc.freeze()


#: How often a non-streamed request checks that its client is still connected (a streamed one learns it when a
#: write fails).
DISCONNECT_POLL_S = 0.25


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass
class Echo:
    """What completions' ``echo`` puts before each choice: the prompt's text and, when the request asked for
    log-probabilities, its tokens' (``first``: the prompt's first token, which has none)."""

    text: str
    first: int
    logprobs: list[TokenLogprob] | None


async def echo_of(service: Service, body: CompletionRequest, prompt_ids: list[int]) -> Echo:
    """The request's echo; the prompt's log-probabilities come from a forward of the target alone, in the engine's
    thread, so they are the same whatever drafts."""
    tokenizer = service.generator.target.tokenizer
    text = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt_ids)
    top = body.logprobs_top
    read = service.generator.prompt_logprobs
    logprobs = None if top is None else await service.worker.call(lambda: read(prompt_ids, top))
    return Echo(text, prompt_ids[0], logprobs)


class Exchange:
    """One choice of a request being answered: its submission, text assembly and response shape."""

    def __init__(
        self, service: Service, submission: Submission, body: _Common, shape: ResponseShape, echo: Echo | None = None
    ) -> None:
        self.service = service
        self.submission = submission
        self.body = body
        self.shape = shape
        self.echo = echo
        self.text = TextAssembler(service.generator, submission.prompt_ids, submission.config)
        self.wants_logprobs = submission.config.logprobs is not None
        self.logprobs: list[TokenLogprob] = []  # every generated token's, as the updates bring them
        self.logprobs_sent = 0
        self.last = submission.arrived
        self.first = True
        self.look_again_at = 0.0  # when a non-streamed request next checks that its client is still there
        self.stats: GenerationStats | None = None  # once the choice has ended
        # The model's calls are read from its <tool_call> blocks as they come, or, when a call is forced, from the
        # whole output (held to the calls' JSON); not at all without tools.
        chat_tools = isinstance(body, ChatCompletionRequest) and bool(body.offered_tools)
        self.forced = chat_tools and body.forced_tool_choice
        self.tool_stream = ToolCallStream(body.parallel) if chat_tools and not self.forced else None
        self.forced_text = ""  # a forced call's output, read once it is complete
        self.calls_sent = 0

    def take(self, update: Update) -> str:
        """The text an update releases (a stop string ends the request at once)."""
        if update.error:
            raise ApiError(500, update.error, kind="server_error")
        now = time.perf_counter()
        self.service.metrics.record_tokens(len(update.tokens), now - self.last, self.first)
        if update.tokens:
            self.last, self.first = now, False
        self.logprobs.extend(update.logprobs)
        if not update.tokens or self.text.stopped:
            return ""
        piece = self.text.add(update.tokens).text
        if self.text.stopped and not update.finished:
            self.service.worker.cancel(self.submission, reason="stop")
        return piece

    def ending(self, update: Update) -> tuple[str, str, dict]:
        """(the rest of the text, OpenAI's finish reason, the response's extra fields) of the last update."""
        reason = "stop" if self.text.stopped else (update.finish_reason or "abort")
        self.stats = update.stats
        rest = self.text.finish(DecodeOutcome(self.stats, reason)).text if self.stats is not None else ""
        return rest, finish_reason(reason), _speculative_metrics([self.stats] if self.stats is not None else [])

    async def complete(self, request: Request) -> dict:
        """This choice of the non-streamed response."""
        pieces = []
        while True:
            update = await self._next(request)
            if update is None:  # the client left
                raise ApiError(499, "client disconnected")
            pieces.append(self.take(update))
            if update.finished:
                break
        rest, reason, _ = self.ending(update)
        text, logprobs = "".join(pieces) + rest, self._unsent_logprobs()
        if self.forced or self.tool_stream is not None:
            said, calls = self._read_calls(text, final=True)
            reason = "tool_calls" if calls and reason == "stop" else reason
            content = None if calls and not (said or "").strip() else said  # OpenAI's null beside calls
            return self.shape.complete_choice(content, reason, logprobs, tool_calls=self._numbered(calls))
        if self.echo is None:
            return self.shape.complete_choice(text, reason, logprobs)
        echoed = None if logprobs is None else (self.echo.logprobs or []) + logprobs
        return self.shape.complete_choice(self.echo.text + text, reason, echoed, lead=self.echo.first)

    def _unsent_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities of the kept tokens not yet sent (a stop string drops the tokens after it); None
        when the request did not ask for them."""
        if not self.wants_logprobs:
            return None
        kept = self.logprobs[self.logprobs_sent : len(self.text.generated)]
        self.logprobs_sent += len(kept)
        return kept

    async def _next(self, request: Request) -> Update | None:
        """The next update, or None once the client has disconnected.  The connection is looked at every
        ``DISCONNECT_POLL_S``, between updates as well as while waiting for one: a request whose steps come
        faster than that would otherwise never look, and decode to its end for nobody."""
        getter = asyncio.ensure_future(self.submission.updates.get())
        while True:
            if time.monotonic() >= self.look_again_at:
                self.look_again_at = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    getter.cancel()
                    self.service.worker.cancel(self.submission)
                    return None
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if done:
                return getter.result()

    async def chunks(self) -> AsyncIterator[dict]:
        """This choice's streamed chunks, up to the one with its finish reason (an engine failure raises)."""
        try:
            if self.shape.chat:
                yield self._with_usage(self.shape.chunk(None, first=True))
            if self.echo is not None:
                lead = self.echo.first if self.wants_logprobs else None
                yield self._with_usage(self.shape.chunk(self.echo.text, logprobs=self.echo.logprobs, lead=lead))
            while True:
                update = await self.submission.updates.get()
                said, calls = self._read_calls(self.take(update))
                if said or calls:
                    yield self._with_usage(self._chunk(said, calls))
                if update.finished:
                    break
            rest, reason, extra = self.ending(update)
            said, calls = self._read_calls(rest, final=True)
            if said or calls:
                yield self._with_usage(self._chunk(said, calls))
            reason = "tool_calls" if self.calls_sent and reason == "stop" else reason
            final = self._with_usage(self.shape.chunk(None, reason, logprobs=self._unsent_logprobs()))
            if not self.body.include_usage:
                final.update(extra)
            yield final
        finally:  # also when the client went away mid-stream (the task is cancelled)
            self.service.worker.cancel(self.submission)

    def _chunk(self, text: str | None, calls: list[dict]) -> dict:
        return self.shape.chunk(text, logprobs=self._unsent_logprobs(), tool_calls=self._numbered(calls))

    def _read_calls(self, text: str, final: bool = False) -> tuple[str | None, list[dict]]:
        """(the text to send, the tool calls to send) of the next text, the last when ``final``: the text itself when
        the request offered no tools."""
        if self.forced:
            self.forced_text += text
            if not final:
                return None, []
            calls = forced_calls(self.forced_text, self.body.tool_choice)
            return (None, calls) if calls else (self.forced_text, [])
        if self.tool_stream is None:
            return text, []
        said, calls = self.tool_stream.feed(text)
        if final:
            rest, last = self.tool_stream.finish()
            said, calls = said + rest, calls + last
        return said, calls

    def _numbered(self, calls: list[dict]) -> list[dict] | None:
        """The calls with their place among the choice's calls (``index``, as OpenAI numbers them); None for none."""
        if not calls:
            return None
        numbered = [dict(call, index=self.calls_sent + k) for k, call in enumerate(calls)]
        self.calls_sent += len(calls)
        return numbered

    def _with_usage(self, chunk: dict) -> dict:
        """``chunk`` with the usage so far when the request asked for it in every chunk (``continuous_usage_stats``)."""
        if self.body.continuous_usage:
            chunk["usage"] = usage(len(self.submission.prompt_ids), len(self.text.generated))
        return chunk


def _speculative_metrics(stats: list[GenerationStats]) -> dict:
    """A response's ``metrics`` field: what speculation did for its choices together (nothing when none ended)."""
    return {"metrics": {"speculative_decoding": speculative_summary(GenerationStats.combined(stats))}} if stats else {}


async def complete_choices(request: Request, exchanges: list[Exchange]) -> dict:
    """The non-streamed response to a request: its choices decoded together, usage and metrics summed over them."""
    tasks = [asyncio.ensure_future(exchange.complete(request)) for exchange in exchanges]
    try:
        choices = await asyncio.gather(*tasks)
    except BaseException:  # one failed or the client left: the other choices decode for nobody
        for task, exchange in zip(tasks, exchanges):
            task.cancel()
            exchange.service.worker.cancel(exchange.submission)
        raise
    ended = [exchange.stats for exchange in exchanges if exchange.stats is not None]
    generated = sum(stats.new_tokens for stats in ended)
    prompt_tokens = len(exchanges[0].submission.prompt_ids)
    return exchanges[0].shape.complete(list(choices), prompt_tokens, generated, _speculative_metrics(ended))


async def stream_choices(exchanges: list[Exchange], body: _Common) -> AsyncIterator[str]:
    """The streamed response: every choice's chunks as they come, then the usage (when asked for) and ``[DONE]``."""
    queue: asyncio.Queue[tuple[dict | None, ApiError | None]] = asyncio.Queue()

    async def pump(exchange: Exchange) -> None:
        try:
            async for chunk in exchange.chunks():
                queue.put_nowait((chunk, None))
            queue.put_nowait((None, None))
        except ApiError as exc:
            queue.put_nowait((None, exc))
        except Exception:  # a bug: the stream ends with an error rather than waiting for this choice forever
            log.exception("answering a choice failed")
            queue.put_nowait((None, ApiError(500, "internal error while answering", kind="server_error")))

    tasks = [asyncio.ensure_future(pump(exchange)) for exchange in exchanges]
    try:
        running = len(tasks)
        while running:
            chunk, failure = await queue.get()
            if failure is not None:
                yield _sse(error_body(failure.message, failure.kind))
                return
            if chunk is None:
                running -= 1
            else:
                yield _sse(chunk)
        ended = [exchange.stats for exchange in exchanges]
        if body.include_usage and all(stats is not None for stats in ended):
            generated = sum(stats.new_tokens for stats in ended)
            prompt_tokens = len(exchanges[0].submission.prompt_ids)
            yield _sse(exchanges[0].shape.usage_chunk(prompt_tokens, generated, _speculative_metrics(ended)))
        yield _sse("[DONE]")
    finally:  # also when the client went away mid-stream: each choice's stream cancels its sequence
        for task in tasks:
            task.cancel()


class ApiKeyGuard:
    """Answers 401 to a request without ``Authorization: Bearer <key>`` (``/health`` excepted).  A plain ASGI
    middleware: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) hides the client's disconnect from
    ``Request.is_disconnected``, and a non-streamed request whose client left would then decode on for nobody."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = error_body("invalid or missing API key", "authentication_error")
                await JSONResponse(refusal, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service.config.engine_thread:
            service.worker.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.worker.shutdown, service.config.drain_s)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.service = service

    if service.config.api_key:
        app.add_middleware(ApiKeyGuard, key=service.config.api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems = exc.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = "unsupported field"
        elif first.get("type") == "json_invalid":  # its location is a character offset, not a field
            where, message = "", f"the body is not valid JSON ({message} at character {first['loc'][-1]})"
        text = f"{where}: {message}" if where else message
        return JSONResponse(error_body(text, param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = exc.headers
        if exc.status_code == 405:  # Starlette names the first route of the path's methods; a path may have several
            routes = [route for route in app.routes if route.matches(request.scope)[0] != Match.NONE]
            headers = {"Allow": ", ".join(sorted({m for route in routes for m in getattr(route, "methods", ())}))}
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", responses=reset_responses())
    async def reset_prefix_cache():
        """Forget every prompt kept for prefix caching (vLLM's endpoint of the same name): what a benchmark does
        between runs so that each starts cold.  Refused (409) while requests are in the engine."""
        if not service.worker.reset_prefix_cache():
            raise ApiError(409, "requests are in the engine: reset the prefix cache when the server is idle")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": service.config.model_name, "object": "model", "created": 0, "owned_by": "specdecode"}
        return {"object": "list", "data": [card]}

    async def answer(request: Request, body: _Common, chat: bool):
        submissions = service.choices(body, chat)
        echo = await echo_of(service, body, submissions[0].prompt_ids) if not chat and body.echo else None
        try:
            service.worker.submit(*submissions)
        except QueueFull as exc:
            raise ApiError(429, f"server busy: {exc}", kind="rate_limit_error", headers={"Retry-After": "1"}) from exc
        tokenizer = service.generator.target.tokenizer
        shape = ResponseShape(chat, service.config.model_name, lambda token: tokenizer.decode([token]))
        exchanges = [Exchange(service, sub, body, shape.choice(i), echo) for i, sub in enumerate(submissions)]
        headers = {}
        if ignored := body.ignored_fields():
            log.warning("request fields ignored (not known to this server): %s", ", ".join(ignored))
            headers[IGNORED_FIELDS_HEADER] = ", ".join(json.dumps(name)[1:-1] for name in ignored)  # ASCII, one line
        if body.stream:
            return StreamingResponse(stream_choices(exchanges, body), media_type="text/event-stream", headers=headers)
        return JSONResponse(await complete_choices(request, exchanges), headers=headers)

    @app.post("/v1/chat/completions", responses=completion_responses())
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await answer(request, body, chat=True)

    @app.post("/v1/completions", responses=completion_responses())
    async def completions(request: Request, body: CompletionRequest):
        return await answer(request, body, chat=False)

    document: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not document:
            backend = service.generator.target.backend
            served = sorted(service.drafters), service.verifiers()
            config = service.config
            most = config.max_queue + config.max_batch_size
            tools = service.generator.renders_tools
            document.update(
                api_document(app, backend.vocab_size, *served, strict=config.strict_api, most_choices=most, tools=tools)
            )
        return document

    app.openapi = openapi
    # Imported here: the module builds on this one's ApiError and Service.
    from specdecode.server.sled import add_verify_routes

    app.state.verify_sessions = add_verify_routes(app, service)
    return app
