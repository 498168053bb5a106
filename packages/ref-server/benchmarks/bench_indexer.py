"""DeepSeek-V3.2's indexer (`ref_server.kernels.indexer`): its logits in a decode step over the
paged key cache and in a prefill, and the top-k selection, against the same run's bounds.

    python benchmarks/bench_indexer.py [--batches 64,128] [--contexts 4096,16384,65536,131072]
                                       [--s-q 1,2] [--reps 20] [--no-reference] [--json out.json]

CUDA only. V3.2's shapes: 64 index heads of dim 128, FP8 queries and keys (one fp32 scale a
key), pages of 64 tokens handed out in random order, top-k 2,048. Decode: every sequence of the
batch holds the context's tokens, its s_q new ones included (the logits are as wide as the
block table: the context). Prefill: one 4,096-token sequence and eight of 512, causal, packed on
one axis (each query's key range [ks, ke) its sequence's keys up to itself).

Work first: FLOPs = 2 * 64 * 128 per (query, key it sees); bytes = the keys seen (132 bytes a
key, read once a sequence), q and weights read, the logits written (4 bytes a query and position).
The bound is the slower of FLOPs over the FP8 matmul ceiling (torch._scaled_mm, per-tensor
scales, 8192^3) and bytes over the copy ceiling (1 GiB), both measured in this run. Beside it,
the bound of the sparse attention a decode step's indices feed (V3.2's MLA: 128 heads of 576 /
512, 2,048 tokens a query from the 656-byte FP8 cache, bf16 ceiling).

Times: CUDA-graph replays, events, the median of --reps after a warm-up: the Triton kernel, the
torch reference (the default implementation; --no-reference skips it), `index_topk` over the
logits (torch.topk) and `cache_slots`. Before timing, the kernel's logits are checked against the
reference's (same -inf places, each value within `logits_error_bound`, the FP8 tensor cores'
accumulation error); a mismatch stops the run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_expert_gemm import ceilings, graph_ms  # this folder's: the same timing and ceilings

from ref_server.kernels.indexer import (
    FP8,
    _reference_paged,
    _reference_ragged,
    cache_slots,
    index_topk,
    logits_error_bound,
    triton_index_logits,
    triton_index_logits_paged,
)

HEADS, DIM, PAGE, TOPK = 64, 128, 64, 2048
KEY_BYTES = DIM + 4
PREFILL = {"1 x 4096": [4096], "8 x 512": [512] * 8}
IMPLS = ["triton", "reference", "topk", "slots"]  # the columns of times
# the sparse attention a decode query feeds: V3.2's MLA heads, its FP8 cache's bytes a token
MLA_HEADS, MLA_QK, MLA_V, MLA_TOKEN_BYTES = 128, 576, 512, 656


def fp8_matmul_ceiling(reps: int) -> float:
    """FLOP/s of torch._scaled_mm (per-tensor scales) at 8192^3."""
    a = torch.randn(8192, 8192, device="cuda").to(FP8)
    one = torch.ones((), device="cuda")
    ms = graph_ms(lambda: torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16), reps)
    return 2 * 8192**3 / ms * 1e3


def fp8(shape, generator) -> torch.Tensor:
    return torch.randn(shape, device="cuda", generator=generator).to(FP8)


def decode_case(batch: int, context: int, s_q: int, generator):
    """The paged operator's arguments: every sequence `context` tokens, pages shuffled."""
    pages = batch * context // PAGE
    q = fp8((batch, s_q, HEADS, DIM), generator)
    weights = torch.randn(batch, s_q, HEADS, device="cuda", generator=generator)
    k_cache = fp8((pages, PAGE, DIM), generator)
    k_scale = torch.rand(pages, PAGE, device="cuda", generator=generator)
    order = torch.randperm(pages, device="cuda", generator=generator)
    block_table = order.view(batch, context // PAGE).int()
    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, weights, k_cache, k_scale, block_table, seqlens


def decode_work(batch: int, context: int, s_q: int) -> tuple[int, int]:
    """The paged logits' FLOPs and bytes (the module's docstring) over `decode_case`'s."""
    seen = batch * sum(context - s_q + 1 + i for i in range(s_q))
    nbytes = batch * (context * KEY_BYTES + s_q * HEADS * (DIM + 4) + 4 * s_q * context)
    return 2 * HEADS * DIM * seen, nbytes


def prefill_case(lengths: list[int], generator):
    """The ragged operator's arguments: the sequences packed, each query its keys up to itself."""
    tokens = sum(lengths)
    starts = torch.repeat_interleave(
        torch.tensor([sum(lengths[:i]) for i in range(len(lengths))]), torch.tensor(lengths)
    )
    ke = torch.arange(1, tokens + 1, dtype=torch.int32)
    q = fp8((tokens, HEADS, DIM), generator)
    weights = torch.randn(tokens, HEADS, device="cuda", generator=generator)
    k = fp8((tokens, DIM), generator)
    k_scale = torch.rand(tokens, device="cuda", generator=generator)
    return q, weights, k, k_scale, starts.int().cuda(), ke.cuda()


def check(got: torch.Tensor, reference, args, name: str) -> None:
    """Exits unless got, the kernel's logits of args, has the -inf places of `reference(*args)`
    and is within `logits_error_bound` of it elsewhere."""
    want, bound = reference(*args), logits_error_bound(reference, *args)
    finite = want.isfinite()
    if not torch.equal(finite, got.isfinite()):
        sys.exit(f"{name}: the kernel's -inf places differ from the reference's")
    over = int(((got - want)[finite].abs() > bound[finite]).sum())
    if over:
        sys.exit(
            f"{name}: {over} of the kernel's logits are further from the reference's than bounded"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--contexts", default="4096,16384,65536,131072")
    parser.add_argument("--s-q", default="1,2")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--json")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_indexer needs a CUDA device")
    bf16_flops, copy_ceiling = ceilings(options.reps)
    fp8_flops = fp8_matmul_ceiling(options.reps)
    print(
        f"{torch.cuda.get_device_name()}: FP8 matmul {fp8_flops / 1e12:.0f} TFLOP/s, bf16 "
        f"{bf16_flops / 1e12:.0f}, copy {copy_ceiling / 1e9:.0f} GB/s"
    )
    generator = torch.Generator("cuda").manual_seed(0)

    def timed(name: str, calls: dict, flops: float, nbytes: float, extra: dict) -> dict:
        bound_us = max(flops / fp8_flops, nbytes / copy_ceiling) * 1e6
        times = {impl: graph_ms(fn, options.reps) * 1e3 for impl, fn in calls.items()}
        row = dict(case=name, gflop=flops / 1e9, mb=nbytes / 1e6, bound_us=bound_us, **extra)
        row |= {f"{impl}_us": t for impl, t in times.items()}
        cells = " ".join(f"{times.get(impl, float('nan')):11.1f}" for impl in IMPLS)
        print(
            f"{name:<28} {row['gflop']:8.1f} {row['mb']:8.1f} {bound_us:8.1f} "
            f"{bound_us / times['triton']:5.2f} {cells} {extra.get('sparse_mla_bound_us', 0):9.1f}",
            flush=True,
        )
        return row

    print(
        f"{'case':<28} {'GFLOP':>8} {'MB':>8} {'bound µs':>8} {'ratio':>5} "
        + " ".join(f"{impl + ' µs':>11}" for impl in IMPLS)
        + f" {'MLA bd µs':>9}"
    )
    rows = []
    for batch in map(int, options.batches.split(",")):
        for context in map(int, options.contexts.split(",")):
            for s_q in map(int, options.s_q.split(",")):
                args = decode_case(batch, context, s_q, generator)
                name = f"decode b{batch} ctx{context} s_q{s_q}"
                logits = triton_index_logits_paged(*args)
                check(logits, _reference_paged, args, name)
                flops, nbytes = decode_work(batch, context, s_q)
                positions = index_topk(logits, TOPK)
                calls = {
                    "triton": lambda args=args: triton_index_logits_paged(*args),
                    "topk": lambda logits=logits: index_topk(logits, TOPK),
                    "slots": lambda p=positions, t=args[4]: cache_slots(p, t, PAGE),
                }
                if not options.no_reference:
                    calls["reference"] = lambda args=args: _reference_paged(*args)
                queries = batch * s_q * min(TOPK, context)
                mla_flops = 2 * queries * MLA_HEADS * (MLA_QK + MLA_V)
                mla_bound = max(mla_flops / bf16_flops, queries * MLA_TOKEN_BYTES / copy_ceiling)
                extra = dict(batch=batch, context=context, s_q=s_q)
                extra["sparse_mla_bound_us"] = mla_bound * 1e6
                rows.append(timed(name, calls, flops, nbytes, extra))
                del args, logits, positions, calls
    for name, lengths in PREFILL.items():
        args = prefill_case(lengths, generator)
        check(triton_index_logits(*args), _reference_ragged, args, name)
        tokens = sum(lengths)
        seen = sum(n * (n + 1) // 2 for n in lengths)
        flops = 2 * HEADS * DIM * seen
        nbytes = tokens * (KEY_BYTES + HEADS * (DIM + 4) + 4 * tokens)
        calls = {"triton": lambda args=args: triton_index_logits(*args)}
        if not options.no_reference:
            calls["reference"] = lambda args=args: _reference_ragged(*args)
        rows.append(timed(f"prefill {name}", calls, flops, nbytes, dict(lengths=lengths)))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    fp8_flops=fp8_flops,
                    bf16_flops=bf16_flops,
                    copy_bytes_per_s=copy_ceiling,
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
