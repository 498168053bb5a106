"""The thread that owns an instance's engine: gRPC handlers never touch the engine directly,
and never wait for it on their own thread.

Handlers queue functions to run on the loop thread (`submit`, which returns a future at once),
and requests register a sink for their events (`open`): ("token", id), ("done", FinishReason),
("error", message). Between commands the loop steps the engine while it has work, publishes a
load snapshot (`load`, read without waiting), and frees held KV pages whose lease ran out.

A prefill instance holds a finished request's pages under a lease of `hold_seconds`: `extend`
renews it (a decode instance is copying), `release` ends it, and the loop frees the pages
when it runs out. So pages are never reused while their lease holds. A `release` that finds
nothing held is remembered for `hold_seconds` (at most RELEASED_KEPT ids): should the request
finish after it (its cancel overtaken by the release), its pages are freed at once.

A decode request's pages are written by its KV pull while it is reserved: only its own call's
`cancel`, once the pull has ended, frees them (an engine-wide abort ends the request but leaves
them reserved, and `start` then refuses it).

The ranks of an expert-parallel instance step in lockstep: every MoE layer of a step is a
collective of all of them. Before each step they agree (an all-reduce over the instance's
group) on the readiest rank's state; a rank without sequences then runs an idle step. When an
exchange fails, every rank gets `EPCommError` from the same step (ep_comm raises it on all of
them): each ends its requests with an error and rebuilds the exchange with the others; an
instance whose rebuild fails stops, out of service (`on_failure`).

An elastic instance (`membership`) instead goes on over the ranks left whenever a step or an
agreement fails on a rank (a peer died or stopped answering, an exchange failed, an error of
its own): it drops its group, agrees with the others on who is left (`Membership.agree`), and
they form a new group over which the lost ranks' experts are placed anew (`Engine.regroup`).
Requests keep their state and the failed step runs again (it changed none), so they complete
with the tokens they would have had; only a step that fails again with every rank there,
which they may be the cause of, ends them with the error. Those of a lost rank were in its
process. A lost member that comes back (`serve --join`) is admitted between two steps, all
ranks at the same one: the per-step agreement carries it (`Membership.joiner`, `_admit`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ep_comm import EPCommError
from ref_server.engine import Engine, FinishReason, Status
from ref_server.services.elastic import Membership

IDLE, BLOCKED, RUNNABLE = 0, 1, 2  # no requests; requests waiting on held pages; work to run
RELEASED_KEPT = 16384  # ids of releases that found nothing held, remembered at most

log = logging.getLogger(__name__)


def exchange_failure(error: BaseException) -> EPCommError | None:
    """The EPCommError behind an engine step's error (an op that raised wraps it), if any."""
    while error is not None and not isinstance(error, EPCommError):
        error = error.__cause__ or error.__context__
    return error


def one_line(error: BaseException) -> str:
    """An exception as one line for a client: its type and first line, never a traceback."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        hold_seconds: float = 60.0,
        membership: Membership | None = None,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        """membership: an elastic instance's ranks; on_failure: called once when the ranks
        lose each other for good or cannot rebuild a failed exchange (the loop has stopped
        then, every request ended)."""
        self.engine = engine
        self.hold_seconds = hold_seconds
        self.membership = membership
        self.on_failure = on_failure
        self.failure: str | None = None
        self.failed_steps = 0  # in a row with every rank there (elastic): the second ends them
        self.commands: queue.Queue = queue.Queue()
        self.sinks: dict[str, Callable[[tuple], None]] = {}
        self.leases: dict[str, float] = {}  # held request -> when its pages are freed
        self.released: OrderedDict[str, float] = OrderedDict()  # nothing held -> kept until
        self.load = self._load()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ for handlers (any thread)

    def submit(self, fn: Callable) -> Future:
        """fn(engine) on the loop thread; a future of its result. A loop that has failed
        fails the future with RuntimeError instead of leaving it pending."""
        future: Future = Future()
        self.commands.put((fn, future))
        if self.failure is not None:
            self._drain()
        return future

    def open(self, request_id: str, admit: Callable, sink: Callable[[tuple], None]) -> Future:
        """Run admit(engine), which adds the request; its events go to sink(event), called
        on the loop thread (it must not block)."""

        def register(engine):
            if request_id in self.sinks:
                raise ValueError(f"request id {request_id!r} is already in flight here")
            result = admit(engine)
            self.sinks[request_id] = sink
            return result

        return self.submit(register)

    def cancel(self, request_id: str) -> Future:
        """Abort a request wherever it is (queued, running, reserved or held): its pages are
        freed. Does not wait; the future says whether the request was here."""

        def abort(engine):
            found = engine.abort(request_id) is not None
            self.leases.pop(request_id, None)
            self._end(request_id, ("done", FinishReason.ABORT))
            return found

        return self.submit(abort)

    def extend(self, request_id: str, read: Callable = lambda engine: None) -> Future:
        """Renew a held request's lease and read(engine) under it; the future's result is
        read's (KeyError when nothing is held under that id)."""

        def renew(engine):
            if request_id not in engine.scheduler.held:
                raise KeyError(request_id)
            self.leases[request_id] = time.monotonic() + self.hold_seconds
            return read(engine)

        return self.submit(renew)

    def release(self, request_id: str) -> Future:
        """End a held request's lease and free its pages; False if none was held (it ran out,
        or was released or aborted, or it has not finished yet: then its pages are freed as
        it finishes)."""

        def end(engine):
            self.leases.pop(request_id, None)
            if engine.release(request_id):
                return True
            self.released[request_id] = time.monotonic() + self.hold_seconds
            self.released.move_to_end(request_id)
            if len(self.released) > RELEASED_KEPT:
                self.released.popitem(last=False)
            return False

        return self.submit(end)

    def start(self, request_id: str) -> Future:
        """A reserved request whose KV has arrived joins the batch; KeyError when it ended
        meanwhile (its pages stay reserved until `cancel`)."""

        def run(engine):
            if request_id not in self.sinks:
                raise KeyError(request_id)
            return engine.start(request_id)

        return self.submit(run)

    def stop(self) -> None:
        self.stopped = True
        if self.membership is not None:  # its peers, stopping too, need not wait for its answer
            self.membership.close()
        self.commands.put((None, None))
        self.thread.join(timeout=10)

    # ------------------------------------------------------------ the loop thread

    def _load(self) -> dict:
        engine, scheduler = self.engine, self.engine.scheduler
        balancer = engine.runner.expert_balancer
        moved = balancer.moved if balancer else None
        return dict(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_usage=scheduler.blocks.usage,
            queued_tokens=sum(len(s.prompt) for s in scheduler.waiting),
            queued_flops=engine.queued_prefill_flops(),
            held=len(scheduler.held) + len(scheduler.reserved),
            ranks=engine.runner.ranks,
            expert_rebalances=balancer.rebalances if balancer else 0,
            expert_bytes_moved=moved.copied + moved.sent if moved else 0,
            draft_acceptance_rate=engine.speculative_stats.acceptance_rate,
            accepted_length=engine.speculative_stats.accepted_length,
        )

    def _run(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)
        while not self.stopped:
            self._run_commands(wait=False)
            self._expire()
            try:
                readiest, joiner = self._agree(self._readiness())
                lost = None
            except Exception as error:  # a peer rank died or stopped answering
                lost = f"the instance's ranks lost each other: {one_line(error)}"
            if lost is not None:  # past the except block, which holds the old group
                if self.membership is None:
                    self._fail(lost)
                    return
                self._regroup(lost)
                continue
            if joiner is not None:
                self._admit(joiner)
                continue
            if readiest > IDLE:
                self._step()
            self.load = self._load()
            if readiest < RUNNABLE:
                self._run_commands(wait=True)

    def _readiness(self) -> int:
        if not self.engine.has_work():
            return IDLE
        return BLOCKED if self.engine.idle else RUNNABLE

    def _agree(self, readiness: int) -> tuple[int, int | None]:
        """The readiest rank's state, every rank stepping when any can; and an elastic
        instance's joining member (`Membership.joiner`: the lowest rank's find), if any."""
        group = self.engine.runner.group
        if group is None:
            return readiness, None
        joiner = self.membership.joiner() if self.membership else None
        flags = torch.tensor([readiness, -1 if joiner is None else joiner])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        readiest, joiner = flags.tolist()
        return readiest, None if joiner < 0 else joiner

    def _run_commands(self, wait: bool) -> None:
        """The queued commands; with wait, the first may come within 50 ms."""
        while not self.stopped:
            try:
                fn, future = self.commands.get(block=wait, timeout=0.05 if wait else None)
            except queue.Empty:
                return
            wait = False
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as error:  # the handler raises it
                future.set_exception(error)

    def _drain(self) -> None:
        """Fail every queued command (the loop has stopped for good)."""
        while True:
            try:
                _, future = self.commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(self.failure))

    def _end(self, request_id: str, event: tuple) -> None:
        sink = self.sinks.pop(request_id, None)
        if sink is not None:
            sink(event)

    def _fail(self, message: str) -> None:
        self.failure = message
        self.stopped = True
        if self.membership is not None:  # the others need not wait for this rank
            self.membership.close()
        for request_id in list(self.sinks):
            self._end(request_id, ("error", message))
        self._drain()
        self.on_failure()

    def _step(self) -> None:
        try:
            updated, failed = self.engine.step(), None
        except Exception as error:
            if self.membership is None:
                self._step_failed(error)
                return
            log.exception("an engine step failed")
            failed = f"an engine step failed: {one_line(exchange_failure(error) or error)}"
        if failed is not None:  # past the except block: the error's frames hold the old group
            self._regroup(failed)
            return
        self.failed_steps = 0
        now = time.monotonic()
        for seq in updated:
            sink = self.sinks.get(seq.request_id)
            if seq.request_id in self.engine.scheduler.held:  # the lease starts as it finishes
                if self.released.pop(seq.request_id, None) is not None:  # its Release came
                    self.engine.release(seq.request_id)
                    self._end(seq.request_id, ("done", FinishReason.ABORT))
                    continue
                self.leases[seq.request_id] = now + self.hold_seconds
            if sink is None:
                continue
            for token in seq.tokens[len(seq.tokens) - seq.num_new :]:  # several: speculative
                sink(("token", token))
            if seq.status is Status.FINISHED:
                self._end(seq.request_id, ("done", seq.finish_reason))

    def _step_failed(self, error: Exception) -> None:
        """A failed step of an instance that is not elastic: a failed exchange is rebuilt,
        anything else ends the requests."""
        failure = exchange_failure(error)
        if failure is not None:
            self._rebuild(failure)
            return
        log.exception("engine step failed")
        self._abort_all(f"engine step failed: {one_line(error)}")

    def _abort_all(self, message: str) -> None:
        """End every request with `message` and free its pages, but a reserved one's: its
        pull may still be writing them (its call frees them once the pull has ended)."""
        for request_id in list(self.sinks):
            if request_id not in self.engine.scheduler.reserved:
                self.engine.abort(request_id)
            self._end(request_id, ("error", message))

    def _rebuild(self, failure: EPCommError) -> None:
        """Every rank is here after the same failed step: end its requests, rebuild together."""
        log.error(
            "an expert-parallel exchange failed; ending %d requests and rebuilding it: %s",
            len(self.sinks),
            failure,
        )
        self._abort_all(f"the expert-parallel exchange failed: {one_line(failure)}")
        try:
            self.engine.rebuild_exchange()
        except Exception as error:
            log.exception("rebuilding the expert-parallel exchange failed")
            self._fail(f"rebuilding the expert-parallel exchange failed: {one_line(error)}")
            return
        log.warning("rebuilt the expert-parallel exchange: serving again")

    def _regroup(self, why: str) -> None:
        """An elastic instance's ranks after a failure: agree on who is left and go on over
        them (`Membership.regroup`: again without a rank lost before their group formed); the
        loop stops (`_fail`) if this rank was left out, if placing the experts fails (a rank
        lost while they move), or if it is stopping (its peers are, too)."""
        if self.stopped:
            self._fail(why)
            return
        log.error("%s: agreeing with the other ranks on who is left", why)
        started = time.monotonic()
        before = self.engine.runner.ranks
        self.engine.leave_group()  # its connections close: peers waiting on this rank fail now
        self.membership.leave()
        try:
            group, survivors = self.membership.regroup()
            self.engine.regroup(group, survivors)
        except Exception as error:
            log.exception("the instance could not go on over the ranks left")
            self._fail(f"the instance could not go on over the ranks left: {one_line(error)}")
            return
        log.warning(
            "serving again over %d of %d ranks, %.1f s after the failure",
            len(survivors), before, time.monotonic() - started,
        )  # fmt: skip
        # a lost rank explains a failure; a step that failed again without one may be its
        # requests' doing
        self.failed_steps = 0 if len(survivors) < before else self.failed_steps + 1
        if self.failed_steps > 1:
            self._abort_all(why)

    def _admit(self, joiner: int) -> None:
        """Every rank of an elastic instance at the same step boundary: go on over a group
        with `joiner` (`Membership.admit`), which receives its experts. If it never forms the
        group, the ranks agree on who is there and go on over them; the loop stops (`_fail`)
        if moving the experts fails, which leaves the layers half placed."""
        started, before = time.monotonic(), self.membership.members
        self.engine.leave_group()
        self.membership.leave()
        try:
            sources = self.membership.admit(joiner)
            group = self.membership.join()
        except Exception as error:
            log.exception("rank %d did not join", joiner)
            self.membership.members = before  # whom the engine's experts are placed over
            self._regroup(f"rank {joiner} did not join: {one_line(error)}")
            return
        try:
            self.engine.regroup(group, sources)
        except Exception as error:
            log.exception("placing the experts over the ranks with rank %d failed", joiner)
            self._fail(f"placing the experts with rank {joiner} failed: {one_line(error)}")
            return
        log.warning(
            "rank %d joined: serving over %d ranks, %.1f s after it was found",
            joiner, len(sources), time.monotonic() - started,
        )  # fmt: skip

    def _expire(self) -> None:
        """Free the held pages whose lease ran out; forget releases kept long enough."""
        now = time.monotonic()
        for request_id, deadline in list(self.leases.items()):
            if deadline <= now:
                self.engine.release(request_id)
                del self.leases[request_id]
        while self.released and next(iter(self.released.values())) <= now:
            self.released.popitem(last=False)
