"""Prefill and decode throughput of the model, next to the roofline from FLOPs and bytes.

    python benchmarks/bench_model.py [--preset v2-lite] [--layers N] [--prompt 512]
                                     [--batches 1,8,32,128,256] [--weight-dtype bf16|fp8]
                                     [--kernels ours,deepseek] [--overlap-steps off|on]
                                     [--profile] [--trace PATH] [--json results.json]

Random weights from the preset (`--layers` keeps the first N layers, to fit a smaller device;
the default on CPU is `tiny`); `--weight-dtype fp8` keeps the projections DeepSeek stores in
FP8 as e4m3 with 128 x 128 block scales (`from_args(weight_dtype="fp8")`). For each batch
size: one cached prefill step of `--prompt` tokens per sequence, eagerly and (on CUDA, up to
`--prefill-graph-tokens` tokens a step) replayed piecewise from CUDA graphs (`PrefillGraphs`),
then `--steps` decode steps of one random token per sequence (absorbed MLA through
mla_kernels), eagerly and replayed from CUDA graphs (`DecodeGraphs`, on CUDA), each timed as
the median of its repetitions (after two untimed calls) with the device synchronized: these
carry the host's part of a step (its inputs, the metadata). On CUDA also the decode graph's
replay alone (GPU ms a step: 10 replays back to back between events, the median of `--reps`),
which moves only with the kernels, for A/B comparisons of kernel changes. The ratios are of
the graphs' figures where there are graphs. Then the same decode through an `Engine` as a
server drives it (its scheduler, its runner's inputs and decode graphs, greedy sampling, the
tokens back on the host): `batch` requests of `--prompt` random tokens, prefilled, then the
median over `--steps` decode steps of each step's tokens per second; `--overlap-steps on`
queues each engine step before the previous one's tokens are read (`Engine(overlap_steps=)`),
for an A/B against `off`.

Roofline per step, from the same run's measured ceilings (a large matmul, a large copy):
FLOPs = 2 x active parameters x tokens + attention (prefill: causal scores and values on the
decompressed heads; decode: 576 + 512 wide products over the cached context) and bytes =
the weights the step touches (attention, dense layers, shared experts, the routed experts
the step's tokens chose, counted per layer in one eager step of the same inputs (decode: of
random tokens, as the timed steps decode); FP8 ones at 1 byte plus their block scales, as
`ModelArgs.weight_bytes_per_gpu` counts them) + the latent cache read (decode); the bound is
the slower of FLOPs / matmul ceiling and bytes / copy ceiling. The matmul ceiling is the
activations' dtype's (bf16 on CUDA) with FP8 weights too: attention and the head stay bf16,
so a step has no single FP8 rate; an FP8 run also measures torch._scaled_mm (e4m3, per-tensor
scales, 8192^3) and prints it beside, for the headroom of the projections alone.

`--profile`: at the first batch size, each step under torch.profiler: its wall time, its kernels
(CUDA) and its host ops by self time, each as the total, the count and the 20 that took the
longest, with the whole tables in the JSON under `profile`; kernels far below the wall time
mean the host bounds the step. The decode step is a replay of its CUDA graph, or, where
the profiler sees no kernels in a replay, the eager step (the output says which).
`--trace PATH` (implies `--profile`) also writes each step's Chrome trace, PATH with
`-prefill` and `-decode` before its suffix.

`--kernels ours,deepseek` runs the whole table once per kernel set (`kernels` of the model:
ours, or DeepSeek's FlashMLA, DeepGEMM and DeepEP where the model has their parts; see
docs/model.md), each model built from the same seed and fed the same random inputs, then sets
the sets' figures side by side per batch with each one's speed over the first's. The JSON's
rows say their set (`kernels`); `side_by_side` holds the comparison, `profile` each set's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.kernel_choice import KernelsUnavailable, parse_list
from ref_server.model import StepBatch
from ref_server.model.kernel_set import resolve
from ref_server.model.sampling import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, reps: int) -> float:
    for _ in range(2):  # Triton compiles and tunes its kernels for new shapes in the first calls
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replay_seconds(replay, reps: int, group: int = 10) -> float:
    """GPU time of one replay of a CUDA graph: `group` replays back to back between two events
    (the queue stays full, so the host's launch cost hides), the median over `reps` groups. It
    moves only with the kernels, where the decode figures also carry the host's step."""
    replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(group):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / group)
    return statistics.median(times)


def ceilings(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """Measured matmul FLOP/s and copy bytes/s (read + write) on this device."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / median_seconds(lambda: a @ a, device, 10)
    src = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / median_seconds(lambda: dst.copy_(src), device, 10)
    return flops, copy


def fp8_ceiling(device: torch.device) -> float:
    """Measured FP8 matmul FLOP/s: torch._scaled_mm of e4m3 operands with per-tensor scales
    (the second column-major, as it requires), bf16 out, at 8192^3."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)

    def matmul():
        return torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)

    return 2 * n**3 / median_seconds(matmul, device, 10)


def weight_bytes(args: M.ModelArgs, reached: list[int], weight_dtype: str) -> float:
    """Bytes of the weights a step reads, as `ModelArgs.weight_bytes_per_gpu` counts them: all
    but the embedding table (a lookup) and the routed experts no token chose (reached[l]: the
    experts MoE layer l's tokens chose)."""
    experts = args.n_routed_experts
    everything = args.weight_bytes_per_gpu(1, weight_dtype)
    # split over one rank per expert a GPU keeps one routed expert a layer: experts - 1 fewer
    one_each = args.weight_bytes_per_gpu(experts, weight_dtype)
    expert = (everything - one_each) / max(experts - 1, 1) / len(reached)  # one, in one layer
    unused = sum(experts - r for r in reached)
    return everything - unused * expert - 2 * args.vocab_size * args.hidden_size


def step_cost(
    args: M.ModelArgs,
    batch: int,
    new: int,
    context: int,
    cache_bytes: int,
    weight_dtype: str,
    reached: list[int],
):
    """(FLOPs, bytes) of one step: `batch` sequences, `new` tokens each, `context` cached after,
    weights in weight_dtype ("bf16" or "fp8"), reached[l] routed experts chosen in MoE layer l."""
    heads, layers = args.num_attention_heads, args.num_hidden_layers
    tokens = batch * new
    if new == 1:  # absorbed decode: products 576 and 512 wide over the latent cache
        flops = args.matmul_flops(batch) + 2 * layers * batch * heads * (576 + 512) * context
    else:
        flops = batch * args.prefill_flops(new, context - new)
    cache = layers * batch * context * cache_bytes if new == 1 else layers * tokens * cache_bytes
    return flops, weight_bytes(args, reached, weight_dtype) + cache


def reached_experts(model, step) -> list[int]:
    """How many routed experts each MoE layer's tokens chose in one eager `step()`."""
    reached, layers = [], model.moe_layers()
    for moe in layers:

        def recorded(logits, real_rows=None, select=moe.gate.select):
            weights, ids = select(logits, real_rows)
            reached.append(int(ids[ids >= 0].unique().numel()))
            return weights, ids

        moe.gate.select = recorded
    try:
        step()
    finally:
        for moe in layers:
            del moe.gate.select
    return reached


def profile_step(fn, device: torch.device, source: str, trace: str | None = None) -> dict:
    """One call of fn under torch.profiler: its wall time, the host's ops by self time and, on
    CUDA, every kernel (and copy) it ran on the GPU by name; each table sorted by time, with
    counts and shares. A step whose kernels add up to much less than its wall time is bound by
    the host. source: what fn runs, for the reader."""
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync(device)
        wall_s = time.perf_counter() - start
    if trace:
        prof.export_chrome_trace(trace)
    kernels: dict[str, list] = {}
    host: dict[str, list] = {}
    for event in prof.events():
        if event.is_user_annotation:
            continue
        on_gpu = event.device_type == DeviceType.CUDA
        totals, us = (
            (kernels, event.device_time_total) if on_gpu else (host, event.self_cpu_time_total)
        )
        entry = totals.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    found = dict(source=source, wall_ms=wall_s * 1e3, host=_time_table(host))
    if gpu:
        found["kernels"] = _time_table(kernels)
    return found


def _time_table(totals: dict[str, list]) -> dict:
    total_us = sum(us for _, us in totals.values())
    table = [
        dict(name=name, count=count, total_ms=us / 1e3, share=us / total_us if total_us else 0.0)
        for name, (count, us) in sorted(totals.items(), key=lambda item: -item[1][1])
    ]
    count = sum(count for count, _ in totals.values())
    return dict(total_ms=total_us / 1e3, count=count, table=table)


def print_profile(step: str, batch: int, found: dict, top: int = 20) -> None:
    print(f"\n{step} step, batch {batch} ({found['source']}): {found['wall_ms']:.3f} ms wall")
    for what, title in (("kernels", "kernels"), ("host", "host ops (self time)")):
        if what not in found:
            continue
        part = found[what]
        print(
            f"{part['total_ms']:.3f} ms in {part['count']} {title}; the "
            f"{min(top, len(part['table']))} longest:"
        )
        print(f"{'share':>6} | {'ms':>9} | {'count':>5} | name")
        for row in part["table"][:top]:
            print(
                f"{row['share']:6.1%} | {row['total_ms']:9.3f} | {row['count']:5d} | "
                f"{row['name'][:120]}"
            )


def engine_for(model, batch: int, longest: int, **engine_options) -> Engine:
    """An `Engine` (engine_options: its keywords) with pages for `batch` sequences of `longest`
    tokens, without prefill graphs."""
    page = 64
    config = SchedulerConfig(
        num_blocks=batch * -(-longest // page),
        block_size=page,
        max_num_seqs=batch,
        max_model_len=longest,
    )
    return Engine(model, config, prefill_graph_tokens=0, **engine_options)


def fill(
    engine: Engine, batch: int, prompt: int, max_tokens: int, temperature: float = 0.0
) -> None:
    """`batch` requests of `prompt` random tokens, each with room for max_tokens and a seed of
    its own (sampled at temperature; 0: greedy), stepped until every one decodes."""
    vocab = engine.model.args.vocab_size
    for seed in range(batch):
        params = SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature)
        engine.add(torch.randint(2, vocab, (prompt,)).tolist(), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed > 1 for seq in scheduler.running):
        engine.step()


def step_times(engine: Engine, steps: int) -> list[tuple[int, float]]:
    """The tokens and seconds of each of `steps` engine steps."""
    timed = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens = sum(seq.num_new for seq in engine.step())
        timed.append((tokens, time.perf_counter() - start))
    return timed


def engine_decode_tok_s(model, batch: int, prompt: int, steps: int, overlap_steps: str) -> float:
    """Tokens per second of an `Engine`'s decode steps (see the module's docstring)."""
    engine = engine_for(model, batch, prompt + steps + 4, overlap_steps=overlap_steps)
    fill(engine, batch, prompt, steps + 4)
    # two untimed, as median_seconds; fewer than batch tokens if a sequence drew its end token
    timed = step_times(engine, 2 + steps)[2:]
    return statistics.median(tokens / seconds for tokens, seconds in timed)


def trace_path(trace: str | None, step: str) -> str | None:
    if trace is None:
        return None
    path = Path(trace)
    return str(path.with_name(f"{path.stem}-{step}{path.suffix}"))


def run(
    model, batch, prompt, steps, device, reps, graph_tokens, overlap_steps, profiling=False,
    trace=None,
):  # fmt: skip
    """Seconds of a prefill step (eager, and on CUDA from `PrefillGraphs` up to graph_tokens
    tokens) and of a decode step (eager; on CUDA from CUDA graphs, and the graph's replay alone,
    `replay_seconds`), an `Engine`'s decode tokens per second (`engine_decode_tok_s`),
    the context after the timed decode steps, with `profiling` each step's `profile_step`
    (trace: `--trace`), and the experts each MoE layer's tokens chose in each kind of step
    (one eager step of the same inputs: prefill; of random tokens like the timed ones: decode)."""
    args = model.args
    page = 64
    pages = -(-(prompt + 2 * steps * (reps + 2)) // page)
    cache = M.PagedKVCache(args, batch * pages, page, torch.bfloat16, device)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    ids = torch.randint(2, args.vocab_size, (batch * prompt,), device=device)
    prefill = StepBatch(ids, [prompt] * batch, [prompt] * batch, table)
    prefill_s = median_seconds(lambda: model.forward_step(prefill, cache), device, reps)
    prefill_graphs_s = None
    if device.type == "cuda" and batch * prompt <= graph_tokens:
        prefill_graphs = M.PrefillGraphs(model, cache, sizes=[batch * prompt])
        prefill_graphs_s = median_seconds(lambda: prefill_graphs(prefill), device, reps)
        del prefill_graphs
        torch.cuda.empty_cache()  # the graphs' pool, before the decode steps
    reached = dict(prefill=reached_experts(model, lambda: model.forward_step(prefill, cache)))
    profiles = {}
    if profiling:
        profiles["prefill"] = profile_step(
            lambda: model.forward_step(prefill, cache),
            device,
            "eager",
            trace_path(trace, "prefill"),
        )
    length = [prompt]

    def decode(forward):
        length[0] += 1
        tokens = torch.randint(2, args.vocab_size, (batch,), device=device)
        forward(StepBatch(tokens, [1] * batch, [length[0]] * batch, table))

    def eager(b):
        return model.forward_step(b, cache)

    eager_s = median_seconds(lambda: decode(eager), device, steps)
    reached["decode"] = reached_experts(model, lambda: decode(eager))
    graphs_s = replay_s = None
    context = length[0]
    decode_trace = trace_path(trace, "decode")
    if device.type == "cuda":
        graphs = M.DecodeGraphs(model, cache, max_batch=batch, max_blocks=pages)
        graphs_s = median_seconds(lambda: decode(graphs), device, steps)
        context = length[0]
        decode(graphs)  # fills the graph's inputs: the replays below are the kernels alone
        graph = graphs.graphs[graphs.bucket(batch)]
        replay_s = replay_seconds(graph.replay, reps)
        if profiling:
            found = profile_step(graph.replay, device, "CUDA-graph replay", decode_trace)
            if found["kernels"]["count"]:
                profiles["decode"] = found
        del graphs, graph  # the graphs' memory pool, before any eager step below
    if profiling and "decode" not in profiles:
        source = "eager"
        if device.type == "cuda":
            source += ": the profiler saw no kernels in a CUDA-graph replay"
        profiles["decode"] = profile_step(lambda: decode(eager), device, source, decode_trace)
    decode_s = (eager_s, graphs_s, replay_s)
    engine_tok_s = engine_decode_tok_s(model, batch, prompt, steps, overlap_steps)
    return (prefill_s, prefill_graphs_s), decode_s, engine_tok_s, context, profiles, reached


def measure(model, options, device, ceiling, trace) -> tuple[list[dict], dict | None]:
    """Every batch size of `options` through `model`, a row each, printed as a table; with
    profiling, the first batch's profiles (trace: `--trace`'s path for them, or None)."""
    args, (flops_peak, copy_peak) = model.args, ceiling
    profiling = options.profile or trace is not None
    print(
        "batch | prefill tok/s: graphs | eager | roofline | ratio | decode tok/s: graphs | eager "
        "| roofline | ratio | GPU ms a step (replay) | engine tok/s | ratio "
        "| experts chosen a layer: prefill / decode"
    )
    rows = []
    profiled = None
    for i, batch in enumerate(map(int, options.batches.split(","))):
        prefill_times, decode_times, engine_tok_s, context, profiles, reached = run(
            model,
            batch,
            options.prompt,
            options.steps,
            device,
            options.reps,
            options.prefill_graph_tokens,
            options.overlap_steps,
            profiling=profiling and i == 0,
            trace=trace,
        )
        if profiles:
            profiled = dict(batch=batch, **profiles)
        prefill_eager_s, prefill_graphs_s = prefill_times
        eager_s, graphs_s, replay_s = decode_times
        decode_s = graphs_s or eager_s
        prefill_s = prefill_graphs_s or prefill_eager_s
        bounds = []
        for new, ctx, seconds, step in (
            (options.prompt, options.prompt, prefill_s, "prefill"),
            (1, context, decode_s, "decode"),
        ):
            flops, nbytes = step_cost(
                args, batch, new, ctx, 576 * 2, options.weight_dtype, reached[step]
            )
            bound = max(flops / flops_peak, nbytes / copy_peak)
            bounds.append((batch * new / seconds, batch * new / bound))
        (prefill, prefill_bound), (decode, decode_bound) = bounds
        eager = batch / eager_s
        prefill_eager = batch * options.prompt / prefill_eager_s
        rows.append(
            dict(
                kernels=model.kernels.spec,
                batch=batch,
                prefill_tok_s=prefill,
                prefill_eager_tok_s=prefill_eager,
                prefill_roofline=prefill_bound,
                decode_tok_s=decode,
                decode_eager_tok_s=eager,
                decode_roofline=decode_bound,
                decode_replay_ms=replay_s and replay_s * 1e3,
                decode_engine_tok_s=engine_tok_s,
                prefill_experts_reached=reached["prefill"],
                decode_experts_reached=reached["decode"],
            )
        )
        graphs = f"{decode:20.1f}" if graphs_s else f"{'-':>20}"
        prefill_graphs = f"{prefill:22.0f}" if prefill_graphs_s else f"{'-':>22}"
        replay = f"{replay_s * 1e3:22.3f}" if replay_s else f"{'-':>22}"
        mean = {step: sum(r) / len(r) for step, r in reached.items()}
        print(
            f"{batch:5d} | {prefill_graphs} | {prefill_eager:5.0f} | {prefill_bound:8.0f} | "
            f"{prefill / prefill_bound:5.2f} "
            f"| {graphs} | {eager:5.0f} | {decode_bound:8.0f} | {decode / decode_bound:5.2f} "
            f"| {replay} | {engine_tok_s:12.1f} | {engine_tok_s / decode_bound:5.2f} "
            f"| {mean['prefill']:5.1f} / {mean['decode']:5.1f}"
        )
    if profiled:
        for step in ("prefill", "decode"):
            print_profile(step, profiled["batch"], profiled[step])
    return rows, profiled


# The figures `side_by_side` sets beside each other: row key, heading, format.
COMPARED = (
    ("prefill_tok_s", "prefill tok/s", "{:9.0f}"),
    ("decode_tok_s", "decode tok/s", "{:9.1f}"),
    ("decode_replay_ms", "GPU ms a step", "{:9.3f}"),
    ("decode_engine_tok_s", "engine tok/s", "{:9.1f}"),
)


def side_by_side(rows: list[dict], kernels: list[str]) -> list[dict]:
    """Per batch, each figure of `COMPARED` for every kernel set and each set's ratio to the
    first's (of a time, the first's over its: above 1 is faster), printed as a table."""
    first = kernels[0]
    table = []
    batches = dict.fromkeys(row["batch"] for row in rows)
    header = ["batch"]
    for _, heading, _ in COMPARED:
        header += [f"{heading}: {name}" for name in kernels]
        header += [f"speed {name} / {first}" for name in kernels[1:]]
    print("\n" + " | ".join(header))
    for batch in batches:
        of = {row["kernels"]: row for row in rows if row["batch"] == batch}
        entry, cells = dict(batch=batch), [f"{batch:5d}"]
        for key, _, form in COMPARED:
            values = {name: of[name][key] for name in kernels}
            cells += [form.format(v) if v else f"{'-':>9}" for v in values.values()]
            for name in kernels[1:]:
                mine, theirs = values[name], values[first]
                ratio = None
                if mine and theirs:
                    ratio = theirs / mine if key.endswith("_ms") else mine / theirs
                entry[f"{key}_{name}_over_{first}"] = ratio
                cells.append(f"{ratio:6.3f}" if ratio else f"{'-':>6}")
            entry |= {f"{key}_{name}": value for name, value in values.items()}
        print(" | ".join(cells))
        table.append(entry)
    return table


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="v2-lite" if cuda else "tiny")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batches", default="1,8,32,128,256" if cuda else "1,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--weight-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument(
        "--kernels",
        default="ours",
        help="kernel sets to run in turn, side by side (ours, deepseek, deepseek:PART[,PART]; "
        "e.g. ours,deepseek)",
    )
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=16384,
        help="time prefill steps of up to this many tokens from PrefillGraphs too (CUDA)",
    )
    parser.add_argument(
        "--overlap-steps",
        choices=("off", "on"),
        default="off",
        help="the engine's column: each step queued before the previous one's tokens are read",
    )
    parser.add_argument("--profile", action="store_true", help="kernels of the first batch's steps")
    parser.add_argument("--trace", help="Chrome traces of the profiled steps (implies --profile)")
    parser.add_argument("--json")
    options = parser.parse_args()
    if options.trace:
        Path(options.trace).parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    fp8 = options.weight_dtype == "fp8"
    args = M.PRESETS[options.preset]
    if options.layers:
        args = dataclasses.replace(
            args,
            num_hidden_layers=options.layers,
            first_k_dense_replace=min(args.first_k_dense_replace, options.layers),
        )
    try:  # every set's libraries before the first set's minutes of measuring
        kernels = [choice.spec for choice in parse_list(options.kernels)]
        for spec in kernels:
            resolve(spec, device=device, dtype=dtype, fp8=fp8, expert_parallel=False)
    except (ValueError, KernelsUnavailable) as error:
        parser.error(f"--kernels: {error}")
    flops_peak, copy_peak = ceilings(device, dtype)
    fp8_peak = fp8_ceiling(device) if fp8 and cuda else None
    where = torch.cuda.get_device_name() if cuda else "CPU"
    weights = "weights fp8 (e4m3, 128 x 128 block scales)" if fp8 else f"weights {dtype}"
    print(
        f"model {options.preset} ({args.num_hidden_layers} layers, "
        f"{args.num_parameters() / 1e9:.2f} B parameters), {where}, {dtype}, {weights}; prompt "
        f"{options.prompt}; engine steps overlapped: {options.overlap_steps}; measured "
        f"ceilings: matmul {flops_peak / 1e12:.1f} TFLOP/s, copy {copy_peak / 1e9:.0f} GB/s"
    )
    if fp8:
        measured = f"{fp8_peak / 1e12:.1f} TFLOP/s" if fp8_peak else "not measured on the CPU"
        print(
            f"the FP8 steps' roofline takes the {dtype} matmul ceiling (attention and the head "
            f"stay {dtype}); an FP8 matmul (_scaled_mm, per-tensor scales): {measured}"
        )
    rows, profiles, described = [], {}, []
    for spec in kernels:
        torch.manual_seed(0)  # the same inputs for every set (and the same weights: seed 0)
        model = M.from_args(
            args,
            seed=0,
            dtype=dtype,
            device=device,
            weight_dtype="fp8" if fp8 else None,
            kernels=spec,
        )
        described.append(model.kernels.describe())
        print(f"\nkernels {described[-1]}")
        trace = options.trace
        if trace and len(kernels) > 1:
            trace = trace_path(trace, spec.replace(":", "-").replace(",", "-"))
        found, profiled = measure(model, options, device, (flops_peak, copy_peak), trace)
        rows += found
        if profiled:
            profiles[spec] = profiled
        del model
        if cuda:
            torch.cuda.empty_cache()  # the next set's model in this one's place
    comparison = side_by_side(rows, kernels) if len(kernels) > 1 else None
    if options.json:
        document = dict(
            vars(options),
            device=where,
            matmul_flops=flops_peak,
            copy_bytes_s=copy_peak,
            kernel_sets=described,
        )
        if fp8_peak:
            document["matmul_flops_fp8"] = fp8_peak
        if profiles:
            document["profile"] = profiles
        if comparison:
            document["side_by_side"] = comparison
        with open(options.json, "w") as f:
            json.dump(document | {"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
