"""`EventOverlap`: what asynchronous calls return, as in DeepEP.

It holds a CUDA event recorded on the communication stream after the work (None when the work
ran on the CPU, or finished before returning) and the tensors that must stay alive until then.
"""

from __future__ import annotations

import torch


class EventOverlap:
    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple = ()) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the work (no-op without an event)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


def capture() -> EventOverlap:
    """An event recorded now on the current CUDA stream (`previous_event` for a later call)."""
    event = torch.cuda.Event()
    event.record()
    return EventOverlap(event)
