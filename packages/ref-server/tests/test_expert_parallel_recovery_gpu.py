"""Expert-parallel decode through ep_comm's low-latency cuda backend (NVSHMEM), eager and
replayed from CUDA graphs, and an instance rebuilding a failed exchange on the GPU (`gpu`
marker): ranks are processes sharing one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from ep_comm.testing import run_ranks

pytestmark = pytest.mark.gpu
SCENARIOS = str(Path(__file__).with_name("model_scenarios.py"))


@pytest.fixture
def checkpoint(checkpoints, tmp_path):
    """hidden_size 128: the low-latency mode moves whole blocks of 128 channels."""
    checkpoints.write(tmp_path, seed=16, hidden_size=128)
    return str(tmp_path)


@pytest.mark.parametrize("weight_dtype", [None, "fp8"])
def test_low_latency_decode_on_the_cuda_backend_matches_the_normal_mode(checkpoint, weight_dtype):
    scenario = "low_latency_decode_matches_the_normal_mode"
    run_ranks(2, SCENARIOS, scenario, checkpoint, "cuda", weight_dtype, limit=600)


def test_low_latency_decode_graphs_match_the_eager_step(checkpoint):
    run_ranks(2, SCENARIOS, "low_latency_graphs_match_eager", checkpoint, limit=600)


def test_a_failed_exchange_is_rebuilt_with_its_decode_graphs(checkpoint):
    run_ranks(2, SCENARIOS, "a_failed_exchange_is_rebuilt", checkpoint, "cuda", limit=600)
