"""Expert slots, routing to replicas, load counts and live re-placement on the GPU (`gpu`
marker): ep_comm's cuda backend, its low-latency dispatch's receive counts and decode CUDA
graphs that replay across re-placements. Ranks are processes sharing one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from ep_comm.testing import run_ranks

pytestmark = pytest.mark.gpu
SCENARIOS = str(Path(__file__).with_name("model_scenarios.py"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_balanced_experts_on_the_gpu_serve_as_one_process(world, checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=21, hidden_size=128)
    scenario = "balanced_experts_serve_as_one_process"
    run_ranks(world, SCENARIOS, scenario, str(tmp_path), "cuda", limit=600)
