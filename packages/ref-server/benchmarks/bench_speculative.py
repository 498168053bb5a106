"""MTP speculative decoding: the cost of its draft and verify steps against a decode step, and an
engine's decode tokens per second against the acceptance rate.

    python benchmarks/bench_speculative.py [--preset v2-lite] [--prompt 512]
        [--batches 1,8,32,64,128,256] [--engine-batches 1,32,128] [--draft-tokens 1,2,3]
        [--rates 0,0.25,0.5,0.7,0.85,0.9,1] [--steps 10] [--reps 5]
        [--device cuda|cpu] [--json results.json]

Random weights from the preset with its MTP module (`from_preset(mtp=True)`; tiny on the CPU).
Random weights draft almost nothing the model accepts, so the engine's acceptance is forced:
with `forced_acceptance=a` each draft is kept with probability a whatever the models say, up to
the first rejected one, so a round of k drafts keeps a + a^2 + ... + a^k of them on average.

Step costs, at each batch of `--batches` with `--prompt` tokens of each sequence in the cache
(one eager prefill; the module's rows a copy of the last layer's), each step the median of
`--reps` calls after two, the device synchronized, over the same cache rows every call, its new
tokens on the host as an engine's step prepares them:
- decode: one token a sequence (`forward_step`), eagerly and replayed from CUDA graphs
  (`DecodeGraphs`, on CUDA), the latter as the plain engine runs it;
- verify: k + 1 tokens a sequence through `SpeculativeSteps.verify` (the MLA decode kernel at
  s_q = k + 1), what `ModelRunner.verify` runs before accepting;
- draft: k tokens a sequence through `SpeculativeSteps.draft` after a verify step that kept
  every draft (the module over k + 1 rows a sequence, then k - 1 times over one), greedy, as
  `ModelRunner.draft` runs it, the drafts read on the host.
Verify and draft run eagerly (the engine's default) and, on CUDA, replayed from the graphs that
`SpeculativeSteps` captures at the batch (what the engine runs with REF_SERVER_MTP_GRAPHS=1).
On CUDA also each graph's replay alone: its GPU time, the host's launch hidden
(`replay_seconds`). Break-even: the tokens a round must give a sequence for verify + draft to
cost what as many decode steps cost, (verify + draft) / decode: eager and graphs each against
the decode graphs (the plain engine's path), and replay against replay.

Engine, at each batch of `--engine-batches`: `batch` requests of `--prompt` random tokens
through an `Engine` as a server drives it (bench_model's `engine_for` and `fill`; end tokens
ignored, so the batch keeps its size), prefilled, two untimed steps, then `--steps` timed ones:
first the plain engine (its decode steps replayed from CUDA graphs on CUDA), then one engine
per K of `--draft-tokens` (`Engine(draft_tokens=K)`, the drafts accepted per sequence on the
host) with its verify and draft steps eager, and on CUDA another with REF_SERVER_MTP_GRAPHS=1
(replayed from graphs; with `--temperature` above 0 its drafts are sampled eagerly, and a third
engine, path "graphs-sampling", adds REF_SERVER_MTP_SAMPLED_GRAPHS=1: the drafts sampled in
the draft graphs), each at each rate of `--rates`, with fresh requests for each rate
(every rate starts from the same context length); each row names its path. Tokens per second:
the timed steps' tokens over their seconds; beside it the accepted length measured
(`Engine.speculative_stats`) and the one the rate gives, and each step's time split into verify
(`ModelRunner.verify`, the acceptance included), draft (`ModelRunner.draft`) and the rest (the
scheduler). Each request has a seed of its own: the acceptance draws are keyed by (seed,
position), so with one seed every sequence would keep the same drafts.

Projected: the speed-up over the plain engine at DeepSeek-V3's published acceptance of 85-90 %
(of the second token, K = 1), read off each path's curve (interpolated between the measured
rates): what a module that drafts as well as V3's would give through this engine, beside V3's
published 1.8x.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import time
from unittest import mock

import numpy as np
import torch
from bench_model import (
    engine_for,
    fill,
    median_seconds,
    replay_seconds,
    step_times,
)

import ref_server.model as M
from ref_server.engine.model_runner import MTP_GRAPHS, MTP_SAMPLED_GRAPHS
from ref_server.model import SamplingParams, StepBatch
from ref_server.model.speculative import MAX_DRAFT_TOKENS, SpeculativeStats, check_draft_tokens
from ref_server.model.speculative_graphs import SpeculativeSteps

PUBLISHED = dict(
    source="DeepSeek-V3 technical report (arXiv:2412.19437), section 5.4.3",
    acceptance=(0.85, 0.90),  # of the second token: one draft a round
    draft_tokens=1,
    speedup=1.8,  # "1.8 times TPS", their deployment
)
PAGE = 64
PREFILL_CHUNK = 16384  # tokens a prefill step of the step costs' cache takes at most


def context_cache(model, batch: int, prompt: int, device: torch.device):
    """A cache holding `prompt` tokens of each of `batch` sequences, with room for the most
    rows a verify step and the drafts after it write, and its block table `[batch, pages]`."""
    pages = -(-(prompt + 2 * MAX_DRAFT_TOKENS) // PAGE)
    cache = M.PagedKVCache(model.args, batch * pages, PAGE, torch.bfloat16, device)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    per_step = max(1, PREFILL_CHUNK // prompt)
    for first in range(0, batch, per_step):
        rows = table[first : first + per_step]
        ids = torch.randint(2, model.args.vocab_size, (len(rows) * prompt,), device=device)
        model.forward_step(StepBatch(ids, [prompt] * len(rows), [prompt] * len(rows), rows), cache)
    # the module attends to these rows: the model's last layer's stand in for its own
    cache.layers[-1].copy_(cache.layers[-2])
    return cache, table


def new_tokens(model, table, prompt: int, n: int) -> StepBatch:
    """n random new tokens for each sequence of `table` after its `prompt` cached ones, on the
    host as an engine's step prepares them."""
    batch = len(table)
    ids = torch.randint(2, model.args.vocab_size, (batch * n,))
    return StepBatch(ids, [n] * batch, [prompt + n] * batch, table)


def step_costs(model, cache, table, batch, prompt, draft_tokens, reps) -> list[dict]:
    """One row per k of draft_tokens: decode, verify and draft at `batch` sequences (the first
    rows of `table`) of `prompt` cached tokens, eagerly and on CUDA from graphs; milliseconds."""
    device, table = cache.device, table[:batch]
    cuda = device.type == "cuda"

    def decode_step(step) -> float:
        return ms(median_seconds(lambda: step(new_tokens(model, table, prompt, 1)), device, reps))

    decode = dict(
        decode_eager_ms=decode_step(lambda tokens: model.forward_step(tokens, cache)),
        decode_graphs_ms=None,
        decode_replay_ms=None,
    )
    if cuda:
        graphs = M.DecodeGraphs(model, cache, batch_sizes=[batch], max_blocks=table.shape[1])
        decode["decode_graphs_ms"] = decode_step(graphs)
        decode["decode_replay_ms"] = ms(replay_seconds(graphs.graphs[batch].replay, reps))
        del graphs
        free_device_memory(model)  # the graphs' pool
    plain = decode["decode_graphs_ms"] or decode["decode_eager_ms"]
    rows = []
    for k in draft_tokens:
        row = dict(batch=batch, k=k, **decode)
        for path in ("eager", "graphs"):
            row |= speculative_costs(model, cache, table, prompt, k, reps, path)
            free_device_memory(model)  # the steps' graphs' pool
        row["break_even_eager"] = ratio((row["verify_eager_ms"], row["draft_eager_ms"]), plain)
        row["break_even_graphs"] = ratio((row["verify_graphs_ms"], row["draft_graphs_ms"]), plain)
        row["break_even_replay"] = ratio(
            (row["verify_replay_ms"], row["draft_replay_ms"]), row["decode_replay_ms"]
        )
        rows.append(row)
    return rows


def speculative_costs(model, cache, table, prompt, k, reps, path: str) -> dict:
    """Milliseconds of `SpeculativeSteps`' verify (k + 1 tokens a sequence) and draft (k tokens
    a sequence, greedy, after a verify step that kept every draft) as the engine's runner calls
    them, on `path`: "eager", or "graphs" replayed (with each replay's GPU time; None off
    CUDA)."""
    names = [f"verify_{path}_ms", f"draft_{path}_ms"]
    graphs = path == "graphs"
    if graphs:
        names += ["verify_replay_ms", "draft_replay_ms"]
        if cache.device.type != "cuda":
            return dict.fromkeys(names)
    batch, device = len(table), cache.device
    steps = SpeculativeSteps(
        model, cache, k, max_blocks=table.shape[1], batch_sizes=[batch], capture_graphs=graphs
    )
    dtype = model.embed_tokens.weight.dtype
    hidden = torch.randn(batch * (k + 1), model.args.hidden_size, device=device, dtype=dtype)
    params, counts = [SamplingParams()] * batch, [k] * batch

    def verify() -> None:
        steps.verify(new_tokens(model, table, prompt, k + 1))

    def draft() -> None:
        steps.draft(new_tokens(model, table, prompt, k + 1), hidden, params, counts)

    seconds = [median_seconds(verify, device, reps), median_seconds(draft, device, reps)]
    if graphs:
        seconds += [
            replay_seconds(steps.graphs[step, batch].replay, reps) for step in ("verify", "draft")
        ]
    return {name: ms(s) for name, s in zip(names, seconds, strict=True)}


def ratio(parts: tuple, whole: float | None) -> float | None:
    """sum(parts) / whole; None where any is."""
    return None if whole is None or None in parts else sum(parts) / whole


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


class RunnerTimes:
    """Seconds an engine's runner spends in `verify` and `draft`, its methods wrapped. Both end
    reading tokens on the host, so the device has finished their work when they return."""

    def __init__(self, runner) -> None:
        self.seconds = dict(verify=0.0, draft=0.0)
        for name in self.seconds:
            setattr(runner, name, self._timed(name, getattr(runner, name)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def expected_accepted_length(rate: float, k: int) -> float:
    """Tokens a round gives a sequence on average when each of its k drafts is kept with
    probability `rate` up to the first rejected one: 1 + rate + ... + rate^k."""
    return sum(rate**j for j in range(k + 1))


def curve_engine(model, batch: int, prompt: int, k: int, steps: int, graphs: str = "eager"):
    """An engine of k drafts a round (0: none) for `batch` requests of `prompt` tokens, its
    speculative steps as graphs says ("eager", "graphs", "graphs-sampling": REF_SERVER_MTP_GRAPHS
    and REF_SERVER_MTP_SAMPLED_GRAPHS), and the max_tokens its requests take: none ends within
    two untimed and `steps` timed steps."""
    # room for every round's k drafts up to the last step's: max_tokens never cuts one short
    max_tokens = (steps + 3) * (k + 1)
    switches = {
        MTP_GRAPHS: "0" if graphs == "eager" else "1",
        MTP_SAMPLED_GRAPHS: "1" if graphs == "graphs-sampling" else "0",
    }
    with mock.patch.dict(os.environ, switches):
        engine = engine_for(model, batch, prompt + max_tokens, draft_tokens=k)
    # random weights' argmax may be the end token at any step: the batch must keep its size
    engine.eos_ids = frozenset()
    return engine, max_tokens


def refill(engine, batch: int, prompt: int, max_tokens: int, temperature: float) -> None:
    """Fresh requests (`fill`; those running aborted, so that every run starts from the same
    context length), stepped twice past their prefill, untimed."""
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)
    fill(engine, batch, prompt, max_tokens, temperature)
    step_times(engine, 2)


def timed_total(engine, steps: int) -> tuple[int, float]:
    """The tokens and seconds of `steps` engine steps together."""
    tokens, seconds = zip(*step_times(engine, steps), strict=True)
    return sum(tokens), sum(seconds)


def engine_curve(model, batch, prompt, draft_tokens, rates, steps, temperature) -> list[dict]:
    """The plain engine's decode tokens per second at `batch`, then for each K of draft_tokens
    a row per forced acceptance rate, its steps eager and on CUDA also from graphs (see the
    module's docstring); requests sampled at temperature (0: greedy)."""
    plain, max_tokens = curve_engine(model, batch, prompt, 0, steps)
    refill(plain, batch, prompt, max_tokens, temperature)
    tokens, seconds = timed_total(plain, steps)
    plain_tok_s = tokens / seconds
    path = "graphs" if plain.runner.decode_graphs else "eager"
    del plain
    rows = [
        dict(
            batch=batch,
            draft_tokens=0,
            decode_path=path,
            tokens=tokens,
            tok_s=plain_tok_s,
            speedup=1.0,
            step_ms=seconds / steps * 1e3,
        )
    ]
    paths = ["eager"]
    if model.embed_tokens.weight.is_cuda:
        paths += ["graphs", "graphs-sampling"] if temperature else ["graphs"]
    for k, path in itertools.product(draft_tokens, paths):
        free_device_memory(model)  # the last engine's cache and graphs, before this one's
        engine, max_tokens = curve_engine(model, batch, prompt, k, steps, path)
        speculative = engine.runner.speculative
        taken = "graphs" if speculative.captured else "eager"
        taken += "-sampling" if speculative.sampling is not None else ""
        assert taken == path, f"asked for the {path} path, the runner took {taken}"
        parts, stats = RunnerTimes(engine.runner), engine.speculative_stats
        for rate in rates:
            engine.forced_acceptance = rate
            refill(engine, batch, prompt, max_tokens, temperature)
            before, spent = dataclasses.replace(stats), dict(parts.seconds)
            tokens, seconds = timed_total(engine, steps)
            counted = SpeculativeStats(
                stats.drafted - before.drafted,
                stats.accepted - before.accepted,
                stats.rounds - before.rounds,
            )
            verify_s, draft_s = (parts.seconds[n] - spent[n] for n in ("verify", "draft"))
            rows.append(
                dict(
                    batch=batch,
                    draft_tokens=k,
                    forced_acceptance=rate,
                    decode_path=path,
                    tokens=tokens,
                    tok_s=tokens / seconds,
                    speedup=tokens / seconds / plain_tok_s,
                    step_ms=seconds / steps * 1e3,
                    verify_ms=verify_s / steps * 1e3,
                    draft_ms=draft_s / steps * 1e3,
                    accepted_length=counted.accepted_length,
                    expected_accepted_length=expected_accepted_length(rate, k),
                    acceptance_rate=counted.acceptance_rate,
                )
            )
        del engine, parts
    free_device_memory(model)
    return rows


def free_device_memory(model) -> None:
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.empty_cache()


def projection(rows: list[dict]) -> list[dict]:
    """For each batch, K and path of the engine's rows: tok/s and speed-up over the plain
    engine at each published acceptance rate, interpolated between the measured rates (none
    where the measured rates do not span it)."""
    found = []
    plain = {row["batch"]: row["tok_s"] for row in rows if row["draft_tokens"] == 0}
    for batch, k, path in dict.fromkeys(
        (r["batch"], r["draft_tokens"], r["decode_path"]) for r in rows if r["draft_tokens"]
    ):
        curve = sorted(
            (r["forced_acceptance"], r["tok_s"])
            for r in rows
            if (r["batch"], r["draft_tokens"], r["decode_path"]) == (batch, k, path)
        )
        rates, tok_s = zip(*curve, strict=True)
        for rate in PUBLISHED["acceptance"]:
            if rates[0] <= rate <= rates[-1]:
                projected = float(np.interp(rate, rates, tok_s))
                found.append(
                    dict(
                        batch=batch,
                        draft_tokens=k,
                        decode_path=path,
                        acceptance=rate,
                        tok_s=projected,
                        speedup=projected / plain[batch],
                    )
                )
    return found


def cell(value, form: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{form}}"


def print_step_costs(rows: list[dict]) -> None:
    print(
        "\nstep costs, ms: each step's wall time eager and from CUDA graphs (verify and draft "
        "through SpeculativeSteps, as the engine runs them), and a replay's GPU time; "
        "break-even: the tokens a round must give a sequence for verify + draft to cost what "
        "decoding them does, each path against the plain engine's decode (graphs where there "
        "are), and replays against the decode's replay\n"
        "batch | k | decode: graphs | replay |  eager | verify, k + 1 tokens: eager | graphs "
        "| replay | draft, k tokens: eager | graphs | replay "
        "| break-even: eager / plain | graphs / plain | replay / replay"
    )
    for r in rows:
        print(
            f"{r['batch']:5d} | {r['k']} | {cell(r['decode_graphs_ms'], '.3f', 14)} | "
            f"{cell(r['decode_replay_ms'], '.3f', 6)} | {r['decode_eager_ms']:6.2f} | "
            f"{r['verify_eager_ms']:27.2f} | {cell(r['verify_graphs_ms'], '.3f', 6)} | "
            f"{cell(r['verify_replay_ms'], '.3f', 6)} | {r['draft_eager_ms']:22.2f} | "
            f"{cell(r['draft_graphs_ms'], '.3f', 6)} | {cell(r['draft_replay_ms'], '.3f', 6)} | "
            f"{r['break_even_eager']:25.2f} | {cell(r['break_even_graphs'], '.2f', 14)} | "
            f"{cell(r['break_even_replay'], '.2f', 15)}"
        )


def print_engine(rows: list[dict]) -> None:
    print(
        "\nengine decode (path: the plain engine's decode steps', a speculative engine's "
        "verify and draft steps', from graphs with REF_SERVER_MTP_GRAPHS=1)\n"
        "batch |     K |   path | forced acceptance |    tok/s | x plain "
        "| accepted length: measured | expected | ms a step | verify | draft |  rest"
    )
    for r in rows:
        if not r["draft_tokens"]:
            print(
                f"{r['batch']:5d} | {'plain':>5} | {r['decode_path']:>6} | {'-':>17} | "
                f"{r['tok_s']:8.1f} | {1:7.2f} | "
                f"{'-':>25} | {'-':>8} | {r['step_ms']:9.2f} |"
            )
            continue
        rest = r["step_ms"] - r["verify_ms"] - r["draft_ms"]
        print(
            f"{r['batch']:5d} | {r['draft_tokens']:5d} | {r['decode_path']:>6} | "
            f"{r['forced_acceptance']:17.2f} | "
            f"{r['tok_s']:8.1f} | {r['speedup']:7.2f} | {r['accepted_length']:25.2f} | "
            f"{r['expected_accepted_length']:8.2f} | {r['step_ms']:9.2f} | "
            f"{r['verify_ms']:6.2f} | {r['draft_ms']:5.2f} | {rest:5.2f}"
        )


def print_projection(rows: list[dict]) -> None:
    published = PUBLISHED["speedup"]
    print(
        f"\nprojected: the curve read at DeepSeek-V3's published acceptance (forced on random "
        f"weights); published: {published}x TPS at 85-90 % with one draft ({PUBLISHED['source']}; "
        "their deployment, against a published figure)\n"
        "batch | K |   path | acceptance |    tok/s | x plain (projected) "
        f"| over the published {published}x"
    )
    for r in rows:
        against = (
            r["speedup"] / published if r["draft_tokens"] == PUBLISHED["draft_tokens"] else None
        )
        print(
            f"{r['batch']:5d} | {r['draft_tokens']} | {r['decode_path']:>6} | "
            f"{r['acceptance']:10.2f} | "
            f"{r['tok_s']:8.1f} | {r['speedup']:19.2f} | {cell(against, '.2f', 27)}"
        )


def positive_ints(option: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{option} takes integers >= 1 separated by commas, got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    try:
        rates = sorted({float(v) for v in text.split(",")})
    except ValueError:
        rates = [math.nan]
    if not 0 <= rates[0] <= rates[-1] <= 1:
        raise ValueError(f"--rates takes rates from 0 to 1 separated by commas, got {text!r}")
    return rates


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--preset", choices=list(M.PRESETS), help="default: v2-lite, tiny on CPU")
    parser.add_argument("--prompt", type=int, default=512, help="cached tokens a sequence")
    parser.add_argument("--batches", default="1,8,32,64,128,256", help="of the step costs")
    parser.add_argument("--engine-batches", default="1,32,128", help="of the engine's curve")
    parser.add_argument("--draft-tokens", default="1,2,3", help="k, K: drafts a round (1-3)")
    parser.add_argument("--rates", default="0,0.25,0.5,0.7,0.85,0.9,1", help="forced acceptance")
    parser.add_argument("--steps", type=int, default=10, help="timed engine steps a rate")
    parser.add_argument("--reps", type=int, default=5, help="timed calls of each step cost")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="the engine's requests' (0: greedy)"
    )
    parser.add_argument("--json")
    options = parser.parse_args(argv)
    try:
        batches = positive_ints("--batches", options.batches)
        engine_batches = positive_ints("--engine-batches", options.engine_batches)
        draft_tokens = positive_ints("--draft-tokens", options.draft_tokens)
        for k in draft_tokens:
            check_draft_tokens(k)
        rates = rate_list(options.rates)
        for name in ("prompt", "steps", "reps"):
            positive_ints(f"--{name}", str(getattr(options, name)))
        if not 0 <= options.temperature <= 100:  # NaN fails too
            raise ValueError(f"--temperature takes 0 to 100, got {options.temperature}")
    except ValueError as error:
        parser.error(str(error))
    if options.device == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA device here")
    device = torch.device(options.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = options.preset or ("v2-lite" if device.type == "cuda" else "tiny")
    started = time.perf_counter()
    model = M.from_preset(preset, mtp=True, seed=0, dtype=dtype, device=device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"model {preset} ({model.args.num_hidden_layers} layers and the MTP module, "
        f"{parameters / 1e9:.2f} B parameters), random weights, {where}, {dtype}; "
        f"{options.prompt} tokens a sequence before decoding; the engine's requests "
        + (f"sampled at temperature {options.temperature:g}" if options.temperature else "greedy")
    )
    document = dict(vars(options), device=where, preset=preset, published=PUBLISHED)

    def save(**found) -> None:  # after each part: a failure later keeps what was measured
        document.update(found)
        if options.json:
            with open(options.json, "w") as f:
                json.dump(document, f, indent=1)

    cache, table = context_cache(model, max(batches), options.prompt, device)
    costs = []
    for batch in batches:
        costs += step_costs(model, cache, table, batch, options.prompt, draft_tokens, options.reps)
    print_step_costs(costs)
    print(f"step costs measured: {time.perf_counter() - started:.0f} s from the start")
    save(step_costs=costs)
    del cache
    free_device_memory(model)  # the step costs' cache, before the engines'
    curve = []
    for batch in engine_batches:
        curve += engine_curve(
            model, batch, options.prompt, draft_tokens, rates, options.steps, options.temperature
        )
    print_engine(curve)
    projected = projection(curve)
    print_projection(projected)
    save(engine=curve, projection=projected)
    print(f"bench_speculative: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
