"""An elastic instance grows back: a replacement for a lost rank joins it (`serve --elastic
--join`; `Membership.wait_admitted`, `Membership.admit`), receives its share of the experts
(`regroup_experts` with a joining rank) and serves; a join that is never admitted fails."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ref_server.model as M
from ref_server.engine import FinishReason
from ref_server.model.expert_rebalance import plan_moves, regroup_slots, resize_slots
from ref_server.model.moe import Experts
from ref_server.services.deployment import free_port

HELPER = Path(__file__).with_name("elastic_join_ranks.py")
FULL_SIZE_S = 20.0  # the goal on the CPU, from the joiner's start to its admission


@pytest.fixture
def checkpoint(checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=47, hidden_size=128)
    return tmp_path


def join_ranks():
    """elastic_join_ranks.py as a module the spawned ranks import by name (pytest's importlib
    mode gives this file a name they cannot import)."""
    if str(HELPER.parent) not in sys.path:
        sys.path.insert(0, str(HELPER.parent))
    return importlib.import_module("elastic_join_ranks")


def test_a_replacement_rank_joins_and_the_instance_serves_at_full_size(checkpoint, serving):
    """Two ranks serve two requests each; member 1 is killed at its third token. Rank 0 goes
    on alone; a replacement process then joins as member 1 while rank 0 decodes two more
    requests. Every request of rank 0 completes with one process's tokens, the ones running
    across the switch included (tokens before and after it); the joiner serves two requests
    with right tokens; both ranks end with members [0, 1], two ranks, and four slots each whose
    experts together cover all eight."""
    helper = join_ranks()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{port}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    path = str(checkpoint)

    def spawn(member: int, joining: bool):
        process = context.Process(
            target=helper.serve, args=(member, 2, address, path, joining, results), daemon=True
        )
        process.start()
        return process

    processes = [spawn(0, False), spawn(1, False)]
    got = {}
    try:
        store.wait(["lost_at"], timedelta(seconds=120))
        joiner_started = time.time()
        processes.append(spawn(1, True))
        deadline = time.monotonic() + 240
        while len(got) < 2:
            member, joining, report = results.get(timeout=max(deadline - time.monotonic(), 1))
            got[member] = report
            assert joining or member == 0
        joined_at = float(store.get("joined_at"))
        store.set("finish", "")
    except (queue.Empty, dist.DistStoreError):
        pytest.fail(
            f"member 1 was not lost, or members {sorted({0, 1} - got.keys())} did not "
            "report, in time"
        )
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
    print(f"full size {joined_at - joiner_started:.1f} s after the joiner started")
    assert joined_at - joiner_started < FULL_SIZE_S
    reference = M.from_pretrained(checkpoint, dtype=torch.float32)
    expected = {0: ("first", "during", "after"), 1: ("after",)}
    for member, report in got.items():
        assert report["failure"] is None, report["failure"]
        assert report["members"] == [0, 1]
        assert report["ranks"] == 2
        assert [len(slots) for slots in report["slots"]] == [4] * len(report["slots"])
        names = {request_id.split("-")[0] for request_id in report["served"]}
        assert names == set(expected[member])
        for request_id, record in report["served"].items():
            phase = request_id.split("-")[0]
            assert record["end"] == ("done", FinishReason.LENGTH), (request_id, record["end"])
            assert len(record["tokens"]) == helper.MAX_TOKENS[phase]
            assert serving.near_greedy(reference, record["prompt"], record["tokens"]), request_id
            if phase == "during":  # running as the ranks switched
                assert min(record["times"]) < joined_at < max(record["times"]), request_id
    for layer in range(len(got[0]["slots"])):
        assert sorted(got[0]["slots"][layer] + got[1]["slots"][layer]) == list(range(8))


def test_a_join_that_is_never_admitted_fails_within_the_bound(tmp_path):
    """`serve --elastic --join` at a store where no instance runs: the process loads the
    model, waits --group-timeout-s for its admission, then exits with a clear error."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    command = [
        sys.executable, "-m", "ref_server", "serve", "--role", "decode", "--preset", "tiny",
        "--device", "cpu", "--ranks", "2", "--rank", "1", "--elastic", "--join",
        "--group-address", f"127.0.0.1:{port}", "--group-store", "external",
        "--group-timeout-s", "3", "--port", str(free_port()),
    ]  # fmt: skip
    started = time.monotonic()
    environment = os.environ | {"REF_SERVER_INTERNAL_SECRET": "s" * 32}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert "rank 1 was not admitted into the instance within 3 s" in done.stderr
    assert took < 60
    assert not store.check(["joining/1"])  # it takes its announcement back


def test_a_joining_rank_receives_its_slots_from_the_rank_that_held_them():
    """Placement for a grow: rank 0 held all 8 slots alone (a random order); with a joining
    rank at 4 slots each, where rank 0 keeps four of its experts and the joiner gets the other
    four, the moves run over 8 slots per rank: rank 0's kept experts move to its first four
    slots (copies within the rank) and the joiner's each come from rank 0's slot holding it;
    rank 0's last four slots, which then go, stay as they are."""
    old = torch.randperm(8)
    keep = torch.randperm(8)[:4]
    give = torch.tensor([e for e in range(8) if e not in keep.tolist()])
    new = torch.cat([keep, give])  # [ranks * 4]
    held, target = regroup_slots(old, [0, None], before=8, new=new)
    assert held.tolist() == old.tolist() + [-1] * 8
    assert target.tolist() == keep.tolist() + old[4:].tolist() + give.tolist() + [-1] * 4
    slot_of = {int(e): s for s, e in enumerate(old)}
    moves = {(m.to, m.source) for m in plan_moves(held, target, ranks=2)}
    expected = {(s, slot_of[int(e)]) for s, e in enumerate(keep) if slot_of[int(e)] != s}
    expected |= {(s, slot_of[int(e)]) for s, e in enumerate(old[4:], 4) if slot_of[int(e)] != s}
    expected |= {(8 + s, slot_of[int(e)]) for s, e in enumerate(give)}
    assert moves == expected
    assert all(source < 8 for _, source in moves)  # every source is rank 0's


def test_fewer_slots_keep_the_first_ones_weights():
    """resize_slots down (a rank's slots after a grow): the first slots keep their weights."""
    experts = Experts(5, 8, 4)
    for tensor in experts.parameters():
        torch.nn.init.normal_(tensor)
    first = [t[:3].clone() for t in experts.parameters()]
    resize_slots(experts, 3)
    assert experts.num_experts == 3
    for before, after in zip(first, experts.parameters(), strict=True):
        assert torch.equal(before, after)


def test_a_joining_rank_loads_every_weight_but_its_routed_experts(checkpoint):
    """Its routed experts come from the instance when it is admitted: built to join, a model
    reads every other weight from the checkpoint and holds zeros in its expert slots."""
    joining = M.from_pretrained(checkpoint, dtype=torch.float32, joining=(1, 2))
    whole = M.from_pretrained(checkpoint, dtype=torch.float32)
    theirs = whole.state_dict()
    for name, ours in joining.state_dict().items():
        if ".mlp.experts." in name:
            assert not ours.any(), name
        elif ".location." not in name:
            assert torch.equal(ours, theirs[name]), name
