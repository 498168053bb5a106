"""The thread that owns an instance's engine: gRPC handlers never touch the engine directly.

Handlers send functions to run on the loop thread (`call`), and requests register a queue of
events (`open`): ("token", id), ("done", FinishReason), ("error", message). Between commands the
loop steps the engine while it has work, and releases held KV pages whose transfer deadline
passed.

The ranks of an expert-parallel instance step in lockstep: every MoE layer of a step is a
collective of all of them. Before each step they agree (an all-reduce over the instance's
group) on the readiest rank's state; a rank without sequences then runs an idle step.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from ref_server.engine import Engine, FinishReason, Status

IDLE, BLOCKED, RUNNABLE = 0, 1, 2  # no requests; requests waiting on held pages; work to run


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        hold_seconds: float = 60.0,
        group: dist.ProcessGroup | None = None,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        """group: the instance's ranks (gloo), when it has several; on_failure: called once
        when they lose each other (the loop has stopped then, every request ended)."""
        self.engine = engine
        self.hold_seconds = hold_seconds
        self.group = group
        self.on_failure = on_failure
        self.failure: str | None = None
        self.commands: queue.Queue = queue.Queue()
        self.events: dict[str, queue.Queue] = {}
        self.hold_deadlines: dict[str, float] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def call(self, fn: Callable, timeout: float | None = None):
        """fn(engine) on the loop thread; its result (or exception) here. RuntimeError once
        the loop has failed."""
        future: Future = Future()
        self.commands.put((fn, future))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:
                if self.failure is not None:
                    raise RuntimeError(self.failure) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise

    def open(self, request_id: str, admit: Callable) -> tuple[object, queue.Queue]:
        """Run admit(engine) on the loop thread; its result, and the request's events."""
        events: queue.Queue = queue.Queue()

        def register(engine):
            if request_id in self.events:
                raise ValueError(f"request id {request_id!r} is already in flight here")
            seq = admit(engine)
            self.events[request_id] = events
            return seq

        return self.call(register), events

    def hold(self, request_id: str) -> None:
        """Release this request's held pages unless they are released first."""

        def set_deadline(_):
            self.hold_deadlines[request_id] = time.monotonic() + self.hold_seconds

        self.call(set_deadline)

    def cancel(self, request_id: str) -> bool:
        """Abort a request now (its KV pages are freed); False if it is not running here."""

        def abort(engine):
            seq = engine.abort(request_id)
            events = self.events.pop(request_id, None)
            if events is not None:
                events.put(("done", FinishReason.ABORT))
            return seq is not None

        return self.call(abort)

    def stop(self) -> None:
        self.stopped = True
        self.commands.put((None, None))
        self.thread.join(timeout=10)

    def load(self) -> dict:
        scheduler = self.engine.scheduler
        return dict(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_usage=scheduler.blocks.usage,
            queued_tokens=sum(len(s.prompt) for s in scheduler.waiting),
            queued_flops=self.engine.queued_prefill_flops(),
        )

    def _run(self) -> None:
        while not self.stopped:
            self._run_commands(wait=False)
            self._expire_holds()
            try:
                readiest = self._agree(self._readiness())
            except Exception as error:  # a peer rank died or stopped answering
                self._fail(f"the instance's ranks lost each other: {error}")
                return
            if readiest > IDLE:
                self._step()
            if readiest < RUNNABLE:
                self._run_commands(wait=True)

    def _readiness(self) -> int:
        if not self.engine.has_work():
            return IDLE
        return BLOCKED if self.engine.idle else RUNNABLE

    def _agree(self, readiness: int) -> int:
        """The readiest rank's state: every rank steps when any can."""
        if self.group is None:
            return readiness
        flag = torch.tensor([readiness])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)

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
            try:
                future.set_result(fn(self.engine))
            except Exception as error:  # the handler raises it
                future.set_exception(error)

    def _fail(self, message: str) -> None:
        self.failure = message
        self.stopped = True
        for events in self.events.values():
            events.put(("error", message))
        self.events.clear()
        self.on_failure()

    def _step(self) -> None:
        try:
            updated = self.engine.step()
        except Exception:
            message = traceback.format_exc(limit=3)
            for request_id in list(self.events):
                self.engine.abort(request_id)
                self.events.pop(request_id).put(("error", message))
            return
        for seq in updated:
            events = self.events.get(seq.request_id)
            if events is None:
                continue
            events.put(("token", seq.tokens[-1]))
            if seq.status is Status.FINISHED:
                events.put(("done", seq.finish_reason))
                del self.events[seq.request_id]

    def _expire_holds(self) -> None:
        now = time.monotonic()
        for request_id, deadline in list(self.hold_deadlines.items()):
            if deadline <= now or request_id not in self.engine.scheduler.held:
                self.engine.release(request_id)
                del self.hold_deadlines[request_id]
