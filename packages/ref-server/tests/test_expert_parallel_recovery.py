"""Expert-parallel decode through ep_comm's low-latency mode (its torch backend over gloo here),
the experts' packed path it feeds, and what an instance does when an exchange fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ep_comm.testing import run_ranks
from ref_server.model.moe import Experts

SCENARIOS = str(Path(__file__).with_name("model_scenarios.py"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_match_the_expert_loop(dtype):
    """Tokens packed per expert as a low-latency dispatch leaves them (the first count[e] rows
    of expert e, the rest garbage), through `Experts.packed`, then weighted and summed per
    token: the looped path's result."""
    g = torch.Generator().manual_seed(8)
    experts = Experts(4, 64, 32).to(dtype)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2)
    tokens, k, rows = 10, 2, 16
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(tokens)]) - 2  # <0: away
    ids = ids.clamp(min=-1)
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    packed = torch.randn(4, rows, 64, generator=g).to(dtype)
    where = {}
    for e in range(4):
        token, slot = (ids == e).nonzero(as_tuple=True)
        packed[e, : len(token)] = x[token]
        where[e] = (token, slot)
    out = experts.packed(packed)
    assert out.shape == (4, rows, 64)
    summed = torch.zeros(tokens, 64, dtype=torch.float32)
    for e, (token, slot) in where.items():
        summed.index_add_(0, token, out[e, : len(token)].float() * weights[token, slot, None])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    want = experts.looped(x, ids, weights).float()
    torch.testing.assert_close(summed, want, rtol=tolerance, atol=tolerance)


@pytest.fixture
def checkpoint(checkpoints, tmp_path):
    """hidden_size 128: the low-latency mode moves whole blocks of 128 channels."""
    checkpoints.write(tmp_path, seed=14, hidden_size=128)
    return str(tmp_path)


def test_low_latency_decode_over_two_gloo_ranks_matches_the_normal_mode(checkpoint):
    run_ranks(2, SCENARIOS, "low_latency_decode_matches_the_normal_mode", checkpoint, limit=300)
    run_ranks(2, SCENARIOS, "engines_decode_low_latency", checkpoint, limit=300)


def test_fp8_low_latency_decode_sends_fp8_rows_and_matches_the_normal_mode(checkpoint):
    scenario = "low_latency_decode_matches_the_normal_mode"
    run_ranks(2, SCENARIOS, scenario, checkpoint, "cpu", "fp8", limit=300)


def test_a_failed_exchange_is_rebuilt_and_a_failed_rebuild_stops_the_instance(checkpoint):
    run_ranks(2, SCENARIOS, "a_failed_exchange_is_rebuilt", checkpoint, limit=300)
