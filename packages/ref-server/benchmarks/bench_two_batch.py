"""Two-batch overlap against one batch: a DeepSeek-V3-shaped MoE layer and the V2-Lite-sized
model, expert-parallel over 1, 2 and 4 processes sharing one GPU.

    python benchmarks/bench_two_batch.py [--worlds 1 2 4] [--workloads v3-layer v2-lite]
        [--out DIR] [--json FILE] [--quick] [--gpu-per-rank]

Each rank holds 1/W of the routed experts and runs its own tokens (data-parallel attention):
prefill steps of 4K, 8K and 16K new tokens per rank (prompts of 4096 tokens; 4K is one prompt
cut in two), decode steps of 32, 64, 128 and 256 sequences per rank (context 1024, replayed
from CUDA graphs). A step is timed with and without two-batch overlap (events, median over
repetitions, the slowest rank's). One eager step of each kind is also recorded op by op
(`overlap_sched.Recorder`): from the one-batch trace the communication / compute ratio, from the
two-batch trace the share of communication that ran while compute did. SGLang's published
TBO gains (H100, EP32/EP16 over InfiniBand) are printed beside ours as anchors, not targets:
processes time-slicing one GPU are not GPUs on NVLink, and with W = 1 there is nothing to hide.

The V3 layer: hidden 7168, MLA with 128 heads, 256 routed experts top-8 plus one shared expert
(one MoE layer; vocabulary cut to 4096, the head is not what is measured). Trace JSON and
timeline PNGs of one prefill and one decode layer go to --out (figures: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ref_server.model as M
from ep_comm.testing import run_ranks
from overlap_sched import Recorder, split_decode, split_prefill, summarize
from ref_server.model import StepBatch

PROMPT = 4096
DECODE_CONTEXT = 1024
PREFILL_TOKENS = (4096, 8192, 16384)
DECODE_TOKENS = (32, 64, 128, 256)
# SGLang's TBO throughput ratios (two-batch / one-batch), lmsys blog 2025-05-05, H100.
ANCHORS = {
    ("decode", 32): "0.73 (-27%)",
    ("decode", 64): "~1.0",
    ("decode", 128): "~1.0",
    ("decode", 256): "1.255",
    ("prefill", 4096): "1.27-1.35",
    ("prefill", 8192): "1.27-1.35",
    ("prefill", 16384): "1.27-1.35",
}


def workload_args(name: str) -> M.ModelArgs:
    if name == "v3-layer":
        return dataclasses.replace(
            M.PRESETS["v3"], num_hidden_layers=1, first_k_dense_replace=0, vocab_size=4096
        )
    return M.PRESETS["v2-lite"]


def timed(fn, reps: int, barrier: bool = True) -> float:
    """Median milliseconds of fn() on this rank, each repetition started by a barrier (all
    ranks step together)."""
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        if barrier:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def slowest(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def trace_of(model, batch, cache, split, out: Path | None, label: str) -> dict:
    """One eager step recorded op by op: the trace's summary (and its JSON and PNG in out)."""
    recorder = Recorder(rank=dist.get_rank())
    parts = [batch] if split is None else batch.split(split)
    inputs = [(p.input_ids, p.metadata(cache)) for p in parts]
    model.run_step(inputs, cache, "decode" if batch.is_decode else "prefill", recorder=recorder)
    events = recorder.events()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    if out is not None and dist.get_rank() == 0:
        from overlap_sched.timeline import draw

        everything = [e for rank_events in gathered for e in rank_events]
        (out / f"{label}.trace.json").write_text(json.dumps({"traceEvents": everything}))
        draw(everything, out / f"{label}.png", title=label)
    return summarize(events)


def rank_main(rank, world, group, workload, reps, quick, out):
    args = workload_args(workload)
    device = torch.device("cuda", torch.cuda.current_device())
    model = M.from_args(args, seed=0, dtype=torch.bfloat16, device=device, group=group)
    out = Path(out) if out else None
    g = torch.Generator().manual_seed(rank)
    prefill_points = PREFILL_TOKENS[:1] if quick else PREFILL_TOKENS
    decode_points = DECODE_TOKENS[::3] if quick else DECODE_TOKENS
    rows = []
    for tokens in prefill_points:
        need = moe_bytes(args, tokens, world) * world
        if need > 0.6 * torch.cuda.get_device_properties().total_memory:  # the same on every rank
            if rank == 0:
                gib = need / 2**30
                print(f"{workload} W={world} prefill {tokens}: skipped (needs ~{gib:.0f} GiB)")
            continue
        save = out if tokens == prefill_points[0] else None
        rows.append(prefill_row(model, world, workload, tokens, g, reps, save))
    for seqs in decode_points:
        save = out if seqs == decode_points[-1] else None
        rows.append(decode_row(model, world, workload, seqs, g, reps, save))
    return rows


def moe_bytes(args, tokens: int, world: int) -> int:
    """About the peak of one rank's MoE layer: the grouped GEMMs take every received row once
    per top-k slot, and the weighted sum keeps two float32 copies of them."""
    slots = tokens * min(world, args.num_experts_per_tok) * args.num_experts_per_tok
    return slots * (args.hidden_size * (2 + 2 + 4 + 4) + args.moe_intermediate_size * 2 * 3)


@torch.no_grad()
def prefill_row(model, world, workload, tokens, g, reps, out) -> dict:
    args, device = model.args, model.embed_tokens.weight.device
    prompts, pages = tokens // PROMPT, PROMPT // 64
    cache = M.PagedKVCache(args, prompts * pages, 64, torch.bfloat16, device)
    table = torch.arange(prompts * pages, dtype=torch.int32).view(prompts, pages)
    ids = torch.randint(2, args.vocab_size, (tokens,), generator=g).to(device)
    batch = StepBatch(ids, [PROMPT] * prompts, [PROMPT] * prompts, table)
    split = split_prefill(batch.query_lens, batch.context_lens)
    one = slowest(timed(lambda: model.forward_step(batch, cache), reps))
    two = slowest(timed(lambda: model.forward_step(batch, cache, split), reps))
    label = f"{workload}-prefill-{tokens}-w{world}"
    single = trace_of(model, batch, cache, None, None, label)
    overlapped = trace_of(model, batch, cache, split, out, label)
    return row(workload, world, "prefill", tokens, one, two, single, overlapped)


@torch.no_grad()
def decode_row(model, world, workload, seqs, g, reps, out) -> dict:
    args, device = model.args, model.embed_tokens.weight.device
    pages = -(-(DECODE_CONTEXT + 1) // 64)
    cache = M.PagedKVCache(args, seqs * pages, 64, torch.bfloat16, device)
    table = torch.arange(seqs * pages, dtype=torch.int32).view(seqs, pages)
    ids = torch.randint(2, args.vocab_size, (seqs,), generator=g).to(device)
    batch = StepBatch(ids, [1] * seqs, [DECODE_CONTEXT] * seqs, table)
    times = []
    for two_batch_from in (None, 2):
        graphs = M.DecodeGraphs(
            model, cache, max_blocks=pages, two_batch_from=two_batch_from, batch_sizes=[seqs]
        )
        times.append(slowest(timed(lambda graphs=graphs: graphs(batch), reps * 4)))
        del graphs
    label = f"{workload}-decode-{seqs}-w{world}"
    single = trace_of(model, batch, cache, None, None, label)
    overlapped = trace_of(model, batch, cache, split_decode(batch.context_lens), out, label)
    return row(workload, world, "decode", seqs, *times, single, overlapped)


def row(workload, world, mode, tokens, one, two, single, overlapped) -> dict:
    compute = single["compute_us"]
    return {
        "workload": workload,
        "ranks": world,
        "mode": mode,
        "tokens_per_rank": tokens,
        "one_batch_ms": one,
        "two_batch_ms": two,
        "speedup": one / two,
        "comm_over_compute": single["communication_us"] / compute if compute else 0.0,
        "hidden_share": overlapped["hidden_share"],
        "sglang": ANCHORS[(mode, tokens)],
    }


def ceilings() -> dict:
    """This run's copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s)."""
    x = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    copy = timed(lambda: y.copy_(x), 20, barrier=False)
    matmul = timed(lambda: a @ b, 20, barrier=False)
    return {"copy_GBps": 2 * x.numel() / copy / 1e6, "matmul_TFLOPs": 2 * 8192**3 / matmul / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workloads", nargs="+", default=["v3-layer", "v2-lite"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one prefill and two decode sizes")
    parser.add_argument(
        "--out", type=Path, help="trace JSON and PNGs (of the largest --worlds) go here"
    )
    parser.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r")
    parser.add_argument("--commit", help="the commit to print (default: git rev-parse HEAD)")
    parser.add_argument("--json", type=Path, help="write every row here")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_two_batch: no CUDA device; nothing measured")
        return
    if options.out:
        options.out.mkdir(parents=True, exist_ok=True)
    limits = ceilings()
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = options.commit or subprocess.run(git, capture_output=True, text=True).stdout.strip()
    print(
        f"{torch.cuda.get_device_name()}, commit {commit or '?'}: copy "
        f"{limits['copy_GBps']:.0f} GB/s, bf16 matmul {limits['matmul_TFLOPs']:.0f} TFLOP/s"
    )
    rows = []
    for workload in options.workloads:
        for world in options.worlds:
            results = run_ranks(
                world, __file__, "rank_main", workload, options.reps, options.quick,
                str(options.out or "") if world == max(options.worlds) else "",
                timeout=600, limit=1200, gpu_per_rank=options.gpu_per_rank,
            )  # fmt: skip
            rows += results[0]
            print_rows(results[0])
    if options.json:
        result = {"gpu": torch.cuda.get_device_name(), "commit": commit, "ceilings": limits}
        options.json.write_text(json.dumps(result | {"rows": rows}, indent=1))


def print_rows(rows) -> None:
    for r in rows:
        print(
            f"{r['workload']:9} W={r['ranks']} {r['mode']:7} {r['tokens_per_rank']:6} tok/rank: "
            f"one {r['one_batch_ms']:8.2f} ms, two {r['two_batch_ms']:8.2f} ms, "
            f"speedup {r['speedup']:.2f} (SGLang {r['sglang']}), comm/compute "
            f"{r['comm_over_compute']:.2f}, hidden {r['hidden_share']:.0%}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
