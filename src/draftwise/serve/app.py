"""The OpenAI-compatible HTTP API over a :class:`~draftwise.serve.engine.ServingEngine`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent
events, one event per generated token), ``GET /health`` and ``GET /metrics`` (Prometheus).

With an API key (:func:`create_app`'s ``api_key``) every request but ``GET /health`` (and ``GET /metrics``, unless
``protect_metrics``) must carry ``Authorization: Bearer KEY``; others are answered 401 in OpenAI's error shape
(:class:`APIKeyCheck`).

Every response carries the request's speculation statistics in the extension field ``draftwise`` (in a stream: in
the chunk that carries the finish reason, and in the usage chunk); the usage names, as OpenAI's does, the prompt
tokens restored from the prefix cache (``prompt_tokens_details.cached_tokens``). The statistics:
``method``, ``steps`` (forward passes), ``mean_accepted_tokens`` (new tokens / steps), ``mean_acceptance_length``
(1 + accepted / drafts, vLLM's definition), ``draft_acceptance_rate`` (accepted / drafted tokens), ``drafts``,
``drafted_tokens``, ``accepted_tokens``, ``acceptance_per_position``, ``queue_time_s``, ``time_to_first_token_s``
(from admission) and ``time_s`` (admission to last token).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..api import SettledText, StopSequences, encode_prompt
from ..decoding.logprobs import TokenLogprob
from ..decoding.stats import GenerationStats
from ..errors import InvalidRequestError
from .defaults import DEFAULT_MAX_TOKENS
from .engine import EngineStoppedError, ServerBusyError, ServingEngine, TokenEvent
from .protocol import FINISH_REASONS, ChatCompletionRequest, CompletionRequest, max_new_tokens

#: How often a waiting non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def speculation_stats(stats: GenerationStats, method: str) -> dict[str, Any]:
    """The extension field ``draftwise`` of a response: the request's speculation statistics."""
    drafts = stats.drafts
    return {
        "method": method,
        "steps": stats.steps,
        "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),
        "mean_acceptance_length": round(1 + stats.accepted_tokens / drafts, 4) if drafts else 1.0,
        "draft_acceptance_rate": round(stats.acceptance_rate, 4),
        "drafts": drafts,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_per_position": [round(rate, 4) for rate in stats.acceptance_per_position],
        "queue_time_s": round(stats.queue_time_s, 4),
        "time_to_first_token_s": round(stats.time_to_first_token_s, 4),
        "time_s": round(stats.time_s, 4),
    }


@dataclass
class _Job:
    """One request on its way through the engine, as the web layer sees it."""

    kind: str  # "text_completion" or "chat.completion"
    prompt_ids: list[int]
    events: asyncio.Queue
    ticket: Any
    stops: StopSequences | None
    identifier: str
    created: int
    keep_stop: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    echo: str = ""  # the prompt's text, sent before the answer (completions with echo)
    logprobs: int | None = None  # alternatives per token, when log-probabilities are asked for
    prompt_logprobs: bool = False  # the prompt's too (completions with echo and logprobs)
    min_new_tokens: int = 0  # (min_tokens: stop strings end the text only after these)

    def settled_text(self, tokenizer: Any) -> SettledText:
        return SettledText(tokenizer, self.stops, self.keep_stop, self.skip_special_tokens, self.min_new_tokens)


class Server:
    """The web layer: request parsing, the engine's events turned into OpenAI responses.

    Args:
        engine: the serving engine (started and stopped with the app).
        model_name: the name clients give as ``model`` (``/v1/models`` lists it).
        default_max_tokens: tokens generated when a request names no limit.
    """

    def __init__(self, engine: ServingEngine, model_name: str, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = engine
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    # -- requests -------------------------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           code="model_not_found")

    async def _submit(self, kind: str, request: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> _Job:
        request.refuse_unsupported()
        sampling = request.sampling()
        limit = max_new_tokens(request, self.default_max_tokens, self.engine.context_length - len(prompt_ids))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def on_event(event: TokenEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        stops = request.stops()
        stop_ids = self._token_ids(request.stop_token_ids or [], "stop_token_ids")
        logprobs = request.logprobs_asked()
        prompt_logprobs = isinstance(request, CompletionRequest) and request.prompt_logprobs_asked()
        try:
            ticket = self.engine.submit(prompt_ids, limit, on_event, sampling, stops, request.ignore_eos, stop_ids,
                                        logprobs, prompt_logprobs, min_new_tokens=request.min_tokens,
                                        prediction_ids=self._prediction_ids(request))
        except EngineStoppedError as error:
            raise APIError(503, str(error), kind="server_error", code="engine_dead") from None
        except ServerBusyError as error:
            self.engine.metrics.request_refused()
            raise APIError(503, str(error), kind="server_overloaded", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
        return _Job(kind, prompt_ids, events, ticket, StopSequences(self.engine.tokenizer, stops) if stops else None,
                    f"{prefix}-{uuid.uuid4().hex}", int(time.time()), request.include_stop_str_in_output,
                    request.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                    min_new_tokens=request.min_tokens)

    def _prediction_ids(self, request: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
        """The token ids of the request's predicted output (``None`` without one)."""
        if request.prediction is None or not request.prediction.text():
            return None
        return list(self.engine.tokenizer(request.prediction.text(), add_special_tokens=False)["input_ids"])

    def _prompt_ids(self, request: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if isinstance(request, ChatCompletionRequest):
            return encode_prompt(tokenizer, request.chat(), chat_template=True)
        if isinstance(request.prompt, str):
            return encode_prompt(tokenizer, request.prompt, chat_template=False)
        return self._token_ids(request.prompt, "prompt token ids")

    def _token_ids(self, ids: list[int], what: str) -> list[int]:
        """``ids`` as given, or a 400 when one is outside the model's vocabulary."""
        vocab = self.engine.target.config.vocab_size
        if any(token < 0 or token >= vocab for token in ids):
            raise InvalidRequestError(f"{what} must be in [0, {vocab})")
        return list(ids)

    async def handle(self, kind: str, request: CompletionRequest | ChatCompletionRequest, http: Request) -> Response:
        self._check_model(request.model)
        job = await self._submit(kind, request, self._prompt_ids(request))
        if isinstance(request, CompletionRequest) and request.echo:
            prompt = request.prompt
            job.echo = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(
                prompt, skip_special_tokens=request.skip_special_tokens)
        if request.stream:
            options = request.stream_options
            include_usage = bool(options and options.include_usage)
            continuous_usage = include_usage and bool(options and options.continuous_usage_stats)
            return StreamingResponse(self._stream(job, include_usage, continuous_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await self._complete(job, http))

    # -- answers --------------------------------------------------------------------------------------------------

    def _usage(self, job: _Job, completion_tokens: int) -> dict[str, Any]:
        """OpenAI's usage: token counts, the prompt tokens restored from the prefix cache, and with a prediction how
        much of it was accepted."""
        prompt = len(job.prompt_ids)
        state = job.ticket.state
        cached = state.stats.cached_prompt_tokens if state is not None else 0
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
        predicted = job.ticket.predicted
        if job.ticket.prediction:  # (OpenAI's Predicted Outputs: how much of the prediction was used)
            accepted = predicted.accepted_prediction_tokens if predicted is not None else 0
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": len(job.ticket.prediction) - accepted,
            }
        return usage

    def _chunk_choice(self, job: _Job, piece: str, finish_reason: str | None, first: bool,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A stream chunk's choice: one token's settled text (and its log-probability when asked for)."""
        reason = None if finish_reason is None else FINISH_REASONS.get(finish_reason, finish_reason)
        if job.kind == "text_completion":
            return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": reason}
        delta: dict[str, Any] = {"role": "assistant", "content": piece} if first else {"content": piece}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, job: _Job, entries: list[TokenLogprob], text_offset: int) -> dict[str, Any] | None:
        """``entries`` in OpenAI's shape: chat's ``{"content": [...]}``, or completions' ``tokens``,
        ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (the first token at ``text_offset``)."""
        if job.logprobs is None:
            return None
        decode = self.engine.tokenizer.decode

        def text(token: int) -> str:
            return decode([token])

        if job.kind != "text_completion":
            return {"content": [
                {"token": text(entry.token), "logprob": _finite(entry.logprob),
                 "bytes": list(text(entry.token).encode()),
                 "top_logprobs": [{"token": text(token), "logprob": _finite(value), "bytes": list(text(token).encode())}
                                  for token, value in entry.top]}
                for entry in entries]}
        tokens = [text(entry.token) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(entry.logprob) for entry in entries],
                "top_logprobs": [{text(entry.token): _finite(entry.logprob),
                                  **{text(token): _finite(value) for token, value in entry.top}} for entry in entries],
                "text_offset": offsets}

    def _prompt_logprobs(self, job: _Job, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """The prompt's log-probabilities in completions' shape (the first token has none), offsets from 0."""
        if not job.prompt_logprobs:
            return None
        first = self.engine.tokenizer.decode([job.prompt_ids[0]])
        rest = self._logprobs(job, entries, len(first)) or {}
        return {"tokens": [first, *rest.get("tokens", [])],
                "token_logprobs": [None, *rest.get("token_logprobs", [])],
                "top_logprobs": [None, *rest.get("top_logprobs", [])],
                "text_offset": [0, *rest.get("text_offset", [])]}

    async def _next_event(self, job: _Job, http: Request | None) -> TokenEvent:
        """The job's next event; a client gone away cancels the job."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    self.engine.cancel(job.ticket)
                    raise asyncio.CancelledError from None

    async def _complete(self, job: _Job, http: Request) -> dict[str, Any]:
        tokens: list[int] = []
        entries: list[TokenLogprob] = []
        prompt_entries: list[TokenLogprob] = []
        while True:
            event = await self._next_event(job, http)
            tokens.extend(event.tokens)
            entries.extend(event.logprobs or ())
            prompt_entries.extend(event.prompt_logprobs or ())
            if event.finish_reason is not None:
                break
        if event.finish_reason == "error":
            raise APIError(500, event.error or "the engine failed", kind="server_error")
        text = job.settled_text(self.engine.tokenizer).advance(tokens, finished=True)
        reason = FINISH_REASONS.get(event.finish_reason, event.finish_reason)
        logprobs = self._logprobs(job, entries, len(job.echo))
        prompt_logprobs = self._prompt_logprobs(job, prompt_entries)
        if logprobs is not None and prompt_logprobs is not None:
            logprobs = {key: prompt_logprobs[key] + logprobs[key] for key in logprobs}
        if job.kind == "text_completion":
            choice: dict[str, Any] = {"index": 0, "text": job.echo + text, "logprobs": logprobs,
                                      "finish_reason": reason}
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": reason}
            obj = "chat.completion"
        return {
            "id": job.identifier,
            "object": obj,
            "created": job.created,
            "model": self.model_name,
            "choices": [choice],
            "usage": self._usage(job, len(tokens)),
            "draftwise": speculation_stats(event.stats or GenerationStats(), self.engine.method),
        }

    async def _stream(self, job: _Job, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """One server-sent event per generated token (its settled text, possibly empty while a stop sequence or
        a character is undecided), the finish reason with the last token; then the usage chunk when asked for.
        With ``continuous_usage`` every token's chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        chunk_object = "text_completion" if job.kind == "text_completion" else "chat.completion.chunk"
        settled = job.settled_text(self.engine.tokenizer)
        tokens: list[int] = []

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {"id": job.identifier, "object": chunk_object, "created": job.created, "model": self.model_name,
                    "choices": choices, **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        finished = False
        text_offset = len(job.echo)  # (completions' log-probabilities give each token's place in the text)
        try:
            first = True
            waiting: TokenEvent | None = None
            if job.echo:  # the prompt first, as vLLM streams an echo (with its log-probabilities: at the first token)
                usage = {"usage": self._usage(job, 0) if continuous_usage else None} if include_usage else {}
                prompt_logprobs = None
                if job.prompt_logprobs:
                    waiting = await self._next_event(job, None)
                    prompt_logprobs = self._prompt_logprobs(job, waiting.prompt_logprobs or [])
                yield chunk([self._chunk_choice(job, job.echo, None, first, prompt_logprobs)], **usage)
                first = False
            while not finished:
                if waiting is not None:  # (the first event, already taken for the prompt's log-probabilities)
                    event, waiting = waiting, None
                else:
                    event = await self._next_event(job, None)
                if event.finish_reason == "error":
                    error = {"message": event.error or "the engine failed", "type": "server_error", "code": None}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    finished = True
                    break
                for position, token in enumerate(event.tokens):
                    tokens.append(token)
                    last = position == len(event.tokens) - 1 and event.finish_reason is not None
                    piece = settled.advance(tokens, finished=last)
                    extra: dict[str, Any] = {}
                    if include_usage:
                        extra["usage"] = self._usage(job, len(tokens)) if continuous_usage else None
                    if last:
                        extra["draftwise"] = speculation_stats(event.stats or GenerationStats(), self.engine.method)
                    reason = event.finish_reason if last else None
                    logprobs = None
                    if event.logprobs is not None:
                        logprobs = self._logprobs(job, event.logprobs[position : position + 1], text_offset)
                        text_offset += sum(len(token) for token in (logprobs or {}).get("tokens", ()))
                    yield chunk([self._chunk_choice(job, piece, reason, first, logprobs)], **extra)
                    first = False
                if event.finish_reason is not None:
                    finished = True
                    if include_usage:
                        yield chunk([], usage=self._usage(job, len(tokens)),
                                    draftwise=speculation_stats(event.stats or GenerationStats(), self.engine.method))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream
                self.engine.cancel(job.ticket)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "draftwise",
             "max_model_len": self.engine.context_length},
        ]}


def create_app(engine: ServingEngine, model_name: str, default_max_tokens: int = DEFAULT_MAX_TOKENS, *,
               manage_engine: bool = True, replica: str | None = None, api_key: str | None = None,
               protect_metrics: bool = False) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``model_name``.

    With ``manage_engine`` the engine starts and stops with the app; without it the caller owns the engine's
    worker thread (a Ray Serve replica starts it in its constructor and stops it when the replica goes).
    ``replica`` names this copy of the server in every response's ``x-draftwise-replica`` header (scale-out).
    ``api_key``: requests must carry ``Authorization: Bearer <api_key>`` (``/health`` stays open, and ``/metrics``
    unless ``protect_metrics``); ``None`` serves anyone who can reach the port.
    """
    if api_key is not None and not api_key.strip():
        raise InvalidRequestError("the API key is empty")
    server = Server(engine, model_name, default_max_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not manage_engine:
            yield
            return
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="draftwise", lifespan=lifespan)
    app.state.server = server
    if replica is not None:
        app.add_middleware(ReplicaHeader, replica=replica)
    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key,
                           open_paths=("/health",) if protect_metrics else ("/health", "/metrics"))

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, error: InvalidRequestError) -> JSONResponse:
        return APIError(400, str(error)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return APIError(400, _validation_message(error)).response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not engine.alive:
            raise APIError(503, "the decoding engine has stopped", kind="server_error", code="engine_dead")
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.handle("text_completion", body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.handle("chat.completion", body, request)

    return app


class APIKeyCheck:
    """ASGI middleware: a request must carry ``Authorization: Bearer <api_key>`` (compared in constant time) unless
    its path is one of ``open_paths``; otherwise it is answered 401 in OpenAI's error shape (code
    ``invalid_api_key``), as OpenAI's API and vLLM's ``--api-key`` do, before any route sees it."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope.get("headers", []) if name == b"authorization"), b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = ("no API key given: send the header Authorization: Bearer <key>" if not given else
                   "incorrect API key provided")
        refusal = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await refusal.response()(scope, receive, send)


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that answered (``x-draftwise-replica``); a pure ASGI
    wrapper, so streamed responses pass through untouched."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (b"x-draftwise-replica", replica.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry (vLLM's floor for an impossible token)."""
    return max(logprob, -9999.0)


def _validation_message(error: RequestValidationError) -> str:
    """pydantic's errors as one readable sentence per problem."""
    messages = []
    for problem in error.errors():
        location = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")
        kind = problem.get("type", "")
        if kind == "json_invalid":
            messages.append("the request body is not valid JSON")
        elif kind == "extra_forbidden":
            messages.append(f"'{location}' is not a supported option")
        elif kind == "missing":
            messages.append(f"'{location}' is required")
        else:
            message = str(problem.get("msg", "invalid value")).removeprefix("Value error, ")
            messages.append(f"'{location}': {message}" if location else message)
    return "; ".join(dict.fromkeys(messages)) or "invalid request"
