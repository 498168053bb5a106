"""A decode step's linear layers at few rows: cuBLAS (torch.mm, what the model runs) against
the Triton block GEMM that serves the experts (`triton_block_gemm`, dense layout, bf16, k
split over the SMs), next to the bandwidth bound.

    python benchmarks/bench_decode_linear.py [--tokens 1,4,8,16,32,64] [--reps 20]
                                             [--json results.json]

CUDA only. Why: at batch 1 a V2-Lite decode step spends about 1 ms in cuBLAS's small-row GEMMs
(187 calls, about 2 TB/s where the copy ceiling is 4; docs/benchmarks.md), more than in the
routed experts' Triton GEMMs, which read their weights at about 2.8 TB/s. Shapes: V2-Lite's
fused q + kv_a projection (2048 -> 3648), o_proj (2048 -> 2048), the shared experts' gate+up
(2048 -> 5632) and down (2816 -> 2048), the first layer's dense MLP (2048 -> 21888, 10944 ->
2048) and the head (2048 -> 102400); V3's kv_a + q_a (7168 -> 2112), o_proj (16384 -> 7168)
and shared experts (7168 -> 4096, 2048 -> 7168). Both are checked against float64 first.
Times: CUDA-graph replays with the L2 cache overwritten before each, events, the median of
--reps. Bytes: the weight, x and out, read or written once; the bound is bytes over the same
run's copy ceiling (these are far from the matmul ceiling); ratio = bound / time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_expert_gemm import ceilings, graph_ms

from ref_server.kernels.fp8_gemm import triton_block_gemm

FLUSH_BYTES = 256 << 20  # written before each timed replay: more than the H200's 50 MB L2
SHAPES = {  # name: (n, k)
    "v2-lite qkv_a": (3648, 2048),
    "v2-lite o_proj": (2048, 2048),
    "v2-lite shared gate_up": (5632, 2048),
    "v2-lite shared down": (2048, 2816),
    "v2-lite dense gate_up": (21888, 2048),
    "v2-lite dense down": (2048, 10944),
    "v2-lite lm_head": (102400, 2048),
    "v3 qkv_a": (2112, 7168),
    "v3 o_proj": (7168, 16384),
    "v3 shared gate_up": (4096, 7168),
    "v3 shared down": (7168, 2048),
}


def check(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    """Both against float64 on the same operands: bf16 rounding of out, no more."""
    expected = x.double() @ w.double().t()
    scale = expected.abs().max().item()
    for label, out in (("cublas", x @ w.t()), ("triton", triton_block_gemm(x, None, w, None))):
        error = (out.double() - expected).abs().max().item() / scale
        if not error < 2e-2:
            sys.exit(f"{name}: {label} is off by {error:.2e} of the largest output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,8,16,32,64", help="rows M")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_linear needs a CUDA device")
    tokens = [int(t) for t in args.tokens.split(",")]
    flops, copy = ceilings(args.reps)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {flops / 1e12:.0f} TFLOP/s, "
          f"copy {copy / 1e9:.0f} GB/s (measured now)")  # fmt: skip
    print(f"{'shape':24} {'M':>4} | {'cuBLAS ms':>9} {'ratio':>5} | {'Triton ms':>9} {'ratio':>5}"
          f" | Triton / cuBLAS speed")  # fmt: skip
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) / k**0.5
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            check(x, w, name)
            cublas = graph_ms(lambda x=x, w=w: x @ w.t(), args.reps, FLUSH_BYTES)
            triton = graph_ms(
                lambda x=x, w=w: triton_block_gemm(x, None, w, None), args.reps, FLUSH_BYTES
            )
            bound = (n * k + m * k + m * n) * 2 / copy * 1e3
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_ms": cublas, "triton_ms": triton}
            row |= {
                "bound_ms": bound,
                "cublas_ratio": bound / cublas,
                "triton_ratio": bound / triton,
            }
            rows.append(row)
            print(f"{name:24} {m:4} | {cublas:9.4f} {bound / cublas:5.2f} | {triton:9.4f} "
                  f"{bound / triton:5.2f} | {cublas / triton:5.2f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            ceiling = {"bf16_flops": flops, "copy_bytes_per_s": copy}
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": ceiling, "rows": rows},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
