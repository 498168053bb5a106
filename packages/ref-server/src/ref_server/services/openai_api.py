"""The router's OpenAI-compatible API, between the HTTP bodies and the router's flow: each
choice is one request of the flow, with its validation and errors, and its events come back
as OpenAI's completion, chat and server-sent-event shapes. `usage.prompt_tokens_details.
cached_tokens` is always present (0 included). The HTTP server itself: `http_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse

from ref_server.services.messages import BadRequest, checked_sampling, random_seed
from ref_server.services.openai_bodies import ChatBody
from ref_server.services.router import Finished, RequestError, Router, Tokens
from ref_server.services.security import ApiKeys

log = logging.getLogger(__name__)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
FINISH = {1: "stop", 2: "length", 3: "abort"}


def error_body(status: int, kind: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(error: RequestError) -> JSONResponse:
    status, kind = HTTP_STATUS.get(error.code, (500, "server_error"))
    headers = {"Retry-After": f"{error.retry_after:g}"} if error.retry_after else None
    body = error_body(status, kind, error.message, error.param)
    return JSONResponse(body, status, headers=headers)


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _invalid(message: str, param: str | None) -> RequestError:
    return RequestError(INVALID, message, param=param)


class OpenAIApi:
    """Turns HTTP bodies into the router's submissions, and its events into OpenAI's shapes."""

    def __init__(self, router: Router, keys: ApiKeys) -> None:
        self.router, self.keys = router, keys
        self.model_id = router.model.name
        self.created = int(time.time())

    def _prompts(self, body) -> list[list[int]]:
        tokenizer = self.router.tokenizer
        try:
            if isinstance(body, ChatBody):
                messages = [
                    {
                        "role": "system" if m.role == "developer" else m.role,
                        "content": tokenizer.escape_special_tokens(m.text()),
                    }
                    for m in body.messages
                ]
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                return [tokenizer.encode(text, add_special_tokens=False)]
            prompts = body.prompts(self.router.limits.max_prompts)
        except ValueError as error:  # BadRequest among them
            field = "messages" if isinstance(body, ChatBody) else "prompt"
            raise _invalid(str(error), getattr(error, "param", None) or field) from None
        if any(p in ("", []) for p in prompts):
            raise _invalid("empty prompt", "prompt")
        if isinstance(prompts[0], str):
            return [tokenizer.encode(p) for p in prompts]
        return [list(p) for p in prompts]

    def submissions(self, body, request: Request) -> tuple[list, list[list[int]]]:
        """One submission per choice (prompt-major, n per prompt), and the prompts."""
        tenant = request.state.tenant  # the API key gate's
        if body.model not in (None, self.model_id):
            message = (
                f"model {body.model!r} is not served here; this router serves {self.model_id!r}"
            )
            raise RequestError(grpc.StatusCode.NOT_FOUND, message)
        if problem := body.unsupported():
            raise _invalid(problem, problem.split(" ", 1)[0])  # it begins with the field's name
        if body.model_extra:
            log.debug("ignored fields: %s", ", ".join(body.model_extra))
        prompts = self._prompts(body)
        limit, most = self.router.model.max_model_len, self.router.limits.max_choices
        if len(prompts) * body.n > most:
            raise _invalid(
                f"{len(prompts) * body.n} choices (prompts x n: {len(prompts)} x {body.n}), over "
                f"the limit of {most} (max_choices)",
                "n",
            )
        stops = body.stops()
        share_tenant = tenant or (request.client.host if request.client else "")
        submissions = []
        for p, prompt in enumerate(prompts):
            max_tokens = body.max_tokens
            if isinstance(body, ChatBody):
                max_tokens = body.max_completion_tokens or max_tokens or limit - len(prompt)
                if max_tokens <= 0:
                    raise _invalid(
                        f"the prompt of {len(prompt)} tokens leaves no room for a completion "
                        f"in the context limit of {limit}",
                        "messages",
                    )
            for choice in range(body.n):
                seed = random_seed() if body.seed is None else (body.seed + choice) % 2**63
                try:
                    params = checked_sampling(
                        limit,
                        temperature=body.temperature,
                        top_p=body.top_p,
                        top_k=max(body.top_k, 0),
                        max_tokens=max_tokens,
                        seed=seed,
                        stop_token_ids=body.stop_token_ids,
                    )
                except BadRequest as error:
                    invalid = RequestError(INVALID, str(error), param=error.param)
                    raise self._named(body, invalid) from None
                request_id = f"{p}.{choice}.{uuid.uuid4().hex}"  # unique: nobody aborts it by id
                owner, salt = f"http:{request_id}", self.keys.cache_salt(tenant)
                try:
                    submission = self.router.submission(
                        prompt, params, stops, request_id, owner, salt, tenant=share_tenant
                    )
                except RequestError as error:
                    raise self._named(body, error) from None
                submissions.append(submission)
        return submissions, prompts

    @staticmethod
    def _named(body, error: RequestError) -> RequestError:
        """The error with its field named as this body names it (a chat's prompt is its
        messages; its max_tokens may be max_completion_tokens)."""
        if isinstance(body, ChatBody):
            if error.param == "prompt":
                error.param = "messages"
            elif error.param == "max_tokens" and body.max_completion_tokens:
                error.param = "max_completion_tokens"
        return error

    async def events(self, submissions):
        """(choice index, event) of every choice's request as they come; ends when all end.
        The choices are admitted all or none: a refusal is the first and only event."""
        try:
            flights = self.router.admit(submissions)
        except RequestError as error:
            yield 0, error
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, flight) -> None:
            try:
                async for event in self.router.stream(flight):
                    queue.put_nowait((index, event))
            except RequestError as error:
                queue.put_nowait((index, error))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(run(i, f)) for i, f in enumerate(flights)]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get())[1] is not None:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for flight in flights:  # one whose task never started has no stream to close
                flight.task.cancel()

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
