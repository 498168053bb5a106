"""The thread that owns an instance's engine: gRPC handlers never touch the engine directly.

Handlers send functions to run on the loop thread (`call`), and requests register a queue of
events (`open`): ("token", id), ("done", FinishReason), ("error", message). Between commands the
loop steps the engine while it has work, and releases held KV pages whose transfer deadline
passed.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future

from ref_server.engine import Engine, FinishReason, Status


class EngineLoop:
    def __init__(self, engine: Engine, hold_seconds: float = 60.0) -> None:
        self.engine = engine
        self.hold_seconds = hold_seconds
        self.commands: queue.Queue = queue.Queue()
        self.events: dict[str, queue.Queue] = {}
        self.hold_deadlines: dict[str, float] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def call(self, fn: Callable, timeout: float | None = None):
        """fn(engine) on the loop thread; its result (or exception) here."""
        future: Future = Future()
        self.commands.put((fn, future))
        return future.result(timeout)

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
        )

    def _run(self) -> None:
        while not self.stopped:
            try:
                block = not self.engine.has_work() or self.engine.idle
                fn, future = self.commands.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                fn = None
            if fn is not None:
                try:
                    future.set_result(fn(self.engine))
                except Exception as error:  # the handler raises it
                    future.set_exception(error)
                continue  # drain commands before stepping
            self._expire_holds()
            if self.engine.has_work():
                self._step()

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
