"""The figures of a benchmark run, computed from its requests' measurements alone.

`summarize(records, mode)` gives one run's JSON object (docs/ref-server.md lists its fields):
- throughput: prompt and output tokens of the requests that ended without error, divided by
  the run's duration (the first request sent to the last one ended);
- TTFT: first output token minus sending; TPOT: (last token - first token) / (tokens - 1),
  per request with at least two tokens; latency: end minus sending (mean, p50, p90, p99:
  linear interpolation between the closest ranks, numpy's default);
- cache-hit share: the cached prompt tokens the server reported over all prompt tokens;
- errors by status (gRPC status names, `HTTP 429`, ...) with the first request's message of
  each, and finish reasons;
- fill mode only, the full-batch window: from the moment the last request got its second
  token (every request decoding: in the disaggregated flow the first token comes from the
  prefill instance, and a request may wait for decode room after it) to the first request's
  last token (a request that samples eos ends it early; under 2 decode steps it is no
  window). Its output tok/s (tokens that arrived in the window over its length) is the
  saturation figure, comparable with other servers' figures at a full decode batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

SCHEMA = "ref-server-bench/1"
MODES = ("rate", "concurrency", "fill")


@dataclass(frozen=True)
class Mode:
    """How requests were sent: `rate` (requests/s, Poisson arrivals), `concurrency` (that many
    in flight, each next one sent when one ends) or `fill` (that many at once)."""

    kind: str
    value: float  # requests/s for rate; a whole number (int) for concurrency and fill

    def __post_init__(self) -> None:
        if self.kind not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.kind!r}")
        if not 0 < self.value < float("inf"):
            raise ValueError(f"{self.kind} must be a finite number > 0, got {self.value:g}")
        if self.kind != "rate":
            if self.value != int(self.value):
                raise ValueError(f"{self.kind} must be a whole number, got {self.value:g}")
            object.__setattr__(self, "value", int(self.value))  # 8, not 8.0, in the report

    @property
    def label(self) -> str:
        if self.kind == "fill":
            return f"saturation (fill {self.value})"
        if self.kind == "rate":
            return f"steady state (rate {self.value:g} req/s)"
        return f"steady state (concurrency {self.value})"


@dataclass
class Record:
    """One request's measurements; times in seconds since its run started."""

    sent_s: float
    prompt_tokens: int  # as the server's usage counts them (as sent without usage)
    max_tokens: int
    token_s: list[float] = field(default_factory=list)  # when each output token arrived
    end_s: float = 0.0
    cached_tokens: int = 0
    finish_reason: str = ""  # stop, length or abort; "" after an error
    error: str = ""  # what ended it otherwise: a gRPC status name, "HTTP 429", ...
    detail: str = ""  # the server's message with the error

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.sent_s if self.token_s else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_s) < 2:
            return None
        return (self.token_s[-1] - self.token_s[0]) / (len(self.token_s) - 1)


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90 and p99 of `values` (None each when there are none)."""
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p99"))
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"mean": float(np.mean(values)), "p50": p50, "p90": p90, "p99": p99}


class NoFullBatch(ValueError):
    """The requests of a fill run never all decoded at once."""


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float
    output_tokens: int  # tokens that arrived in (start_s, end_s]

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    def as_dict(self) -> dict:
        return {
            "start_s": self.start_s,
            "end_s": self.end_s,
            "seconds": self.seconds,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tokens / self.seconds,
        }


def full_batch_window(records: list[Record]) -> Window:
    """The span in which every request was decoding (see the module's doc); NoFullBatch says
    why there is none."""
    if failed := [r for r in records if r.error]:
        raise NoFullBatch(f"{len(failed)} of {len(records)} requests failed")
    if short := [r for r in records if len(r.token_s) < 3]:
        raise NoFullBatch(
            f"{len(short)} requests ended with fewer than 3 tokens; ask for more output tokens"
        )
    start = max(r.token_s[1] for r in records)
    end = min(r.token_s[-1] for r in records)
    if end <= start:
        raise NoFullBatch(
            f"a request ended {start - end:.3f} s before the last one started decoding: the "
            "server did not run them all at once (too few sequences per decode batch, or too "
            "few output tokens asked)"
        )
    tokens = sum(start < t <= end for r in records for t in r.token_s)
    if tokens < 2 * len(records):
        first = min(records, key=lambda r: r.token_s[-1])
        raise NoFullBatch(
            f"the full batch lasted {end - start:.3f} s, {tokens} tokens, under 2 decode steps "
            f"of {len(records)}: a request ended ({first.finish_reason}) after "
            f"{len(first.token_s)} tokens"
        )
    return Window(start, end, tokens)


def summarize(records: list[Record], mode: Mode) -> dict:
    """One run's figures (module doc); `records` in the order the workload made them."""
    ok = [r for r in records if not r.error]
    errors = Counter(r.error for r in records if r.error)
    duration = max(r.end_s for r in records) - min(r.sent_s for r in records)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(len(r.token_s) for r in ok)
    run = {
        "label": mode.label,
        "mode": mode.kind,
        "value": mode.value,
        "requests": {
            "sent": len(records),
            "ok": len(ok),
            "errors": dict(errors),
            "error_examples": {e: next(r.detail for r in records if r.error == e) for e in errors},
            "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        },
        "tokens": {"prompt": prompt, "cached": cached, "output": output},
        "cache_hit_share": cached / prompt if prompt else None,
        "duration_s": duration,
        "throughput": {
            "input_tok_s": prompt / duration if duration > 0 else None,
            "output_tok_s": output / duration if duration > 0 else None,
            "requests_per_s": len(ok) / duration if duration > 0 else None,
        },
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "latency_s": distribution([r.end_s - r.sent_s for r in ok]),
    }
    if mode.kind == "fill":
        try:
            run["window"], run["window_problem"] = full_batch_window(records).as_dict(), None
        except NoFullBatch as problem:
            run["window"], run["window_problem"] = None, str(problem)
    run["records"] = [
        {
            "sent_s": r.sent_s,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "output_tokens": len(r.token_s),
            "max_tokens": r.max_tokens,
            "ttft_s": r.ttft_s,
            "latency_s": r.end_s - r.sent_s,
            "finish_reason": r.finish_reason,
            "error": r.error,
        }
        for r in records
    ]
    return run


def headline_output_tok_s(run: dict) -> float | None:
    """The run's output tok/s: over the full-batch window in fill mode, else the whole run."""
    if run["mode"] == "fill":
        return run["window"]["output_tok_s"] if run["window"] else None
    return run["throughput"]["output_tok_s"]
