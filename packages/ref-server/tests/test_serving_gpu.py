"""The deployment on the GPU (`gpu` marker): instances sharing the GPU, KV pages copied between
them through CUDA IPC."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import subprocess
import time
import urllib.request

import pytest
import torch

import ref_server.model as M
from ref_server.client import Client
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services.deployment import Deployment, free_port, serve_command, wait_serving
from ref_server.services.kv_transfer import CUDA_IPC, KvPuller, TransferError
from ref_server.services.security import SECRET_ENV, internal_channel
from ref_server.services.servers import scheduler_config
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

pytestmark = pytest.mark.gpu

SEED = 6


def test_v2_lite_deployment_matches_one_process_and_moves_kv_through_cuda_ipc(serving):
    config = serving.config(
        preset="v2-lite", seed=SEED, device="cuda", num_blocks=512, block_size=64,
        max_model_len=2048, max_num_seqs=128,
    )  # fmt: skip
    # one process running the instances' engine: prefill from the same graph buckets (padded to
    # 256 tokens, a prompt may round unlike `generate`'s eager step of its own length), decode at
    # batch 1; run before the instances start, so that an 80 GB GPU holds two V2-Lite copies
    model = M.from_preset("v2-lite", seed=SEED, dtype=torch.bfloat16, device="cuda")
    one = dataclasses.replace(scheduler_config(config), num_blocks=64, max_num_seqs=1)
    reference = Engine(model, one, prefill_graph_tokens=config.prefill_graph_tokens)
    assert reference.runner.prefill_graphs.buckets[0] == 256
    g = torch.Generator().manual_seed(SEED)
    # one request at a time, so the greedy tokens agree exactly (pages of 64: the prompts end
    # inside, at and past a page)
    prompts = [
        (torch.randint(2, 100_000, (length,), generator=g).tolist(), max_tokens)
        for length, max_tokens in ((5, 12), (64, 8), (300, 16))
    ]
    wants = [reference.generate([p], M.SamplingParams(max_tokens=n))[0] for p, n in prompts]
    del reference, model
    torch.cuda.empty_cache()
    deployment = Deployment(config, startup_timeout=400)
    try:
        client = Client(deployment.address)
        for (prompt, max_tokens), want in zip(prompts, wants, strict=True):
            got = client.generate(prompt, temperature=0, max_tokens=max_tokens, timeout=120)
            assert got.token_ids == want
        requests = [  # sampled, of many lengths: decode batches of many sizes
            dict(prompt=f"request {i} " * (i + 1), max_tokens=32, temperature=0.8, seed=i)
            for i in range(48)
        ]
        results = serving.generate_together(client, requests, timeout=300)
        assert all(1 <= r.usage.completion_tokens <= 32 for r in results)
        url = f"http://127.0.0.1:{config.http_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'ref_server_kv_transfer_bytes_total{method="cuda_ipc"}' in text
        assert 'method="grpc"' not in text
        serving.wait_idle(client)
        client.close()
    finally:
        deployment.stop()


@pytest.mark.parametrize("speculative", ["off", "mtp"])
def test_instances_of_two_ranks_on_the_gpu_exchange_through_ep_comm_cuda(serving, speculative):
    """The tiny preset in four processes sharing the GPU: each instance's two ranks move MoE
    rows with ep_comm's cuda backend (CUDA IPC), an idle rank in lockstep with a busy one; with
    --speculative mtp and two-batch overlap, through verify and module steps too."""
    drafting = dict(draft_tokens=3, two_batch="on", two_batch_decode_tokens=2)
    config = serving.config(
        seed=SEED, device="cuda", ranks=2, speculative=speculative,
        **(drafting if speculative == "mtp" else {}),
    )  # fmt: skip
    reference = M.from_preset("tiny", seed=SEED, dtype=torch.bfloat16, device="cuda")
    serving.instances_of_two_ranks(config, reference, batch_invariant=False)


HAS_NIXL = importlib.util.find_spec("nixl") is not None


@pytest.mark.parametrize("preset", ["tiny", "v3.2-tiny"])
def test_kv_through_cuda_ipc_and_nixl_gives_the_tokens_of_one_engine(serving, capfd, preset):
    """Deployments on the GPU with `--kv-transfer cuda_ipc` and, where nixl is installed,
    `--kv-transfer nixl`: the greedy tokens of one engine of the instances' settings (prefill
    and decode in one process) for prompts that end inside, at and past a page, every page's
    bytes under its method (V3.2's with the indexer's keys and scales), and under nixl both
    agents registered the cache in GPU memory."""
    prompts = [list(range(2, 60)), [9] * 16, list(range(100, 230)), [5, 6, 7]]
    page_bytes = 16 * M.cache_bytes_per_token(M.PRESETS[preset])
    pages = sum(-(-len(prompt) // 16) for prompt in prompts)
    tokens = {}
    for method in ("cuda_ipc", "nixl") if HAS_NIXL else ("cuda_ipc",):
        config = serving.config(preset=preset, seed=SEED, device="cuda", kv_transfer=method)
        deployment = Deployment(config, startup_timeout=300)
        try:
            with Client(deployment.address) as client:
                tokens[method] = [
                    client.generate(prompt, temperature=0, max_tokens=12, timeout=60).token_ids
                    for prompt in prompts
                ]
            url = f"http://127.0.0.1:{config.http_port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        finally:
            deployment.stop()
        moved = f'ref_server_kv_transfer_bytes_total{{method="{method}"}} '
        assert [
            float(line.split()[-1]) for line in text.splitlines() if line.startswith(moved)
        ] == [pages * page_bytes], text
        assert 'method="grpc"' not in text
    model = M.from_preset(preset, seed=SEED, dtype=torch.bfloat16, device="cuda")
    engine = Engine(
        model, scheduler_config(config), prefill_graph_tokens=config.prefill_graph_tokens
    )
    params = M.SamplingParams(max_tokens=12)
    assert tokens["cuda_ipc"] == [engine.generate([prompt], params)[0] for prompt in prompts]
    if HAS_NIXL:
        assert tokens["nixl"] == tokens["cuda_ipc"]
        logged = "".join(capfd.readouterr())
        assert logged.count("holds the KV cache: ") == 2, logged[-3000:]  # prefill's and decode's
        assert logged.count(" MiB of VRAM") == 2
        assert logged.count("comes by a NIXL read (--kv-transfer nixl)") == 1


class SlowCopy(KvPuller):
    """Copies, then sleeps past the prefill instance's lease before it is checked."""

    delay = 0.0

    def _copy_blocks(self, layers, source, target):
        super()._copy_blocks(layers, source, target)
        time.sleep(self.delay)


def test_a_cuda_ipc_copy_that_outlasts_its_lease_is_an_error_not_wrong_kv(serving):
    """A prefill instance with a lease of 1 s; this process maps its cache and copies a
    prompt's pages into a cache of its own. On time, the copy equals the pages the gRPC
    stream carried; sleeping 2 s after the copy, Release finds the lease gone and the pull
    fails (the pages may have been reused during the copy)."""
    config = serving.config(seed=SEED, device="cuda", hold_seconds=1.0)
    port = free_port()
    env = {**os.environ, SECRET_ENV: "lease-test"}
    prefill = subprocess.Popen(serve_command(config, role="prefill", port=port), env=env)
    address = f"127.0.0.1:{port}"
    model = M.from_preset("tiny", seed=SEED, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, SchedulerConfig(num_blocks=96, block_size=16, max_model_len=512))

    async def run() -> None:
        puller = SlowCopy(engine.runner, "lease-test")
        puller.set_peers([address])
        channel = internal_channel(address, "lease-test")
        stub, kv = rpc.PrefillStub(channel), rpc.KvTransferStub(channel)
        prompt = list(range(3, 60))  # 4 pages of 16

        async def prefill_one(request_id: str) -> pb.PrefillResponse:
            sampling = pb.SamplingParams(max_tokens=4)
            message = pb.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling)
            return await stub.Prefill(message, timeout=60)

        first = await prefill_one("on-time")
        pages = [m async for m in kv.Pull(pb.PullRequest(kv_handle=first.kv_handle))]
        targets = [(i, 10 + i) for i in range(first.num_pages)]
        assert await puller.pull(address, first.kv_handle, targets, first.num_pages) == CUDA_IPC
        for (index, block), page in zip(targets, pages, strict=True):
            copied = torch.stack([layer[block, :, 0] for layer in engine.runner.cache.layers])
            sent = torch.frombuffer(bytearray(page.data), dtype=torch.int16)
            assert torch.equal(copied.cpu().view(torch.int16).flatten(), sent), index
        late = await prefill_one("late")
        puller.delay = 2.0
        with pytest.raises(TransferError, match="lease on the KV ran out during the copy"):
            await puller.pull(address, late.kv_handle, targets, late.num_pages)
        await channel.close()

    try:
        wait_serving(address, 120, prefill)
        asyncio.run(run())
    finally:
        prefill.kill()
        prefill.wait()


def test_cuda_ipc_copies_a_prompt_s_last_hidden_state_with_its_pages(serving):
    """A prefill instance that drafts with the MTP module: a prompt's pages copied through CUDA
    IPC into this process's cache are the bytes the gRPC stream carries (the module's rows, and
    the prompt's last hidden state in its last page); an engine started on them drafts before
    it verifies anything."""
    config = serving.config(seed=SEED, device="cuda", speculative="mtp", draft_tokens=3)
    port = free_port()
    env = {**os.environ, SECRET_ENV: "handoff-test"}
    prefill = subprocess.Popen(serve_command(config, role="prefill", port=port), env=env)
    address = f"127.0.0.1:{port}"
    model = M.from_preset("tiny", seed=SEED, mtp=True, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, scheduler_config(config), draft_tokens=3)
    prompt, params = list(range(3, 60)), M.SamplingParams(max_tokens=8)  # 4 pages of 16

    async def run() -> None:
        puller = KvPuller(engine.runner, "handoff-test", "cuda_ipc")
        puller.set_peers([address])
        channel = internal_channel(address, "handoff-test")
        stub, kv = rpc.PrefillStub(channel), rpc.KvTransferStub(channel)
        message = pb.PrefillRequest(
            request_id="r", token_ids=prompt, sampling=pb.SamplingParams(max_tokens=8)
        )
        first = await stub.Prefill(message, timeout=60)
        pages = [m async for m in kv.Pull(pb.PullRequest(kv_handle=first.kv_handle))]
        targets = engine.reserve(prompt, first.first_token, params, "r")
        assert [index for index, _ in targets] == list(range(first.num_pages))
        assert await puller.pull(address, first.kv_handle, targets, first.num_pages) == CUDA_IPC
        for (index, block), page in zip(targets, pages, strict=True):
            assert engine.runner.read_page(block).numpy().tobytes() == page.data, index
        hidden = engine.runner.cache.prompt_hidden[targets[-1][1]]
        assert hidden.abs().sum() > 0
        await channel.close()

    try:
        wait_serving(address, 120, prefill)
        asyncio.run(run())
    finally:
        prefill.kill()
        prefill.wait()
    seq = engine.start("r")
    assert engine.step() == [] and len(seq.drafts) == 3
    while engine.has_work():
        engine.step()
    assert len(seq.completion) == 8 and engine.speculative_stats.rounds > 0


def test_a_dead_prefill_instance_is_unmapped_and_a_restarted_one_mapped_again(serving):
    config = serving.config(seed=SEED, device="cuda")
    deployment = Deployment(config, startup_timeout=300)
    try:
        client = Client(deployment.address)

        def decode_load():
            return next(w.load for w in client.server_info().workers if w.role == "decode")

        client.generate([5, 6, 7], temperature=0, max_tokens=4, timeout=60)
        serving.wait_until(lambda: decode_load().mapped_caches == 1, 10, "prefill cache mapped")
        deployment.children[deployment.addresses("prefill")[0]].kill()
        serving.wait_until(lambda: decode_load().mapped_caches == 0, 30, "the dead cache unmapped")
        serving.wait_until(lambda: client.server_info().serving, 120, "the prefill restarted")
        assert (
            len(client.generate([5, 6, 7], temperature=0, max_tokens=4, timeout=60).token_ids) == 4
        )
        serving.wait_until(lambda: decode_load().mapped_caches == 1, 10, "the new cache mapped")
        client.close()
    finally:
        deployment.stop()
