"""The same scenarios with CUDA tensors: 2, 4 and 8 processes sharing one GPU over gloo (NCCL
refuses two ranks on one device), so the torch backend moves CUDA tensors through the host."""

from pathlib import Path

import pytest
import torch

from ep_comm.testing import run_ranks

SCENARIOS = str(Path(__file__).with_name("scenarios.py"))
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4, 8])
def test_roundtrip_with_cuda_tensors(world):
    run_ranks(world, SCENARIOS, "roundtrip", "cuda", 2000 + world, limit=600)


def test_async_flags_give_the_plain_result():
    assert torch.cuda.is_available()
    run_ranks(4, SCENARIOS, "async_paths", limit=600)
