"""bench_elastic.py's `--layouts` counting on the CPU: the expert copies an elastic instance
moves when it loses a rank, on a layout small enough to work out by hand, and V3's expert bytes."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

from ref_server.model import PRESETS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
V3_EXPERT_BYTES = 44_050_944


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module("bench_elastic")


def test_a_v3_expert_is_three_fp8_matrices_and_their_block_scales(bench):
    # gate, up: 2048 x 7168; down: 7168 x 2048; e4m3, one fp32 scale per 128 x 128 block
    weights = 3 * 7168 * 2048
    scales = (2 * 16 * 56 + 56 * 16) * 4
    assert weights + scales == V3_EXPERT_BYTES
    assert bench.expert_slot_bytes(PRESETS["v3"]) == V3_EXPERT_BYTES


def test_the_copies_of_a_lost_rank_by_source_and_their_bytes_and_time(bench):
    """8 experts in 12 slots over 4 ranks, 2 a node (default placement: ranks hold {0,1,2},
    {3,4,5}, {6,7,0}, {1,2,3}); rank 2 is lost. The survivors (0, 1, 3; nodes 0, 0, 1) keep
    [0,1,2 | 3,4,5 | 1,2,3]; only 6 and 7 are missing, and each replaces a copy of an expert
    held twice on the survivor with the least load a copy, survivor 3 both times:
    [0,1,2 | 3,4,5 | 6,7,3], both read from the checkpoint, nothing crossing a link."""
    old = np.tile(np.arange(12) % 8, (3, 1))  # three layers alike
    received, sent = bench.lost_rank_copies(old, 4, 2, 2)
    # per survivor: (local, NVLink, RDMA, checkpoint) received; (NVLink, RDMA) sent
    assert received.tolist() == [[[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2]]] * 3
    assert sent.tolist() == [[[0, 0], [0, 0], [0, 0]]] * 3
    assert bench.only_on(old, 4, 2) == 2 * 3  # experts 6 and 7, each layer

    moved = bench.traffic(received, sent, V3_EXPERT_BYTES)
    assert moved["copies"] == 6
    assert [moved[f"from_{s}"] for s in bench.SOURCES] == [0, 0, 0, 6]
    assert moved["bytes"] == 6 * V3_EXPERT_BYTES
    assert moved["bytes_per_layer"] == 2 * V3_EXPERT_BYTES
    assert moved["busiest_survivor_bytes"] == 6 * V3_EXPERT_BYTES
    assert moved["seconds"] == pytest.approx(3 * 2 * V3_EXPERT_BYTES / 25e9, rel=1e-12)


def test_a_lost_rank_whose_experts_survivors_hold_moves_nothing(bench):
    """Rank 3 ({1,2,3}) is lost: ranks 0 and 1 hold experts 1-3 too, so the survivors keep
    [0,1,2 | 3,4,5 | 6,7,0] as they are."""
    old = np.arange(12)[None] % 8
    received, sent = bench.lost_rank_copies(old, 4, 3, 2)
    assert not received.any() and not sent.any()
    assert bench.only_on(old, 4, 3) == 0
    moved = bench.traffic(received, sent, 1000)
    assert (moved["copies"], moved["bytes"], moved["seconds"]) == (0, 0, 0)
