"""Runs a benchmark: probe the target, then for each mode of the sweep send the workload's
requests on that schedule and summarize what came back.

Schedules (`Mode`):
- rate R: open loop, Poisson arrivals (exponential gaps of mean 1/R s from the seed; the first
  request at 0), each request sent at its time whatever is still in flight;
- concurrency C: closed loop, C requests in flight, the next sent as soon as one ends;
- fill N: N requests sent at once; the report measures the window in which all N decode.

All requests of a run share one event loop (and one gRPC channel or HTTP client), so a single
process drives thousands of streams; request i samples with seed `seed + i`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from ref_server.bench.report import SCHEMA, Mode, Record, summarize
from ref_server.bench.targets import GrpcTarget, OpenAITarget
from ref_server.bench.workload import BenchRequest, Workload

DEFAULT_REQUESTS = 64


def request_count(mode: Mode, workload: Workload, requests: int | None) -> int:
    """How many requests a run sends: N for fill N; else `requests`, or the length file's
    lines, or DEFAULT_REQUESTS."""
    if mode.kind == "fill":
        if requests is not None:
            raise ValueError("fill N sends N requests; leave out --requests")
        return mode.value
    if requests is not None:
        if requests <= 0:
            raise ValueError(f"requests must be > 0, got {requests}")
        return requests
    return len(workload.length_file.rows) if workload.length_file else DEFAULT_REQUESTS


def arrival_times(rate: float, count: int, seed: int) -> list[float]:
    """Seconds from the start at which each of `count` requests is sent: a Poisson process of
    `rate` per second (exponential gaps), the first at 0."""
    gaps = np.random.default_rng([seed, 3]).exponential(1 / rate, count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def send_all(
    target: GrpcTarget | OpenAITarget,
    jobs: list[BenchRequest],
    mode: Mode,
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> list[Record]:
    """Every job's record, in the jobs' order, sent on `mode`'s schedule."""
    records: list[Record | None] = [None] * len(jobs)
    async with target:
        origin = time.perf_counter()

        async def one(i: int) -> None:
            records[i] = await target.send(jobs[i], seed + i, origin)
            on_done()

        if mode.kind == "rate":
            tasks = []
            for i, at in enumerate(arrival_times(mode.value, len(jobs), seed)):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - origin)))
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        else:
            pending = iter(range(len(jobs)))

            async def worker() -> None:
                for i in pending:
                    await one(i)

            width = len(jobs) if mode.kind == "fill" else mode.value
            await asyncio.gather(*(worker() for _ in range(min(width, len(jobs)))))
    return records


def run_bench(
    target: GrpcTarget | OpenAITarget,
    workload: Workload,
    modes: list[Mode],
    requests: int | None = None,
    vocab_size: int | None = None,
    console=None,
) -> dict:
    """The JSON document of a sweep (docs/ref-server.md): one run per mode, each with its own
    prompts (`Workload.requests(run=...)`). vocab_size: the range of prompt token ids, by
    default the model's (gRPC tells it, and ref-server's /v1/models; another OpenAI server may
    not). console: a rich Console for
    the progress bar (shown on terminals only)."""
    counts = [request_count(mode, workload, requests) for mode in modes]  # bad input first
    facts = target.probe()
    vocab = vocab_size or facts.vocab_size
    if vocab is None:
        raise ValueError(
            "--api openai needs --vocab-size (the range of prompt token ids): this server's "
            "/v1/models does not tell the model's vocabulary"
        )
    if facts.vocab_size and vocab > facts.vocab_size:
        raise ValueError(f"vocab size {vocab} is over the model's {facts.vocab_size}")
    if facts.max_model_len:
        for count in set(counts):
            workload.check_context(count, facts.max_model_len)
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    disable = console is None or not console.is_terminal
    runs = []
    with Progress(*columns, console=console, disable=disable) as progress:
        for run, (mode, count) in enumerate(zip(modes, counts, strict=True)):
            jobs = workload.requests(count, vocab, run=run)
            bar = progress.add_task(mode.label, total=count)
            records = asyncio.run(
                send_all(
                    target, jobs, mode, workload.seed, functools.partial(progress.advance, bar)
                )
            )
            runs.append(summarize(records, mode))
    return {
        "schema": SCHEMA,
        "api": target.api,
        "target": target.address,
        "model": {
            "name": facts.name,
            "vocab_size": facts.vocab_size,
            "max_model_len": facts.max_model_len,
        },
        "workload": {**workload.describe(), "prompt_token_ids_below": vocab},
        "runs": runs,
    }
