"""The disaggregated deployment on loopback through its public gRPC API: a prefill and a decode
instance and the router as processes (`--role all`), the tiny preset on CPU; outputs against
one-process generation. Where the router sends prefills is watched through a router in the
test's own process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ref_server.model as M
from ref_server.balance import write_placement
from ref_server.client import Client, request
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services.deployment import Deployment, free_port, serve_command, wait_serving
from ref_server.services.metrics import Metrics
from ref_server.services.router import Finished, Router
from ref_server.services.security import SECRET_ENV
from ref_server.services.servers import model_args, model_facts, model_fingerprint, router_limits
from ref_server.services.workers import Expected, WorkerPool
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

SEED = 4
SERVED_PRESETS = ["tiny", "v3.2-tiny"]
REJOIN_DELAY_S = 3  # the supervisor's first restart of a lost elastic rank, in its test


@pytest.fixture(scope="module")
def reference():
    return M.from_preset("tiny", seed=SEED)


@pytest.fixture(scope="module")
def speculative_deployment(reference, serving, tmp_path_factory):
    """`--speculative mtp --draft-tokens 3`, drafting by `faults/sitecustomize.py`'s oracle."""
    folder = tmp_path_factory.mktemp("drafts")
    running = serving.drafting_by_oracle(serving.config(draft_tokens=3), reference, folder)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(request):
    """The router of the shared deployment; parametrized "mtp": of the speculative one."""
    speculative = getattr(request, "param", "plain") == "mtp"
    deployment = "speculative_deployment" if speculative else "tiny_deployment"
    with Client(request.getfixturevalue(deployment).address) as with_router:
        yield with_router


PLAIN_AND_SPECULATIVE = pytest.mark.parametrize("client", ["plain", "mtp"], indirect=True)


@pytest.mark.parametrize("preset", [*SERVED_PRESETS, "tiny+mtp"])
def test_greedy_output_equals_one_process_generation(request, deployment_of, preset):
    """Prefill and decode in two instances, the KV pages streamed between them (V3.2's with the
    indexer's keys; tiny+mtp: the MTP layer's rows too, and decoding speculatively): the tokens
    of one process, and of one engine (prefill and decode in one instance, pages of the
    deployment's size)."""
    name = preset.removesuffix("+mtp")
    reference = M.from_preset(name, seed=SEED)
    if name == preset:
        running = deployment_of(preset)
    else:
        running = request.getfixturevalue("speculative_deployment")
    config = running.config
    pages = SchedulerConfig(num_blocks=96, block_size=config.block_size, max_model_len=512)
    engine = Engine(reference, pages)
    prompts = [[5, 6, 7], list(range(2, 60)), [9] * 17, list(range(100, 230))]
    with Client(running.address) as client:
        for prompt, max_tokens in zip(prompts, (1, 5, 16, 30), strict=True):
            params = M.SamplingParams(max_tokens=max_tokens)
            want = reference.generate([prompt], params)[0]
            assert engine.generate([prompt], params)[0] == want
            got = client.generate(prompt, temperature=0, max_tokens=max_tokens, timeout=60)
            assert got.token_ids == want
            assert got.usage.prompt_tokens == len(prompt)
            assert got.usage.completion_tokens == len(want)
            assert got.finish_reason == ("length" if len(want) == max_tokens else "stop")


@pytest.mark.parametrize("v32", [False, True], ids=["v3", "v3.2"])
def test_a_checkpoint_serves_what_it_generates_in_one_process(checkpoints, tmp_path, serving, v32):
    """`--model DIR` of a DeepSeek-V3 or V3.2 checkpoint in transformers' layout (V3's config
    names an MTP module its weights lack; V3.2's indexer picks 8 tokens): the deployment's
    greedy tokens are those of the checkpoint in one process, and the router counts the bytes
    of the pages the instances' caches hold (V3.2's index keys in, no MTP layer)."""
    checkpoints.write(tmp_path, seed=1, v32=v32)
    reference = M.from_pretrained(tmp_path, dtype=torch.float32)  # as an instance on the CPU
    assert reference.args.is_sparse == v32 and reference.args.num_nextn_predict_layers == 0
    prompts = [[5, 6, 7], list(range(2, 60)), list(range(100, 230))]
    running = Deployment(serving.config(model=str(tmp_path)), startup_timeout=120)
    try:
        with Client(running.address) as client:
            for prompt in prompts:
                want = reference.generate([prompt], M.SamplingParams(max_tokens=12))[0]
                got = client.generate(prompt, temperature=0, max_tokens=12, timeout=60)
                assert got.token_ids == want
        url = f"http://127.0.0.1:{running.config.http_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        running.stop()
    pages = sum(-(-len(prompt) // 16) for prompt in prompts)
    page_bytes = M.PagedKVCache(reference.args, 1, 16).page_bytes
    moved = 'ref_server_kv_transfer_bytes_total{method="grpc"} '
    assert [float(line.split()[-1]) for line in text.splitlines() if line.startswith(moved)] == [
        pages * page_bytes
    ]


def test_a_request_without_a_deadline_succeeds(client, tiny_deployment, reference):
    """grpcurl and most clients send none: the router's ceiling applies, not an instant
    DEADLINE_EXCEEDED. Both through the client and a bare stub."""
    want = reference.generate([[5, 6, 7]], M.SamplingParams(max_tokens=6))[0]
    assert client.generate([5, 6, 7], temperature=0, max_tokens=6).token_ids == want
    with grpc.insecure_channel(tiny_deployment.address) as channel:
        stub = rpc.RouterStub(channel)
        responses = list(stub.Generate(request([5, 6, 7], temperature=0, max_tokens=6)))
    tokens = [t for r in responses if r.WhichOneof("payload") == "chunk" for t in r.chunk.token_ids]
    assert tokens == want
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH


def test_text_in_text_out_and_seeded_sampling(client, reference):
    prompt = "prefill, then decode"
    ids = reference.tokenizer.encode(prompt)
    assert ids[0] == reference.args.bos_token_id  # text is encoded as the tokenizer says: BOS first
    sampled = dict(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    first = client.generate(prompt, timeout=60, **sampled)
    again = client.generate(prompt, timeout=60, **sampled)
    assert first.token_ids == again.token_ids
    params = M.SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=12, seed=7)
    assert first.token_ids == reference.generate([ids], params)[0]
    assert first.text == reference.tokenizer.decode(first.token_ids)
    assert first.usage.prompt_tokens == len(ids)


def test_multibyte_characters_stream_intact(client, reference):
    """Streamed chunks of sampled bytes: no chunk shows a broken character, their
    concatenation is the decoded completion, and multi-byte characters do occur."""
    multibyte = 0
    for seed in range(12):
        chunks = list(client.stream("héllo € 中文", max_tokens=64, temperature=1.5, seed=seed))
        ids = [t for c in chunks for t in c.token_ids]
        text = "".join(c.text for c in chunks)
        assert text == reference.tokenizer.decode(ids)
        multibyte += sum(1 for ch in text if ord(ch) > 127 and ch != "\ufffd")
        for chunk in chunks:
            chunk.text.encode("utf-8")  # a lone surrogate or a split character would not encode
    assert multibyte > 0


@PLAIN_AND_SPECULATIVE
def test_stop_strings_end_the_text_before_them(client, reference):
    full = client.generate([5, 6, 7], temperature=0, max_tokens=40)
    stop = full.text[5:8]
    assert len(stop) == 3 and stop.strip()
    stopped = client.generate([5, 6, 7], temperature=0, max_tokens=40, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    streamed = "".join(
        c.text for c in client.stream([5, 6, 7], temperature=0, max_tokens=40, stop=[stop])
    )
    assert streamed == stopped.text


def test_a_stop_string_in_the_only_token_makes_it_a_stop(client, reference):
    """max_tokens 1 and a stop string in that token's text: "stop", as OpenAI and vLLM say,
    not "length"."""
    for start in range(3, 300):
        prompt = [start, start + 1]
        token = reference.generate([prompt], M.SamplingParams(max_tokens=1))[0][0]
        text = reference.tokenizer.decode([token])
        if text.isprintable() and text.strip() and text != "\ufffd":
            break
    got = client.generate(prompt, temperature=0, max_tokens=1, stop=[text], timeout=60)
    assert (got.token_ids, got.text, got.finish_reason) == ([token], "", "stop")
    assert client.generate(prompt, temperature=0, max_tokens=1).text == text


def test_absent_sampling_fields_take_the_http_api_s_defaults(client, reference):
    """max_tokens 16, temperature 1 and a random seed, as over HTTP: `generate("Hello")`
    samples up to 16 tokens; with a seed, what temperature 1 samples; without one, each
    request its own draw."""
    ids = reference.tokenizer.encode("Hello")
    seeded = client.generate("Hello", seed=5, timeout=60)
    params = M.SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    want = reference.generate([ids], params)[0]
    assert seeded.token_ids == want
    assert seeded.finish_reason == ("length" if len(want) == 16 else "stop")
    unseeded = [tuple(client.generate("Hello", max_tokens=32).token_ids) for _ in range(3)]
    assert len(set(unseeded)) == 3


def test_64_concurrent_streams_are_all_correct(client, reference, serving):
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(64)]
    want = reference.generate(prompts, M.SamplingParams(max_tokens=8))
    results = serving.generate_together(
        client, [dict(prompt=p, max_tokens=8, temperature=0) for p in prompts], timeout=120
    )
    assert [r.token_ids for r in results] == want


def test_256_concurrent_streams_complete_without_an_error(tiny_deployment, client, serving):
    """More streams than the decode instance runs at once and than the prefill cache holds:
    they wait for room (at the router, first come first served) and all complete."""

    async def run() -> list:
        async with grpc.aio.insecure_channel(tiny_deployment.address) as channel:
            stub = rpc.RouterStub(channel)

            async def one(i: int):
                message = request(
                    list(range(3 + i % 50, 20 + i % 50)), temperature=0, max_tokens=12
                )
                try:
                    return [r async for r in stub.Generate(message)][-1]
                except grpc.aio.AioRpcError as error:
                    return error.code()

            return await asyncio.gather(*(one(i) for i in range(256)))

    outcomes = asyncio.run(run())
    errors = [o for o in outcomes if not isinstance(o, pb.GenerateResponse)]
    assert errors == []
    assert all(o.WhichOneof("payload") == "complete" for o in outcomes)
    serving.wait_idle(client)


def test_aborts_right_after_the_first_chunk_leave_nothing_running(tiny_deployment, client, serving):
    """100 streams, each aborted by Router.Abort as its first chunk arrives: the decode calls
    are cancelled while the decode instance admits them, and still nothing stays reserved,
    running or held (the adversarial run found 12-19 sequences decoding for nobody)."""

    async def run() -> list:
        async with grpc.aio.insecure_channel(tiny_deployment.address) as channel:
            stub = rpc.RouterStub(channel)

            async def one(i: int):
                message = request([3 + i % 50, 4, 5], f"first-{i}", temperature=0, max_tokens=200)
                last = None
                async for response in stub.Generate(message):
                    if last is None:
                        await stub.Abort(pb.AbortRequest(request_id=f"first-{i}"))
                    last = response
                return last.complete.finish_reason

            return await asyncio.gather(*(one(i) for i in range(100)))

    reasons = asyncio.run(run())
    assert reasons.count(pb.FINISH_REASON_ABORT) >= 90  # the rest may stop on eos first
    # A leak never frees; 100 cancellations on a loaded 2-core CI machine once took over 5 s.
    serving.wait_idle(client, timeout=30)


@pytest.mark.parametrize("preset", SERVED_PRESETS)
def test_a_repeated_prefix_is_reported_and_skipped(deployment_of, preset):
    """The second prompt's first four pages come from the instances' prefix caches (V3.2's
    index keys with them), its tokens still one process's."""
    reference = M.from_preset(preset, seed=SEED)
    prefix = list(range(300, 364))  # four 16-token pages
    with Client(deployment_of(preset).address) as client:
        first = client.generate([*prefix, 7], temperature=0, max_tokens=4, timeout=60)
        second = client.generate([*prefix, 8, 9], temperature=0, max_tokens=4, timeout=60)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 64
    want = reference.generate([[*prefix, 8, 9]], M.SamplingParams(max_tokens=4))[0]
    assert second.token_ids == want


def recorded(call, name: str, calls: list):
    """`call`, noting (the instance's name, the message) of each call."""

    def noted(message, **kwargs):
        calls.append((name, message))
        return call(message, **kwargs)

    return noted


def test_a_shared_prefix_goes_where_it_is_cached_without_asking_the_instances(serving):
    """Two prefill instances and a router in this process, to see where it sends prefills:
    two prompts sent together spread over both; then a prompt sharing the second one's
    prefix goes where that is cached (the least loaded instance would be the first, by its
    name), and one sharing the first one's goes there, both finding their prefix cached.
    The router never calls PrefixMatch."""
    config = serving.config(prefill_instances=2)
    facts, tokenizer = model_facts(config)
    args = model_args(config)
    expected = Expected(
        model_fingerprint(config), args.num_hidden_layers, config.block_size, args.cache_width
    )
    first, second = list(range(100, 148)), list(range(200, 248))  # three 16-token pages each
    served, asked, metrics = [], [], Metrics()

    async def run() -> list[int]:
        pool = WorkerPool(
            running.addresses("prefill"),
            running.addresses("decode"),
            expected,
            running.env[SECRET_ENV],
            on_update=lambda: None,
            interval=config.health_interval_s,
        )
        for worker in pool.of("prefill"):
            stub = worker.prefill
            stub.Prefill = recorded(stub.Prefill, worker.name, served)
            stub.PrefixMatch = recorded(stub.PrefixMatch, worker.name, asked)
        router = Router(pool, facts, tokenizer, metrics, router_limits(config))

        async def cached_tokens(prompt: list[int]) -> int:
            params = M.SamplingParams(max_tokens=2)
            submission = router.submission(prompt, params, [], f"{prompt[0]}-{len(prompt)}", "test")
            events = [e async for e in router.generate(submission)]
            assert isinstance(events[-1], Finished), events
            return events[-1].usage.cached_tokens

        await pool.start()
        try:
            assert pool.problem == ""
            together = await asyncio.gather(cached_tokens([*first, 5]), cached_tokens([*second, 5]))
            return [
                *together,
                await cached_tokens([*second, 6, 7]),
                await cached_tokens([*first, 6, 7]),
            ]
        finally:
            await router.close()
            await pool.close()

    running = Deployment(config, startup_timeout=120)
    try:
        assert asyncio.run(run()) == [0, 0, 48, 48]
    finally:
        running.stop()
    assert [(m.token_ids[0], name) for name, m in served] == [
        (100, "prefill-0"),
        (200, "prefill-1"),
        (200, "prefill-1"),
        (100, "prefill-0"),
    ]
    assert asked == []
    routes = "ref_server_prefill_routes_total"
    assert metrics.registry.get_sample_value(routes, {"rule": "load"}) == 2
    assert metrics.registry.get_sample_value(routes, {"rule": "prefix"}) == 2
    assert metrics.registry.get_sample_value("ref_server_predicted_cached_tokens_total") == 96


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(prompt=[], max_tokens=4), "empty prompt"),
        (dict(prompt="", max_tokens=4), "empty prompt"),
        (dict(prompt=[5], max_tokens=0), "max_tokens must be > 0"),
        (dict(prompt=[5], max_tokens=600), "max_tokens 600 is over the limit of 512"),
        (dict(prompt=list(range(2, 502)), max_tokens=20), "exceeds the context limit of 512"),
        (dict(prompt=[5], max_tokens=4, temperature=-0.5), "temperature must be finite and >= 0"),
        (dict(prompt=[5], max_tokens=4, temperature=float("nan")), "temperature must be finite"),
        (dict(prompt=[5], max_tokens=4, temperature=float("inf")), "temperature must be finite"),
        (dict(prompt=[5], max_tokens=4, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(prompt=[5], max_tokens=4, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(prompt=[5], max_tokens=4, top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(prompt=[5], max_tokens=4, top_k=-1), "top_k must be >= 0"),
        (dict(prompt=[9999], max_tokens=4), r"token id 9999 outside \[0, 512\)"),
        (
            dict(prompt="x" * 1_100_000, max_tokens=4),
            r"request of \d+ bytes is over the limit of 1048576",
        ),
    ],
)
def test_bad_requests_are_invalid_argument(client, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(timeout=30, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, caught.value.details()), caught.value.details()
    assert "Traceback" not in caught.value.details()


def test_abort_ends_the_stream_and_frees_its_pages(client, tiny_deployment, serving):
    stream = client.responses(
        [5, 6], temperature=0, max_tokens=400, request_id="abort-me", timeout=60
    )
    first = next(stream)
    assert first.request_id == "abort-me" and first.WhichOneof("payload") == "chunk"
    client.abort("abort-me")
    last = list(stream)[-1]
    assert last.complete.finish_reason == pb.FINISH_REASON_ABORT
    assert 1 <= last.complete.usage.completion_tokens < 400
    with pytest.raises(grpc.RpcError) as caught:
        client.abort("nobody")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    serving.wait_idle(client)


def test_a_client_aborts_only_its_own_requests(client, tiny_deployment, serving):
    stream = client.responses([5, 6], temperature=0, max_tokens=300, request_id="mine", timeout=60)
    next(stream)
    # another connection (channels of one process share theirs unless told not to)
    options = [("grpc.use_local_subchannel_pool", 1)]
    with (
        grpc.insecure_channel(tiny_deployment.address, options=options) as channel,
        pytest.raises(grpc.RpcError) as caught,  # no API keys: not its request
    ):
        rpc.RouterStub(channel).Abort(pb.AbortRequest(request_id="mine"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    client.abort("mine")
    assert list(stream)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    serving.wait_idle(client)


def test_deadline_is_honored(client, serving):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate([5, 6], temperature=0, max_tokens=450, timeout=0.3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    serving.wait_idle(client)


def test_health_info_and_metrics(client, tiny_deployment):
    assert client.health() == "SERVING"
    assert client.health("ref_server.v1.Router") == "SERVING"
    info = client.model_info()
    assert info.vocab_size == 512 and info.max_model_len == 512 and info.eos_token_ids == [1]
    server = client.server_info()
    assert server.serving and server.problem == ""
    assert sorted(w.name for w in server.workers) == ["decode-0", "prefill-0"]
    assert all(w.healthy and not w.problem for w in server.workers)
    assert "127.0.0.1" not in str(server)  # internal addresses are not published
    client.generate([3, 4, 5], temperature=0, max_tokens=3, timeout=30)
    base = f"http://127.0.0.1:{tiny_deployment.config.http_port}"
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    for name in (
        "ref_server_time_to_first_token_seconds_bucket",
        "ref_server_time_per_output_token_seconds_count",
        "ref_server_output_tokens_total",
        "ref_server_cached_tokens_total",
        'ref_server_kv_transfer_bytes_total{method="grpc"}',  # CPU caches: through host memory
        'ref_server_worker_kv_usage{worker="decode-0"}',
        "ref_server_output_tokens_per_second",
        "ref_server_requests_in_flight",
    ):
        assert name in text, name
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{base}/anything", timeout=5)
    assert caught.value.code == 404


@pytest.mark.parametrize("client", ["mtp"], indirect=True)
def test_speculative_decoding_streams_accepted_runs_reports_them_and_frees_pages(
    client, speculative_deployment, reference, serving
):
    prompt, max_tokens = list(range(100, 230)), serving.drafted[tuple(range(100, 230))]
    want = reference.generate([prompt], M.SamplingParams(max_tokens=max_tokens))[0]
    chunks = list(client.stream(prompt, temperature=0, max_tokens=max_tokens, timeout=60))
    assert [t for c in chunks for t in c.token_ids] == want
    assert "".join(c.text for c in chunks) == reference.tokenizer.decode(want)

    def loads():  # as the router last read them
        return {w.role: w.load for w in client.server_info().workers}

    serving.wait_until(lambda: loads()["decode"].accepted_length > 0, 3, "the decode load's stats")
    assert 0.3 < loads()["decode"].draft_acceptance_rate < 1
    assert 1.3 < loads()["decode"].accepted_length <= 4
    port = speculative_deployment.config.http_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    rate = re.search(r'ref_server_worker_draft_acceptance_rate\{worker="decode-0"\} (\S+)', text)
    length = re.search(r'ref_server_worker_accepted_length\{worker="decode-0"\} (\S+)', text)
    assert 0.3 < float(rate[1]) < 1 and 1.3 < float(length[1]) <= 4
    serving.wait_idle(client)


def test_a_decode_instance_drafts_its_first_step_from_the_prompt_s_last_hidden_state(
    reference, serving, tmp_path
):
    """The pages streamed from the prefill instance bring it (`drafts_as_one_engine`)."""
    running = serving.drafting_by_oracle(serving.config(draft_tokens=3), reference, tmp_path)
    try:
        serving.drafts_as_one_engine(running, reference)
    finally:
        running.stop()


def test_instances_must_agree_on_drafting():
    """A decode instance that drafts needs the hidden state that only a prefill instance that
    drafts hands over: the router serves with neither kind of instance but its own."""
    expected = Expected("f", 3, 16, 576, speculative=True)
    info = pb.InstanceInfo(
        model="tiny", model_fingerprint="f", num_layers=3, page_size=16, cache_width=576,
        cache_dtype="bfloat16",
    )  # fmt: skip
    assert expected.problem(info, "bfloat16") == "tiny: speculative False, not True"
    info.speculative = True
    assert expected.problem(info, "bfloat16") == ""
    plain = dataclasses.replace(expected, speculative=False)
    assert plain.problem(info, None) == "tiny: speculative True, not False"


def test_reflection_lists_only_the_public_api(tiny_deployment):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(tiny_deployment.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(stub.ServerReflectionInfo(iter([ask]), timeout=10))
    names = sorted(s.name for s in answer.list_services_response.service)
    assert names == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "ref_server.v1.Router",
    ]


def test_a_dead_decode_instance_fails_its_requests_and_the_other_takes_over(reference, serving):
    running = Deployment(serving.config(decode_instances=2), startup_timeout=120)
    try:
        client = Client(running.address)
        streams = [
            client.responses([5, 6 + i], temperature=0, max_tokens=450, timeout=120)
            for i in range(2)
        ]
        for stream in streams:
            next(stream)

        def decoding() -> dict[str, int]:
            workers = client.server_info().workers
            return {w.name: w.load.running for w in workers if w.role == "decode"}

        serving.wait_until(lambda: sum(decoding().values()) == 2, 30, "both requests decoding")
        # The balancer spreads the two by the loads it last polled, so usually one each: the
        # killed instance's requests fail and the other's complete.
        placed = decoding()
        running.children[running.addresses("decode")[0]].kill()
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(list(stream)[-1].WhichOneof("payload"))
            except grpc.RpcError as error:
                outcomes.append(error.code())
        failed = outcomes.count(grpc.StatusCode.UNAVAILABLE)
        assert (failed, outcomes.count("complete")) == (placed["decode-0"], placed["decode-1"]), (
            placed,
            outcomes,
        )
        want = reference.generate([[7, 8, 9]], M.SamplingParams(max_tokens=6))[0]
        assert client.generate([7, 8, 9], temperature=0, max_tokens=6, timeout=60).token_ids == want
        serving.wait_until(
            lambda: all(w.healthy for w in client.server_info().workers),
            60,
            "the killed decode instance restarted and registered",
        )
        client.close()
    finally:
        running.stop()


def test_instances_of_two_ranks_serve_from_every_rank(reference, serving):
    serving.instances_of_two_ranks(serving.config(ranks=2), reference)


@pytest.mark.parametrize("preset", SERVED_PRESETS)
def test_instances_of_two_ranks_serve_the_same_with_two_batch_overlap(serving, preset):
    """Every step of two tokens or more runs as two overlapped microbatches on both ranks (for
    V3.2, a prefill cut inside a sequence reads the index keys its first part wrote)."""
    config = serving.config(
        preset=preset, ranks=2, two_batch="on", two_batch_decode_tokens=2,
        two_batch_prefill_tokens=2,
    )  # fmt: skip
    reference = M.from_preset(preset, seed=SEED)
    serving.instances_of_two_ranks(config, reference, batch_invariant=False)


def test_instances_of_two_ranks_draft_with_two_batch_overlap(reference, serving):
    """`--speculative mtp` on instances of two ranks with every step of two tokens or more in
    two overlapped microbatches (verify steps too), balancing their experts every 3 steps
    (the MTP module's layer with the model's): the reference's greedy tokens within the
    exchange's rounding. A rank without requests takes its experts' share of its peer's
    verify and module steps, also while the peer drafts a handed-over request's first round."""
    config = serving.config(
        ranks=2, speculative="mtp", draft_tokens=3, two_batch="on", two_batch_decode_tokens=2,
        two_batch_prefill_tokens=2, redundant_experts=2, eplb_interval=3,
    )  # fmt: skip
    serving.instances_of_two_ranks(config, reference, batch_invariant=False)


def test_instances_balance_their_experts_while_serving(reference, serving, tmp_path):
    """Instances of two ranks, each MoE layer in 10 expert slots for 8 experts, starting from
    a saved placement and placing their experts anew every 3 steps (weights moving between
    the ranks' processes): completions are the reference's greedy tokens within rounding, and
    the router shows each instance's rebalances and moved bytes."""
    placement = tmp_path / "placement.json"
    rows = [[7, 6, 5, 4, 3, 2, 1, 0, 7, 0]] * reference.args.num_moe_layers
    write_placement(placement, rows, reference.args.n_routed_experts)
    config = serving.config(
        ranks=2,
        redundant_experts=2,
        eplb_interval=3,
        expert_placement=str(placement),
        max_num_batched_tokens=24,  # prompts in chunks: prefill steps enough to rebalance
        health_interval_s=1.0,  # five processes on CI's two cores answer checks slowly
    )
    running = Deployment(config, startup_timeout=300)
    try:
        client = Client(running.address)
        prompts = [list(range(3, 3 + n)) for n in (4, 20, 70)]
        requests = [dict(prompt=p, max_tokens=12, temperature=0) for p in prompts * 2]
        for i, result in enumerate(serving.generate_together(client, requests)):
            assert serving.near_greedy(reference, prompts[i % 3], list(result.token_ids))

        def balanced():
            loads = [w.load for w in client.server_info().workers]
            return all(w.expert_rebalances > 0 and w.expert_bytes_moved > 0 for w in loads)

        serving.wait_until(balanced, 5, f"rebalancing workers: {client.server_info().workers}")
        base = f"http://127.0.0.1:{config.http_port}"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        for worker in ("prefill-0", "decode-0"):
            assert f'ref_server_worker_expert_rebalances{{worker="{worker}"}}' in text
            assert f'ref_server_worker_expert_bytes_moved{{worker="{worker}"}}' in text
        client.close()
    finally:
        running.stop()


def test_a_rank_that_dies_takes_its_instance_out_of_service(serving):
    """Two ranks of a decode instance started by hand (no supervisor): killing one, its
    sibling's loop fails within the group timeout instead of waiting for ever, and says
    NOT_SERVING."""
    config = serving.config(ranks=2, group_timeout_s=20)
    group = f"127.0.0.1:{free_port()}"
    ports = [free_port(), free_port()]
    env = {**__import__("os").environ, "REF_SERVER_INTERNAL_SECRET": "s"}
    ranks = [
        subprocess.Popen(
            serve_command(config, role="decode", port=port, rank=rank, group_address=group),
            env=env,
        )
        for rank, port in enumerate(ports)
    ]
    try:
        for port, rank in zip(ports, ranks, strict=True):
            wait_serving(f"127.0.0.1:{port}", 120, rank)
        ranks[0].kill()
        with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            serving.wait_until(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == not_serving
                ),
                60,
                "the sibling says NOT_SERVING",
            )
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_calls_to_a_stopped_instance_end_once_its_health_checks_fail(serving):
    """An instance stopped (SIGSTOP) keeps its connections open. A request whose prefill
    instance stopped moves to the other one as soon as the router drops it (two failed checks
    0.5 s apart); one streaming from a decode instance that stopped ends UNAVAILABLE, naming
    it, at that point, not at the request's 120 s deadline. Continued, both serve again."""
    config = serving.config(
        prefill_instances=2, health_interval_s=0.5, health_failures=2, request_timeout_s=120
    )
    running = Deployment(config, startup_timeout=120)
    prefill = running.children[running.addresses("prefill")[0]]  # the first pick of ties
    decode = running.children[running.addresses("decode")[0]]
    stopped_at, chunks = [], []

    def stop_decode_at_the_third_chunk(_) -> None:
        if not stopped_at and len(chunks) == 2:
            decode.send_signal(signal.SIGSTOP)
            stopped_at.append(time.monotonic())
        chunks.append(None)

    try:
        client = Client(running.address)
        prefill.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        assert len(client.generate([5, 6, 7], temperature=0, max_tokens=4).token_ids) == 4
        assert time.monotonic() - start < 10
        prefill.send_signal(signal.SIGCONT)
        with pytest.raises(grpc.RpcError) as ended:
            client.generate(
                list(range(3, 20)), temperature=0, max_tokens=200, timeout=120,
                on_chunk=stop_decode_at_the_third_chunk,
            )  # fmt: skip
        waited = time.monotonic() - stopped_at[0]
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ended.value.details() == "decode at decode-0 stopped answering its health checks"
        assert waited < 10, waited
        decode.send_signal(signal.SIGCONT)

        def every_instance_back() -> bool:
            workers = client.server_info().workers
            return client.health() == "SERVING" and all(w.healthy for w in workers)

        serving.wait_until(every_instance_back, 30, "every instance healthy again")
        assert len(client.generate([5, 6, 7], temperature=0, max_tokens=4).token_ids) == 4
        client.close()
    finally:
        prefill.send_signal(signal.SIGCONT)
        decode.send_signal(signal.SIGCONT)
        running.stop()


def test_an_elastic_instance_goes_on_over_the_rank_it_has_left_and_takes_it_back(
    monkeypatch, reference, serving
):
    """`--role all --ranks 2 --elastic`: decode rank 1 is killed while requests stream from both
    decode ranks. Its own requests end UNAVAILABLE; rank 0's complete with the reference's
    greedy tokens; the supervisor leaves rank 0 running; the router reports the instance's
    degraded size (GetServerInfo, /metrics, /health). The supervisor restarts rank 1 alone with
    --join (here REJOIN_DELAY_S after it ended, time to see the instance degraded), and the
    instance is back at 2 ranks within 60 s: the requests rank 0 decodes meanwhile, across the
    switch, all complete with the reference's tokens, and requests sent after it are decoded
    by both ranks, with the reference's tokens."""
    monkeypatch.setattr(
        "ref_server.services.deployment.RESTART_DELAYS_S", (REJOIN_DELAY_S, 2, 5, 10)
    )
    # pages for rank 0's requests and the three of 480 tokens it decodes across the switch
    config = serving.config(ranks=2, elastic=True, failure_timeout_s=10, num_blocks=160)
    running = Deployment(config, startup_timeout=300)
    try:
        client = Client(running.address)
        decode = running.addresses("decode")
        survivor = running.children[decode[0]]
        outcomes, times = {}, {}

        def run(i: int, prompt: list[int], max_tokens: int) -> None:
            times[i] = []
            try:
                result = client.generate(
                    prompt, temperature=0, max_tokens=max_tokens, timeout=120,
                    on_chunk=lambda _: times[i].append(time.monotonic()),
                )  # fmt: skip
                outcomes[i] = (prompt, list(result.token_ids), result.finish_reason)
            except grpc.RpcError as error:
                outcomes[i] = (prompt, error.code(), None)

        def start(first: int, prompts: list[list[int]], max_tokens: int) -> list[threading.Thread]:
            threads = [
                threading.Thread(target=run, args=(i, prompt, max_tokens))
                for i, prompt in enumerate(prompts, first)
            ]
            for thread in threads:
                thread.start()
            return threads

        def served(first: int, last: int, max_tokens: int) -> None:
            """Requests first..last-1 completed with the reference's greedy tokens (within
            rounding, which may choose the end of sequence early)."""
            for i in range(first, last):
                prompt, tokens, finish_reason = outcomes[i]
                assert isinstance(tokens, list), (i, tokens)
                length = len(tokens) == max_tokens
                assert finish_reason == ("length" if length else "stop"), (i, tokens)
                assert serving.near_greedy(reference, prompt, tokens), i

        def decoding() -> bool:
            workers = client.server_info().workers
            return all(w.load.running for w in workers if w.role == "decode")

        before = start(0, [list(range(3 + i, 13 + 2 * i)) for i in range(6)], 160)
        serving.wait_until(decoding, 60, "both decode ranks decoding")
        running.children[decode[1]].kill()

        def degraded(worker) -> bool:
            return worker.load.ranks == 1 and worker.load.configured_ranks == 2

        serving.wait_until(
            lambda: any(w.name == "decode-0" and degraded(w) for w in client.server_info().workers),
            30,
            "the router sees decode-0 serve with 1 of its 2 ranks",
        )
        base = f"http://127.0.0.1:{config.http_port}"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        assert 'ref_server_worker_ranks{worker="decode-0"} 1.0' in text
        assert 'ref_server_worker_configured_ranks{worker="decode-0"} 2.0' in text
        health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=5).read())
        assert {"worker": "decode-0", "ranks": 1, "configured_ranks": 2} in health["degraded"]

        across = start(6, [list(range(40 + i, 50 + 3 * i)) for i in range(3)], 480)

        def full_size() -> bool:
            workers = [w for w in client.server_info().workers if w.role == "decode"]
            return all(w.healthy and w.load.ranks == 2 for w in workers)

        serving.wait_until(
            full_size, 60, "the supervisor restarted decode rank 1 (--join): decode-0 at 2 ranks"
        )
        full_at = time.monotonic()
        after = start(9, [list(range(80 + i, 90 + 3 * i)) for i in range(3)], 64)
        serving.wait_until(decoding, 30, "both decode ranks decoding after the rank's return")
        for thread in before + across + after:
            thread.join(timeout=180)
        first = [outcomes[i][1] for i in range(6)]
        lost = [i for i, o in enumerate(first) if o == grpc.StatusCode.UNAVAILABLE]
        kept = [i for i, o in enumerate(first) if isinstance(o, list)]
        assert lost and kept and len(lost) + len(kept) == 6, first
        for i in kept:
            served(i, i + 1, 160)
        served(6, 9, 480)
        assert any(times[i][0] < full_at < times[i][-1] for i in range(6, 9)), "none across"
        served(9, 12, 64)
        health = json.loads(urllib.request.urlopen(f"{base}/health", timeout=5).read())
        assert "degraded" not in health
        assert survivor.poll() is None and running.children[decode[0]] is survivor
        client.close()
    finally:
        running.stop()


def consecutive_free_ports() -> int:
    import socket

    while True:
        port = free_port()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port + 1)) != 0:
                return port


def test_torchrun_starts_an_instance_of_two_ranks(reference, serving):
    """`torchrun --nproc-per-node 2 -m ref_server serve --role decode --port P`: two ranks in
    one group from torchrun's environment, serving on P and P + 1; with a prefill instance
    and the router, concurrent requests complete with the reference's greedy tokens."""
    settings = serving.config()
    port = consecutive_free_ports()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m"]
    decode_ranks = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    prefill = f"127.0.0.1:{free_port()}"
    env = {**__import__("os").environ, "REF_SERVER_INTERNAL_SECRET": "torchrun-test"}
    decode_command = serve_command(settings, role="decode", port=port)[2:]
    children = [
        subprocess.Popen([*torchrun, *decode_command], env=env),
        subprocess.Popen(
            serve_command(settings, role="prefill", port=int(prefill.split(":")[1])), env=env
        ),
    ]
    router = serve_command(settings, role="router", prefill=[prefill], decode=decode_ranks)
    try:
        for address in [*decode_ranks, prefill]:
            wait_serving(address, 120)
        children.append(subprocess.Popen(router, env=env))
        wait_serving(f"127.0.0.1:{settings.port}", 60, children[-1])
        with Client(f"127.0.0.1:{settings.port}") as client:
            prompts = [list(range(3, 3 + n)) for n in (6, 30, 18, 9)]
            results = serving.generate_together(
                client, [dict(prompt=p, max_tokens=10, temperature=0) for p in prompts]
            )
            for prompt, result in zip(prompts, results, strict=True):
                assert serving.near_greedy(reference, prompt, list(result.token_ids))
            assert sorted(w.name for w in client.server_info().workers) == [
                "decode-0",
                "decode-1",
                "prefill-0",
            ]
    finally:
        for child in children:
            child.terminate()
            child.wait(timeout=30)
