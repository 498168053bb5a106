"""The same scenarios with CUDA tensors: 2, 4 and 8 processes sharing one GPU. The process
group is gloo (NCCL refuses two ranks on one device): the torch backend moves CUDA tensors
through the host, the cuda backend bootstraps over gloo and then moves them by CUDA IPC."""

from pathlib import Path

import pytest
import torch

from ep_comm.config import CONTROL_BYTES, combine_slot_bytes, dispatch_slot_bytes
from ep_comm.cuda_backend import peer_problem
from ep_comm.extension import load_extension
from ep_comm.testing import run_ranks

SCENARIOS = str(Path(__file__).with_name("scenarios.py"))
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["cuda", "torch"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_roundtrip_with_cuda_tensors(world, backend):
    """Received rows, ids and weights exact (BF16 and FP8), combine bit for bit against the
    reference order of sums: both backends meet the same exact expectations, so they agree
    row by row."""
    run_ranks(world, SCENARIOS, "roundtrip", "cuda", 2000 + world, backend, limit=600)


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_a_rank_that_neither_sends_nor_receives_on_the_gpu(backend):
    run_ranks(2, SCENARIOS, "roundtrip", "cuda", 2009, backend, True, limit=300)


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_async_flags_give_the_plain_result(backend):
    assert torch.cuda.is_available()
    run_ranks(4, SCENARIOS, "async_paths", backend, limit=600)


@pytest.mark.parametrize("world", [2, 8])
def test_dispatch_and_combine_in_a_cuda_graph(world):
    run_ranks(world, SCENARIOS, "cuda_graph", limit=600)


def test_num_worst_tokens_overflow_poisons_until_reset_and_is_reported_on_every_rank():
    run_ranks(3, SCENARIOS, "overflow_on_gpu", limit=300)


def test_an_overflowed_rank_returns_nan_rows_instead_of_stalling_its_peers(monkeypatch):
    monkeypatch.setenv("EP_COMM_OVERFLOW_RETURNS_ROWS", "1")
    run_ranks(3, SCENARIOS, "overflow_returns_nan_rows", limit=300)


def test_rings_larger_than_the_buffer_are_refused_on_every_rank():
    run_ranks(2, SCENARIOS, "buffer_too_small", limit=300)


def test_a_kernel_waiting_for_an_absent_peer_times_out():
    run_ranks(2, SCENARIOS, "absent_peer_on_gpu", limit=120)


def test_buffer_layout_constants_match_the_kernels():
    """The Python side sizes buffers with the same layout the kernels use."""
    native = load_extension().Intranode
    assert native.control_bytes() == CONTROL_BYTES
    for widths in ([512], [256, 8, 32, 16], [14336, 64, 32], [7168, 224, 128, 64]):
        assert native.dispatch_slot_bytes(widths) == dispatch_slot_bytes(widths)
    for hidden, topk in ((256, 0), (7168, 8), (4096, 3)):
        assert native.combine_slot_bytes(hidden, topk) == combine_slot_bytes(hidden, topk)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_a_peer_past_the_timeout_poisons_outputs_and_every_rank_raises(graph):
    run_ranks(2, SCENARIOS, "sleeping_peer", graph, limit=180)


def test_a_host_failure_between_kernels_drains_and_recovers():
    run_ranks(2, SCENARIOS, "allocation_fails_between_kernels", limit=180)


def test_tensors_on_another_device_are_refused_on_every_rank():
    run_ranks(2, SCENARIOS, "wrong_device", limit=120)


def test_a_peer_gpu_that_is_not_visible_rules_out_the_cuda_backend():
    mine = str(torch.cuda.get_device_properties(0).uuid)
    assert peer_problem([mine, mine], 0) is None
    problem = peer_problem([mine, "GPU-00000000-0000-0000-0000-000000000000"], 0)
    assert "rank 0 cannot see rank 1's GPU GPU-00000000" in problem
