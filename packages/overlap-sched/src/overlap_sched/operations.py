"""Operation lists: a model step written as callables, cut into stages at `Yield` markers.

An operation is any callable taking the microbatch's `State`; `Op` gives it a name for traces
and errors. An op that starts communication returns what marks its end: an event (anything with
`current_stream_wait()`, such as `ep_comm.EventOverlap`) or a receive hook (a callable). The
executor waits on it, or calls it, when a later op first reads a key the op wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class OverlapError(RuntimeError):
    """An op list that cannot run, or an op that failed while it ran."""


class OpListError(OverlapError, ValueError):
    """An op list that cannot run: a misplaced `Yield`, an entry that is not an op,
    microbatches whose lists disagree."""


class Yield:
    """Where one stage ends and the next begins: the other microbatch runs in between."""

    def __repr__(self) -> str:
        return "Yield()"


@dataclass(frozen=True)
class Op:
    """A named operation: `fn(state)` returns None, an event or a receive hook."""

    name: str
    fn: Callable[[Any], Any]

    def __call__(self, state) -> Any:
        return self.fn(state)


def op_name(op: Callable) -> str:
    if isinstance(op, Op):
        return op.name
    while isinstance(op, functools.partial):
        op = op.func
    return getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)


Stage = list[Callable]


def stages(ops: Sequence) -> list[Stage]:
    """The ops between consecutive `Yield`s. A stage may not be empty: a list may not begin or
    end with a `Yield`, nor hold two in a row."""
    if not ops:
        raise OpListError("the op list is empty")
    cut: list[Stage] = [[]]
    for position, entry in enumerate(ops):
        if isinstance(entry, Yield):
            if not cut[-1]:
                if position == 0:
                    raise OpListError("the op list begins with a Yield: its first stage is empty")
                raise OpListError(
                    f"the op list has two Yields in a row at positions {position - 1} and "
                    f"{position}: the stage between them is empty"
                )
            cut.append([])
        elif isinstance(entry, type) and issubclass(entry, Yield):
            raise OpListError(f"position {position} is the Yield class: write Yield()")
        elif callable(entry):
            cut[-1].append(entry)
        else:
            raise OpListError(f"position {position} is {entry!r}, neither an op nor a Yield")
    if not cut[-1]:
        raise OpListError("the op list ends with a Yield: its last stage is empty")
    return cut


def stages_of_each(ops, count: int) -> list[list[Stage]]:
    """One stage list per microbatch: `ops` is one list for all, or one list per microbatch,
    which must have the same stages with the same op names."""
    lists = ops if _is_list_of_lists(ops) else [ops] * count
    if len(lists) != count:
        raise OpListError(f"{len(lists)} op lists for {count} microbatches")
    cut = [stages(one) for one in lists]
    names = [[[op_name(op) for op in stage] for stage in each] for each in cut]
    for index, other in enumerate(names[1:], start=1):
        if other != names[0]:
            raise OpListError(
                f"microbatch {index}'s op list differs from microbatch 0's: "
                f"{_first_difference(names[0], other)}"
            )
    return cut


def _is_list_of_lists(ops) -> bool:
    return bool(ops) and all(isinstance(one, (list, tuple)) for one in ops)


def _first_difference(a: list[list[str]], b: list[list[str]]) -> str:
    if len(a) != len(b):
        return f"{len(a)} stages against {len(b)}"
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return f"stage {index} is {x} against {y}"
    return "they differ"
