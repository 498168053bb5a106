"""The deployment on the GPU (`gpu` marker): the V2-Lite-sized preset in a prefill and a decode
instance sharing the GPU, KV pages copied between them through CUDA IPC."""

from __future__ import annotations

import urllib.request

import pytest
import torch

import ref_server.model as M
from ref_server.services.client import Client, request
from ref_server.services.deployment import Deployment, ServeConfig, free_port

pytestmark = pytest.mark.gpu

SEED = 6


def test_v2_lite_deployment_matches_one_process_and_moves_kv_through_cuda_ipc(serving_checks):
    config = ServeConfig(
        port=free_port(), metrics_port=free_port(), preset="v2-lite", seed=SEED, device="cuda"
    )
    deployment = Deployment(config, startup_timeout=400)
    try:
        client = Client(deployment.address)
        reference = M.from_preset("v2-lite", seed=SEED, dtype=torch.bfloat16, device="cuda")
        g = torch.Generator().manual_seed(SEED)
        # one request at a time: prefill and decode run at batch 1 as `generate` does, so the
        # greedy tokens agree exactly (pages of 64: the prompts end inside, at and past a page)
        for length, max_tokens in ((5, 12), (64, 8), (300, 16)):
            prompt = torch.randint(2, 100_000, (length,), generator=g).tolist()
            want = reference.generate([prompt], M.SamplingParams(max_tokens=max_tokens))[0]
            got = client.generate(request(token_ids=prompt, max_tokens=max_tokens), timeout=120)
            assert got.token_ids == want
        del reference

        messages = [  # sampled, of many lengths: decode batches of many sizes
            request(text=f"request {i} " * (i + 1), max_tokens=32, temperature=0.8, seed=i)
            for i in range(48)
        ]
        results = serving_checks.generate_together(client, messages, timeout=300)
        assert all(1 <= r.usage.completion_tokens <= 32 for r in results)
        url = f"http://127.0.0.1:{config.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'ref_server_kv_transfer_bytes_total{method="cuda_ipc"}' in text
        assert 'method="grpc"' not in text
        client.close()
    finally:
        deployment.stop()


def test_instances_of_two_ranks_on_the_gpu_exchange_through_ep_comm_cuda(serving_checks):
    """The tiny preset in four processes sharing the GPU: each instance's two ranks move MoE
    rows with ep_comm's cuda backend (CUDA IPC), an idle rank in lockstep with a busy one."""
    config = ServeConfig(
        port=free_port(),
        metrics_port=free_port(),
        preset="tiny",
        seed=SEED,
        device="cuda",
        ranks=2,
        num_blocks=96,
        block_size=16,
        max_model_len=512,
    )
    reference = M.from_preset("tiny", seed=SEED, dtype=torch.bfloat16, device="cuda")
    serving_checks.instances_of_two_ranks(config, reference, batch_invariant=False)
