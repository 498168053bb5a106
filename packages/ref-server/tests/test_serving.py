"""The disaggregated deployment on loopback: a prefill and a decode instance as processes, the
router in the test process; outputs against one-process generation (CPU, tiny preset)."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import ref_server.model as M
from ref_server.services.client import Client, request
from ref_server.services.deployment import (
    Deployment,
    ServeConfig,
    free_port,
    instance_command,
    start_router,
    wait_serving,
)
from ref_server.services.metrics import Metrics
from ref_server.services.router import ModelFacts, RouterService
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

SEED = 4


def config(**overrides) -> ServeConfig:
    values = dict(
        port=free_port(),
        metrics_port=free_port(),
        preset="tiny",
        seed=SEED,
        device="cpu",
        num_blocks=96,
        block_size=16,
        max_model_len=512,
        max_num_seqs=80,
    )
    return ServeConfig(**(values | overrides))


@pytest.fixture(scope="module")
def deployment():
    running = Deployment(config(), startup_timeout=120)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(deployment):
    with_router = Client(deployment.address)
    yield with_router
    with_router.close()


@pytest.fixture(scope="module")
def reference():
    return M.from_preset("tiny", seed=SEED)


def test_greedy_output_equals_one_process_generation(client, reference):
    prompts = [[5, 6, 7], list(range(2, 60)), [9] * 17, list(range(100, 230))]
    for prompt, max_tokens in zip(prompts, (1, 5, 16, 30), strict=True):
        want = reference.generate([prompt], M.SamplingParams(max_tokens=max_tokens))[0]
        got = client.generate(request(token_ids=prompt, max_tokens=max_tokens), timeout=60)
        assert got.token_ids == want
        assert got.usage.prompt_tokens == len(prompt)
        assert got.usage.completion_tokens == len(want)
        expected = "FINISH_REASON_LENGTH" if len(want) == max_tokens else "FINISH_REASON_STOP"
        assert got.finish_reason == expected


def test_text_in_text_out_and_seeded_sampling(client, reference):
    prompt = "prefill, then decode"
    ids = reference.tokenizer.encode(prompt)
    sampled = dict(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    first = client.generate(request(text=prompt, **sampled), timeout=60)
    again = client.generate(request(text=prompt, **sampled), timeout=60)
    assert first.token_ids == again.token_ids
    params = M.SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=12, seed=7)
    assert first.token_ids == reference.generate([ids], params)[0]
    assert first.text == reference.tokenizer.decode(first.token_ids)


def test_64_concurrent_streams_are_all_correct(client, reference, serving_checks):
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(64)]
    want = reference.generate(prompts, M.SamplingParams(max_tokens=8))
    messages = [request(token_ids=p, max_tokens=8) for p in prompts]
    results = serving_checks.generate_together(client, messages, timeout=120)
    assert [r.token_ids for r in results] == want


def test_a_repeated_prefix_is_reported_and_skipped(client, reference):
    prefix = list(range(300, 364))  # four 16-token pages
    first = client.generate(request(token_ids=[*prefix, 7], max_tokens=4), timeout=60)
    second = client.generate(request(token_ids=[*prefix, 8, 9], max_tokens=4), timeout=60)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 64
    want = reference.generate([[*prefix, 8, 9]], M.SamplingParams(max_tokens=4))[0]
    assert second.token_ids == want


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(token_ids=[], max_tokens=4), "empty prompt"),
        (dict(text="", max_tokens=4), "empty prompt"),
        (dict(token_ids=[5], max_tokens=0), "max_tokens must be > 0"),
        (dict(token_ids=[5], max_tokens=600), "max_tokens 600 is over the limit of 512"),
        (dict(token_ids=list(range(2, 502)), max_tokens=20), "exceeds the context limit of 512"),
        (dict(token_ids=[5], max_tokens=4, temperature=-0.5), "temperature must be >= 0"),
        (dict(token_ids=[5], max_tokens=4, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(token_ids=[5], max_tokens=4, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(token_ids=[5], max_tokens=4, top_k=-1), "top_k must be >= 0"),
        (dict(token_ids=[9999], max_tokens=4), r"token id 9999 outside \[0, 512\)"),
        (
            dict(text="x" * 1_100_000, max_tokens=4),
            r"request of \d+ bytes is over the limit of 1048576",
        ),
    ],
)
def test_bad_requests_are_invalid_argument(client, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(request(**fields), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details()
    import re

    assert re.search(message, caught.value.details()), caught.value.details()


def test_abort_frees_the_request_and_unknown_ids_are_rejected(client, deployment):
    stream = client.stream(request(token_ids=[5, 6], max_tokens=400, request_id="abort-me"), 60)
    first = next(stream)
    assert first.request_id == "abort-me" and first.WhichOneof("payload") == "chunk"
    client.router.Abort(pb.AbortRequest(request_id="abort-me"), timeout=10)
    last = list(stream)[-1]
    assert last.complete.finish_reason == pb.FINISH_REASON_ABORT
    with pytest.raises(grpc.RpcError) as caught:
        client.router.Abort(pb.AbortRequest(request_id="nobody"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the decode instance freed its pages
        info = client.router.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if all(w.load.kv_usage == 0 for w in info.workers if w.role == "decode"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"KV pages still in use: {info}")


def test_deadline_is_honored(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(request(token_ids=[5, 6], max_tokens=450), timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_health_info_and_metrics(client, deployment):
    health = health_pb2_grpc.HealthStub(client.channel)
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    info = client.router.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.vocab_size == 512 and info.max_model_len == 512 and info.eos_token_ids == [1]
    workers = client.router.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).workers
    assert sorted(w.role for w in workers) == ["decode", "prefill"] and all(
        w.healthy for w in workers
    )
    client.generate(request(token_ids=[3, 4, 5], max_tokens=3), timeout=30)
    url = f"http://127.0.0.1:{deployment.config.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in (
        "ref_server_time_to_first_token_seconds_bucket",
        "ref_server_time_per_output_token_seconds_count",
        "ref_server_output_tokens_total",
        "ref_server_cached_tokens_total",
        'ref_server_kv_transfer_bytes_total{method="grpc"}',  # CPU caches: through host memory
        "ref_server_worker_kv_usage",
        "ref_server_output_tokens_per_second",
    ):
        assert name in text, name


def test_a_dead_decode_instance_fails_its_requests_and_the_other_takes_over(reference):
    running = Deployment(config(decode_instances=2), startup_timeout=120)
    try:
        client = Client(running.address)
        # one long request per decode instance (the balancer spreads them)
        streams = [
            client.stream(request(token_ids=[5, 6 + i], max_tokens=450), 120) for i in range(2)
        ]
        for stream in streams:
            next(stream)
        time.sleep(0.5)
        decode_addresses = [w.address for w in running.router.workers if w.role == "decode"]
        victim = running.children[decode_addresses[0]]
        victim.kill()
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(list(stream)[-1].WhichOneof("payload"))
            except grpc.RpcError as error:
                outcomes.append(error.code())
        assert grpc.StatusCode.UNAVAILABLE in outcomes
        assert "complete" in outcomes  # the other instance's request finished
        want = reference.generate([[7, 8, 9]], M.SamplingParams(max_tokens=6))[0]
        assert (
            client.generate(request(token_ids=[7, 8, 9], max_tokens=6), timeout=60).token_ids
            == want
        )
        client.close()
    finally:
        running.stop()


def test_instances_of_two_ranks_serve_from_every_rank(reference, serving_checks):
    serving_checks.instances_of_two_ranks(config(ranks=2), reference)


def test_a_rank_that_dies_takes_its_instance_out_of_service():
    """Killing one rank of a two-rank decode instance: its sibling's loop fails within the
    group timeout instead of waiting for it forever, and says NOT_SERVING."""
    running = Deployment(config(ranks=2, group_timeout_s=20), startup_timeout=180)
    try:
        first, sibling = [w.address for w in running.router.workers if w.role == "decode"]
        running.children[first].kill()
        with grpc.insecure_channel(sibling) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            status = None
            while (
                time.monotonic() < deadline and status != health_pb2.HealthCheckResponse.NOT_SERVING
            ):
                time.sleep(0.5)
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        running.stop()


def consecutive_free_ports() -> int:
    while True:
        port = free_port()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port + 1)) != 0:
                return port


def test_torchrun_starts_an_instance_of_two_ranks(reference, serving_checks):
    """`torchrun --nproc-per-node 2 -m ref_server serve --role decode --port P`: two ranks in
    one group from torchrun's environment, serving on P and P + 1; with a prefill instance
    and the router, concurrent requests complete with the reference's greedy tokens."""
    settings = config()
    port = consecutive_free_ports()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m"]
    decode_ranks = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    prefill_port = free_port()
    children = [
        subprocess.Popen([*torchrun, *instance_command(settings, "decode", port)[2:]]),
        subprocess.Popen(instance_command(settings, "prefill", prefill_port)),
    ]
    try:
        for address in [*decode_ranks, f"127.0.0.1:{prefill_port}"]:
            wait_serving(address, 120)
        router = dataclasses.replace(
            settings, role="router", prefill=[f"127.0.0.1:{prefill_port}"], decode=decode_ranks
        )
        server, service, _ = start_router(router)
        client = Client(f"127.0.0.1:{settings.port}")
        prompts = [list(range(3, 3 + n)) for n in (6, 30, 18, 9)]
        messages = [request(token_ids=p, max_tokens=10) for p in prompts]
        results = serving_checks.generate_together(client, messages)
        for prompt, result in zip(prompts, results, strict=True):
            assert serving_checks.near_greedy(reference, prompt, list(result.token_ids))
        client.close()
        service.stop.set()
        server.stop(grace=1).wait()
    finally:
        for child in children:
            child.terminate()
            child.wait(timeout=30)


class ReportingPrefill(rpc.PrefillServicer):
    """A prefill instance that only reports: a cached prefix of some pages, and queued work."""

    def __init__(self, cached_pages: int, queued_flops: float) -> None:
        self.cached_pages, self.queued_flops = cached_pages, queued_flops

    def PrefixMatch(self, request, context):
        return pb.PrefixMatchResponse(cached_pages=min(self.cached_pages, len(request.page_hashes)))

    def GetLoad(self, request, context):
        return pb.WorkerLoad(queued_flops=self.queued_flops)


def test_the_prefill_balancer_prefers_a_cached_prefix_then_the_least_queued_work():
    reporting = [ReportingPrefill(0, 5e12), ReportingPrefill(0, 1e9), ReportingPrefill(2, 9e12)]
    servers, addresses = [], []
    for servicer in reporting:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc.add_PrefillServicer_to_server(servicer, server)
        health_service = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    facts = ModelFacts("fake", 512, 512, 3, 1, [], page_size=16, page_bytes=1)
    router = RouterService(addresses, ["127.0.0.1:1"], facts, None, Metrics())
    try:
        prompt = list(range(100))
        assert router.pick_prefill(prompt).address == addresses[2]  # two pages cached there
        reporting[2].cached_pages = 0
        assert router.pick_prefill(prompt).address == addresses[1]  # the least work queued
        reporting[1].queued_flops = 6e12
        assert router.pick_prefill(prompt).address == addresses[0]
    finally:
        router.stop.set()
        for server in servers:
            server.stop(grace=0)
