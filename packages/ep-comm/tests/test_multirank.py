"""Dispatch and combine across real gloo process groups of 2, 3 and 4 spawned processes."""

from pathlib import Path

import pytest

from ep_comm.testing import run_ranks

SCENARIOS = str(Path(__file__).with_name("scenarios.py"))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_combine_roundtrip(world):
    run_ranks(world, SCENARIOS, "roundtrip", "cpu", 1000 + world)


def test_a_rank_that_neither_sends_nor_receives():
    run_ranks(2, SCENARIOS, "roundtrip", "cpu", 1009, "torch", True)


@pytest.mark.parametrize(
    "case",
    [
        "expert id out of range",
        "hidden differs",
        "wrong dtype",
        "weights shape",
        "num_worst_tokens too small",
        "combine rows",
    ],
)
def test_bad_arguments_raise_on_every_rank(case):
    run_ranks(3, SCENARIOS, "rejected_everywhere", case)


def test_an_allocation_failure_on_one_rank_raises_on_every_rank():
    run_ranks(2, SCENARIOS, "allocation_fails_on_one_rank", limit=120)


def test_absent_peer_times_out_with_rank_and_step():
    run_ranks(2, SCENARIOS, "absent_peer", limit=60)


def test_a_rank_late_from_its_kernels_is_waited_for():
    run_ranks(2, SCENARIOS, "late_from_the_device", limit=60)
