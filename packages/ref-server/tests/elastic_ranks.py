"""One rank of an elastic expert-parallel instance in the elastic tests (imported by name in a
spawned process): an engine loop serving its own requests, of which `victim` is lost mid-step
(killed, or stopped and later continued by the test) or whose exchange fails. The model is a
checkpoint's, or with draft tokens the tiny preset's with its MTP module (`model`). It puts
(rank, "phase", what it does now) on `results` as it goes, and once (rank, "result", what it
served), by the test's deadline less REPORT_MARGIN_S whatever it reached."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services.elastic import Membership
from ref_server.services.engine_loop import EngineLoop

CONFIG = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256)
MAX_TOKENS = 24
REPORT_MARGIN_S = 10.0  # for the result to reach the test before its deadline
PROGRESS_S = 15.0  # between a waiting rank's reports of how far it got
DRAFTING = dataclasses.replace(M.PRESETS["tiny"], hidden_size=128, num_nextn_predict_layers=1)


def model(path: str, draft_tokens: int, device: str, **options) -> M.Model:
    """The checkpoint at path, or for an instance drafting, DRAFTING's random weights (the
    module's experts reloaded from the same seed where a rank is lost)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if draft_tokens:
        return M.from_args(DRAFTING, seed=7, dtype=dtype, device=device, **options)
    return M.from_pretrained(path, dtype=dtype, device=device, **options)


def prompts_of(rank: int, name: str) -> list[list[int]]:
    """Two prompts per rank, different on every rank and for every name."""
    first = 3 + 17 * rank + (50 if name == "later" else 0)
    return [list(range(first, first + n)) for n in (9, 30)]


def inject(runner, fault: str, store) -> None:
    """The fault, once, after noting the time in the store ("lost_at"): "kill" (SIGKILL) in this
    rank's third decode (or verify) step or "stop" (SIGSTOP) in its first prefill step, in the
    middle of it:
    an eager step in the second MoE layer's dispatch, a step replayed from a CUDA graph (decode
    on the GPU) just before the replay, once the ranks have planned it (nothing runs between a
    graph's exchanges: the others wait in its first). "fail": in its third decode step its
    buffer reports a failure, as a kernel that timed out leaves it (every rank raises
    EPCommError from the step's check). Counted in `ModelRunner.plan`, which both kinds of step
    go through."""
    plan, moe = runner.plan, runner.model.moe_layers()[1]
    dispatch = moe.op_dispatch_a
    seen = {"decode": 0, "fired": False}

    def lose() -> None:
        store.set("lost_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    def lost_in_dispatch(state):
        moe.op_dispatch_a = dispatch
        lose()
        return dispatch(state)  # continued (SIGCONT) after SIGSTOP

    def planned(batch, s_q=None):
        step = plan(batch, s_q)
        if batch is None or seen["fired"]:
            return step
        decode = batch.is_decode or s_q is not None  # a verify step: its newest and drafts
        seen["decode"] += decode
        due = not decode if fault == "stop" else seen["decode"] == 3
        if not due:
            return step
        seen["fired"] = True
        if fault == "fail":
            store.set("lost_at", repr(time.time()))
            runner.expert_parallel.buffer.failure = lambda: "injected: a kernel timed out"
        elif step.bucket:
            lose()
        else:
            moe.op_dispatch_a = lost_in_dispatch
        return step

    runner.plan = planned


def die_joining(members: Membership, store) -> None:
    """SIGKILL as this rank starts to join the group formed after the first loss: lost after
    the others agreed it was there, before the group forms."""

    def join():
        store.set("second_lost_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    members.join = join


def serve(
    rank: int,
    ranks: int,
    address: str,
    path: str,
    victim: int,
    fault: str,
    draft_tokens: int,
    device: str,
    failure_timeout: float,
    deadline: float,
    results,
) -> None:
    """Serve two requests ("first"), then two more once the instance has regrouped after the
    fault ("later"); put (rank, "result", ...) on results: each request's tokens with their
    times and how it ended, the members this rank ended with, and why it stopped or which state
    it did not reach by `deadline` (time.time()) less REPORT_MARGIN_S ("failure"). On CUDA every
    rank uses GPU 0."""
    report_by = deadline - REPORT_MARGIN_S

    def phase(what: str) -> None:
        results.put((rank, "phase", what))

    def left() -> float:
        return max(report_by - time.time(), 1.0)

    # the engine loop's and the membership's logs, told apart in the test's output
    logging.basicConfig(format=f"rank {rank} %(asctime)s %(name)s: %(message)s")
    if device == "cuda":
        torch.cuda.set_device(0)
    phase("joining the instance and loading the model")
    members = Membership(
        address, rank, ranks, timedelta(seconds=failure_timeout), timedelta(seconds=left())
    )
    ours = model(path, draft_tokens, device, group=members.join(), num_physical_experts=8)
    ours.expert_parallel.timeout = members.timeout
    phase("building the engine (ep_comm buffers, decode graphs)")
    engine = Engine(ours, CONFIG, two_batch="off", draft_tokens=draft_tokens)
    members.ready()
    host, port = address.rsplit(":", 1)

    def client(timeout: float) -> dist.TCPStore:  # the membership's is the loop's: not thread-safe
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))

    if rank == victim:
        inject(engine.runner, "kill" if fault == "kill-two" else fault, client(left()))
    if fault == "kill-two" and rank == (victim + 1) % ranks:
        die_joining(members, client(left()))
    stopped = threading.Event()
    loop = EngineLoop(engine, membership=members, on_failure=stopped.set)
    served: dict[str, dict] = {}

    def start(name: str) -> None:
        params = M.SamplingParams(max_tokens=MAX_TOKENS)
        admitted = []
        for i, prompt in enumerate(prompts_of(rank, name)):
            request_id = f"{name}-{rank}-{i}"
            record = served[request_id] = dict(prompt=prompt, tokens=[], times=[], end=None)

            def sink(event, record=record):
                if event[0] == "token":
                    record["tokens"].append(event[1])
                    record["times"].append(time.time())
                else:
                    record["end"] = event

            add = lambda e, p=prompt, r=request_id: e.add(p, params, r)  # noqa: E731
            admitted.append((record, loop.open(request_id, add, sink)))
        for record, admission in admitted:
            try:
                admission.result(timeout=left())
            except RuntimeError as error:  # the loop stopped first
                record["end"] = ("refused", str(error))
            except TimeoutError:
                record["end"] = ("refused", "the engine loop did not admit it in time")

    def progress() -> str:
        tokens = sum(len(r["tokens"]) for r in served.values())
        ended = sum(r["end"] is not None for r in served.values())
        return (
            f"{tokens} tokens, {ended} of {len(served)} requests ended, generation "
            f"{members.generation}, members {members.members}"
        )

    def wait_for(state: str, reached: Callable[[], bool]) -> str | None:
        """None once reached() or the loop stopped; else, at the deadline, what was missed.
        Says how far it got every PROGRESS_S meanwhile."""
        said = time.time()
        while not (reached() or stopped.is_set()):
            if time.time() > report_by:
                return f"rank {rank} did not see {state} in time ({progress()})"
            if time.time() - said > PROGRESS_S:
                phase(f"waiting for {state} ({progress()})")
                said = time.time()
            time.sleep(0.05)
        return None

    phase("serving its first requests")
    start("first")
    missed = wait_for("the instance regroup after the fault", lambda: members.generation > 0)
    if not (missed or stopped.is_set()):
        phase(f"agreed on members {members.members}: sending its later requests")
        start("later")
        missed = wait_for(
            "its requests end", lambda: all(r["end"] is not None for r in served.values())
        )
    failure = loop.failure or missed
    phase(f"reporting: {failure or f'done ({progress()})'}")
    results.put((rank, "result", dict(served=served, members=members.members, failure=failure)))
    results.close()
    results.join_thread()
    # every rank ends at once, when the test has every result: to the others, one that
    # stopped alone would be a lost rank
    try:
        client(max(deadline - time.time(), 1.0)).wait(["finish"])
    except dist.DistStoreError:
        print(f"rank {rank}: the test did not say finish by its deadline", flush=True)
    os._exit(0)
