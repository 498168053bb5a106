"""Gating two-batch overlap: the per-rank threshold, and agreement across real gloo ranks.

The multi-rank tests start this file as a script once per rank (`python test_gating.py RANK
WORLD PORT`); each rank runs every scenario in one process group and prints its answers.
"""

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from overlap_sched.gating import MODES, Thresholds, agree, wants_overlap

# Each rank's (new tokens, mode), None for an idle rank, and the mode every rank must agree on.
# A world of 2 takes the first two ranks; the answer is the same.
SCENARIOS = {
    "all want decode": ([(64, "decode"), (300, "decode"), (100, "decode")], "decode"),
    "all want prefill": ([(512, "prefill"), (4096, "prefill"), (600, "prefill")], "prefill"),
    "one rank below threshold": ([(100, "decode"), (63, "decode"), (100, "decode")], None),
    "modes differ": ([(1000, "decode"), (1000, "prefill"), (1000, "prefill")], None),
    "an idle rank follows": ([(1000, "prefill"), (0, None), (1000, "prefill")], "prefill"),
    "idle ranks follow": ([(0, None), (70, "decode"), (0, None)], "decode"),
    "idle and one below": ([(0, None), (10, "prefill"), (2000, "prefill")], None),
    "idle and modes differ": ([(100, "decode"), (1000, "prefill"), (0, None)], None),
    "all idle": ([(0, None), (0, None), (0, None)], None),
}
LIMIT = 60  # seconds for all ranks of one world, start to finish


def wants(num_tokens, mode):
    return mode is not None and wants_overlap(num_tokens, mode)


def test_thresholds():
    assert not wants_overlap(63, "decode") and wants_overlap(64, "decode")
    assert not wants_overlap(511, "prefill") and wants_overlap(512, "prefill")
    assert not wants_overlap(0, "decode")
    custom = Thresholds(decode=2, prefill=1000)
    assert wants_overlap(2, "decode", custom) and not wants_overlap(999, "prefill", custom)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Thresholds(decode=1), "Thresholds.decode is 1: two microbatches need at least 2"),
        (lambda: Thresholds(prefill=0), "Thresholds.prefill is 0"),
        (lambda: wants_overlap(100, "mixed"), "mode must be 'decode' or 'prefill', got 'mixed'"),
        (lambda: wants_overlap(-1, "decode"), "num_tokens is -1: it cannot be negative"),
        (lambda: agree(True, "extend"), "mode must be 'decode' or 'prefill', got 'extend'"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("mode", MODES)
def test_agree_alone(mode):
    assert agree(True, mode) == mode
    assert agree(False, mode) is None
    assert agree(False, None) is None
    assert agree(True, None) is None  # an idle rank's wish does not count


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"{world} ranks")
def answers(request):
    """Every rank's answers, by scenario name."""
    return run_ranks(request.param)


@pytest.mark.parametrize("name", SCENARIOS)
def test_ranks_agree(answers, name):
    _, agreed = SCENARIOS[name]
    assert [each[name] for each in answers] == [agreed] * len(answers)


def test_a_group_of_one_rank_keeps_its_own_choice(answers):
    votes, _ = SCENARIOS["one rank below threshold"]
    own = [mode if wants(num_tokens, mode) else None for num_tokens, mode in votes]
    assert [each["alone"] for each in answers] == own[: len(answers)]


def run_ranks(world):
    """Start `world` ranks of this file; each rank's answers, or a failure with their output."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + LIMIT

    def finish(process):
        try:
            return process.communicate(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            return stdout, f"{stderr}\n(still running after {LIMIT} s: killed)"

    try:
        outputs = [finish(process) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    failed = [
        f"--- rank {rank} (exit {process.returncode}):\n{stderr}"
        for rank, (process, (_, stderr)) in enumerate(zip(ranks, outputs, strict=True))
        if process.returncode != 0
    ]
    if failed:
        pytest.fail(f"{world} gloo ranks failed:\n" + "\n".join(failed), pytrace=False)
    return [json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=20),
    )
    try:
        answers = {}
        for name, (votes, _) in SCENARIOS.items():
            num_tokens, mode = votes[rank]
            answers[name] = agree(wants(num_tokens, mode), mode, dist.group.WORLD)
        alone = [dist.new_group([r]) for r in range(world)][rank]
        num_tokens, mode = SCENARIOS["one rank below threshold"][0][rank]
        answers["alone"] = agree(wants(num_tokens, mode), mode, alone)
        print(json.dumps(answers))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(*map(int, sys.argv[1:]))
