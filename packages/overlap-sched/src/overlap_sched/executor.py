"""Running an op list for one microbatch, or for two against each other (SGLang's semantics).

`run_overlapped(ops, [a, b], delta_stages=d)` runs d stages of a, then alternates a stage of a
and a stage of b until a is done, then runs b's last d stages. Everything runs on the calling
thread and the current CUDA stream; the overlap comes from communication that runs elsewhere
(ep_comm's communication stream, or in the background until a receive hook is called) while the
other microbatch's compute is queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from overlap_sched.operations import OpListError, OverlapError, Stage, op_name, stages_of_each
from overlap_sched.state import State


class OpFailed(OverlapError):
    """An op raised; the message names the op, its microbatch and stage (the cause is chained)."""


def run(ops: Sequence, state: State, recorder=None) -> State:
    """All of `ops` for one microbatch, in order."""
    (cut,) = stages_of_each(ops, 1)
    runner = _Microbatch(0, cut, state, recorder)
    _drive([runner], [runner] * len(cut))
    return state


def run_overlapped(ops: Sequence, states: Sequence[State], delta_stages: int, recorder=None):
    """Two microbatches through the same stages, the second `delta_stages` behind.

    ops: one op list for both, or a pair of lists with the same stages and op names.
    states: one `State` per microbatch. A microbatch of 0 tokens runs every op (a rank without
    tokens still takes part in every exchange), but only if the other has 0 tokens too.
    """
    if len(states) != 2:
        raise OpListError(f"run_overlapped runs two microbatches, got {len(states)} states")
    sizes = [s.num_tokens for s in states]
    if 0 in sizes and any(sizes):
        empty = sizes.index(0)
        raise OpListError(
            f"microbatch {empty} is empty while microbatch {1 - empty} has {sizes[1 - empty]} "
            "tokens: run one batch instead"
        )
    cut_a, cut_b = stages_of_each(ops, 2)
    count = len(cut_a)
    if not 0 <= delta_stages <= count:
        raise OpListError(f"delta_stages must be in [0, {count}] (the stages), got {delta_stages}")
    a, b = (
        _Microbatch(i, cut, s, recorder)
        for i, (cut, s) in enumerate(zip((cut_a, cut_b), states, strict=True))
    )
    order = [a] * delta_stages + [a, b] * (count - delta_stages) + [b] * delta_stages
    _drive([a, b], order)
    return list(states)


def _drive(microbatches: list[_Microbatch], order: list[_Microbatch]) -> None:
    try:
        for microbatch in order:
            microbatch.next_stage()
        for microbatch in microbatches:
            microbatch.finish()
    except BaseException as error:
        for microbatch in microbatches:  # nothing stays in flight: wait for or receive it all
            problem = microbatch.abandon()
            if problem is not None:
                error.add_note(problem)
        raise


class _Microbatch:
    def __init__(self, index: int, cut: list[Stage], state: State, recorder) -> None:
        self.index, self.stages, self.state, self.recorder = index, cut, state, recorder
        object.__setattr__(state, "microbatch", index)
        self.done = 0

    def next_stage(self) -> None:
        stage = self.done
        for op in self.stages[stage]:
            self._call(op, stage)
        self.done += 1

    def _call(self, op: Callable, stage: int) -> None:
        name, state = op_name(op), self.state
        before = {key: id(state._values[key]) for key in state._values}
        span = self.recorder.op(name, self.index, stage) if self.recorder else nullcontext()
        try:
            with span:
                result = op(state)
        except OverlapError:
            raise
        except Exception as error:
            raise OpFailed(
                f"op {name!r} of microbatch {self.index} (stage {stage + 1} of "
                f"{len(self.stages)}) raised {type(error).__name__}: {error}"
            ) from error
        if result is None:
            return
        written = [k for k in state._values if before.get(k) != id(state._values[k])]
        if not written:
            raise OpListError(
                f"op {name!r} of microbatch {self.index} returned {type(result).__name__} but "
                "wrote no state key for a later op to wait on"
            )
        state._wait_for(written, self._waiter(name, result))

    def _waiter(self, name: str, result: Any) -> Callable[[], None]:
        if hasattr(result, "current_stream_wait"):
            finish = result.current_stream_wait
        elif callable(result):
            finish = result
        else:
            raise OpListError(
                f"op {name!r} returned {type(result).__name__}: expected None, an event (with "
                "current_stream_wait()) or a receive hook (a callable)"
            )
        if self.recorder:
            self.recorder.communication(name, self.index, result)

        def wait() -> None:
            self.state._done_waiting(wait)  # first: a hook that raises is not called twice
            span = self.recorder.wait(name, self.index) if self.recorder else nullcontext()
            with span:
                finish()

        return wait

    def finish(self) -> None:
        for wait in self.state._pending():
            wait()

    def abandon(self) -> str | None:
        """Wait for what is still in flight after a failure; what went wrong doing so, if any."""
        problems = []
        for wait in self.state._pending():
            try:
                wait()
            except Exception as error:
                problems.append(f"{type(error).__name__}: {error}")
        if problems:
            return f"microbatch {self.index}, finishing its communication: " + "; ".join(problems)
        return None
