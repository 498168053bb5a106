"""The low-latency mode's cuda backend (NVSHMEM) on one GPU shared by 2, 4 and 8 processes,
against the expected rows and combine sums and against the torch backend. The process group is
gloo (NCCL refuses two ranks on one GPU); NVSHMEM bootstraps over it and runs its PEs in
"limited MPG" mode (several PEs per GPU without MPS)."""

import os
from pathlib import Path

import pytest
import torch

from ep_comm import nvshmem
from ep_comm.testing import run_ranks

SCENARIOS = str(Path(__file__).with_name("ll_gpu_scenarios.py"))
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def built_once():
    """Build the kernels here, once, rather than in every spawned rank at the same time."""
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    assert torch.cuda.is_available()
    nvshmem.build_library()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_dispatch_and_combine_match_the_expected_rows_and_the_torch_backend(world):
    run_ranks(world, SCENARIOS, "roundtrip", "cuda", ["cuda", "torch"], 300 + world, limit=300)


@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("world", [2, 8])
def test_cuda_graphs_replay_with_new_inputs_and_token_counts(world, hooks):
    run_ranks(world, SCENARIOS, "cuda_graph", hooks, limit=300)


@pytest.mark.parametrize("graph", [False, True])
def test_a_late_rank_times_out_poisons_and_the_buffer_recovers(graph):
    run_ranks(2, SCENARIOS, "late_rank", graph, limit=300)


def test_a_layout_larger_than_the_buffer_is_refused():
    run_ranks(2, SCENARIOS, "too_small", limit=120)
