"""Low-latency dispatch and combine in DeepEP's setting, with its byte accounting.

    python benchmarks/bench_low_latency.py [--ranks 1,2,4,8] [--quick] [--json out.json]
                                           [--commit SHA] [--backends cuda,torch]

128 tokens per rank, hidden 7168, top-8 of 288 experts, 10 random (token, k) slots per rank set
to -1; FP8 dispatch, BF16 combine. Bytes per rank (DeepEP's): every valid (token, k) selection
moves H + H/128 * 4 + 16 bytes in dispatch and 2H in combine. cuda: kernel time, from CUDA
events around a CUDA-graph replay of `--calls` calls (dispatch with its receive; combine
likewise), median of `--reps` replays; in hook mode, the send and the receive kernels' times
from the profiler (the receive called at once, so it includes the wait for the peers). torch:
whole calls with host work, median of `--reps`. The anchors are DeepEP's EP8
figures (H800, NVLink). Unless every rank has a GPU of its own, all ranks share one GPU: the
PEs are processes time-sliced on it, not NVLink, and the figures show that, not bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_comm.collectives import Collectives
from ep_comm.low_latency import LowLatencyMode
from ep_comm.low_latency_backend import rdma_size_hint
from ep_comm.streams import CommStream
from ep_comm.testing import run_ranks

DEEPEP_EP8_US = {"dispatch": 77.0, "combine": 114.0}  # H800 NVLink, README (PR #173)
CAVEAT = "PEs share one GPU, time-sliced, not NVLink"


def problem(rank: int, tokens: int, hidden: int, topk: int, experts: int):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=g).abs() + 1
    topk_idx = scores.topk(topk, dim=1).indices
    for _ in range(10):  # DeepEP's test drops 10 random selections per rank
        t = int(torch.randint(tokens, (1,), generator=g))
        k = int(torch.randint(topk, (1,), generator=g))
        topk_idx[t, k] = -1
    topk_weights = torch.rand(tokens, topk, generator=g)
    return x.cuda(), topk_idx.cuda(), topk_weights.cuda()


def graph_us(fn, calls: int, reps: int) -> float:
    """Median µs per call of `fn` captured `calls` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times[1:])


def hook_us(send, reps: int) -> tuple[float, float]:
    """Median µs of the send kernel and of the receive kernel (its hook, called at once, so it
    includes waiting for the peers), from the profiler's kernel times."""
    from torch.profiler import ProfilerActivity, profile

    send()()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            dist.barrier()
            send()()
            torch.cuda.synchronize()
    times = {"send": [], "recv": []}
    for event in prof.events():
        for kind, found in times.items():
            if event.name.startswith("ep_comm::ll::") and f"_{kind}_kernel" in event.name:
                found.append(event.device_time_total)
    return _median(times["send"]), _median(times["recv"])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")  # no kernel seen


def host_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times[1:])


def measure(mode, backend, x, topk_idx, topk_weights, tokens, experts, calls, reps) -> dict:
    recv_x, _, handle, _, _ = mode.dispatch(x, topk_idx, tokens, experts)
    y = torch.randn(recv_x[0].shape, device="cuda").to(torch.bfloat16)

    def dispatch(hook=False):
        return mode.dispatch(x, topk_idx, tokens, experts, return_recv_hook=hook)[4]

    def combine(hook=False):
        return mode.combine(y, topk_idx, topk_weights, handle, return_recv_hook=hook)[2]

    if backend != "cuda":
        return {"dispatch": host_us(dispatch, reps), "combine": host_us(combine, reps)}
    return {
        "dispatch": graph_us(lambda: dispatch(True)(), calls, reps),
        "combine": graph_us(lambda: combine(True)(), calls, reps),
        "dispatch_hook": hook_us(lambda: dispatch(True), reps),
        "combine_hook": hook_us(lambda: combine(True), reps),
    }


def rank_main(rank, world, group, backends, tokens, hidden, topk, experts, calls, reps):
    x, topk_idx, topk_weights = problem(rank, tokens, hidden, topk, experts)
    result = {"rank": rank, "selections": int((topk_idx >= 0).sum())}
    for backend in backends:
        rdma = rdma_size_hint(tokens, hidden, world, experts) if backend == "cuda" else 0
        comm = Collectives(group, timedelta(seconds=300))
        mode = LowLatencyMode(comm, backend, rdma, timedelta(seconds=120), CommStream())
        shape = (tokens, experts, calls, reps)
        result[backend] = measure(mode, backend, x, topk_idx, topk_weights, *shape)
        mode.destroy()
    return result


def git_commit() -> str | None:
    try:
        run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
    except OSError:
        return None
    return run.stdout.decode().strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8", help="comma-separated world sizes")
    parser.add_argument("--backends", default="cuda,torch")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--calls", type=int, default=20, help="calls per graph replay")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="ranks 1,2; few repetitions")
    parser.add_argument(
        "--json", "--out", dest="json", default=os.environ.get("EP_COMM_BENCH_JSON")
    )
    parser.add_argument("--commit", default=None, help="recorded in the JSON (default: git HEAD)")
    parser.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.calls, args.reps = "1,2", 5, 3
    worlds = [int(r) for r in args.ranks.split(",")]
    backends = args.backends.split(",")
    from bench_dispatch import copy_ceiling_gbps  # this directory: the same ceiling

    device = torch.cuda.get_device_name()
    ceiling = copy_ceiling_gbps()
    shared = not args.gpu_per_rank
    print(
        f"ep-comm low-latency: {args.tokens} tokens x hidden {args.hidden}, top-{args.topk} of "
        f"{args.experts} experts, FP8 dispatch, BF16 combine, on {device}"
    )
    print(f"  copy ceiling (one process, read + write): {ceiling:.0f} GB/s")
    if shared:
        print(f"  caveat: {CAVEAT}")
    dispatch_bytes = args.hidden + args.hidden // 128 * 4 + 16
    combine_bytes = 2 * args.hidden
    document = {
        "device": device,
        "commit": args.commit or git_commit(),
        "args": vars(args),
        "copy_ceiling_GBps": ceiling,
        "caveat": CAVEAT if shared else None,
        "worlds": {},
    }
    for world in worlds:
        results = run_ranks(
            world,
            __file__,
            "rank_main",
            backends,
            args.tokens,
            args.hidden,
            args.topk,
            args.experts,
            args.calls,
            args.reps,
            limit=1800,
            gpu_per_rank=args.gpu_per_rank,
        )
        selections = statistics.mean(r["selections"] for r in results)
        summary = {}
        for backend in backends:
            for op, per_selection in (("dispatch", dispatch_bytes), ("combine", combine_bytes)):
                us = statistics.mean(r[backend][op] for r in results)
                gbps = selections * per_selection / us / 1e3
                anchor = DEEPEP_EP8_US[op]
                entry = {"us": us, "GBps": gbps, "deepep_ep8_us": anchor, "ratio": us / anchor}
                line = (
                    f"  {world} PEs {backend:5s} {op:8s} {us:9.1f} us {gbps:7.2f} GB/s per rank"
                    f" | DeepEP EP8 {anchor:.0f} us, ours/theirs {us / anchor:.1f}x"
                )
                hook = f"{op}_hook"
                if hook in results[0][backend]:
                    send = statistics.mean(r[backend][hook][0] for r in results)
                    receive = statistics.mean(r[backend][hook][1] for r in results)
                    entry |= {"hook_send_us": send, "hook_recv_us": receive}
                    line += f" | hook: send {send:.1f} us + receive {receive:.1f} us"
                summary[f"{backend}_{op}"] = entry
                print(line)
        document["worlds"][world] = {"ops": summary, "ranks": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
