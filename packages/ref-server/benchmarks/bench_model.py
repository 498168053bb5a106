"""Prefill and decode throughput of the model, next to the roofline from FLOPs and bytes.

    python benchmarks/bench_model.py [--preset v2-lite] [--layers N] [--prompt 512]
                                     [--batches 1,8,32,128,256] [--json results.json]

Random weights from the preset (`--layers` keeps the first N layers, to fit a smaller device;
the default on CPU is `tiny`). For each batch size: one cached prefill step of `--prompt`
tokens per sequence, then `--steps` decode steps of one token per sequence (absorbed MLA through
mla_kernels), eagerly and replayed from CUDA graphs (`DecodeGraphs`, on CUDA), each timed as the
median of its repetitions with the device synchronized. The ratio is of the graphs' figure.

Roofline per step, from the same run's measured ceilings (a large matmul, a large copy):
FLOPs = 2 x active parameters x tokens + attention (prefill: causal scores and values on the
decompressed heads; decode: 576 + 512 wide products over the cached context) and bytes =
the weights the step touches (attention, dense layers, shared experts, the routed experts
that the batch's tokens can reach) + the latent cache read (decode); the bound is the slower of
FLOPs / matmul ceiling and bytes / copy ceiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import ref_server.model as M
from ref_server.model import StepBatch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
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


def step_cost(args: M.ModelArgs, batch: int, new: int, context: int, cache_bytes: int):
    """(FLOPs, bytes) of one step: `batch` sequences, `new` tokens each, `context` cached after."""
    h, heads, layers = args.hidden_size, args.num_attention_heads, args.num_hidden_layers
    moe_layers = layers - args.first_k_dense_replace
    tokens = batch * new
    if new == 1:  # absorbed decode: products 576 and 512 wide over the latent cache
        flops = args.matmul_flops(batch) + 2 * layers * batch * heads * (576 + 512) * context
    else:
        flops = batch * args.prefill_flops(new, context - new)
    reachable = min(args.n_routed_experts, tokens * args.num_experts_per_tok)
    unreached = (args.n_routed_experts - reachable) * args.expert_parameters()
    weights = (args.num_parameters() - moe_layers * unreached - args.vocab_size * h) * 2
    cache = layers * batch * context * cache_bytes if new == 1 else layers * tokens * cache_bytes
    return flops, weights + cache


def run(model, batch: int, prompt: int, steps: int, device, reps: int):
    """Seconds of a prefill step and of a decode step, eager and (on CUDA) from CUDA graphs."""
    args = model.args
    page = 64
    pages = -(-(prompt + 2 * steps * (reps + 2)) // page)
    cache = M.PagedKVCache(args, batch * pages, page, torch.bfloat16, device)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    ids = torch.randint(2, args.vocab_size, (batch * prompt,), device=device)
    prefill = StepBatch(ids, [prompt] * batch, [prompt] * batch, table)
    prefill_s = median_seconds(lambda: model.forward_step(prefill, cache), device, reps)
    length = [prompt]

    def decode(forward):
        length[0] += 1
        token = torch.full((batch,), 7, device=device)
        forward(StepBatch(token, [1] * batch, [length[0]] * batch, table))

    eager_s = median_seconds(lambda: decode(lambda b: model.forward_step(b, cache)), device, steps)
    graphs_s = None
    if device.type == "cuda":
        graphs = M.DecodeGraphs(model, cache, max_batch=batch, max_blocks=pages)
        graphs_s = median_seconds(lambda: decode(graphs), device, steps)
        del graphs
    return prefill_s, eager_s, graphs_s, length[0]


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="v2-lite" if cuda else "tiny")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batches", default="1,8,32,128,256" if cuda else "1,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    options = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    args = M.PRESETS[options.preset]
    if options.layers:
        args = dataclasses.replace(
            args,
            num_hidden_layers=options.layers,
            first_k_dense_replace=min(args.first_k_dense_replace, options.layers),
        )
    model = M.from_args(args, seed=0, dtype=dtype, device=device)
    flops_peak, copy_peak = ceilings(device, dtype)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"model {options.preset} ({args.num_hidden_layers} layers, "
        f"{args.num_parameters() / 1e9:.2f} B parameters), {where}, {dtype}; prompt "
        f"{options.prompt}; measured ceilings: matmul {flops_peak / 1e12:.1f} TFLOP/s, "
        f"copy {copy_peak / 1e9:.0f} GB/s"
    )
    print(
        "batch | prefill tok/s | roofline | ratio | decode tok/s: graphs | eager | roofline | ratio"
    )
    rows = []
    for batch in map(int, options.batches.split(",")):
        prefill_s, eager_s, graphs_s, context = run(
            model, batch, options.prompt, options.steps, device, options.reps
        )
        decode_s = graphs_s or eager_s
        bounds = []
        for new, ctx, seconds in (
            (options.prompt, options.prompt, prefill_s),
            (1, context, decode_s),
        ):
            flops, nbytes = step_cost(args, batch, new, ctx, 576 * 2)
            bound = max(flops / flops_peak, nbytes / copy_peak)
            bounds.append((batch * new / seconds, batch * new / bound))
        (prefill, prefill_bound), (decode, decode_bound) = bounds
        eager = batch / eager_s
        rows.append(
            dict(
                batch=batch,
                prefill_tok_s=prefill,
                prefill_roofline=prefill_bound,
                decode_tok_s=decode,
                decode_eager_tok_s=eager,
                decode_roofline=decode_bound,
            )
        )
        graphs = f"{decode:20.1f}" if graphs_s else f"{'-':>20}"
        print(
            f"{batch:5d} | {prefill:13.0f} | {prefill_bound:8.0f} | {prefill / prefill_bound:5.2f} "
            f"| {graphs} | {eager:5.0f} | {decode_bound:8.0f} | {decode / decode_bound:5.2f}"
        )
    if options.json:
        document = dict(
            vars(options), device=where, matmul_flops=flops_peak, copy_bytes_s=copy_peak
        )
        with open(options.json, "w") as f:
            json.dump(document | {"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
