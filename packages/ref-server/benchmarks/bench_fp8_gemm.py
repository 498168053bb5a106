"""FP8 block-scaled GEMMs (`ref_server::fp8_block_gemm`) against bf16 on DeepSeek-V3's shapes.

    python benchmarks/bench_fp8_gemm.py [--ms 128,512,1024,4096,8192,16384] [--reps 20]
                                        [--pointer] [--tune] [--json results.json]

CUDA only. Shapes: the attention projections as linear layers (q_a 7168->1536, q_b
1536->24576, kv_a 7168->576, kv_b 512->32768, o 16384->7168); the routed experts' gate+up
(7168->4096, both halves in one) and down (2048->7168) projections over 8 and 32 local experts,
grouped contiguously (M rows in equal groups, the prefill layout) and batched with per-expert
counts (32 and 9 experts of 128 and 256 rows, all of them counted: the decode layout).

First each implementation is checked against float64 on the dequantized operands (M = 512, on
the device) and the run stops if one is off. Then each is timed: replayed from a CUDA graph
(so that small shapes show device time, not Python's), CUDA events around each replay, the
median of --reps after a warm-up. Implementations: the operator through Triton (TMA loads;
with --pointer also the masked pointer loads), through CUTLASS's grouped kernel (every
layout), for linear layers also through torch._scaled_mm's blockwise
scaling where it takes the shape, the operator's default ("auto": `fp8_gemm.pick_backend`),
and bf16 on the same shapes (torch.mm, torch._grouped_mm, torch.bmm). Activations are
quantized beforehand: the times are the GEMMs alone. The same run measures bf16 and
per-tensor-scaled FP8 matmuls at 8192^3 as ceilings. The goal is FP8 >= 1.6x bf16
at M >= 4096. With --tune, the Triton kernel is then timed under each of a few launch
configurations at M = 8192 (about a minute more).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch

from ref_server.kernels import cutlass_gemm
from ref_server.kernels.fp8_cast import (
    dequantize_activations,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)
from ref_server.kernels.fp8_gemm import (
    KernelConfig,
    block_gemm,
    scaled_mm_takes,
    triton_block_gemm,
)

TARGET, TARGET_M = 1.6, 4096
LINEAR = {"q_a": (7168, 1536), "q_b": (1536, 24576), "kv_a": (7168, 576)}  # k, n
LINEAR |= {"kv_b": (512, 32768), "o": (16384, 7168)}
EXPERT = {"gate_up": (7168, 4096), "down": (2048, 7168)}
GROUPED_EXPERTS = (8, 32)
BATCHED = ((32, 128), (9, 256))  # experts, rows each
TUNE_M = 8192
# block_m, block_n, num_warps, num_stages: PREFILL and DECODE, and around them; with 4 warps
# and up to 4 stages two programs fit on an SM, one rescaling while the other's wgmma runs
TUNE_CONFIGS = [
    KernelConfig(128, 128, 8, 3),
    KernelConfig(128, 128, 8, 4),
    KernelConfig(128, 64, 4, 4),
    KernelConfig(64, 128, 4, 3),
    KernelConfig(64, 128, 4, 4),
    KernelConfig(64, 128, 4, 6),
]


def graph_ms(fn, reps: int) -> float:
    """Median milliseconds of one replay of fn captured in a CUDA graph."""
    fn()  # compiles Triton kernels and warms cuBLAS before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in times)


def ceilings(reps: int) -> dict:
    """TFLOP/s of a bf16 matmul and of a per-tensor-scaled FP8 one at 8192^3."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    flops = 2 * n**3
    bf16 = graph_ms(lambda: a @ b.t(), reps)
    fp8 = graph_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), reps)
    return {"bf16_tflops": flops / bf16 / 1e9, "fp8_per_tensor_tflops": flops / fp8 / 1e9}


@functools.lru_cache(maxsize=1)  # cases sharing weights come one after the other
def weights(shape: tuple[int, ...]):
    """Quantized weights (e4m3, scales) of `shape`, and their bf16 dequantization."""
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    w = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    quantized = quantize_blocks(w)
    return quantized, dequantize_blocks(*quantized).bfloat16()


class Case:
    """One shape and layout at one M: quantized operands, their bf16 dequantization, and the
    calls to time."""

    def __init__(self, name: str, layout: str, m: int, k: int, n: int, experts: int):
        self.label, self.layout, self.m, self.n, self.k = f"{name} {layout} M={m}", layout, m, n, k
        g = torch.Generator(device="cuda").manual_seed(m)
        x_shape = (experts, m, k) if layout == "batched" else (m, k)
        x = torch.randn(x_shape, device="cuda", generator=g, dtype=torch.bfloat16)
        self.x = quantize_activations(x)
        self.x16 = dequantize_activations(*self.x).bfloat16()
        self.w, self.w16 = weights((n, k) if layout == "dense" else (experts, n, k))
        self.offsets = self.counts = None
        if layout == "grouped":
            ends = [(i + 1) * m // experts for i in range(experts)]
            self.offsets = torch.tensor(ends, dtype=torch.int32, device="cuda")
        if layout == "batched":
            self.counts = torch.full((experts,), m, dtype=torch.int32, device="cuda")
        self.rows = m * experts if layout == "batched" else m
        self.flops = 2 * self.rows * n * k

    def fp8(self, backend: str = "triton"):
        args = (*self.x, *self.w, self.offsets, self.counts, torch.bfloat16, backend)
        return lambda: block_gemm(*args)

    def triton(self, config: KernelConfig | None = None, tma: bool | None = None):
        args = (*self.x, *self.w, self.offsets, self.counts, torch.bfloat16)
        return lambda: triton_block_gemm(*args, config=config, tma=tma)

    def bf16(self):
        x, w = self.x16, self.w16
        if self.layout == "dense":
            return lambda: torch.mm(x, w.t())
        if self.layout == "grouped":
            return lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=self.offsets)
        return lambda: torch.bmm(x, w.transpose(1, 2))

    def implementations(self, pointer: bool) -> dict:
        found = {"fp8 triton": self.fp8()}
        if pointer:
            found["fp8 triton pointer"] = self.triton(tma=False)
        if cutlass_gemm.takes(self.n, self.k, torch.bfloat16, torch.device("cuda")):
            found["fp8 cutlass"] = self.fp8("cutlass")
        if self.layout == "dense" and scaled_mm_takes(
            self.m, self.n, self.k, torch.bfloat16, "cuda"
        ):
            found["fp8 scaled_mm"] = self.fp8("scaled_mm")
        return found | {"fp8 auto": self.fp8("auto"), "bf16": self.bf16()}

    def check(self, pointer: bool) -> None:
        """Every implementation against float64 on the dequantized operands; exits if off."""
        a = dequantize_activations(*self.x).double()
        b = dequantize_blocks(*self.w).double().transpose(-2, -1)
        if self.layout == "grouped":
            starts = [0, *self.offsets.tolist()[:-1]]
            groups = list(zip(starts, self.offsets.tolist(), strict=True))
            want = torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(groups)])
            magnitude = torch.cat([a[s:e].abs() @ b[g].abs() for g, (s, e) in enumerate(groups)])
        else:
            want, magnitude = a @ b, a.abs() @ b.abs()
        for impl, fn in self.implementations(pointer).items():
            got = fn().double()
            bound = 2**-9 * magnitude + torch.finfo(torch.bfloat16).eps * want.abs()
            worst = ((got - want).abs() / bound).max().item()
            if not worst <= 1:
                sys.exit(f"{self.label} {impl}: error {worst:.3g} x the bound")


def cases(ms: list[int]):
    """(name, layout, m, k, n, experts) of every timed case, in table order."""
    for name, (k, n) in LINEAR.items():
        for m in ms:
            yield name, "dense", m, k, n, 1
    for name, (k, n) in EXPERT.items():
        for experts in GROUPED_EXPERTS:
            for m in ms:
                yield f"{name} x{experts}", "grouped", m, k, n, experts
        for experts, rows in BATCHED:
            yield f"{name} x{experts}", "batched", rows, k, n, experts


def tune(reps: int) -> list[dict]:
    """The Triton kernel under each of TUNE_CONFIGS (TMA loads) at M = TUNE_M, on every linear
    layer and grouped expert shape, against bf16."""
    print(f"\nTriton configs at M = {TUNE_M}: block_m, block_n, num_warps, num_stages")
    found = []
    for name, layout, m, k, n, experts in cases([TUNE_M]):
        if layout == "batched":
            continue
        case = Case(name, layout, m, k, n, experts)
        bf16 = graph_ms(case.bf16(), reps)
        for config in TUNE_CONFIGS:
            config_ms = graph_ms(case.triton(config), reps)
            described = ", ".join(str(v) for v in vars(config).values())
            print(
                f"{name:<12} {layout:<8} ({described}) {config_ms:8.4f} ms "
                f"{case.flops / config_ms / 1e9:6.0f} TFLOP/s {bf16 / config_ms:5.2f} x bf16",
                flush=True,
            )
            found.append(
                dict(shape=name, layout=layout, m=m, experts=experts, config=vars(config))
                | dict(ms=config_ms, ratio_to_bf16=bf16 / config_ms)
            )
        del case
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="128,512,1024,4096,8192,16384", help="rows M (tokens)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--pointer", action="store_true", help="also time pointer loads")
    parser.add_argument(
        "--tune", action="store_true", help=f"then time TUNE_CONFIGS at M = {TUNE_M}"
    )
    parser.add_argument("--json")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_gemm needs a CUDA device")
    began = time.perf_counter()
    ms = [int(m) for m in options.ms.split(",")]
    import triton

    peaks = ceilings(options.reps)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"ceilings at 8192^3: bf16 {peaks['bf16_tflops']:.0f} TFLOP/s, FP8 per-tensor "
        f"{peaks['fp8_per_tensor_tflops']:.0f} TFLOP/s"
    )
    print("checking against float64 (M = 512) ...", flush=True)
    checked = set()
    for name, layout, m, k, n, experts in cases(ms):
        if (name, layout) not in checked:
            Case(name, layout, m if layout == "batched" else 512, k, n, experts).check(
                options.pointer
            )
            checked.add((name, layout))
    print(f"all correct ({time.perf_counter() - began:.0f} s)\n")
    header = f"{'shape':<12} {'M':>6} {'layout':<8} {'implementation':<19} {'ms':>8} "
    print(header + f"{'TFLOP/s':>8} {'x bf16':>7}  target")
    rows = []
    for name, layout, m, k, n, experts in cases(ms):
        case = Case(name, layout, m, k, n, experts)
        found = case.implementations(options.pointer)
        times = {impl: graph_ms(fn, options.reps) for impl, fn in found.items()}
        for impl, impl_ms in times.items():
            ratio = times["bf16"] / impl_ms
            target = ""
            if impl != "bf16" and case.rows >= TARGET_M:
                target = f"{TARGET} {'met' if ratio >= TARGET else 'MISSED'}"
            tflops = case.flops / impl_ms / 1e9
            print(
                f"{name:<12} {m:>6} {layout:<8} {impl:<19} {impl_ms:8.4f} {tflops:8.0f} "
                f"{ratio:7.2f}  {target}",
                flush=True,
            )
            rows.append(
                dict(shape=name, m=m, k=k, n=n, experts=experts, layout=layout)
                | dict(implementation=impl, ms=impl_ms, tflops=tflops, ratio_to_bf16=ratio)
            )
        del case
    tuned = tune(options.reps) if options.tune else []
    print(f"\n{time.perf_counter() - began:.0f} s in all")
    if options.json:
        result = vars(options) | peaks | dict(device=torch.cuda.get_device_name(), rows=rows)
        result["tuning"] = tuned
        result |= dict(torch=torch.__version__, triton=triton.__version__)
        with open(options.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
