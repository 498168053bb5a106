"""The routed experts' bf16 GEMMs (`ref_server::expert_gemm`): the Triton kernel against torch's
grouped GEMM (CUTLASS) at decode and small-prefill sizes, next to the bandwidth bound; then
SwiGLU's gate+up GEMM and activation, unfused against fused (`ref_server::expert_swiglu`).

    python benchmarks/bench_expert_gemm.py [--tokens 1,8,32,64,128,256,512]
                                           [--swiglu-tokens 1,8,32,128,512,4096] [--reps 20]
                                           [--json results.json]

CUDA only. Shapes: V2-Lite's experts (64, gate+up 2048 -> 2816, down 1408 -> 2048, 6 a token)
and V3's at EP 8 (32 local of 256, gate+up 7168 -> 4096, down 2048 -> 7168, 8 a token, a
quarter of them local). Each token picks its experts at random (uniform), rows grouped by
expert: the prefill/eager decode layout. Both implementations are checked against each other
first. Times: CUDA-graph replays, events, the median of --reps. The bound is the bytes of the
experts that got rows (read once) over the same run's copy ceiling, or the FLOPs over the bf16
matmul ceiling, whichever is slower; the ratio is bound / time.

The SwiGLU table times, in bf16 and FP8 (block-scaled weights, activations quantized
beforehand), the Triton gate+up GEMM then the activation (`silu_mul`; FP8 experts'
`silu_mul_fp8`, which casts for the down GEMM) against the Triton kernel with the activation
in its epilogue (then, in FP8, the cast), both through the kernels at every size; "op" says
which of the two `expert_swiglu` takes at that size. "same bits": whether the fused result is
the unfused one bit for bit (checked before timing; a difference beyond two bf16 roundings stops
the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ref_server.kernels.activation import silu_mul, silu_mul_fp8
from ref_server.kernels.expert_gemm import TRITON_MAX_GROUP_ROWS
from ref_server.kernels.expert_swiglu import takes_fused_kernel
from ref_server.kernels.fp8_cast import cast_activations, quantize_activations, quantize_blocks
from ref_server.kernels.fp8_gemm import check_inputs, triton_block_gemm

# name: experts (local), n, k, experts a token picks among all, local share of the picks
SHAPES = {
    "v2-lite gate_up": (64, 2816, 2048, 6, 1.0),
    "v2-lite down": (64, 2048, 1408, 6, 1.0),
    "v3/ep8 gate_up": (32, 4096, 7168, 8, 0.25),
    "v3/ep8 down": (32, 7168, 2048, 8, 0.25),
}

# name: experts (local), inter, hidden, experts a token picks among all, local share of the picks
SWIGLU_SHAPES = {
    "v2-lite": (64, 1408, 2048, 6, 1.0),
    "v3/ep8": (32, 2048, 7168, 8, 0.25),
}


def graph_ms(fn, reps: int, flush_bytes: int = 0) -> float:
    """Median ms of a CUDA-graph replay of fn (called once first, outside the capture: Triton
    compiles, cuBLAS warms up). With flush_bytes, that many bytes are written before each
    replay, so that the L2 cache holds none of fn's operands (as in a step where every layer's
    weights differ)."""
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") if flush_bytes else None
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    events = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def ceilings(reps: int) -> tuple[float, float]:
    """bf16 matmul FLOP/s at 8192^3 and copy bytes/s (read + write) of 1 GiB."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3 / graph_ms(lambda: a @ a, reps) * 1e3
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return flops, 2 * src.numel() / graph_ms(lambda: dst.copy_(src), reps) * 1e3


def case(experts, n, k, picks, local, tokens, seed):
    """x `[rows, k]`, w `[experts, n, k]`, offsets, and how many experts got rows."""
    g = torch.Generator().manual_seed(seed)
    total = round(experts / local)
    ids = torch.rand(tokens, total, generator=g).topk(picks, dim=-1).indices.flatten()
    ids = ids[ids < experts]
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(len(ids), k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    return x, w, offsets, int((counts > 0).sum())


def implementations(x, w, offsets) -> dict:
    """The calls to time: torch's grouped GEMM (CUTLASS) and the Triton kernel."""
    return {
        "cutlass": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
        "triton": lambda: triton_block_gemm(x, None, w, None, offsets, None, x.dtype),
    }


def swiglu_implementations(x, w, offsets, inter: int, fp8: bool):
    """The calls to time (unfused, fused), each giving what the down GEMM takes, and whether
    expert_swiglu takes the fused kernel here; exits if the fused result is not the unfused
    one within bf16 rounding. x and w bf16, quantized first for FP8."""
    args = (*quantize_activations(x), *quantize_blocks(w)) if fp8 else (x, None, w, None)

    def gemm(**options):
        return triton_block_gemm(*args, offsets, None, torch.bfloat16, **options)

    def unfused():
        gate_up = gemm()
        return (silu_mul_fp8 if fp8 else silu_mul)(gate_up[:, :inter], gate_up[:, inter:])

    def fused():
        hidden = gemm(swiglu_inter=inter)
        return cast_activations(hidden) if fp8 else hidden

    want = silu_mul(*gemm().chunk(2, dim=-1)).float()
    got = gemm(swiglu_inter=inter).float()
    if not torch.allclose(got, want, 2**-6, 1e-2):  # two bf16 roundings apart
        sys.exit(f"fused SwiGLU differs from the unfused kernels ({'fp8' if fp8 else 'bf16'})")
    layout = check_inputs(*args, offsets, None, torch.bfloat16)
    op = "fused" if takes_fused_kernel(layout, args[0].dtype, False) else "unfused"
    return {"unfused": unfused, "fused": fused}, op, torch.equal(got, want)


def swiglu_table(tokens_list: list[int], reps: int) -> list[dict]:
    print(
        f"{'shape':<8} {'dtype':<5} {'tokens':>6} {'rows':>6} {'op':>7} "
        f"{'unfused µs':>10} {'fused µs':>8} {'speedup':>7} {'same bits':>9}"
    )
    rows = []
    for name, (experts, inter, hidden, picks, local) in SWIGLU_SHAPES.items():
        for dtype in ("bf16", "fp8"):
            for tokens in tokens_list:
                x, w, offsets, _ = case(experts, 2 * inter, hidden, picks, local, tokens, tokens)
                calls, op, same = swiglu_implementations(x, w, offsets, inter, dtype == "fp8")
                times = {impl: graph_ms(fn, reps) * 1e3 for impl, fn in calls.items()}
                print(
                    f"{name:<8} {dtype:<5} {tokens:>6} {len(x):>6} {op:>7} "
                    f"{times['unfused']:10.1f} {times['fused']:8.1f} "
                    f"{times['unfused'] / times['fused']:7.2f} {'yes' if same else 'no':>9}",
                    flush=True,
                )
                rows.append(
                    dict(
                        shape=name,
                        dtype=dtype,
                        tokens=tokens,
                        rows=len(x),
                        op=op,
                        same_bits=same,
                        **{f"{impl}_us": t for impl, t in times.items()},
                    )
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,8,32,64,128,256,512")
    parser.add_argument("--swiglu-tokens", default="1,8,32,128,512,4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_expert_gemm needs a CUDA device")
    flops_ceiling, copy_ceiling = ceilings(options.reps)
    print(
        f"{torch.cuda.get_device_name()}: matmul {flops_ceiling / 1e12:.0f} TFLOP/s, copy "
        f"{copy_ceiling / 1e9:.0f} GB/s; expert_gemm takes Triton up to "
        f"{TRITON_MAX_GROUP_ROWS} rows an expert"
    )
    print(
        f"{'shape':<16} {'tokens':>6} {'rows':>6} {'busy':>4} {'bound µs':>8} "
        f"{'cutlass µs':>10} {'ratio':>5} {'triton µs':>9} {'ratio':>5} {'speedup':>7}"
    )
    rows = []
    for name, (experts, n, k, picks, local) in SHAPES.items():
        for tokens in map(int, options.tokens.split(",")):
            x, w, offsets, busy = case(experts, n, k, picks, local, tokens, seed=tokens)
            found = implementations(x, w, offsets)
            if not torch.allclose(
                found["triton"]().float(), found["cutlass"]().float(), 2**-7, 1e-2
            ):
                sys.exit(f"{name} at {tokens} tokens: Triton differs from torch._grouped_mm")
            bound = max(busy * n * k * 2 / copy_ceiling, 2 * len(x) * n * k / flops_ceiling)
            times = {impl: graph_ms(fn, options.reps) * 1e3 for impl, fn in found.items()}
            bound_us = bound * 1e6
            print(
                f"{name:<16} {tokens:>6} {len(x):>6} {busy:>4} {bound_us:8.1f} "
                f"{times['cutlass']:10.1f} {bound_us / times['cutlass']:5.2f} "
                f"{times['triton']:9.1f} {bound_us / times['triton']:5.2f} "
                f"{times['cutlass'] / times['triton']:7.2f}",
                flush=True,
            )
            rows.append(
                dict(
                    shape=name,
                    tokens=tokens,
                    rows=len(x),
                    busy_experts=busy,
                    bound_us=bound_us,
                    **{f"{impl}_us": t for impl, t in times.items()},
                )
            )
    swiglu_rows = swiglu_table(list(map(int, options.swiglu_tokens.split(","))), options.reps)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    copy_bytes_per_s=copy_ceiling,
                    matmul_flops=flops_ceiling,
                    rows=rows,
                    swiglu_rows=swiglu_rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
