"""One rank of an elastic expert-parallel instance in the elastic tests (loaded by path in a
spawned process): an engine loop serving its own requests, of which `victim` is lost mid-step
(killed, or stopped and later continued by the test) or whose exchange fails. What it served
goes to `results`."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services.elastic import Membership
from ref_server.services.engine_loop import EngineLoop

CONFIG = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256)
MAX_TOKENS = 24


def prompts_of(rank: int, name: str) -> list[list[int]]:
    """Two prompts per rank, different on every rank and for every name."""
    first = 3 + 17 * rank + (50 if name == "later" else 0)
    return [list(range(first, first + n)) for n in (9, 30)]


def inject(model, fault: str, store) -> None:
    """The fault, after noting the time in the store: "kill" (SIGKILL) or "stop" (SIGSTOP) in
    the second MoE layer of this rank's third decode step ("kill") or first prefill step
    ("stop"); "fail": after its third decode step its buffer reports a failure, as a kernel
    that timed out leaves it (every rank raises EPCommError from the step's check)."""
    steps = {"decode": 0, "armed": 0}
    forward_step, moe = model.forward_step, model.moe_layers()[1]
    dispatch = moe.op_dispatch_a

    def counted(batch, *args, **kwargs):
        steps["decode"] += batch.is_decode
        armed = not batch.is_decode if fault == "stop" else steps["decode"] == 3
        armed = armed and not steps["armed"]  # once
        steps["armed"] += armed
        if armed and fault == "fail":
            buffer = model.expert_parallel.buffer
            store.set("lost_at", repr(time.time()))
            buffer.failure = lambda: "injected: a kernel timed out"
        moe.op_dispatch_a = lost if armed and fault != "fail" else dispatch
        return forward_step(batch, *args, **kwargs)

    def lost(state):
        moe.op_dispatch_a = dispatch
        store.set("lost_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return dispatch(state)  # continued (SIGCONT) after SIGSTOP

    model.forward_step = counted


def serve(
    rank: int,
    ranks: int,
    address: str,
    path: str,
    victim: int,
    fault: str,
    device: str,
    failure_timeout: float,
    results,
) -> None:
    """Serve two requests ("first"), then two more once the instance has lost `victim`
    ("later"); put (rank, what happened) on results: each request's tokens with their times
    and how it ended, and the members this rank ended with (or why it stopped). On CUDA every
    rank uses GPU 0."""
    if device == "cuda":
        torch.cuda.set_device(0)
    members = Membership(
        address, rank, ranks, timedelta(seconds=failure_timeout), timedelta(seconds=120)
    )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = M.from_pretrained(
        path, dtype=dtype, device=device, group=members.join(), num_physical_experts=8
    )
    model.expert_parallel.timeout = members.timeout
    engine = Engine(model, CONFIG, two_batch="off")
    members.ready()
    host, port = address.rsplit(":", 1)

    def client() -> dist.TCPStore:  # the membership's is the engine loop's: not thread-safe
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))

    if rank == victim:
        inject(model, fault, client())
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
                admission.result(timeout=60)
            except RuntimeError as error:  # the loop stopped first
                record["end"] = ("refused", str(error))

    def ended() -> bool:
        return all(r["end"] is not None for r in served.values())

    start("first")
    deadline = time.monotonic() + 120
    while members.generation == 0 and not stopped.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not stopped.is_set():
        start("later")
    while not (ended() or stopped.is_set()) and time.monotonic() < deadline:
        time.sleep(0.05)
    results.put((rank, dict(served=served, members=members.members, failure=loop.failure)))
    results.close()
    results.join_thread()
    # every rank ends at once, when the test has every result: to the others, one that
    # stopped alone would be a lost rank
    client().wait(["finish"])
    os._exit(0)
