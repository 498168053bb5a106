"""Every KV page is free within 2 s of every end of a request. The prefill and decode instances
(`run_instance`, an engine each) and the router run in the test's own event loop (the tiny
preset on CPU), so that hooks can hold a request at the exact await or loop turn where it may
end, and the engines' page tables are read directly."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services import engine_loop
from ref_server.services.deployment import free_port
from ref_server.services.engine_loop import EngineLoop
from ref_server.services.http_server import HttpServer, create_app
from ref_server.services.kv_transfer import KvPuller
from ref_server.services.metrics import Metrics
from ref_server.services.router import RequestError, Router
from ref_server.services.security import ApiKeys, internal_channel
from ref_server.services.servers import (
    model_args,
    model_facts,
    model_fingerprint,
    router_limits,
    run_instance,
    scheduler_config,
)
from ref_server.services.workers import Expected, WorkerPool
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

SEED = 4
SECRET = "page-release-test"
OWNER = "test"
FREED_WITHIN_S = 2.0
PROMPT = list(range(3, 67))  # 64 tokens: four pages of 16, prefilled in four steps of 16


@contextlib.asynccontextmanager
async def deployment(serving, http: bool = False, **overrides):
    """A prefill and a decode instance and a router on them, in this event loop (with http, the
    router's HTTP API too): yields the router, both engines, the prefill instance's address and
    the HTTP API's."""
    config = serving.config(max_num_batched_tokens=16, **overrides)
    stop, engines, addresses, instances = asyncio.Event(), {}, {}, []
    for role in ("prefill", "decode"):
        engines[role] = Engine(M.from_preset("tiny", seed=SEED), scheduler_config(config))
        port = free_port()
        addresses[role] = f"127.0.0.1:{port}"
        launched = dataclasses.replace(config, role=role, port=port)
        instances.append(
            asyncio.create_task(run_instance(launched, SECRET, engines[role], None, stop))
        )
    facts, tokenizer = model_facts(config)
    args = model_args(config)
    expected = Expected(
        model_fingerprint(config), args.num_hidden_layers, config.block_size, args.cache_width
    )
    pool = WorkerPool(
        [addresses["prefill"]],
        [addresses["decode"]],
        expected,
        SECRET,
        on_update=lambda: None,
        interval=config.health_interval_s,
    )
    metrics = Metrics()
    router = Router(pool, facts, tokenizer, metrics, router_limits(config))
    server = serving_http = None
    try:
        await pool.start()
        await until(lambda: not pool.problem, 30, "the router sees both instances")
        if http:
            keys = ApiKeys(frozenset())
            app = create_app(router, keys, lambda: True, metrics, config.max_request_bytes)
            server = HttpServer(app, "127.0.0.1", config.http_port, None, None)
            serving_http = asyncio.create_task(server.serve())
            await until(lambda: server.started, 10, "the HTTP server listening")
        yield SimpleNamespace(
            router=router,
            prefill=engines["prefill"],
            decode=engines["decode"],
            prefill_address=addresses["prefill"],
            http_address=f"127.0.0.1:{config.http_port}",
        )
    finally:
        if server is not None:
            server.should_exit = True
            await serving_http
        await router.close()
        await pool.close()
        stop.set()
        await asyncio.gather(*instances)


async def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.02)


def pages(engine: Engine) -> dict:
    """The pages an engine's requests hold, and its requests where they are."""
    scheduler = engine.scheduler
    return dict(
        used=scheduler.blocks.num_blocks - scheduler.blocks.num_free,
        held=list(scheduler.held),
        reserved=list(scheduler.reserved),
        running=[s.request_id for s in scheduler.running],
        waiting=[s.request_id for s in scheduler.waiting],
    )


async def freed(*engines: Engine) -> None:
    """Every page of these engines free, and no request left in them, within FREED_WITHIN_S."""
    empty = dict(used=0, held=[], reserved=[], running=[], waiting=[])
    deadline = time.monotonic() + FREED_WITHIN_S
    while any(pages(engine) != empty for engine in engines):
        if time.monotonic() > deadline:
            left = [pages(engine) for engine in engines]
            raise AssertionError(f"still taken after {FREED_WITHIN_S:g} s: {left}")
        await asyncio.sleep(0.02)


def stall(engine: Engine, after: int = 0) -> threading.Event:
    """The engine computes `after` steps, then nothing until the event is set; its loop still
    runs commands between steps (cancels, releases)."""
    go, step, count = threading.Event(), engine.step, itertools.count()

    def stalled():
        if next(count) >= after and not go.is_set():
            time.sleep(0.01)
            return []
        return step()

    engine.step = stalled
    return go


def held_at(owner, name: str, monkeypatch) -> SimpleNamespace:
    """owner.name (an engine's method, run on its thread; or a class's, such as KvPuller._write
    on a worker thread) waits at its start until `go` is set: `reached` is set when a call gets
    there, `args` are its arguments."""
    hook = SimpleNamespace(reached=threading.Event(), go=threading.Event(), args=None)
    method = getattr(owner, name)  # of a class: the function, which the call passes self to

    def held(*args):
        hook.args = args
        hook.reached.set()
        hook.go.wait(10)
        return method(*args)

    monkeypatch.setattr(owner, name, held)
    return hook


def submission(router: Router, request_id: str, max_tokens: int = 200, prompt=PROMPT):
    params = M.SamplingParams(max_tokens=max_tokens)
    return router.submission(list(prompt), params, [], request_id, OWNER)


async def events_of(router: Router, submitted) -> list:
    """Every event of a request (a RequestError last if it failed)."""
    events = []
    try:
        async for event in router.generate(submitted):
            events.append(event)
    except RequestError as error:
        events.append(error)
    return events


def test_an_abort_at_any_stage_frees_every_page_within_2_s(serving, monkeypatch):
    """Router.abort lands at each stage of a request; each time its stream ends with
    FINISH_REASON_ABORT and every page of both instances is free within 2 s. The stages: before
    the request's task has begun; as its Prefill call starts (the loop turn where grpc.aio's
    client interceptor has started the call and the router's await has not resumed: the call
    runs on unless the router cancels it, while the router's Release finds nothing held yet);
    while the prompt is computed; while the decode instance reserves pages, while the KV is
    written into them, while the request starts there; while it decodes."""

    async def abort_when(router, request_id: str, reached, go: threading.Event) -> list:
        """Send a request; once `reached` (a thread's event, or a condition), abort it, then
        let the held part go on. Its events."""
        sent = asyncio.create_task(events_of(router, submission(router, request_id)))
        if isinstance(reached, threading.Event):
            await asyncio.to_thread(reached.wait, 10)
        else:
            await until(reached, 10, f"{request_id}: the stage reached")
        assert router.abort(OWNER, request_id)
        await asyncio.sleep(0.1)  # the cancel reaches the instance while the request is held
        go.set()
        return await sent

    async def run() -> None:
        async with deployment(serving) as stack:
            router = stack.router

            early = router.generate(submission(router, "before-it-began"))
            first = asyncio.ensure_future(anext(early))
            await asyncio.sleep(0)  # the request admitted, its task made but not begun
            assert router.abort(OWNER, "before-it-began")
            assert (await asyncio.wait_for(first, 5)).finish_reason == pb.FINISH_REASON_ABORT
            await early.aclose()
            assert not router.inflight

            worker = router.pool.of("prefill")[0]
            prefill = worker.prefill.Prefill
            started = []  # the calls, to see that each was cancelled

            def prefill_then_abort(message, **kwargs):
                started.append(prefill(message, **kwargs))
                asyncio.get_running_loop().call_soon(router.abort, OWNER, "as-prefill-starts")
                return started[-1]

            go = stall(stack.prefill)
            worker.prefill.Prefill = prefill_then_abort
            events = await events_of(router, submission(router, "as-prefill-starts"))
            worker.prefill.Prefill = prefill
            assert events[-1].finish_reason == pb.FINISH_REASON_ABORT
            assert started[0].cancelled()  # not left to run on at the instance
            go.set()
            await freed(stack.prefill)

            go = stall(stack.prefill, after=1)  # the prompt's pages taken, 16 of 64 computed
            computing = lambda: pages(stack.prefill)["running"]  # noqa: E731
            events = await abort_when(router, "computing", computing, go)
            assert events[-1].finish_reason == pb.FINISH_REASON_ABORT
            await freed(stack.prefill, stack.decode)

            for stage, owner, name in (
                ("reserving", stack.decode, "reserve"),
                ("writing", KvPuller, "_write"),
                ("starting", stack.decode, "start"),
            ):
                hook = held_at(owner, name, monkeypatch)
                events = await abort_when(router, stage, hook.reached, hook.go)
                assert events[-1].finish_reason == pb.FINISH_REASON_ABORT, stage
                await freed(stack.prefill, stack.decode)

            events = []
            async for event in router.generate(submission(router, "decoding")):
                events.append(event)
                if len(events) == 3:
                    assert router.abort(OWNER, "decoding")
            assert events[-1].finish_reason == pb.FINISH_REASON_ABORT
            await freed(stack.prefill, stack.decode)

    asyncio.run(run())


def test_a_release_before_the_prompt_is_held_frees_its_pages_as_it_finishes(serving):
    """A Prefill whose Release comes while its prompt is still computed (its cancel lost or
    overtaken): the Release finds nothing held (NOT_FOUND), and the pages are freed as the
    prompt finishes (the call ends ABORTED), not when their 60 s lease runs out."""

    async def run() -> None:
        async with deployment(serving) as stack:
            go = stall(stack.prefill, after=1)
            async with internal_channel(stack.prefill_address, SECRET) as channel:
                request = pb.PrefillRequest(
                    request_id="early", token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=4)
                )
                call = rpc.PrefillStub(channel).Prefill(request, timeout=30)
                await until(lambda: pages(stack.prefill)["running"], 10, "the prompt computed")
                with pytest.raises(grpc.aio.AioRpcError) as release:
                    await rpc.KvTransferStub(channel).Release(
                        pb.ReleaseRequest(kv_handle="early"), timeout=10
                    )
                assert release.value.code() == grpc.StatusCode.NOT_FOUND
                go.set()
                await freed(stack.prefill)
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await call
                assert ended.value.code() == grpc.StatusCode.ABORTED

    asyncio.run(run())


def test_releases_that_found_nothing_are_remembered_within_bounds(serving, monkeypatch):
    """At most RELEASED_KEPT ids (the oldest forgotten first), each for hold_seconds."""
    monkeypatch.setattr(engine_loop, "RELEASED_KEPT", 5)
    engine = Engine(
        M.from_preset("tiny", seed=SEED),
        SchedulerConfig(num_blocks=8, block_size=16, max_model_len=128),
    )
    loop = EngineLoop(engine, hold_seconds=0.5)
    try:
        ids = [f"unknown-{i}" for i in range(8)]
        assert [loop.release(i).result(timeout=10) for i in ids] == [False] * 8
        assert list(loop.released) == ids[3:]
        serving.wait_until(lambda: not loop.released, 2, "the releases forgotten")
    finally:
        loop.stop()


def test_an_engine_wide_abort_frees_pages_being_written_only_once_the_write_ended(
    serving, monkeypatch
):
    """A decode step fails (injected) while one request decodes and another's KV is being
    written into its reserved pages on a worker thread: both requests fail with the step's
    error; the pages being written stay allocated until the write has ended (freed, they could
    go to another request and be overwritten), then every page is free within 2 s."""

    async def run() -> None:
        async with deployment(serving) as stack:
            router, decode = stack.router, stack.decode
            step, failing = decode.step, threading.Event()

            def step_or_fail():
                if failing.is_set():
                    failing.clear()
                    raise RuntimeError("injected")
                return step()

            monkeypatch.setattr(decode, "step", step_or_fail)
            decoding = asyncio.create_task(
                events_of(router, submission(router, "decoding", 480, prompt=[5, 6]))
            )
            await until(lambda: pages(decode)["running"], 10, "a request decoding")
            write = held_at(KvPuller, "_write", monkeypatch)
            written = asyncio.create_task(events_of(router, submission(router, "written", 8)))
            try:
                await asyncio.to_thread(write.reached.wait, 10)
                blocks = list(write.args[2].values())
                failing.set()
                failed = await decoding
                assert isinstance(failed[-1], RequestError), failed[-1]
                assert "engine step failed: RuntimeError: injected" in failed[-1].message
                await asyncio.sleep(0.2)  # a request that came now would get freed pages
                assert [decode.scheduler.blocks.ref_count[b] for b in blocks] == [1] * 4
                assert len(decode.scheduler.reserved) == 1
            finally:
                write.go.set()
            failed = await written
            assert isinstance(failed[-1], RequestError), failed[-1]
            assert "engine step failed: RuntimeError: injected" in failed[-1].message
            await freed(stack.prefill, stack.decode)

    asyncio.run(run())


def test_a_streamed_http_request_whose_client_leaves_before_its_first_token_ends(serving):
    """The client closes its connection while the prompt is computed (no event yet, so no
    response has begun): the request ends and its pages are free within 2 s."""

    async def run() -> None:
        async with deployment(serving, http=True) as stack:
            go = stall(stack.prefill, after=1)  # the prompt's pages taken, no first token
            try:
                host, port = stack.http_address.split(":")
                _, writer = await asyncio.open_connection(host, int(port))
                body = json.dumps(dict(prompt=PROMPT, max_tokens=8, stream=True)).encode()
                head = (
                    "POST /v1/completions HTTP/1.1\r\nhost: test\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                )
                writer.write(head.encode() + body)
                await writer.drain()
                await until(lambda: pages(stack.prefill)["running"], 10, "the prompt computed")
                writer.close()
                await writer.wait_closed()
                await freed(stack.prefill, stack.decode)
                assert not stack.router.inflight
            finally:
                go.set()

    asyncio.run(run())
