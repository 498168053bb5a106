"""Elastic expert parallelism: an instance of gloo ranks (`elastic_ranks.py`, each in a process
of its own, the store in the test's; on the CPU, or marked gpu sharing one GPU) loses a rank in
the middle of a step and goes on over the others, and how the ranks agree on who is left
(`Membership.agree`)."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ref_server.engine import FinishReason
from ref_server.services import elastic
from ref_server.services.deployment import free_port
from ref_server.services.elastic import LeftOut, Membership

RANKS = Path(__file__).with_name("elastic_ranks.py")
FAILURE_TIMEOUT_S = 6.0
SERVING_AGAIN_S = 10.0  # the goal on the CPU, from the loss to the survivors' next token
# An instance's run, from spawning its ranks to their results (model loading and CUDA graph
# captures included): two GPU tests fit one 280 s device stage (tools/gpu/pending.sh elastic).
BUDGET_S = {"cpu": 120.0, "cuda": 100.0}
EXIT_S = 5.0  # for the ranks to exit once told to finish, before they are killed


@pytest.fixture
def checkpoint(checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=31, hidden_size=128)
    return tmp_path


def run_instance(
    path, ranks: int, victim: int, fault: str, device: str = "cpu", draft_tokens: int = 0
) -> tuple[dict, float, dict]:
    """Spawn the ranks, one of which is lost (fault "kill": SIGKILL mid-decode; "stop":
    SIGSTOP mid-prefill, then SIGCONT once the others have served again; "kill-two": as kill,
    and the next rank too, `lost_ranks`) or has its exchange fail ("fail"): each rank's results, when the fault came, and the store the ranks met in.
    Prints each rank's phases as they come; fails, naming the phase each rank was in, when
    they do not report within BUDGET_S."""
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    budget = BUDGET_S[device]
    started = time.time()
    deadline = started + budget
    serve = elastic_ranks().serve
    rest = (str(path), victim, fault, draft_tokens, device, FAILURE_TIMEOUT_S, deadline, results)
    processes = [
        context.Process(target=serve, args=(rank, ranks, f"127.0.0.1:{port}", *rest), daemon=True)
        for rank in range(ranks)
    ]
    phases = {rank: "spawning" for rank in range(ranks)}
    got = {}

    def where(rank: int) -> str:
        code = processes[rank].exitcode
        return f"rank {rank}: {phases[rank]}" + ("" if code is None else f" (exited: {code})")

    def collect(expected: set[int], waiting_for: str) -> None:
        """Results of the ranks in expected, printing phases meanwhile; fails at the deadline
        or as soon as one of them has exited without reporting."""
        while not expected <= got.keys():
            try:
                rank, kind, value = results.get(timeout=1.0)
            except queue.Empty:
                missing = expected - got.keys()
                if time.time() > deadline or any(
                    processes[r].exitcode is not None for r in missing
                ):
                    pytest.fail(
                        f"ranks {sorted(missing)} did not report {waiting_for} within "
                        f"{time.time() - started:.0f} of {budget:.0f} s; the ranks' last phases:\n"
                        + "\n".join(map(where, range(ranks)))
                    )
                continue
            if kind == "phase":
                phases[rank] = value
                print(f"[{time.time() - started:6.1f} s] rank {rank}: {value}", flush=True)
            else:
                got[rank] = value

    for process in processes:
        process.start()
    try:
        lost = lost_ranks(ranks, victim, fault)
        collect(set(range(ranks)) - lost, "their results")
        if fault == "stop":  # continued, the victim finds itself left out
            os.kill(processes[victim].pid, signal.SIGCONT)
            collect({victim}, "its result once continued (SIGCONT)")
        if not store.check(["lost_at"]):
            pytest.fail(
                f"rank {victim} never reached its fault ({fault}; no lost_at in the store): "
                + where(victim)
            )
        lost_at = float(store.get("lost_at"))
        print(f"[{lost_at - started:6.1f} s] rank {victim}: its fault ({fault})", flush=True)
    finally:
        store.set("finish", "")
        exit_by = time.time() + EXIT_S
        for process in processes:
            process.join(timeout=max(exit_by - time.time(), 0.1))
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
    return got, lost_at, store


def elastic_ranks():
    """elastic_ranks.py as a module the spawned ranks import by name: pytest's importlib mode
    gives this file a name they cannot import."""
    if str(RANKS.parent) not in sys.path:
        sys.path.insert(0, str(RANKS.parent))  # the children start with this process's path
    return importlib.import_module("elastic_ranks")


FAULTS = [pytest.param(2, "kill", id="rank2-killed"), pytest.param(0, "stop", id="rank0-stopped")]


def lost_ranks(ranks: int, victim: int, fault: str) -> set[int]:
    """The ranks a fault loses: "kill-two" loses the victim (killed mid-decode) and the rank
    after it (killed as it joins the group formed without the victim)."""
    if fault == "kill-two":
        return {victim, (victim + 1) % ranks}
    return {victim} if fault in ("kill", "stop") else set()


@pytest.mark.parametrize(("victim", "fault"), FAULTS)
def test_an_instance_goes_on_over_the_ranks_it_did_not_lose(checkpoint, serving, victim, fault):
    """Four ranks serving two requests each; rank 2 is killed (SIGKILL) in its third decode
    step, or rank 0, whose process holds nothing the others need, stops (SIGSTOP) in its first
    prefill step, in the middle of an MoE layer. The other ranks agree on who is left, take
    its experts and go on: every one of their requests completes with the tokens one process
    would give (its greedy tokens within the exchange's bf16 rounding), none is lost, the
    first token after the loss comes within the goal (killed: at once the connections close;
    stopped: within the failure timeout), and two requests each sent after the loss complete
    too. The stopped rank, continued, finds itself left out and ends its requests with that
    error."""
    check_goes_on(checkpoint, serving, 4, victim, fault, "cpu")


def test_an_exchange_that_fails_without_losing_a_rank_keeps_every_request(checkpoint, serving):
    """Rank 1's buffer reports a failure in its third decode step (as a kernel that timed out
    leaves it): every rank raises from the step's check, all four agree on themselves, go on
    over a new group and buffer, and every request completes with one process's tokens."""
    check_goes_on(checkpoint, serving, 4, 1, "fail", "cpu")


def test_a_rank_lost_before_the_new_group_forms_is_agreed_lost_too(checkpoint, serving):
    """Rank 1 is killed mid-decode and rank 2 as it joins the group formed after that (the
    others agreed it was there): their join waits the failure timeout for it, they agree again
    without it and go on over ranks 0 and 3, every request of theirs complete with one
    process's tokens."""
    check_goes_on(checkpoint, serving, 4, 1, "kill-two", "cpu")


def test_an_instance_drafting_with_the_mtp_module_goes_on_over_the_ranks_it_did_not_lose(
    serving,
):
    """As above with speculative decoding (the tiny preset's random weights and MTP module,
    two drafts a round, almost all rejected): rank 2 is killed in its third verify step; the
    others regroup (the module's experts placed with the model's) and every one of their
    requests completes with one process's tokens, the later ones too."""
    check_goes_on(None, serving, 4, 2, "kill", "cpu", draft_tokens=2)


@pytest.mark.gpu
@pytest.mark.parametrize(("victim", "fault"), FAULTS)
def test_an_instance_on_the_gpu_goes_on_over_the_ranks_it_did_not_lose(
    checkpoint, serving, victim, fault
):
    """As on the CPU, the four ranks sharing one GPU: they exchange through ep_comm's cuda
    backends (CUDA IPC for prefill, NVSHMEM for decode, whose steps replay from CUDA graphs:
    the killed rank dies just before its third decode step's replay, the others wait in that
    step's first exchange); after losing a rank the survivors' decode exchanges go through the
    torch low-latency backend (NVSHMEM starts once per process), eagerly."""
    check_goes_on(checkpoint, serving, 4, victim, fault, "cuda")


def check_goes_on(
    checkpoint, serving, ranks: int, victim: int, fault: str, device: str, draft_tokens: int = 0
) -> None:
    got, lost_at, _ = run_instance(checkpoint, ranks, victim, fault, device, draft_tokens)
    reference = elastic_ranks().model(checkpoint, draft_tokens, device)
    survivors = sorted(set(range(ranks)) - lost_ranks(ranks, victim, fault))
    bound = SERVING_AGAIN_S if fault == "kill" else FAILURE_TIMEOUT_S + SERVING_AGAIN_S
    for rank in survivors:
        result = got[rank]
        assert result["failure"] is None, result["failure"]
        assert result["members"] == survivors
        assert len(result["served"]) == 4
        for request_id, record in result["served"].items():
            assert record["end"] == ("done", FinishReason.LENGTH), (request_id, record["end"])
            assert len(record["tokens"]) == 24
            assert serving.near_greedy(reference, record["prompt"], record["tokens"]), request_id
        after = [t for r in result["served"].values() for t in r["times"] if t > lost_at]
        assert min(after) - lost_at < bound, (rank, min(after) - lost_at)
    if fault == "stop":
        left_out = got[victim]
        assert "was left out of the instance" in left_out["failure"]
        for record in left_out["served"].values():  # running, or not admitted yet
            kind, message = record["end"]
            assert kind in ("error", "refused") and "was left out" in message


@pytest.fixture
def memberships():
    """memberships(ranks, timeout): one per rank of an instance, in a store of their own
    (their heartbeats stop before it goes)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    made = []

    def make(ranks: int, timeout: float = 20.0) -> list[Membership]:
        made.extend(
            Membership(f"127.0.0.1:{port}", r, ranks, timedelta(seconds=timeout), timedelta(20))
            for r in range(ranks)
        )
        return made[-ranks:]

    yield make
    for membership in made:
        membership.close()
    time.sleep(2 * elastic.BEAT_S)
    del server


def agree_in_threads(members: list[Membership]) -> dict[int, list[int] | str]:
    """Each membership's agree(), at once, each in a thread: survivors, or LeftOut's text."""
    outcomes = {}

    def agree(m):
        try:
            outcomes[m.member] = m.agree()
        except LeftOut as error:
            outcomes[m.member] = str(error)

    threads = [threading.Thread(target=agree, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_ranks_that_all_answer_stay_members_without_waiting(memberships):
    members = memberships(3)
    started = time.monotonic()
    assert agree_in_threads(members) == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert time.monotonic() - started < 1.0
    assert [m.generation for m in members] == [1, 1, 1]


def test_a_rank_whose_heartbeat_stops_is_agreed_lost(memberships, monkeypatch):
    """Member 1 of 4 never answers and stops beating: the others wait for its beat to go
    stale (STALE_S), not for the timeout, then agree on 0, 2, 3 (ranks 0, 2, 3 before); a
    second failure then agrees among those three, member 3 lost too."""
    monkeypatch.setattr(elastic, "STALE_S", 1.0)
    members = memberships(4)
    time.sleep(0.5)  # every member has beaten
    members[1].close()
    started = time.monotonic()
    outcomes = agree_in_threads([members[0], members[2], members[3]])
    waited = time.monotonic() - started
    assert outcomes == {0: [0, 2, 3], 2: [0, 2, 3], 3: [0, 2, 3]}
    assert 1.0 <= waited < 5.0
    assert [m.members for m in members if m.member != 1] == [[0, 2, 3]] * 3
    assert [m.rank for m in (members[0], members[2], members[3])] == [0, 1, 2]
    members[3].close()
    assert agree_in_threads([members[0], members[2]]) == {0: [0, 1], 2: [0, 1]}
    assert members[2].members == [0, 2] and members[2].rank == 1


def test_a_rank_that_beats_but_never_answers_is_left_out_at_the_timeout(memberships, monkeypatch):
    """Member 2 beats but does not answer (hung in a kernel): the others decide at their
    timeout without it; when it answers later, it learns it was left out."""
    monkeypatch.setattr(elastic, "STALE_S", 0.5)
    members = memberships(3, timeout=3.0)
    started = time.monotonic()
    assert agree_in_threads(members[:2]) == {0: [0, 1], 1: [0, 1]}
    assert 3.0 <= time.monotonic() - started < 6.0
    with pytest.raises(LeftOut, match=r"rank 2 was left out .* agreed on ranks \[0, 1\] of"):
        members[2].agree()
