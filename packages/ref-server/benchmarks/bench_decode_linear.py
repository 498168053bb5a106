"""A decode step's linear layers at few rows: cuBLAS (F.linear) against the Triton block GEMM
that `ref_server::linear` takes there (`linear.py`: `triton_block_gemm`, dense layout, bf16,
16-row tiles of `TILES`), alone and in a chain of layers, next to the bandwidth bound.

    python benchmarks/bench_decode_linear.py [--tokens 1,4,8,16] [--reps 20] [--layers 8]
                                             [--json results.json]

CUDA only. Shapes: V2-Lite's fused q + kv_a projection (2048 -> 3648), o_proj (2048 -> 2048),
the shared experts' gate+up (2048 -> 5632) and down (2816 -> 2048), the first layer's dense MLP
(2048 -> 21888, 10944 -> 2048) and the head (2048 -> 102400); V3's kv_a + q_a (7168 -> 2112),
o_proj (16384 -> 7168) and shared experts (7168 -> 4096, 2048 -> 7168). Both are checked against
float64 first.

Alone: CUDA-graph replays of one GEMM with the L2 cache overwritten before each, events, the
median of --reps. Bytes: the weight, x and out, read or written once; the bound is bytes over
the same run's copy ceiling; ratio = bound / time.

Chain: --layers copies of V2-Lite's attention and shared-expert projections, each weight its
own, in a decode layer's order, an RMS norm before each projection and SiLU-and-multiply before
down (the model's Triton kernels, launched with programmatic dependent launch), captured in one
graph: cuBLAS, the Triton kernel, and the Triton kernel without its weight prefetch (`prefetch`
of `triton_block_gemm`: each program fetches its part of the weight into L2 before waiting for
the kernel before it). Time per layer, and the bound of its weight bytes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_expert_gemm import ceilings, graph_ms

from ref_server.model.activation_kernels import silu_mul
from ref_server.model.fp8_gemm import triton_block_gemm
from ref_server.model.linear import TILES, linear
from ref_server.model.norm_kernels import rms_norm

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
CHAIN = ("v2-lite qkv_a", "v2-lite o_proj", "v2-lite shared gate_up", "v2-lite shared down")


def triton(x, w, prefetch=None):
    return triton_block_gemm(x, None, w, None, out_dtype=x.dtype, config=TILES, prefetch=prefetch)


def check(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    """Both against float64 on the same operands: bf16 rounding of out, no more; and the
    operator takes the Triton kernel (bit-equal to it) at these rows."""
    expected = x.double() @ w.double().t()
    scale = expected.abs().max().item()
    for label, out in (("cublas", F.linear(x, w)), ("triton", triton(x, w))):
        error = (out.double() - expected).abs().max().item() / scale
        if not error < 2e-2:
            sys.exit(f"{name}: {label} is off by {error:.2e} of the largest output")
    if not torch.equal(linear(x, w), triton(x, w)):
        sys.exit(f"{name}: ref_server::linear does not take the Triton kernel at {len(x)} rows")


def alone(tokens, reps, copy, generator) -> list[dict]:
    print(f"{'shape':24} {'M':>4} | {'cuBLAS ms':>9} {'ratio':>5} | {'Triton ms':>9} {'ratio':>5}"
          f" | Triton / cuBLAS speed")  # fmt: skip
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) / k**0.5
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=generator)
            check(x, w, name)
            cublas = graph_ms(lambda x=x, w=w: F.linear(x, w), reps, FLUSH_BYTES)
            ours = graph_ms(lambda x=x, w=w: triton(x, w), reps, FLUSH_BYTES)
            bound = (n * k + m * k + m * n) * 2 / copy * 1e3
            rows.append({"shape": name, "n": n, "k": k, "m": m, "cublas_ms": cublas,
                         "triton_ms": ours, "bound_ms": bound})  # fmt: skip
            print(f"{name:24} {m:4} | {cublas:9.4f} {bound / cublas:5.2f} | {ours:9.4f} "
                  f"{bound / ours:5.2f} | {cublas / ours:5.2f}", flush=True)  # fmt: skip
    return rows


def chain(tokens, reps, layers, copy, generator) -> list[dict]:
    """A decode layer's projections in order, --layers times, each layer's weights its own."""

    def weight(name):
        n, k = SHAPES[name]
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) / k**0.5

    weights = [{name: weight(name) for name in CHAIN} for _ in range(layers)]
    norm = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    weight_bytes = sum(w.numel() * 2 for w in weights[0].values())
    variants = {
        "cublas": F.linear,
        "triton": triton,
        "triton, no prefetch": lambda x, w: triton(x, w, prefetch=False),
    }
    print(f"\nchain of {layers} layers ({weight_bytes / 1e6:.1f} MB of weights a layer), "
          f"ms a layer (bound {weight_bytes / copy * 1e3:.4f} ms):")  # fmt: skip
    print(f"{'M':>4} | " + " | ".join(f"{v:>20}" for v in variants))
    rows = []
    for m in tokens:
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16, generator=generator)

        def run(project, x=x):
            h = x
            for w in weights:
                q = project(rms_norm(h, norm, 1e-6), w["v2-lite qkv_a"])
                h = h + project(rms_norm(q[:, :2048], norm, 1e-6), w["v2-lite o_proj"])
                gate, up = project(rms_norm(h, norm, 1e-6), w["v2-lite shared gate_up"]).chunk(
                    2, -1
                )
                h = h + project(silu_mul(gate, up), w["v2-lite shared down"])
            return h

        want = run(F.linear)
        times = {}
        for label, project in variants.items():
            got = run(project)
            error = (got.float() - want.float()).abs().max() / want.float().abs().max()
            if not error < 2e-2:
                sys.exit(f"chain, {m} rows: {label} is off cuBLAS's by {error:.2e} of its largest")
            times[label] = graph_ms(lambda p=project: run(p), reps, FLUSH_BYTES) / layers
        rows.append({"m": m, "layers": layers, "weight_bytes": weight_bytes} | times)
        print(f"{m:4} | " + " | ".join(f"{t:20.4f}" for t in times.values()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,8,16", help="rows M")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8, help="layers of the chain")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_linear needs a CUDA device")
    tokens = [int(t) for t in args.tokens.split(",")]
    flops, copy = ceilings(args.reps)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {flops / 1e12:.0f} TFLOP/s, "
          f"copy {copy / 1e9:.0f} GB/s (measured now)")  # fmt: skip
    generator = torch.Generator(device="cuda").manual_seed(0)
    single = alone(tokens, args.reps, copy, generator)
    chained = chain(tokens, args.reps, args.layers, copy, generator)
    if args.json:
        with open(args.json, "w") as f:
            ceiling = {"bf16_flops": flops, "copy_bytes_per_s": copy}
            json.dump({"device": torch.cuda.get_device_name(), "ceilings": ceiling,
                       "alone": single, "chain": chained}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
