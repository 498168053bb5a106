"""The router's HTTP server: FastAPI on uvicorn, in the router's event loop.

`POST /v1/completions`, `POST /v1/chat/completions` (JSON or server-sent events), `GET
/v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /metrics`, `GET /version`. With API
keys, every path but /health needs one. Errors have OpenAI's shape: 400 for bad input, 401
without a good API key, 404 for another model or path, 413 for a body over the limit, 429 when
the router is full, 503 when no instance can serve, 504 past the router's ceiling. A client
that disconnects aborts its requests, which frees their pages: it is looked for every
DISCONNECT_POLL_S until the response is ready or, streamed, its first event is (then the
streaming response watches for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ref_server import __version__
from ref_server.services.openai_api import (
    OpenAIApi,
    collected,
    error_body,
    error_response,
    stream,
)
from ref_server.services.openai_bodies import ChatBody, CompletionBody
from ref_server.services.router import RequestError, Router
from ref_server.services.security import ApiKeys, bearer

OPEN_PATHS = ("/health",)


def create_app(router: Router, keys: ApiKeys, serving, metrics, max_request_bytes: int) -> FastAPI:
    api = OpenAIApi(router, keys)
    app = FastAPI(title="ref-server", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(KeyGate, keys=keys)  # the outer one: a refused body is never read

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
        degraded = [
            {"worker": w.name, "ranks": w.load.ranks, "configured_ranks": w.load.configured_ranks}
            for w in router.pool.workers
            if w.routable and w.share < 1
        ]
        details = {"degraded": degraded} if degraded else {}
        if serving():
            return {"status": "ok", **details}
        body = {"status": "unavailable", "problem": router.pool.problem, **details}
        return JSONResponse(body, 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    card = {
        "id": api.model_id,
        "object": "model",
        "created": api.created,
        "owned_by": "ref-server",
        "max_model_len": router.model.max_model_len,
        "vocab_size": router.model.vocab_size,  # so that token-id clients need not be told
    }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # a checkpoint's id is its path, slashes and all
    async def model(model_id: str):
        if model_id != api.model_id:
            message = f"model {model_id!r} is not served here; this router serves {api.model_id!r}"
            return JSONResponse(error_body(404, "not_found_error", message), 404)
        return card

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
            # the first event before the 200, so that a refusal gets its status (429, 503)
            first = await while_connected(request, anext(events))
            if first is GONE or isinstance(first[1], RequestError):
                await events.aclose()  # ends every choice's request
                return Response(status_code=499) if first is GONE else error_response(first[1])
            usage = bool((body.stream_options or {}).get("include_usage"))
            chunks = stream(api, first, events, prompts, body.n, head, echo, usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        response = await while_connected(
            request, collected(api, submissions, prompts, body.n, head, echo)
        )
        return Response(status_code=499) if response is GONE else response

    return app


GONE = object()  # what while_connected gives when the client has gone
DISCONNECT_POLL_S = 0.25


async def while_connected(request: Request, awaitable):
    """awaitable's result, or GONE once the client has disconnected: then it is cancelled,
    which ends its requests and frees their pages (nobody will read them)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return GONE
        return task.result()
    finally:
        if not task.done():  # the client has gone, or the server is stopping
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class KeyGate:
    """401 without a good API key (when keys are configured), before the body is read; every
    path but OPEN_PATHS. Sets `request.state.tenant`: the key's tenant, "" without keys."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        tenant = self.keys.check(bearer(headers))
        if tenant is None and scope["path"] not in OPEN_PATHS:
            body = error_body(401, "authentication_error", "missing or wrong API key")
            return await JSONResponse(body, 401)(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant or ""
        return await self.app(scope, receive, send)


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
        # Listening now, not once uvicorn starts: the router says it serves before that, and a
        # client that connects in between waits in the backlog instead of being refused.
        self.socket.listen(self.config.backlog)

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets=[self.socket])

    def capture_signals(self):
        return contextlib.nullcontext()
