"""The router's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the router's event loop).

`POST /v1/completions`, `POST /v1/chat/completions` (JSON or server-sent events), `GET
/v1/models`, `GET /health`, `GET /metrics`, `GET /version`. Each choice is one request of the
router's flow, with its validation and errors: 400 for bad input, 401 without a good API key,
404 for another model, 429 when the router is full, 503 when no instance can serve, 504 past
the router's ceiling. A client that disconnects aborts its requests, which frees their pages.
`usage.prompt_tokens_details.cached_tokens` is always present (0 included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
import uuid
from typing import Literal

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from ref_server import __version__
from ref_server.services.messages import BadRequest, checked_sampling
from ref_server.services.router import Finished, RequestError, Router, Tokens
from ref_server.services.security import ApiKeys

log = logging.getLogger(__name__)
MAX_STOPS, MAX_N = 16, 16
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
FINISH = {1: "stop", 2: "length", 3: "abort"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """OpenAI's fields are nullable, and clients send null for "not given": the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, lt=2**31)  # -1 or 0: all (vLLM's -1 too); int32
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def unsupported(self) -> str | None:
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise BadRequest(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        return stops


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs is not supported"
        if (self.best_of or 1) > 1 or self.suffix:
            return "best_of and suffix are not supported"
        return super().unsupported()


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's new system
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise BadRequest("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    tools: list | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs is not supported"
        if self.tools:
            return "tools are not supported"
        return super().unsupported()


def error_body(status: int, kind: str, message: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(error: RequestError) -> JSONResponse:
    status, kind = HTTP_STATUS.get(error.code, (500, "server_error"))
    headers = {"Retry-After": f"{error.retry_after:g}"} if error.retry_after else None
    return JSONResponse(error_body(status, kind, error.message), status, headers=headers)


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


class OpenAIApi:
    """Turns HTTP bodies into the router's submissions, and its events into OpenAI's shapes."""

    def __init__(self, router: Router, keys: ApiKeys) -> None:
        self.router, self.keys = router, keys
        self.model_id = router.model.name
        self.created = int(time.time())

    def _tenant(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else None
        tenant = self.keys.check(key)
        if tenant is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        return tenant

    def _prompts(self, body) -> list[list[int]]:
        tokenizer = self.router.tokenizer
        if isinstance(body, ChatBody):
            try:
                messages = [
                    {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages
                ]
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except ValueError as error:
                raise _invalid(str(error)) from None
            return [tokenizer.encode(text, add_special_tokens=False)]
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt or any(p in ("", []) for p in prompt):
            raise _invalid("empty prompt")
        if isinstance(prompt[0], str):
            return [tokenizer.encode(p) for p in prompt]
        return [list(p) for p in prompt] if isinstance(prompt[0], list) else [list(prompt)]

    def submissions(self, body, request: Request) -> tuple[list, list[list[int]]]:
        """One submission per choice (prompt-major, n per prompt), and the prompts."""
        tenant = self._tenant(request)
        if body.model not in (None, self.model_id):
            message = (
                f"model {body.model!r} is not served here; this router serves {self.model_id!r}"
            )
            raise RequestError(grpc.StatusCode.NOT_FOUND, message)
        if problem := body.unsupported():
            raise _invalid(problem)
        vocab = self.router.model.vocab_size
        if bad := [t for t in body.stop_token_ids if not 0 <= t < vocab]:
            raise _invalid(f"stop_token_ids: token id {bad[0]} outside [0, {vocab})")
        if body.model_extra:
            log.debug("ignored fields: %s", ", ".join(body.model_extra))
        prompts = self._prompts(body)
        limit = self.router.model.max_model_len
        submissions = []
        for p, prompt in enumerate(prompts):
            max_tokens = body.max_tokens
            if isinstance(body, ChatBody):
                max_tokens = body.max_completion_tokens or max_tokens or limit - len(prompt)
                if max_tokens <= 0:
                    raise _invalid(
                        f"the prompt of {len(prompt)} tokens leaves no room for a completion "
                        f"in the context limit of {limit}"
                    )
            for choice in range(body.n):
                seed = secrets.randbits(63) if body.seed is None else body.seed + choice
                try:
                    params = checked_sampling(
                        limit,
                        temperature=body.temperature,
                        top_p=body.top_p,
                        top_k=max(body.top_k, 0),
                        max_tokens=max_tokens,
                        seed=seed % 2**63,
                        stop_token_ids=tuple(body.stop_token_ids),
                    )
                    stops = body.stops()
                except BadRequest as error:
                    raise _invalid(str(error)) from None
                request_id = f"{p}.{choice}.{uuid.uuid4().hex}"  # unique: nobody aborts it by id
                owner, salt = f"http:{request_id}", self.keys.cache_salt(tenant)
                submissions.append(
                    self.router.submission(prompt, params, stops, request_id, owner, salt)
                )
        return submissions, prompts

    async def events(self, submissions):
        """(choice index, event) of every choice's request as they come; ends when all end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, submission) -> None:
            try:
                async for event in self.router.generate(submission):
                    queue.put_nowait((index, event))
            except RequestError as error:
                queue.put_nowait((index, error))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(run(i, s)) for i, s in enumerate(submissions)]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get())[1] is not None:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def usage(self, finished: dict[int, Finished], prompts: list[list[int]], n: int) -> dict:
        """OpenAI's usage: each prompt counted once (with its first choice's cache hits), the
        completions of every choice."""
        completion = sum(f.usage.completion_tokens for f in finished.values())
        prompt = sum(len(p) for p in prompts)
        cached = sum(
            finished[p * n].usage.cached_tokens for p in range(len(prompts)) if p * n in finished
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def create_app(router: Router, keys: ApiKeys, serving, metrics, max_request_bytes: int) -> FastAPI:
    api = OpenAIApi(router, keys)
    app = FastAPI(title="ref-server", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        errors = error.errors()
        if errors and errors[0]["type"] == "json_invalid":
            at, why = errors[0]["loc"][-1], errors[0].get("ctx", {}).get("error", "")
            message = f"the body is not valid JSON (at character {at}): {why}".rstrip(": ")
            return JSONResponse(error_body(400, "invalid_request_error", message), 400)
        where = [".".join(str(part) for part in e["loc"] if part != "body") for e in errors[:5]]
        message = "; ".join(
            f"{w or 'body'}: {e['msg']}" for w, e in zip(where, errors, strict=False)
        )
        body = error_body(400, "invalid_request_error", message)
        body["error"]["param"] = where[0] or None if where else None
        return JSONResponse(body, 400)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(
            error_body(error.status_code, "invalid_request_error", error.detail), error.status_code
        )

    @app.exception_handler(RequestError)
    async def request_error(request, error: RequestError):
        return error_response(error)

    @app.exception_handler(Exception)
    async def internal(request, error: Exception):
        """A bug of ours: an OpenAI-style body too (uvicorn logs the traceback, not the client)."""
        message = f"internal error ({type(error).__name__}); the router's log has the details"
        return JSONResponse(error_body(500, "server_error", message), 500)

    @app.get("/health")
    async def health():
        if serving():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "problem": router.pool.problem}, 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request):
        api._tenant(request)
        card = {
            "id": api.model_id,
            "object": "model",
            "created": api.created,
            "owned_by": "ref-server",
            "max_model_len": router.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await respond(body, request, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await respond(body, request, "chat.completion", "chatcmpl")

    async def respond(body, request: Request, kind: str, prefix: str):
        submissions, prompts = api.submissions(body, request)
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        head = {
            "id": response_id,
            "object": kind,
            "created": int(time.time()),
            "model": api.model_id,
        }
        # echo is a completions field: a chat body's `echo` is an unknown field, ignored
        echoed = isinstance(body, CompletionBody) and body.echo
        echo = [router.tokenizer.decode(p) for p in prompts] if echoed else None
        if body.stream:
            events = api.events(submissions)
            first = await anext(events)  # a refusal gets its status (429, 503), not a 200
            if isinstance(first[1], RequestError):
                await events.aclose()
                return error_response(first[1])
            usage = bool((body.stream_options or {}).get("include_usage"))
            chunks = stream(api, first, events, prompts, body.n, head, echo, usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        collect = asyncio.create_task(collected(api, submissions, prompts, body.n, head, echo))
        while not (await asyncio.wait({collect}, timeout=0.25))[0]:
            if await request.is_disconnected():  # nobody will read it: free the pages now
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
                return Response(status_code=499)
        return collect.result()

    return app


def _choice(kind: str, index: int, text: str, finish: str | None, first: bool = False) -> dict:
    if kind == "text_completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if finish is not None and not text:
        delta = {}
    else:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


async def collected(api: OpenAIApi, submissions, prompts, n: int, head: dict, echo) -> JSONResponse:
    texts = [echo[i // n] if echo else "" for i in range(len(submissions))]
    finished: dict[int, Finished] = {}
    async with contextlib.aclosing(api.events(submissions)) as events:
        async for index, event in events:
            if isinstance(event, RequestError):
                return error_response(event)
            if isinstance(event, Tokens):
                texts[index] += event.text
            else:
                finished[index] = event
    choices = []
    for index, text in enumerate(texts):
        reason = FINISH[finished[index].finish_reason]
        if head["object"] == "chat.completion":
            message = {"role": "assistant", "content": text}
            choices.append(
                {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
            )
        else:
            choices.append(
                {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            )
    return JSONResponse({**head, "choices": choices, "usage": api.usage(finished, prompts, n)})


async def stream(api: OpenAIApi, first, events, prompts, n: int, head: dict, echo, usage: bool):
    """Server-sent events of `first` and the rest of `events`: per choice a first chunk (chat:
    the assistant role), text chunks, exactly one chunk with its finish_reason; then with
    include_usage a chunk of no choices and the usage; then [DONE]. An error is one `error`
    event, then [DONE]."""
    kind = "text_completion" if head["object"] == "text_completion" else "chat.completion.chunk"
    head = {**head, "object": kind}

    def event(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, 'usage': None, **extra})}\n\n"

    started: set[int] = set()
    finished: dict[int, Finished] = {}
    async for index, item in _after(first, events):
        if isinstance(item, RequestError):
            status, name = HTTP_STATUS.get(item.code, (500, "server_error"))
            yield f"data: {json.dumps(error_body(status, name, item.message))}\n\n"
            break
        first = index not in started
        started.add(index)
        if isinstance(item, Tokens):
            text = (echo[index // n] if echo and first else "") + item.text
            if text or first:
                yield event([_choice(kind, index, text, None, first)])
        else:
            finished[index] = item
            yield event([_choice(kind, index, "", FINISH[item.finish_reason], first)])
    else:
        if usage:
            yield event([], usage=api.usage(finished, prompts, n))
    yield "data: [DONE]\n\n"


async def _after(first, events):
    """`first`, then the rest of `events`, which is closed however the iteration ends."""
    async with contextlib.aclosing(events):
        yield first
        async for item in events:
            yield item


class BodyLimit:
    """413 for request bodies over `limit` bytes, before they are read whole."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.limit:
            message = f"request body of {int(length)} bytes is over the limit of {self.limit}"
            response = JSONResponse(error_body(413, "invalid_request_error", message), 413)
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"request body over the limit of {self.limit} bytes")
            return message

        return await self.app(scope, counted, send)


class HttpServer(uvicorn.Server):
    """uvicorn in the caller's event loop, on a socket bound here (a clear error when the
    port is taken), leaving signals to the caller."""

    def __init__(self, app, host: str, port: int, cert: str | None, key: str | None) -> None:
        super().__init__(
            uvicorn.Config(
                app,
                log_level="warning",
                ssl_certfile=cert,
                ssl_keyfile=key,
                lifespan="off",
                timeout_graceful_shutdown=2,  # as the gRPC server's grace
            )
        )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as error:
            self.socket.close()
            raise OSError(f"cannot listen on {host}:{port} for HTTP: {error.strerror}") from None

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets=[self.socket])

    def capture_signals(self):
        return contextlib.nullcontext()
