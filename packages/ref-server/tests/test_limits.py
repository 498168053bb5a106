"""Every request bounded (CPU): what one request may ask for (stop strings, stop ids, a request
id, prompts, choices, bytes), what one tenant may hold (its share of max_inflight; a request's
choices all or none) and what a gRPC server takes (concurrent calls, requests that do not
decode); and the router's own metrics. A router of small limits runs in the test's process
without instances: its checks come before any routing. Admission and metrics run against a
router whose instances are fakes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ref_server.services.metrics as metrics_module
import ref_server.services.router as router_module
from ref_server.client import Client
from ref_server.model import SamplingParams
from ref_server.services.config import ServeConfig
from ref_server.services.deployment import free_port
from ref_server.services.http_server import create_app
from ref_server.services.metrics import Metrics
from ref_server.services.router import Finished, Router, Tokens
from ref_server.services.security import ApiKeys
from ref_server.services.servers import model_facts, router_limits, run_router
from ref_server.v1 import serving_pb2 as pb

SMALL = dict(
    max_request_bytes=4096,
    max_inflight=8,  # a tenant's share: 4
    max_concurrent_rpcs=10,
    max_prompts=3,
    max_choices=4,
    max_stops=2,
    max_stop_length=8,
    max_stop_token_ids=3,
    max_request_id_length=8,
)


@pytest.fixture(scope="module")
def small(serving):
    """A router of SMALL limits in a thread of this process; its instances' ports are closed."""
    nobody = [f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]
    config = serving.config(prefill=nobody[0], decode=nobody[1], **SMALL)
    loop, stop = asyncio.new_event_loop(), asyncio.Event()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(run_router(config, "secret", stop),), daemon=True
    )
    thread.start()
    with Client(f"127.0.0.1:{config.port}") as client:
        serving.wait_until(
            lambda: _answers(client) or not thread.is_alive(), 30, "the router answers"
        )
        assert thread.is_alive()
        yield SimpleNamespace(config=config, client=client)
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)
    assert not thread.is_alive()


def _answers(client: Client) -> bool:
    try:
        return client.health(timeout=1) == "NOT_SERVING"  # no instances
    except grpc.RpcError:
        return False


# ---------------------------------------------------------------- one request, both APIs


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(stop=["a", "b", "c"]), r"^3 stop strings, over the limit of 2 \(max_stops\)$"),
        (
            dict(stop=["123456789"]),
            r"^a stop string of 9 characters, over the limit of 8 \(max_stop_length\)$",
        ),
        (
            dict(stop_token_ids=[4, 5, 6, 7]),
            r"^4 distinct stop_token_ids, over the limit of 3 \(max_stop_token_ids\)$",
        ),
        (dict(stop_token_ids=[3, 600]), r"^stop_token_ids: token id 600 outside \[0, 512\)$"),
        (
            dict(request_id="123456789"),
            r"^request_id of 9 characters is over the limit of 8 \(max_request_id_length\)$",
        ),
        (dict(request_id="a/b"), r"^request_id may hold only A-Z, a-z, 0-9 and \. _ : -$"),
        (
            dict(prompt="x" * 4100),
            r"^request of \d+ bytes is over the limit of 4096 \(max_request_bytes\)$",
        ),
    ],
)
def test_a_grpc_request_over_a_limit_is_invalid_argument_naming_it(small, fields, message):
    fields = dict(prompt=[5, 6], max_tokens=2) | fields
    with pytest.raises(grpc.RpcError) as refused:
        small.client.generate(timeout=10, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, refused.value.details()), refused.value.details()


def test_a_grpc_request_at_the_limits_gets_past_them(small):
    """No instance serves here: such a request is refused for that, not for its size."""
    at_limits = dict(stop=["a", "12345678"], stop_token_ids=[4, 5, 6, 5], request_id="Ab.9_:-z")
    with pytest.raises(grpc.RpcError) as refused:
        small.client.generate([5, 6], max_tokens=2, timeout=10, **at_limits)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_abort_takes_only_a_well_formed_request_id(small):
    with pytest.raises(grpc.RpcError) as refused:
        small.client.abort("x" * 200)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id of 200 characters is over the limit of 8" in refused.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        small.client.abort("ok-id")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (dict(stop=["a", "b", "c"]), r"^3 stop strings, over the limit of 2 \(max_stops\)$"),
        (dict(stop="123456789"), r"over the limit of 8 \(max_stop_length\)$"),
        (
            dict(stop_token_ids=[4, 5, 6, 7]),
            r"^4 distinct stop_token_ids, over the limit of 3 \(max_stop_token_ids\)$",
        ),
        (
            dict(prompt=["a", "b", "c", "d"]),
            r"^4 prompts, over the limit of 3 \(max_prompts\)$",
        ),
        (
            dict(prompt=["a", "b"], n=3),
            r"^6 choices \(prompts x n: 2 x 3\), over the limit of 4 \(max_choices\)$",
        ),
        (dict(n=5), r"^5 choices \(prompts x n: 1 x 5\), over the limit of 4 \(max_choices\)$"),
        (dict(prompt=[5, "a"]), "^prompt must be a string, a list of strings, a list of token"),
        (dict(prompt=[{"a": 1}]), "^prompt must be a string, a list of strings, a list of token"),
    ],
)
def test_an_http_request_over_a_limit_is_400_naming_it(small, body, message):
    body = dict(prompt=[5, 6], max_tokens=2) | body
    url = f"http://127.0.0.1:{small.config.http_port}/v1/completions"
    response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert re.search(message, response.json()["error"]["message"]), response.text


def test_an_http_request_at_the_limits_gets_past_them(small):
    body = dict(prompt=["a", "b"], n=2, stop=["a", "12345678"], stop_token_ids=[4, 5, 6])
    url = f"http://127.0.0.1:{small.config.http_port}/v1/completions"
    response = httpx.post(url, json=dict(max_tokens=2, **body), timeout=30)
    assert response.status_code == 503, response.text  # no instance: past every limit


# ---------------------------------------------------------------- what a server takes


def raw_call(address: str, method: str, payload: bytes, streaming: bool):
    """Call `method` with `payload` as the request's bytes; (status code, details)."""
    with grpc.insecure_channel(address) as channel:
        kind = channel.unary_stream if streaming else channel.unary_unary
        call = kind(method, request_serializer=bytes, response_deserializer=bytes)
        try:
            answer = call(payload, timeout=10)
            if streaming:
                list(answer)
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_requests_that_do_not_decode_are_invalid_argument(small):
    address = f"127.0.0.1:{small.config.port}"
    for method, streaming in (("Generate", True), ("Abort", False), ("GetModelInfo", False)):
        code, details = raw_call(address, f"/ref_server.v1.Router/{method}", b"\xff\xff", streaming)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert details.startswith("the request does not decode: Error parsing message"), details


def test_a_request_far_over_max_request_bytes_is_refused_as_it_arrives(small):
    """Within 64 KiB over the limit the router's check names it (above); beyond, gRPC's own
    limit refuses it before it is read whole."""
    message = pb.GenerateRequest(text="x" * (4096 + 70_000)).SerializeToString()
    code, details = raw_call(
        f"127.0.0.1:{small.config.port}", "/ref_server.v1.Router/Generate", message, True
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({len(message)} vs. {4096 + 65536})" in details


def test_a_server_serves_at_most_max_concurrent_rpcs_calls(small, serving):
    """Health watches (open to anyone, and long) count: the eleventh concurrent call is
    refused."""
    channel = grpc.insecure_channel(f"127.0.0.1:{small.config.port}")
    health = health_pb2_grpc.HealthStub(channel)
    watches = []
    try:
        for _ in range(small.config.max_concurrent_rpcs):
            watches.append(health.Watch(health_pb2.HealthCheckRequest(), timeout=30))
            next(watches[-1])  # the call runs: its first answer came
        with pytest.raises(grpc.RpcError) as refused:
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Concurrent RPC limit exceeded" in refused.value.details()
    finally:
        for watch in watches:
            watch.cancel()
    serving.wait_until(lambda: _answers(small.client), 10, "calls are taken again")
    channel.close()


# ---------------------------------------------------------------- admission, fake instances


def held_router(release: threading.Event, **limits) -> Router:
    """A router of the tiny preset whose prefill instance holds every request until `release`
    is set, then answers with its only token (max_tokens 1)."""
    config = dataclasses.replace(tiny_defaults(), **limits)
    facts, tokenizer = model_facts(config)
    router = Router(None, facts, tokenizer, Metrics(), router_limits(config))

    async def prefill(flight):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return None, pb.PrefillResponse(first_token=7, finish_reason=pb.FINISH_REASON_LENGTH)

    router._prefill = prefill
    return router


def tiny_defaults() -> ServeConfig:
    return ServeConfig(preset="tiny", device="cpu", max_model_len=512)


def keyed_app(router: Router):
    """The HTTP API over `router`, for clients with the keys alpha and beta."""
    return create_app(
        router, ApiKeys(frozenset({"alpha", "beta"})), lambda: True, router.metrics, 1 << 20
    )


def post(http: TestClient, key: str, n: int) -> httpx.Response:
    body = dict(prompt=[5, 6], max_tokens=1, n=n)
    return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def outcome(router: Router, name: str) -> float:
    count = router.metrics.registry.get_sample_value("ref_server_requests_total", {"outcome": name})
    return count or 0.0


def test_a_request_s_choices_are_admitted_all_or_none(serving):
    """Two of three slots taken: a request of two choices is refused whole (429), and none of
    its choices started, so none was cancelled either."""
    release = threading.Event()
    router = held_router(release, max_inflight=3, tenant_share=1.0)
    app = keyed_app(router)
    with TestClient(app) as http, ThreadPoolExecutor(2) as pool:
        try:
            held = pool.submit(post, http, "alpha", 2)
            serving.wait_until(lambda: len(router.inflight) == 2, 10, "two choices in flight")
            refused = post(http, "beta", 2)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["message"] == (
                "2 requests in flight; 2 more would pass the limit of 3 (max_inflight); retry later"
            )
            assert len(router.inflight) == 2
        finally:
            release.set()
        assert held.result(timeout=10).status_code == 200
        assert len(held.result().json()["choices"]) == 2
    assert outcome(router, "resource_exhausted") == 2
    assert outcome(router, "cancelled") == 0
    assert outcome(router, "ok") == 2


def test_a_tenant_holds_at_most_its_share_of_max_inflight(serving):
    """max_inflight 4, tenant_share 0.5: alpha holds two, its third is refused at once while
    beta still gets two."""
    release = threading.Event()
    router = held_router(release, max_inflight=4, tenant_share=0.5)
    app = keyed_app(router)
    with TestClient(app) as http, ThreadPoolExecutor(3) as pool:
        try:
            alpha = pool.submit(post, http, "alpha", 2)
            serving.wait_until(lambda: len(router.inflight) == 2, 10, "alpha's two in flight")
            third = pool.submit(post, http, "alpha", 1).result(timeout=10)
            assert third.status_code == 429
            assert third.json()["error"]["message"] == (
                "this client has 2 requests in flight; 1 more would pass its share of 2 "
                "(tenant_share 0.5 of max_inflight); retry later"
            )
            beta = pool.submit(post, http, "beta", 2)
            serving.wait_until(lambda: len(router.inflight) == 4, 10, "beta's two in flight")
        finally:
            release.set()
        assert [alpha.result(timeout=10).status_code, beta.result(timeout=10).status_code] == [
            200,
            200,
        ]


# ---------------------------------------------------------------- the router's metrics


def test_time_per_output_token_is_the_mean_gap_after_the_first_token(monkeypatch):
    """A prefill of 5 s, then three tokens 0.25 s apart: 0.25 s per output token, the first
    token's wait not counted in it."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(router_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    config = tiny_defaults()
    facts, tokenizer = model_facts(config)
    router = Router(None, facts, tokenizer, Metrics(), router_limits(config))

    async def prefill(flight):
        clock.now += 5.0
        return None, pb.PrefillResponse(first_token=7)

    async def decode(flight, prefill, first, text, events):
        for token in (8, 9, 10):
            clock.now += 0.25
            router._tokens(flight, text, events, [token])
        return pb.FINISH_REASON_LENGTH

    router._prefill, router._decode = prefill, decode

    async def run() -> list:
        params = SamplingParams(max_tokens=4)
        submission = router.submission([5, 6], params, [], "r", "owner")
        return [event async for event in router.generate(submission)]

    events = asyncio.run(run())
    assert [t for e in events if isinstance(e, Tokens) for t in e.token_ids] == [7, 8, 9, 10]
    assert isinstance(events[-1], Finished)
    registry = router.metrics.registry
    assert registry.get_sample_value("ref_server_time_per_output_token_seconds_sum") == 0.25
    assert registry.get_sample_value("ref_server_time_per_output_token_seconds_count") == 1
    assert registry.get_sample_value("ref_server_time_to_first_token_seconds_sum") == 5.0


def test_the_tokens_per_second_gauge_falls_to_zero_when_traffic_stops(monkeypatch):
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    metrics = Metrics()

    def rate() -> float:
        return metrics.registry.get_sample_value("ref_server_output_tokens_per_second")

    assert rate() == 0.0
    metrics.count_output(30)
    clock.now += 2.0
    metrics.count_output(50)
    assert rate() == 40.0  # 80 tokens over the 2 s since the first
    clock.now += 8.5  # the first count is 10.5 s old, the second 8.5 s
    assert rate() == 50 / 8.5
    clock.now += 2.0
    assert rate() == 0.0


def test_every_finished_request_is_one_info_line_in_the_router_s_log(monkeypatch, caplog):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(router_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    config = tiny_defaults()
    facts, tokenizer = model_facts(config)
    router = Router(None, facts, tokenizer, Metrics(), router_limits(config))

    async def prefill(flight):
        clock.now += 0.5
        return None, pb.PrefillResponse(first_token=7, finish_reason=pb.FINISH_REASON_LENGTH)

    router._prefill = prefill

    async def run() -> None:
        params = SamplingParams(max_tokens=1)
        ok = router.submission([5, 6, 7], params, [], "first", "owner")
        [_ async for _ in router.generate(ok)]
        aborted = router.generate(router.submission([5], params, [], "second", "owner"))
        router.abort("owner", "second")
        [_ async for _ in aborted]

    with caplog.at_level(logging.INFO, logger="ref_server.services.router"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.message.startswith("request ")]
    assert len(lines) == 2
    assert (
        lines[0].startswith("request 'first' (") and " ok at prefill: 3 prompt tokens" in lines[0]
    )
    assert "1 output tokens, first token 0.500 s, 0.500 s in all" in lines[0]
    assert lines[1].startswith("request 'second' (") and " abort at prefill: 1 prompt" in lines[1]
    assert "0 output tokens, first token none" in lines[1]
