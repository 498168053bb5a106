"""How requests end and what they leave behind (CPU, tiny preset, real processes): cancels and
aborts at every stage, request-id reuse, KV leases, admission and decode room, instances that
die or disagree. Every test ends with no page held anywhere."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import time
import urllib.request

import grpc
import httpx
import pytest
import torch

import ref_server.model as M
from ref_server.client import Client
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services.deployment import Deployment, free_port, serve_command, wait_serving
from ref_server.services.kv_transfer import GRPC, RECONNECT_TIMEOUT, KvPuller, TransferError
from ref_server.services.security import SECRET_ENV, internal_channel
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

SEED = 4


def load(client: Client, role: str) -> pb.WorkerLoad:
    return next(w.load for w in client.server_info().workers if w.role == role)


def aborts(http_port: int) -> dict[str, float]:
    """ref_server_pd_aborts_total by stage, from the router's metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read()
    found = re.findall(rb'ref_server_pd_aborts_total\{stage="(\w+)"\} ([\d.]+)', text)
    return {stage.decode(): float(count) for stage, count in found}


def last(stream) -> pb.GenerateResponse:
    return list(stream)[-1]


@pytest.fixture(scope="module")
def one_at_a_time(serving):
    """Instances that run one sequence each, and prefill in chunks of 4 tokens: requests
    stay in each stage long enough to be caught there."""
    config = serving.config(
        max_num_seqs=1, max_num_batched_tokens=4, num_blocks=200, max_model_len=2048
    )
    running = Deployment(config, startup_timeout=120)
    yield running
    running.stop()


def test_cancel_or_abort_at_every_stage_leaves_no_page_held(one_at_a_time, serving):
    client = Client(one_at_a_time.address)
    before = aborts(one_at_a_time.config.http_port)
    streams = []

    def send(prompt, max_tokens, request_id):
        streams.append(
            client.responses(prompt, temperature=0, max_tokens=max_tokens, request_id=request_id)
        )
        return streams[-1]

    def prefill_load(running, waiting) -> bool:
        found = load(client, "prefill")
        return found.running == running and found.waiting == waiting

    try:
        decoding = send([5, 6], 2000, "a")
        next(decoding)  # a holds the decode instance's one slot from now on
        serving.wait_until(lambda: load(client, "decode").running == 1, 5, "a decoding")
        prefilling = send([2 + i % 500 for i in range(1500)], 8, "b")  # ~400 chunks of 4
        serving.wait_until(lambda: prefill_load(1, 0), 5, "b prefilling")
        queued = send([7, 8, 9], 8, "c")
        serving.wait_until(lambda: prefill_load(1, 1), 5, "c queued behind b")
        queued.cancel()  # the client goes away while its request waits at the prefill instance
        client.abort("b")  # aborted while its prompt is being computed
        assert last(prefilling).complete.finish_reason == pb.FINISH_REASON_ABORT
        handed_off = send([9, 9, 9], 8, "d")
        assert next(handed_off).WhichOneof("payload") == "chunk"  # prefilled, waiting for room
        serving.wait_until(lambda: load(client, "prefill").held == 1, 5, "d's KV held")
        client.abort("d")
        finished = last(handed_off).complete
        assert finished.finish_reason == pb.FINISH_REASON_ABORT
        assert finished.usage.completion_tokens == 1
        decoding.cancel()  # after many chunks
        serving.wait_idle(client)
    finally:  # the next test shares these instances
        for stream in streams:
            stream.cancel()
    after = aborts(one_at_a_time.config.http_port)
    for stage, count in (("prefill", 2), ("handoff", 1), ("decode", 1)):
        assert after.get(stage, 0) - before.get(stage, 0) == count, (stage, before, after)
    # the ids are free again, and reusing them touches nothing of the ended requests
    for request_id in "abcd":
        assert client.generate(
            [7, 8, 9], temperature=0, max_tokens=3, request_id=request_id
        ).finish_reason
    serving.wait_idle(client)
    client.close()


def test_a_storm_of_aborts_then_a_request_is_served_at_once(one_at_a_time, serving):
    client = Client(one_at_a_time.address)
    streams = [
        client.responses([3 + i, 4, 5], temperature=0, max_tokens=500, request_id=f"storm-{i}")
        for i in range(64)
    ]
    next(streams[0])
    missed = set()
    for i in range(64):
        try:
            client.abort(f"storm-{i}")
        except grpc.RpcError as error:  # ended at its first token (eos), or not arrived yet
            assert error.code() == grpc.StatusCode.NOT_FOUND
            missed.add(i)
    time.sleep(0.2)
    for i in missed:  # one that had not arrived is in flight now
        with contextlib.suppress(grpc.RpcError):
            client.abort(f"storm-{i}")
    outcomes = [last(s).complete.finish_reason for s in streams]
    assert all(outcomes[i] == pb.FINISH_REASON_ABORT for i in set(range(64)) - missed)
    assert len(missed) < 8
    serving.wait_idle(client)
    start = time.monotonic()
    assert len(client.generate([5, 6, 7], temperature=0, max_tokens=4).token_ids) == 4
    assert time.monotonic() - start < 3
    client.close()


def test_a_request_that_waits_past_its_kv_lease_fails_cleanly_and_admission_is_bounded(serving):
    """Decode runs one sequence; the second request's KV is held under a lease of 1.5 s, so
    the router stops waiting for room before it runs out: RESOURCE_EXHAUSTED with a retry
    hint, never tokens from reused pages, nothing held after. Beyond max_inflight requests
    the router answers RESOURCE_EXHAUSTED at once."""
    config = serving.config(max_num_seqs=1, hold_seconds=1.5, max_inflight=2, tenant_share=1.0)
    running = Deployment(config, startup_timeout=120)
    reference = M.from_preset("tiny", seed=SEED)
    try:
        client = Client(running.address)
        first = client.responses([5, 6], temperature=0, max_tokens=400)
        next(first)
        start = time.monotonic()
        waiting = client.responses([7, 8, 9], temperature=0, max_tokens=8)
        third = time.monotonic()
        with pytest.raises(grpc.RpcError) as full:
            client.generate([1, 2, 3], temperature=0, max_tokens=2)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 requests in flight" in full.value.details()
        assert time.monotonic() - third < 1
        assert ("retry-after", "1") in full.value.trailing_metadata()
        for stream in (False, True):  # the HTTP API says so with its status, streamed or not
            body = dict(model="tiny", prompt=[1, 2, 3], max_tokens=2, stream=stream)
            url = f"http://127.0.0.1:{config.http_port}/v1/completions"
            answer = httpx.post(url, json=body, timeout=5)
            assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
            assert "2 requests in flight" in answer.json()["error"]["message"]
        tokens = []
        with pytest.raises(grpc.RpcError) as late:
            for response in waiting:
                tokens += response.chunk.token_ids
        assert late.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no decode instance had room in time" in late.value.details()
        assert 0.4 < time.monotonic() - start < 3
        want = reference.generate([[7, 8, 9]], M.SamplingParams(max_tokens=8))[0]
        assert tokens == want[:1]  # its first token, from the prefill instance, and no other
        first.cancel()
        serving.wait_idle(client)
        client.close()
    finally:
        running.stop()


def test_a_decode_instance_without_room_refuses_and_the_router_waits_for_it(serving):
    """Six pages of 16 tokens per instance, eight requests of two pages each: the decode
    instance refuses what it cannot reserve (RESOURCE_EXHAUSTED), the router retries as room
    frees, and every request completes with the reference's tokens."""
    config = serving.config(num_blocks=6, max_model_len=64)
    running = Deployment(config, startup_timeout=120)
    reference = M.from_preset("tiny", seed=SEED)
    try:
        client = Client(running.address)
        prompts = [list(range(3 + i, 23 + i)) for i in range(8)]
        want = reference.generate(prompts, M.SamplingParams(max_tokens=12))
        results = serving.generate_together(
            client, [dict(prompt=p, max_tokens=12, temperature=0) for p in prompts], timeout=60
        )
        assert [r.token_ids for r in results] == want
        serving.wait_idle(client)
        client.close()
    finally:
        running.stop()


def test_health_follows_the_instances_and_the_supervisor_restarts_them(serving, reference_ids):
    """Killing the only decode instance: the router says NOT_SERVING within a second and
    requests fail at once (UNAVAILABLE, naming why); the supervisor restarts the instance
    and the router serves again. Killing the prefill instance while a request's KV waits
    there for decode room fails that request (never a finish reason) and leaves the decode
    instance in service."""
    config = serving.config(max_num_seqs=1)
    running = Deployment(config, startup_timeout=120)
    try:
        client = Client(running.address)
        running.children[running.addresses("decode")[0]].kill()
        serving.wait_until(lambda: client.health() == "NOT_SERVING", 5, "NOT_SERVING")
        assert "no healthy decode instance" in client.server_info().problem
        with pytest.raises(grpc.RpcError) as down:
            client.generate([5, 6, 7], temperature=0, max_tokens=4, timeout=10)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "decode" in down.value.details()
        assert not re.search(r"127\.0\.0\.1|ipv4|:\d{4,5}", down.value.details())
        serving.wait_until(lambda: client.health() == "SERVING", 60, "the restarted decode")
        assert client.generate([5, 6, 7], temperature=0, max_tokens=4).token_ids == reference_ids(
            [5, 6, 7], 4
        )

        busy = client.responses([5, 6], temperature=0, max_tokens=480)
        next(busy)
        waiting = client.responses([7, 8, 9], temperature=0, max_tokens=8)
        assert next(waiting).WhichOneof("payload") == "chunk"  # its KV held at the prefill
        running.children[running.addresses("prefill")[0]].kill()
        with pytest.raises(grpc.RpcError) as lost:
            list(waiting)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill-0" in lost.value.details()
        assert not re.search(r"127\.0\.0\.1|ipv4|:\d{4,5}", lost.value.details())
        decode = next(w for w in client.server_info().workers if w.role == "decode")
        assert decode.healthy
        busy.cancel()
        serving.wait_until(lambda: client.health() == "NOT_SERVING", 5, "the prefill dropped")
        serving.wait_until(lambda: client.health() == "SERVING", 60, "the restarted prefill")
        assert client.generate([5, 6, 7], temperature=0, max_tokens=4).token_ids == reference_ids(
            [5, 6, 7], 4
        )
        serving.wait_idle(client)
        client.close()
    finally:
        running.stop()


def test_a_pull_from_an_instance_that_is_down_fails_in_bounded_time_and_one_that_is_up_serves(
    serving,
):
    """A decode side's KvPuller asks a prefill instance that is not up: after waiting
    RECONNECT_TIMEOUT for its channel, a TransferError naming the address, also when the
    router drops the instance during the wait. The instance then
    starts on that port (the channel in its reconnect backoff) and a prompt it prefilled is
    pulled at once, page for page what its stream holds."""
    config = serving.config(role="prefill", port=free_port())
    address = f"127.0.0.1:{config.port}"
    engine = Engine(
        M.from_preset("tiny", seed=SEED),
        SchedulerConfig(num_blocks=96, block_size=16, max_model_len=512),
    )

    async def run(prefill: list[subprocess.Popen]) -> None:
        puller = KvPuller(engine.runner, "restart-test")
        puller.set_peers([address])
        began = time.monotonic()
        with pytest.raises(TransferError, match=f"{address} unreachable for 5 s"):
            await puller.pull(address, "nothing", [(0, 0)], 1)
        assert RECONNECT_TIMEOUT <= time.monotonic() - began < RECONNECT_TIMEOUT + 5
        waiting = asyncio.ensure_future(puller.pull(address, "nothing", [(0, 0)], 1))
        await asyncio.sleep(1)  # waiting for the channel when the router drops the instance
        puller.set_peers([])
        with pytest.raises(TransferError, match=f"{address} (unreachable for 5 s|left the reg)"):
            await waiting  # neither cancelled nor a closed channel's UsageError
        assert not puller.pulling  # its channel closed once the pull ended
        with pytest.raises(TransferError, match=f"{address} is not a registered"):
            await puller.pull(address, "nothing", [(0, 0)], 1)
        puller.set_peers([address])
        racing = asyncio.ensure_future(puller.pull(address, "nothing", [(0, 0)], 1))
        await asyncio.sleep(0)  # the pull has its channel and awaits its first call
        puller.set_peers([])  # the router drops the instance before that call fails
        with pytest.raises(TransferError, match=f"{address} left the registered prefill"):
            await racing
        assert not puller.nixl_peers  # nothing the pull learnt is kept for a dropped address
        puller.set_peers([address])
        env = os.environ | {SECRET_ENV: "restart-test"}
        prefill.append(subprocess.Popen(serve_command(config, role="prefill"), env=env))
        await asyncio.to_thread(wait_serving, address, 120, prefill[0])
        channel = internal_channel(address, "restart-test")
        request = pb.PrefillRequest(
            request_id="r", token_ids=list(range(3, 40)), sampling=pb.SamplingParams(max_tokens=4)
        )
        first = await rpc.PrefillStub(channel).Prefill(request, timeout=60)
        kv = rpc.KvTransferStub(channel)
        sent = [m async for m in kv.Pull(pb.PullRequest(kv_handle="r"), timeout=60)]
        targets = [(i, 5 + i) for i in range(first.num_pages)]
        assert await puller.pull(address, "r", targets, first.num_pages) == GRPC
        for (_, block), page in zip(targets, sent, strict=True):
            assert engine.runner.read_page(block).view(torch.int16).numpy().tobytes() == page.data
        await channel.close()
        dialled = puller.peers[address]
        prefill[0].kill()  # a pull waits for the channel when the instance shuts down
        prefill[0].wait()
        waiting = asyncio.ensure_future(puller.pull(address, "r", targets, first.num_pages))
        await asyncio.sleep(0.5)
        began = time.monotonic()
        await puller.close()  # at the instance's shutdown: the pull stops waiting at once
        assert time.monotonic() - began < RECONNECT_TIMEOUT / 2  # not the reconnect wait
        assert dialled.get_state() == grpc.ChannelConnectivity.SHUTDOWN and not puller.peers
        assert waiting.done() and not any(puller.pulling.values())  # close waited for it
        with pytest.raises(TransferError, match="closed: shutting down"):
            await waiting
        with pytest.raises(TransferError, match="this instance is shutting down"):
            await puller.pull(address, "r", targets, first.num_pages)

    prefill = []
    try:
        asyncio.run(run(prefill))
    finally:
        for process in prefill:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def reference_ids():
    reference = M.from_preset("tiny", seed=SEED)
    return lambda prompt, n: reference.generate([prompt], M.SamplingParams(max_tokens=n))[0]


def test_instances_that_disagree_keep_the_router_out_of_service(serving):
    """A prefill instance with pages of 32 tokens beside a decode instance and a router with
    16: the router registers both, finds the mismatch, says NOT_SERVING and why, and
    answers requests UNAVAILABLE with that reason."""
    config = serving.config()
    env = {**os.environ, "REF_SERVER_INTERNAL_SECRET": "disagree"}
    ports = {"prefill": free_port(), "decode": free_port()}
    sizes = {"prefill": 32, "decode": 16}
    children = [
        subprocess.Popen(
            serve_command(config, role=role, port=port, block_size=sizes[role]), env=env
        )
        for role, port in ports.items()
    ]
    try:
        for child, port in zip(children, ports.values(), strict=True):
            wait_serving(f"127.0.0.1:{port}", 120, child)
        router = serve_command(
            config,
            role="router",
            prefill=[f"127.0.0.1:{ports['prefill']}"],
            decode=[f"127.0.0.1:{ports['decode']}"],
        )
        children.append(subprocess.Popen(router, env=env))
        client = Client(f"127.0.0.1:{config.port}")
        serving.wait_until(
            lambda: _answers(client) and client.server_info().problem, 60, "a registered router"
        )
        info = client.server_info()
        assert not info.serving and client.health() == "NOT_SERVING"
        assert "prefill-0: tiny: page_size 32, not 16" in info.problem
        with pytest.raises(grpc.RpcError) as refused:
            client.generate([5, 6, 7], temperature=0, max_tokens=4, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "page_size 32, not 16" in refused.value.details()
        client.close()
    finally:
        for child in children:
            child.kill()
            child.wait()


def _answers(client: Client) -> bool:
    try:
        client.server_info(timeout=1)
        return True
    except grpc.RpcError:
        return False
