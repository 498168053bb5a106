"""`Recorder`: when each op of each microbatch ran, on which stream, as a Chrome trace.

    recorder = Recorder()
    run_overlapped(ops, states, 2, recorder=recorder)
    recorder.save("decode.trace.json")        # open in ui.perfetto.dev or chrome://tracing
    recorder.summary()                         # busy and overlapped microseconds per track

On CUDA each op is timed by events on the current stream. A communication op (one that
returned an event) is drawn on the communication track, from when the compute stream reached it
(or the previous communication ended) to when its event completed. Without CUDA (or for a
receive hook) times are the host's. Not usable inside CUDA-graph capture: record an eager run.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

COMPUTE, COMMUNICATION, HOST = "compute", "communication", "host"


@dataclass
class _Span:
    name: str
    microbatch: int
    stage: int
    host: tuple[int, int] = (0, 0)  # perf_counter_ns
    events: tuple | None = None  # CUDA events around the op on the current stream
    done: object = None  # a CUDA event after the op's communication finished
    communication: bool = False
    waits: list = field(default_factory=list)


class Recorder:
    def __init__(self, cuda: bool | None = None, rank: int = 0) -> None:
        """cuda: time with CUDA events (default: when CUDA is available). rank: the process
        row the spans are drawn in (Chrome trace `pid`)."""
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.rank = rank
        self.spans: list[_Span] = []
        self._side = None

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def op(self, name: str, microbatch: int, stage: int):
        span = _Span(name, microbatch, stage)
        start = self._event() if self.cuda else None
        begin = time.perf_counter_ns()
        try:
            yield span
        finally:
            span.host = (begin, time.perf_counter_ns())
            if self.cuda:
                span.events = (start, self._event())
            self.spans.append(span)

    def communication(self, name: str, microbatch: int, result) -> None:
        """The op just run started communication that `result` (event or hook) ends."""
        span = self.spans[-1]
        span.communication = True
        event = getattr(result, "event", None)
        if self.cuda and isinstance(event, torch.cuda.Event):
            if self._side is None:
                self._side = torch.cuda.Stream()
            self._side.wait_event(event)
            span.done = torch.cuda.Event(enable_timing=True)
            span.done.record(self._side)

    @contextmanager
    def wait(self, name: str, microbatch: int):
        begin = time.perf_counter_ns()
        try:
            yield
        finally:
            span = next(
                s for s in reversed(self.spans) if s.name == name and s.microbatch == microbatch
            )
            span.waits.append((begin, time.perf_counter_ns()))

    def events(self) -> list[dict]:
        """Chrome trace events ("X" spans, microseconds): one `op` span per op run, on the
        compute or communication track, and the host's time for each op (`host`)."""
        if not self.spans:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        origin_ns = min(s.host[0] for s in self.spans)
        origin = self.spans[0].events[0] if self.cuda else None
        out, communication_free = [], 0.0
        for s in self.spans:
            host_begin = (s.host[0] - origin_ns) / 1e3
            host_end = (s.host[1] - origin_ns) / 1e3
            if self.cuda:
                begin = origin.elapsed_time(s.events[0]) * 1e3
                end = origin.elapsed_time(s.events[1]) * 1e3
                if s.done is not None:
                    end = max(end, origin.elapsed_time(s.done) * 1e3)
            else:
                begin, end = host_begin, host_end
                if s.waits:  # a communication op ends when its result was waited for
                    end = max(end, (s.waits[-1][1] - origin_ns) / 1e3)
            track = COMMUNICATION if s.communication else COMPUTE
            if s.communication:  # one communication stream: it starts when the previous ends
                begin = max(begin, communication_free)
                communication_free = end = max(end, begin)
            args = {"microbatch": s.microbatch, "stage": s.stage}
            out.append(self._span(s.name, "op", track, begin, end, args))
            out.append(self._span(s.name, "host", HOST, host_begin, host_end, args))
        return out

    def _span(self, name, category, track, begin, end, args) -> dict:
        return {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": round(begin, 3),
            "dur": round(max(end - begin, 0.0), 3),
            "pid": self.rank,
            "tid": track,
            "args": args,
        }

    def trace(self) -> dict:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.trace()))
        return path

    def summary(self) -> dict[str, float]:
        """Microseconds: the span of the whole run, the busy time of the compute and the
        communication tracks, and how much of the communication ran while compute did."""
        return summarize(self.events())


def summarize(events: list[dict]) -> dict[str, float]:
    ops = [e for e in events if e["cat"] == "op"]
    tracks = {
        track: _union([(e["ts"], e["ts"] + e["dur"]) for e in ops if e["tid"] == track])
        for track in (COMPUTE, COMMUNICATION)
    }
    hidden = _length(_intersection(tracks[COMPUTE], tracks[COMMUNICATION]))
    communication = _length(tracks[COMMUNICATION])
    ends = [e["ts"] + e["dur"] for e in ops]
    return {
        "total_us": (max(ends) - min(e["ts"] for e in ops)) if ops else 0.0,
        "compute_us": _length(tracks[COMPUTE]),
        "communication_us": communication,
        "hidden_us": hidden,
        "hidden_share": hidden / communication if communication else 0.0,
    }


def _union(intervals):
    merged = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return merged


def _intersection(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        begin, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if begin < end:
            out.append([begin, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals) -> float:
    return sum(end - begin for begin, end in intervals)
