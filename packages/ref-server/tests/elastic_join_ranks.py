"""The ranks of an elastic instance in test_elastic_join.py (imported by name in spawned
processes): two ranks serve, member 1 is lost (SIGKILL) in the middle of its requests, rank 0
goes on alone, and a replacement process joins as member 1 while rank 0 has requests running.
What each served goes to `results`."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services import elastic
from ref_server.services.elastic import Membership
from ref_server.services.engine_loop import EngineLoop

CONFIG = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256)
SLOTS = 8  # the checkpoint's routed experts, 4 per rank at full size
FAILURE_TIMEOUT_S = 6.0
MAX_TOKENS = {"first": 24, "during": 64, "after": 24}


def prompts_of(member: int, name: str) -> list[list[int]]:
    """Two prompts per member and phase, all different."""
    first = 3 + 17 * member + 40 * list(MAX_TOKENS).index(name)
    return [list(range(first, first + n)) for n in (9, 30)]


class Requests:
    """A rank's requests through its engine loop: each one's prompt, tokens with their times,
    and how it ended."""

    def __init__(self, loop: EngineLoop, member: int) -> None:
        self.loop, self.member, self.served = loop, member, {}

    def start(self, name: str, on_token=lambda record: None) -> list:
        params = M.SamplingParams(max_tokens=MAX_TOKENS[name])
        admissions = []
        for i, prompt in enumerate(prompts_of(self.member, name)):
            request_id = f"{name}-{self.member}-{i}"
            record = self.served[request_id] = dict(prompt=prompt, tokens=[], times=[], end=None)

            def sink(event, record=record):
                if event[0] == "token":
                    record["tokens"].append(event[1])
                    record["times"].append(time.time())
                    on_token(record)
                else:
                    record["end"] = event

            add = lambda e, p=prompt, r=request_id: e.add(p, params, r)  # noqa: E731
            admissions.append(self.loop.open(request_id, add, sink))
        return admissions

    def ended(self) -> bool:
        return all(r["end"] is not None for r in self.served.values())


def wait_until(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def serve(member: int, ranks: int, address: str, path: str, joining: bool, results) -> None:
    """Member `member` of the instance (joining: the replacement); puts (member, joining,
    what happened) on results, then waits for the store's "finish"."""
    members = Membership(
        address, member, ranks, timedelta(seconds=FAILURE_TIMEOUT_S), timedelta(seconds=120)
    )
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
    model = M.from_pretrained(
        path,
        dtype=torch.float32,
        group=None if joining else members.join(),
        num_physical_experts=SLOTS,
        joining=(member, ranks) if joining else None,
    )
    model.expert_parallel.timeout = members.timeout
    engine = Engine(model, CONFIG, two_batch="off")
    if joining:  # as `serve --elastic --join` does
        sources = members.wait_admitted()
        engine.regroup(members.join(), sources)
        store.set("joined_at", repr(time.time()))
    members.ready()
    loop = EngineLoop(engine, membership=members)
    requests = Requests(loop, member)
    if joining:
        after = requests.start("after")
    elif member == 1:  # lost at its requests' third token, between two steps

        def lose(record):
            if len(record["tokens"]) == 3:
                store.set("lost_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        requests.start("first", on_token=lose)
        wait_until(lambda: False)
    else:
        admit_with_requests_running(members, requests)  # before the loss: the joiner may come
        requests.start("first")  # as soon as the ranks left serve again
        wait_until(lambda: members.generation >= 2)  # member 1 agreed lost, then joined
        after = requests.start("after")
    for admission in after:
        admission.result(timeout=60)
    wait_until(requests.ended)
    report = dict(
        served=requests.served,
        members=members.members,
        failure=loop.failure,
        ranks=loop.load["ranks"],
        slots=[moe.slot_experts() for moe in model.moe_layers()],
    )
    results.put((member, joining, report))
    results.close()
    results.join_thread()
    store.wait(["finish"])  # every rank ends at once: one that ends alone is lost to the others
    os._exit(0)


def admit_with_requests_running(members: Membership, requests: Requests) -> None:
    """Let the instance admit a joiner only once this rank (the lowest) has two requests
    ("during") part way: when it first finds one, it starts them, and finds none until each
    has two tokens, so that they are running when the ranks switch."""
    elastic.JOIN_CHECK_S = 0.05
    find = members.joiner
    during = []

    def joiner():
        found = find()
        if found is None:
            return None
        if not during:
            during.extend(requests.start("during"))
        running = [r for name, r in requests.served.items() if name.startswith("during")]
        return found if all(len(r["tokens"]) >= 2 for r in running) else None

    members.joiner = joiner
