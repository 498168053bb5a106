"""Who the ranks of an elastic instance are (`--elastic`), agreed in a store that outlives any
one of them.

The members are the ranks an instance started with, by their first rank ("member id"); each
generation of members has a gloo process group of its own (rank: the member's place among
them, its keys under `group/<generation>/` in the store). A rank that finds a collective failed
(a peer's connection closed, or a wait past `timeout`) drops its group, which closes its
connections, so that the ranks still waiting on it fail at once too, and calls `agree`:

- **who answered** (observation): each rank that arrives sets `answered/<generation>/<id>`;
  every rank also beats (`beat/<id>`, every BEAT_S from a thread of its own, so also while
  it waits in a collective or computes). A member that has not answered is waited for while
  it beats, at most `timeout`; one whose beat stopped for STALE_S (killed, stopped, its host
  gone) is not.
- **who is a member** (agreement): the first rank done waiting writes the members of the next
  generation, those that answered, with a compare-and-set; every rank reads the one value that
  won. A rank left out of it (it answered too late) stops; the others form the next
  generation's group (`join`).

So a rank that dies is agreed lost within STALE_S of the first failed collective (which fails
at once where its connections close, else within `timeout`), and a rank that stops answering
but beats (hung in a kernel) within `timeout` more. One lost after the agreement, before the
new group forms, is agreed lost the same way once the others' join has waited `timeout` for
it (`regroup`).

A lost member comes back as a new process with its member id (`serve --elastic --join`): it
loads the model, sets `joining/<id>` and waits (`wait_admitted`) for a generation whose members
include it. The running ranks admit it at a step boundary, all at the same one: their engine
loop's per-step all-reduce (which every rank does, idle or not) carries the member the lowest
rank found joining (`joiner`, which looks in the store at most every JOIN_CHECK_S), so every
rank learns of it from the same reduction. Each then writes the next generation's members, the
old ones and the joiner in member order, with a compare-and-set (`admit`; they all write the
same value), and they and the joiner form that generation's group, over which the experts are
placed anew. Sequences keep their pages: a step boundary is between steps.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)
BEAT_S = 0.2  # between a rank's heartbeats
STALE_S = 2.0  # a heartbeat unchanged this long: the rank is gone
POLL_S = 0.05  # between looks at the store while agreeing
JOIN_CHECK_S = 0.5  # between the lowest rank's looks for a joining member


class LeftOut(RuntimeError):
    """This rank is no member of the instance any more: the others agreed without it."""


def last_generation(store: dist.Store) -> int:
    """The last generation of members decided in the store (0: the members it started with)."""
    generation = 0
    while store.check([f"members/{generation + 1}"]):
        generation += 1
    return generation


def last_members(store: dist.Store) -> list[int] | None:
    """The member ids of the last generation decided in the store; None before the first
    change (every member it started with)."""
    generation = last_generation(store)
    return json.loads(store.get(f"members/{generation}")) if generation else None


class Membership:
    def __init__(
        self,
        address: str,
        rank: int,
        ranks: int,
        timeout: timedelta,
        startup_timeout: timedelta,
        host_store: bool = False,
    ) -> None:
        """The store at address ("host:port"), hosted by this process with host_store (then
        the instance cannot agree once this process is gone); rank of ranks, the member id;
        timeout: how long any wait on the other ranks lasts once the instance has started
        (`ready`), startup_timeout before (loading the model included)."""
        host, port = address.rsplit(":", 1)

        def client(is_master: bool = False) -> dist.TCPStore:
            return dist.TCPStore(
                host,
                int(port),
                is_master=is_master,
                timeout=startup_timeout,
                wait_for_workers=False,
            )

        self.store = client(host_store)  # the agreement's: a client is not safe to share
        self.member, self.members = rank, list(range(ranks))
        self.ranks = ranks  # the members it started with
        self.generation = 0
        self.timeout = timeout
        self.checked_joining = 0.0  # when `joiner` last looked at the store
        self.stopped = threading.Event()
        beats = client()  # a client per thread: they are not thread-safe
        self._beating = threading.Thread(target=self._beat, args=(beats,), daemon=True)
        self._beating.start()

    def _beat(self, beats: dist.TCPStore) -> None:
        key, count = f"beat/{self.member}", 0
        while not self.stopped.wait(BEAT_S):
            count += 1
            try:
                beats.set(key, str(count))
            except RuntimeError:  # the store is gone: agree() will say so
                return

    def close(self) -> None:
        self.stopped.set()

    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    def join(self) -> dist.ProcessGroup:
        """The current members' process group, the default one, once all of them have joined
        (each waits at most the store's timeout, and its collectives as long)."""
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"group/{self.generation}", self.store),
            rank=self.rank,
            world_size=len(self.members),
            timeout=self.store.timeout,
        )
        return dist.group.WORLD

    def ready(self) -> None:
        """The instance has started: from now on every wait lasts `timeout`."""
        self.store.set_timeout(self.timeout)
        dist.distributed_c10d._set_pg_timeout(self.timeout)

    def leave(self) -> None:
        """Destroy the process group. Its connections close once no one holds it any more
        (the caller drops what does first; cycles are collected here)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    def agree(self) -> list[int]:
        """After a failure, with the others: the members left, as their ranks in the group
        before (survivor i becomes rank i of the next group, `join`). LeftOut when they agreed
        without this rank."""
        generation, before = self.generation, self.members
        decided = f"members/{generation + 1}"
        self.store.set(f"answered/{generation}/{self.member}", "")
        beats: dict[int, tuple[str | None, float]] = {}  # member: (its beat, when it changed)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([decided]):
            answered = [m for m in before if self.store.check([f"answered/{generation}/{m}"])]
            absent = [m for m in before if m not in answered]
            now = time.monotonic()
            for m in absent:
                beat = self._read(f"beat/{m}")
                if m not in beats or beats[m][0] != beat:
                    beats[m] = (beat, now)
            if now >= deadline or all(now - beats[m][1] >= STALE_S for m in absent):
                self.store.compare_set(decided, "", json.dumps(answered))
                break
            time.sleep(POLL_S)
        members = json.loads(self.store.get(decided))
        self.generation += 1
        if self.member not in members:
            raise LeftOut(
                f"rank {self.member} was left out of the instance: the others agreed on ranks "
                f"{members} of {before} without it (it answered too late)"
            )
        self.members = members
        lost = sorted(set(before) - set(members))
        log.warning("the instance's ranks agreed on %s (lost: %s)", members, lost or "none")
        return [before.index(m) for m in members]

    def regroup(self) -> tuple[dist.ProcessGroup, list[int]]:
        """After a failure: `agree` on the members left and `join` their group; where one of
        them is lost before the group forms (the others' join waits `timeout` for it), agree
        again without it, as often as members are lost so. The group and the survivors as
        their ranks in the group before the failure; LeftOut as `agree`; a join that fails
        with no member lost raises its error."""
        sources, failed = list(range(len(self.members))), None
        while True:
            before = len(self.members)
            survivors = self.agree()
            if failed is not None and len(survivors) == before:
                raise failed
            sources = [sources[i] for i in survivors]
            try:
                return self.join(), sources
            except Exception as error:  # DistStoreError and kin: a member never came
                log.error("the group of ranks %s did not form (%s)", self.members, error)
                self.leave()
                failed = error

    def joiner(self) -> int | None:
        """A lost member waiting to join (`wait_admitted`), as the lowest rank finds it at most
        every JOIN_CHECK_S; None elsewhere, and between looks."""
        now = time.monotonic()
        if self.rank != 0 or now - self.checked_joining < JOIN_CHECK_S:
            return None
        self.checked_joining = now
        lost = [m for m in range(self.ranks) if m not in self.members]
        return next((m for m in lost if self.store.check([f"joining/{m}"])), None)

    def admit(self, joiner: int) -> list[int | None]:
        """With the other members, after `joiner` was found: the next generation's members,
        as their ranks before (None: the joiner). Its `joining` key goes, so that a joiner that
        never forms the group is not admitted again. LeftOut when the generation was decided
        without this rank."""
        before = self.members
        decided = f"members/{self.generation + 1}"
        self.store.compare_set(decided, "", json.dumps(sorted([*before, joiner])))
        self.store.delete_key(f"joining/{joiner}")
        members = json.loads(self.store.get(decided))
        self.generation += 1
        if self.member not in members:
            raise LeftOut(f"rank {self.member} was left out of the instance: ranks {members}")
        self.members = members
        log.warning("the instance admits rank %d: ranks %s", joiner, members)
        return [before.index(m) if m in before else None for m in members]

    def wait_admitted(self) -> list[int | None]:
        """A member joining a running instance: announce it and wait until the members admit
        it (`admit`), at most the store's timeout; the new generation's members as their ranks
        before (None: this rank). TimeoutError saying so when it is not admitted."""
        generation = last_generation(self.store) + 1  # the first it may be admitted in
        key = f"joining/{self.member}"
        self.store.set(key, "")
        waited = self.store.timeout.total_seconds()
        deadline = time.monotonic() + waited
        while time.monotonic() < deadline:
            decided = f"members/{generation}"
            if not self.store.check([decided]):
                time.sleep(POLL_S)
                continue
            members = json.loads(self.store.get(decided))
            if self.member in members:
                self.generation, self.members = generation, members
                before = [m for m in members if m != self.member]
                return [None if m == self.member else before.index(m) for m in members]
            generation += 1  # an agreement without this rank: wait for the next
        self.store.delete_key(key)
        raise TimeoutError(
            f"rank {self.member} was not admitted into the instance within {waited:.0f} s: is "
            f"it running with --elastic, with this --group-address, and is rank {self.member} "
            f"one it lost?"
        )

    def _read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None
