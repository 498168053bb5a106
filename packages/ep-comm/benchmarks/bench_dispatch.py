"""Normal-mode dispatch and combine throughput in DeepEP's setting, with its byte accounting.

    python benchmarks/bench_dispatch.py [--world 8] [--device cuda] [--json results.json]
                                        [--gpu-per-rank [--process-group nccl]]

4096 tokens per rank, hidden 7168, top-8 of 256 experts (uniform random routing, as DeepEP's
test). Bytes per rank: received rows x hidden x 2 for BF16 dispatch and for combine; FP8
dispatch counts BF16 bytes x (1 + 4/128) / 2. Each call is timed on every rank between two
barriers; a rank's GB/s is its bytes over its median time. The anchor is DeepEP's intranode EP8
on H800 NVLink. All ranks run on one machine: by default on one GPU, sharing its memory, and
with the torch backend over gloo data moves through host memory and loopback TCP - not NVLink.
With --gpu-per-rank rank r runs on GPU r (the NVLink figures, on a machine of `--world` GPUs),
and --process-group nccl puts the torch backend on NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ep_comm import Buffer, Config
from ep_comm.testing import per_token_cast_to_fp8, run_ranks

DEEPEP_H800_EP8 = {"dispatch_bf16": 153.0, "dispatch_fp8": 153.0, "combine": 158.0}
FP8_FACTOR = (1 + 4 / 128) / 2
TORCH_OVER = {
    "gloo": "gloo: CUDA tensors staged through host memory and loopback TCP",
    "nccl": "NCCL",
}


def _timed(fn, device: str, reps: int) -> list[float]:
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def copy_ceiling_gbps(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy on this GPU by one process: read + write bytes per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[3:]) / 1e9


def rank_main(rank, world, group, device, tokens, hidden, topk, experts, reps):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)
    scores = torch.rand(tokens, experts, generator=g)
    topk_idx = scores.topk(topk, dim=1).indices.to(device)
    topk_weights = torch.rand(tokens, topk, generator=g).to(device)
    backends = ["cuda", "torch"] if device == "cuda" else ["torch"]
    nvl_bytes = Config().get_nvl_buffer_size_hint(hidden * 2, world)
    result = {"rank": rank}
    for backend in backends:
        buffer = Buffer(group, nvl_bytes if backend == "cuda" else 0, backend=backend)
        result[backend] = measure(buffer, x, topk_idx, topk_weights, experts, device, reps)
        buffer.destroy()
    return result


def measure(buffer, x, topk_idx, topk_weights, experts, device, reps):
    hidden = x.shape[1]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    fp8 = per_token_cast_to_fp8(x)
    bf16_bytes = recv_x.shape[0] * hidden * 2
    ops = {
        "dispatch_bf16": (lambda: buffer.dispatch(x, handle=handle), bf16_bytes),
        "dispatch_fp8": (lambda: buffer.dispatch(fp8, handle=handle), bf16_bytes * FP8_FACTOR),
        "combine": (lambda: buffer.combine(recv_x, handle, recv_w), bf16_bytes),
    }
    result = {"received_rows": recv_x.shape[0]}
    for name, (fn, nbytes) in ops.items():
        seconds = statistics.median(_timed(fn, device, reps))
        result[name] = {"us": seconds * 1e6, "GBps": nbytes / seconds / 1e9}
    return result


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=os.environ.get("EP_COMM_BENCH_JSON"))
    parser.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r")
    parser.add_argument("--process-group", choices=["gloo", "nccl"], default="gloo")
    args = parser.parse_args()
    if args.gpu_per_rank and torch.cuda.device_count() < args.world:
        parser.error(f"--gpu-per-rank needs {args.world} GPUs, found {torch.cuda.device_count()}")
    if args.process_group == "nccl" and not args.gpu_per_rank:
        parser.error("--process-group nccl needs --gpu-per-rank (NCCL takes one GPU per rank)")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    placement = "host tensors"
    if args.device == "cuda":
        placement = "one GPU per rank" if args.gpu_per_rank else "one GPU shared by all ranks"
    print(
        f"ep-comm normal mode: {args.world} ranks on one machine ({where}, {placement}); "
        f"{args.tokens} tokens x hidden {args.hidden}, top-{args.topk} of {args.experts} experts"
    )
    if args.device == "cuda":
        torch_how = TORCH_OVER[args.process_group]
        print(f"  backends: cuda (our kernels over CUDA IPC) and torch ({torch_how})")
        if not args.gpu_per_rank:
            print("  on one shared GPU these figures measure HBM copies and host hops, not NVLink")
        ceiling = copy_ceiling_gbps()
        print(f"  copy ceiling (one process, read + write): {ceiling:.0f} GB/s")
    else:
        print("  backend: torch (gloo, host tensors): host copies and loopback TCP")
    results = run_ranks(
        args.world,
        __file__,
        "rank_main",
        args.device,
        args.tokens,
        args.hidden,
        args.topk,
        args.experts,
        args.reps,
        backend=args.process_group,
        limit=1800,
        gpu_per_rank=args.gpu_per_rank,
    )
    backends = [b for b in ("cuda", "torch") if b in results[0]]
    summary = {}
    for name, anchor in DEEPEP_H800_EP8.items():
        summary[name] = {"deepep_h800_ep8_GBps": anchor}
        line = f"  {name:14s}"
        for backend in backends:
            gbps = statistics.mean(r[backend][name]["GBps"] for r in results)
            us = statistics.mean(r[backend][name]["us"] for r in results)
            summary[name] |= {f"{backend}_GBps": gbps, f"{backend}_us": us}
            line += f" | {backend} {us:9.0f} us {gbps:7.2f} GB/s per rank"
        if len(backends) == 2:
            ratio = summary[name]["cuda_GBps"] / summary[name]["torch_GBps"]
            line += f" | cuda/torch {ratio:.1f}x"
        best = summary[name][f"{backends[0]}_GBps"]
        line += f" | DeepEP EP8 H800 {anchor:.0f} GB/s, ratio {best / anchor:.3f}"
        print(line)
    if args.device == "cuda":
        total = args.world * summary["dispatch_bf16"][f"{backends[0]}_GBps"]
        print(f"  all ranks together, BF16 dispatch: {total:.0f} GB/s received")
    if args.json:
        document = {"world": args.world, "device": where, "args": vars(args), "ops": summary}
        if args.device == "cuda":
            document["copy_ceiling_GBps"] = ceiling
        document["ranks"] = results
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
