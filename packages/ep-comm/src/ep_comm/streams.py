"""Running a call's device work on a communication stream, as DeepEP's flags describe.

`previous_event`: the communication stream waits for it (else for the current stream).
`async_finish`: the current stream does not wait; the returned event marks the end.
`allocate_on_comm_stream`: outputs belong to the communication stream's memory pool (else they
are recorded on the current stream, which may then free them). CPU work runs inline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch

from ep_comm.event import EventOverlap


def _tensors(values: Iterable) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found += _tensors(value)
    return found


class CommStream:
    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None

    def allocating(self, allocate_on_comm_stream: bool):
        """Where a call's outputs are allocated before `run` (which gets them among its
        inputs): in the communication stream's memory pool if asked, else the current one's."""
        if not allocate_on_comm_stream or not torch.cuda.is_available():
            return nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return torch.cuda.stream(self.stream)

    def run(
        self,
        work: Callable[[], tuple],
        inputs: tuple,
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple:
        """`work()`'s results followed by an EventOverlap."""
        devices = {t.device.type for t in _tensors(inputs)}
        if devices != {"cuda"}:
            return (*work(), EventOverlap())
        compute = torch.cuda.current_stream()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        comm = self.stream
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        for tensor in _tensors(inputs):
            tensor.record_stream(comm)
        with torch.cuda.stream(comm):
            results = work()
        event = torch.cuda.Event()
        event.record(comm)
        if not allocate_on_comm_stream:
            for tensor in _tensors(results):
                tensor.record_stream(compute)
        if not async_finish:
            compute.wait_event(event)
        return (*results, EventOverlap(event, tuple(_tensors(inputs)) if async_finish else ()))
