"""The router's request flow, shared by its gRPC and HTTP APIs.

    submission = router.submission(prompt, params, stops, request_id, owner, salt, timeout)
    async for event in router.generate(submission): ...   # Tokens, then one Finished

A request is admitted (at most `max_inflight` at once, a tenant at most its `tenant_share` of
them, else RESOURCE_EXHAUSTED at once; the choices of one HTTP request all or none: `admit`),
then runs as its own task: a prefill instance computes its KV and first token (the one caching
the longest prefix of its prompt, unless the queues are uneven: `WorkerPool.pick_prefill`; what
it found cached corrects the router's guess); then a decode instance with room reserves pages,
pulls the KV and streams the rest. Requests wait for decode room first come first served, for
at most `queue_timeout_s` and never past their KV's lease. Without a client deadline a
request runs up to `request_timeout_s`.

However a request ends (finish, stop string, Abort, a client gone, deadline, error, at any
stage, even before its task began), the end of its task releases its KV at the prefill
instance and the calls it cancels free its pages at the instances; the instances' ids are the
router's own (a fresh one per request), so a client reusing an id can never touch another
request's pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import grpc

from ref_server.engine import prefix_hashes
from ref_server.model import SamplingParams
from ref_server.services.aio import background, drained
from ref_server.services.engine_loop import one_line
from ref_server.services.messages import sampling_message
from ref_server.services.metrics import Metrics
from ref_server.services.text import TextStream
from ref_server.services.workers import Worker, WorkerPool
from ref_server.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)
TRANSFER_LABELS = {
    pb.KV_TRANSFER_METHOD_GRPC: "grpc",
    pb.KV_TRANSFER_METHOD_CUDA_IPC: "cuda_ipc",
    pb.KV_TRANSFER_METHOD_NIXL: "nixl",
}
RETRY_AFTER_S = 1.0


class RequestError(Exception):
    """How a request failed, as a gRPC status (the HTTP API maps it to its own)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after: float | None = None,
        param: str | None = None,  # the request field at fault, where one is
    ):
        super().__init__(message)
        self.code, self.message, self.retry_after, self.param = code, message, retry_after, param


@dataclass
class ModelFacts:
    name: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_parameters: int
    eos_token_ids: list[int]
    page_size: int
    page_bytes: int


@dataclass
class Limits:
    """What the router admits; `ServeConfig` says what each is and its default."""

    max_inflight: int
    tenant_share: float
    request_timeout_s: float
    queue_timeout_s: float
    max_prompts: int
    max_choices: int
    max_stops: int
    max_stop_length: int
    max_stop_token_ids: int
    max_request_id_length: int


@dataclass
class Submission:
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    request_id: str  # the client's
    owner: str  # who may abort it: the API key's tenant, else the connection
    cache_salt: bytes
    deadline: float  # time.monotonic()
    tenant: str  # whose share of max_inflight it takes: the API key's tenant, else the client


@dataclass
class Tokens:
    token_ids: list[int]
    text: str


@dataclass
class Finished:
    finish_reason: int  # pb.FinishReason
    usage: pb.Usage


@dataclass(eq=False)
class Flight:
    """An admitted request."""

    submission: Submission
    internal_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stage: str = "prefill"  # then handoff (waiting for decode room, pulling), then decode
    task: asyncio.Task | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: bool = False
    completion: list[int] = field(default_factory=list)
    last_token_at: float = 0.0  # time.monotonic()
    cached_tokens: int = 0
    prefills: list = field(default_factory=list)  # every instance asked to prefill it
    admitted_at: float = field(default_factory=lambda: time.monotonic())
    first_token_at: float | None = None
    outcome: str = "cancelled"  # ok, abort, cancelled, or the error's code in lower case


def _merged(events: list) -> list:
    """Runs of Tokens as one (a client that lags gets fewer, larger chunks)."""
    merged = []
    for event in events:
        if isinstance(event, Tokens) and merged and isinstance(merged[-1], Tokens):
            merged[-1] = Tokens(
                merged[-1].token_ids + event.token_ids, merged[-1].text + event.text
            )
        else:
            merged.append(event)
    return merged


class DecodeRoom:
    """Requests waiting for a decode instance with room, woken first come first served."""

    def __init__(self) -> None:
        self.waiters: deque[asyncio.Future] = deque()

    async def wait(self, timeout: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    def freed(self, count: int = 1) -> None:
        while count and self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        model: ModelFacts,
        tokenizer,
        metrics: Metrics,
        limits: Limits,
    ) -> None:
        self.pool, self.model, self.tokenizer = pool, model, tokenizer
        self.metrics, self.limits = metrics, limits
        self.inflight: dict[tuple[str, str], Flight] = {}
        self.room = DecodeRoom()

    # ------------------------------------------------------------ admission

    def submission(
        self,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        request_id: str,
        owner: str,
        cache_salt: bytes = b"",
        timeout: float | None = None,
        tenant: str | None = None,
    ) -> Submission:
        """A checked request (RequestError INVALID_ARGUMENT naming what is wrong); its tenant
        is its owner unless told."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if not prompt:
            raise RequestError(invalid, "empty prompt", param="prompt")
        bad = next((t for t in prompt if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            message = f"token id {bad} outside [0, {self.model.vocab_size})"
            raise RequestError(invalid, message, param="prompt")
        if problem := self._stops_problem(stops, params.stop_token_ids):
            message, param = problem
            raise RequestError(invalid, message, param=param)
        if len(prompt) + params.max_tokens > self.model.max_model_len:
            message = (
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the "
                f"context limit of {self.model.max_model_len}"
            )
            raise RequestError(invalid, message, param="prompt")
        ceiling = self.limits.request_timeout_s
        budget = ceiling if timeout is None else min(timeout, ceiling)
        deadline = time.monotonic() + budget
        return Submission(
            prompt, params, list(stops), request_id, owner, cache_salt, deadline, tenant or owner
        )

    def _stops_problem(
        self, stops: list[str], stop_token_ids: frozenset[int]
    ) -> tuple[str, str] | None:
        """(what is wrong, the field) when the stop strings or ids pass a limit."""
        limits, vocab = self.limits, self.model.vocab_size
        if len(stops) > limits.max_stops:
            message = f"{len(stops)} stop strings, over the limit of {limits.max_stops} (max_stops)"
            return message, "stop"
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_length:
            message = (
                f"a stop string of {longest} characters, over the limit of "
                f"{limits.max_stop_length} (max_stop_length)"
            )
            return message, "stop"
        if len(stop_token_ids) > limits.max_stop_token_ids:
            message = (
                f"{len(stop_token_ids)} distinct stop_token_ids, over the limit of "
                f"{limits.max_stop_token_ids} (max_stop_token_ids)"
            )
            return message, "stop_token_ids"
        if bad := [t for t in stop_token_ids if not 0 <= t < vocab]:
            return f"stop_token_ids: token id {min(bad)} outside [0, {vocab})", "stop_token_ids"
        return None

    def admit(self, submissions: list[Submission]) -> list[Flight]:
        """The flights of one client request's choices (one tenant's), every one running; or
        none: RESOURCE_EXHAUSTED when they would pass `max_inflight` or the tenant's share of
        it, INVALID_ARGUMENT for a request id in flight."""
        limits, count, tenant = self.limits, len(submissions), submissions[0].tenant
        share = max(1, int(limits.max_inflight * limits.tenant_share))
        held = sum(f.submission.tenant == tenant for f in self.inflight.values())
        refusal = None
        if len(self.inflight) + count > limits.max_inflight:
            refusal = (
                f"{len(self.inflight)} requests in flight; {count} more would pass the limit of "
                f"{limits.max_inflight} (max_inflight); retry later"
            )
        elif held + count > share:
            refusal = (
                f"this client has {held} requests in flight; {count} more would pass its share "
                f"of {share} (tenant_share {limits.tenant_share:g} of max_inflight); retry later"
            )
        if refusal:
            self.metrics.requests.labels("resource_exhausted").inc(count)
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, RETRY_AFTER_S)
        for submission in submissions:
            if (submission.owner, submission.request_id) in self.inflight:
                message = f"request id {submission.request_id!r} is in flight"
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
        flights = [Flight(submission) for submission in submissions]
        for flight in flights:
            self.inflight[(flight.submission.owner, flight.submission.request_id)] = flight
            flight.task = asyncio.create_task(self._run(flight, flight.events))
            flight.task.add_done_callback(lambda _, flight=flight: self._ended(flight))
        self.metrics.inflight.set(len(self.inflight))
        return flights

    async def stream(self, flight: Flight):
        """An admitted request's events: Tokens as they come, then Finished; RequestError on
        failure. Closing it ends the request."""
        try:
            while True:
                for event in _merged(await drained(flight.events)):
                    if event is None:
                        return
                    if isinstance(event, RequestError):
                        raise event
                    yield event
        finally:
            flight.task.cancel()  # the client went away: the task frees what it holds

    def generate(self, submission: Submission):
        """`stream` of the submission, admitted alone (RequestError at once if it is not)."""
        (flight,) = self.admit([submission])
        return self.stream(flight)

    async def close(self) -> None:
        """End every request in flight (the server is stopping)."""
        tasks = [f.task for f in self.inflight.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def abort(self, owner: str, request_id: str) -> bool:
        """End a request of this owner; False when it has none of that id in flight."""
        flight = self.inflight.get((owner, request_id))
        if flight is None or flight.task is None:
            return False
        flight.aborted = True
        flight.task.cancel()
        return True

    # ------------------------------------------------------------ one request

    def _remaining(self, flight: Flight) -> float:
        left = flight.submission.deadline - time.monotonic()
        if left <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return left

    def _usage(self, flight: Flight) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(flight.submission.prompt),
            completion_tokens=len(flight.completion),
            cached_tokens=flight.cached_tokens,
        )

    async def _run(self, flight: Flight, events: asyncio.Queue) -> None:
        submission, start = flight.submission, time.monotonic()
        text = TextStream(self.tokenizer.decoder(), submission.stops)
        try:
            prefill, first = await self._prefill(flight)
            self.metrics.ttft.observe(time.monotonic() - start)
            self._tokens(flight, text, events, [first.first_token])
            first_at = flight.first_token_at = flight.last_token_at
            # a stop string in the first token's text is the reason, even if it also ended there
            finish = pb.FINISH_REASON_STOP if text.stopped else first.finish_reason or None
            if finish is None:
                flight.stage = "handoff"
                finish = await self._decode(flight, prefill, first, text, events)
            if not text.stopped and (tail := text.finish()):
                events.put_nowait(Tokens([], tail))
            if len(flight.completion) > 1:
                gap = (flight.last_token_at - first_at) / (len(flight.completion) - 1)
                self.metrics.tpot.observe(gap)
            self._count(flight, "ok")
            events.put_nowait(Finished(finish, self._usage(flight)))
        except asyncio.CancelledError:
            self._cancelled(flight, events)
        except RequestError as error:
            self._count(flight, error.code.name.lower())
            events.put_nowait(error)
        except Exception as error:
            log.exception("request %s failed", flight.internal_id)
            self._count(flight, "internal")
            events.put_nowait(RequestError(grpc.StatusCode.INTERNAL, one_line(error)))

    def _count(self, flight: Flight, outcome: str) -> None:
        flight.outcome = outcome
        self.metrics.requests.labels(outcome).inc()

    def _cancelled(self, flight: Flight, events: asyncio.Queue) -> None:
        self.metrics.aborts.labels(flight.stage).inc()
        self._count(flight, "abort" if flight.aborted else "cancelled")
        if flight.aborted:
            events.put_nowait(Finished(pb.FINISH_REASON_ABORT, self._usage(flight)))

    def _ended(self, flight: Flight) -> None:
        """However the request's task ended, even cancelled before it began (then `_run` never
        ran): its KV is released at every prefill instance asked (whatever the decode instance
        did, and even if a cancel overtook the prefill's answer), its slot freed, its events
        ended."""
        if flight.task.cancelled():
            self._cancelled(flight, flight.events)
        for worker in flight.prefills:
            background(self._release(worker, flight.internal_id))
        del self.inflight[(flight.submission.owner, flight.submission.request_id)]
        self.metrics.inflight.set(len(self.inflight))
        flight.events.put_nowait(None)
        log.info("%s", access_line(flight))

    def _tokens(self, flight: Flight, text: TextStream, events, token_ids: list[int]) -> None:
        flight.completion += token_ids
        flight.last_token_at = time.monotonic()
        self.metrics.count_output(len(token_ids))
        events.put_nowait(Tokens(token_ids, text.add(token_ids)))

    async def _release(self, prefill: Worker, handle: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # released already, or the lease ran out
            await prefill.kv.Release(pb.ReleaseRequest(kv_handle=handle), timeout=10)

    def _failure(self, worker: Worker, error: grpc.aio.AioRpcError, hop: str) -> RequestError:
        """A failed call to an instance, for the client (one line, never a traceback)."""
        code = error.code()
        details = first_line(error)
        log.warning("%s at %s (%s): %s %s", hop, worker.name, worker.address, code.name,
                    error.details())  # fmt: skip
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED):
            return RequestError(code, f"{hop}: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return RequestError(code, f"{hop}: {details}; retry later", RETRY_AFTER_S)
        if code == grpc.StatusCode.UNAVAILABLE:
            self.pool.failed(worker)
        return RequestError(
            grpc.StatusCode.UNAVAILABLE, f"{hop} at {worker.name} failed: {details}"
        )

    async def _prefill(self, flight: Flight):
        """(instance, PrefillResponse); another instance when one is unreachable."""
        submission, tried, page = flight.submission, set(), self.model.page_size
        prompt = submission.prompt
        leaves = prefix_hashes(prompt, page, submission.cache_salt)  # its full pages, once done
        reusable = leaves[: (len(prompt) - 1) // page]  # the last token is always computed
        message = pb.PrefillRequest(
            request_id=flight.internal_id,
            token_ids=submission.prompt,
            sampling=sampling_message(submission.params),
            cache_salt=submission.cache_salt,
        )
        unreachable = ""  # the last instance that could not be reached, and why
        while True:
            choice = self.pool.pick_prefill(reusable, tried)
            if choice is None:
                problem = self.pool.problem or unreachable or "no prefill instance to ask"
                raise RequestError(grpc.StatusCode.UNAVAILABLE, problem)
            worker = choice.worker
            self.metrics.prefill_routes.labels(choice.rule).inc()
            timeout = self._remaining(flight)  # may raise: before the count it would leak
            worker.assigned += 1
            worker.routed_tokens += len(prompt)
            flight.prefills.append(worker)
            call = worker.prefill.Prefill(message, timeout=timeout)
            watch = worker.cancel_when_down(call)
            try:
                first = await call
            except asyncio.CancelledError:
                if not watch.done() or watch.cancelled():
                    raise
                tried.add(worker)
                unreachable = f"{worker.name} stopped answering its health checks"
                log.warning("%s (%s) stopped answering its health checks: the prefill moves",
                            worker.name, worker.address)  # fmt: skip
                continue
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self.pool.failed(worker)
                    tried.add(worker)
                    log.warning("%s (%s) could not be reached: %s", worker.name,
                                worker.address, error.details())  # fmt: skip
                    unreachable = f"{worker.name} could not be reached"
                    continue
                raise self._failure(worker, error, "prefill") from None
            finally:
                # cancelled as the call starts (its interceptor done, this await not resumed
                # yet), the call would run on at the instance unless cancelled here, and hold
                # pages after `_ended`'s Release found none
                call.cancel()
                watch.cancel()
                worker.assigned -= 1
            flight.cached_tokens = first.cached_tokens
            self.pool.prefilled(choice, leaves, first.cached_tokens // page)
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.cached_tokens.inc(first.cached_tokens)
            self.metrics.predicted_cached_tokens.inc(choice.cached_pages * page)
            return worker, first

    async def _decode(self, flight, prefill: Worker, first, text: TextStream, events) -> int:
        """Stream the decode instance's tokens; the finish reason."""
        submission = flight.submission
        lease_end = time.monotonic() + first.lease_seconds - 1.0  # a second for the copy
        room_deadline = min(time.monotonic() + self.limits.queue_timeout_s, lease_end)
        message = pb.DecodeRequest(
            request_id=flight.internal_id,
            token_ids=submission.prompt,
            first_token=first.first_token,
            sampling=sampling_message(submission.params),
            prefill_address=prefill.address,
            kv_handle=first.kv_handle,
            num_pages=first.num_pages,
            cache_salt=submission.cache_salt,
        )
        tried: set[Worker] = set()
        while True:
            if not prefill.routable:  # its KV went with it
                message = f"{prefill.name}, which holds the request's KV, is down"
                raise RequestError(grpc.StatusCode.UNAVAILABLE, message)
            if not any(w.routable for w in self.pool.of("decode")):
                problem = self.pool.problem or "no healthy decode instance"
                raise RequestError(grpc.StatusCode.UNAVAILABLE, problem)
            worker = self.pool.pick_decode(tried)
            if worker is None:
                await self._wait_for_room(flight, room_deadline)
                tried.clear()
                continue
            timeout = self._remaining(flight)  # may raise: before the count it would leak
            worker.assigned += 1
            call = worker.decode.Decode(message, timeout=timeout)
            watch = worker.cancel_when_down(call)
            try:
                opening = await call.read()
                if opening is grpc.aio.EOF:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, "decode ended before it began")
                flight.stage = "decode"
                label = TRANSFER_LABELS[opening.kv_transfer]
                transfer = first.num_pages * self.model.page_bytes
                self.metrics.transfer_bytes.labels(label).inc(transfer)
                return await self._stream(flight, call, text, events)
            except asyncio.CancelledError:
                if not watch.done() or watch.cancelled():
                    raise
                message = f"decode at {worker.name} stopped answering its health checks"
                log.warning("%s (%s)", message, worker.address)
                raise RequestError(grpc.StatusCode.UNAVAILABLE, message) from None
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if flight.stage == "decode":  # tokens went out: the request cannot move
                    raise self._failure(worker, error, "decode") from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # no pages there now
                    tried.add(worker)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    self.pool.failed(worker)
                    tried.add(worker)
                    continue
                if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.PERMISSION_DENIED):
                    # the KV could not be had (or its prefill instance was dropped): not the
                    # decode instance's fault
                    self.metrics.transfer_failures.inc()
                    message = f"the KV from {prefill.name}: {first_line(error)}"  # who lost it
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, message) from None
                raise self._failure(worker, error, "decode") from None
            finally:
                call.cancel()
                watch.cancel()
                worker.assigned -= 1
                if flight.stage == "decode":  # it held room there, now free for the next
                    self.room.freed()

    async def _wait_for_room(self, flight: Flight, room_deadline: float) -> None:
        left = min(room_deadline, flight.submission.deadline) - time.monotonic()
        if left <= 0:
            message = "no decode instance had room in time; retry later"
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, RETRY_AFTER_S)
        await self.room.wait(min(left, 0.25))  # woken when a decode call ends, else looks again

    async def _stream(self, flight: Flight, call, text: TextStream, events) -> int:
        while (message := await call.read()) is not grpc.aio.EOF:
            if message.token_ids:
                self._tokens(flight, text, events, list(message.token_ids))
                if text.stopped:
                    return pb.FINISH_REASON_STOP
            if message.finish_reason:
                return message.finish_reason
        raise RequestError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended without a finish")


# Codes whose details an instance of ours wrote (the rest are grpc's own: connection errors)
AUTHORED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INTERNAL,
}
ADDRESS = re.compile(
    r"(?:ipv4|ipv6|unix|dns):\S+|\[[0-9a-fA-F:.]+\]:\d+|\b\d{1,3}(?:\.\d{1,3}){3}:\d+"
)


def access_line(flight: Flight) -> str:
    """A finished request, one line for the log: ids, outcome, tokens, times."""
    submission, now = flight.submission, time.monotonic()
    first = flight.first_token_at
    ttft = f"{first - flight.admitted_at:.3f} s" if first is not None else "none"
    return (
        f"request {submission.request_id!r} ({flight.internal_id}, tenant "
        f"{submission.tenant or '-'}) {flight.outcome} at {flight.stage}: "
        f"{len(submission.prompt)} prompt tokens ({flight.cached_tokens} cached), "
        f"{len(flight.completion)} output tokens, first token {ttft}, "
        f"{now - flight.admitted_at:.3f} s in all"
    )


def first_line(error: grpc.aio.AioRpcError) -> str:
    """An instance's error as clients see it: one line, no address in it, and for errors
    grpc itself wrote (an instance it could not reach) the code's name alone."""
    if error.code() not in AUTHORED or not error.details():
        return error.code().name.lower().replace("_", " ")
    return ADDRESS.sub("<address>", error.details().splitlines()[0])
