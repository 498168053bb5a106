"""The same scenarios with CUDA tensors: 2, 4 and 8 processes sharing one GPU. The process
group is gloo (NCCL refuses two ranks on one device): the torch backend moves CUDA tensors
through the host, the cuda backend bootstraps over gloo and then moves them by CUDA IPC."""

from pathlib import Path

import pytest
import torch

from ep_comm.testing import run_ranks

SCENARIOS = str(Path(__file__).with_name("scenarios.py"))
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["cuda", "torch"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_roundtrip_with_cuda_tensors(world, backend):
    """Received rows, ids and weights exact (BF16 and FP8), combine against float64: both
    backends meet the same exact expectations, so they agree row by row."""
    run_ranks(world, SCENARIOS, "roundtrip", "cuda", 2000 + world, backend, limit=600)


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_async_flags_give_the_plain_result(backend):
    assert torch.cuda.is_available()
    run_ranks(4, SCENARIOS, "async_paths", backend, limit=600)


def test_cuda_backend_reports_an_absent_peer():
    run_ranks(2, SCENARIOS, "absent_peer_on_gpu", limit=120)
