"""MLA prefill attention over all of a step's sequences at once: torch's kernels side by side.

    python benchmarks/bench_prefill_attention.py [--reps 20] [--json results.json]

CUDA only. Prefill attends with the decompressed keys (qk head dim 192 = 128 nope + 64 rope)
and values (128) of every head, each new token to its sequence's context up to itself (causal,
aligned bottom-right: a cached prefix comes before the new tokens). Kernels: torch's
memory-efficient kernel in its variable-length form (what the model ran until 2026-12-03,
57 TFLOP/s on V3's heads in docs/reproduction.md, and still runs in float32), torch's flash
attention (FlashAttention 2, variable-length; it wants one head dim, so the values are padded
with zeros to 192 and the output sliced: what `Attention._attend_varlen` runs in bf16 since
this bench measured it) and cuDNN's (variable-length through cumulative lengths; 192 / 128 as
they are; on the H200 with torch 2.11 it was 100-500x slower, and wrong with a cached prefix).
Each is first checked against float32 attention computed sequence by sequence with an explicit
bottom-right mask; one that fails or refuses the call is reported with why, not timed.

Cases: V2-Lite's 16 heads and V3's 128, eight 512-token prompts, one 4,096-token prompt, and
four 256-token chunks over 1,024 cached tokens each (where top-left and bottom-right causal
masks differ). FLOPs count the products the causal mask keeps: per sequence and head,
(new * context - new * (new - 1) / 2) * (2 * 192 + 2 * 128). Times: CUDA events around each
call (no graphs: prefill runs eagerly at these sizes), the median of --reps after warm-up,
beside the same run's bf16 matmul ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

QK, V = 192, 128
CASES = {  # name: heads, [(new tokens, context tokens)] per sequence
    "v2-lite 8 x 512": (16, [(512, 512)] * 8),
    "v2-lite 1 x 4096": (16, [(4096, 4096)]),
    "v2-lite 4 x 256 after 1024 cached": (16, [(256, 1280)] * 4),
    "v3 8 x 512": (128, [(512, 512)] * 8),
    "v3 1 x 4096": (128, [(4096, 4096)]),
    "v3 4 x 256 after 1024 cached": (128, [(256, 1280)] * 4),
}


class Case:
    def __init__(self, heads: int, lengths: list[tuple[int, int]], generator) -> None:
        self.heads, self.lengths = heads, lengths
        new, context = sum(n for n, _ in lengths), sum(c for _, c in lengths)

        def randn(rows, width):
            return torch.randn(rows, heads, width, device="cuda", generator=generator).bfloat16()

        self.q, self.k, self.v = randn(new, QK), randn(context, QK), randn(context, V)
        self.cu_q = cumulative([n for n, _ in lengths])
        self.cu_k = cumulative([c for _, c in lengths])
        self.max_q, self.max_k = max(n for n, _ in lengths), max(c for _, c in lengths)
        self.scale = QK**-0.5
        kept = sum(n * c - n * (n - 1) // 2 for n, c in lengths)
        self.flops = kept * heads * (2 * QK + 2 * V)

    def reference(self) -> torch.Tensor:
        """float32, sequence by sequence, query i of a sequence of `new` tokens over `context`
        seeing keys up to context - new + i."""
        outputs, i, j = [], 0, 0
        for new, context in self.lengths:
            q = self.q[i : i + new].float().transpose(0, 1)
            k = self.k[j : j + context].float().transpose(0, 1)
            v = self.v[j : j + context].float().transpose(0, 1)
            seen = torch.ones(new, context, dtype=torch.bool, device="cuda").tril(context - new)
            scores = (q @ k.transpose(1, 2) * self.scale).masked_fill(~seen, float("-inf"))
            outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
            i, j = i + new, j + context
        return torch.cat(outputs)

    def mem_efficient(self) -> torch.Tensor:
        from torch.nn.attention.bias import CausalVariant

        out = torch.ops.aten._efficient_attention_forward(
            self.q[None], self.k[None], self.v[None], None, self.cu_q, self.cu_k,
            self.max_q, self.max_k, 0.0, int(CausalVariant.LOWER_RIGHT), scale=self.scale,
        )[0]  # fmt: skip
        return out[0]

    def flash_padded(self) -> torch.Tensor:
        v = torch.nn.functional.pad(self.v, (0, QK - V))
        out = torch.ops.aten._flash_attention_forward(
            self.q, self.k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, 0.0, True, False,
            scale=self.scale,
        )[0]  # fmt: skip
        return out[..., :V]

    def cudnn(self) -> torch.Tensor:
        return torch.ops.aten._cudnn_attention_forward(
            self.q, self.k, self.v, None, self.cu_q, self.cu_k, self.max_q, self.max_k, False,
            0.0, True, False, scale=self.scale,
        )[0]  # fmt: skip


IMPLEMENTATIONS = ("mem_efficient", "flash_padded", "cudnn")


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device="cuda").cumsum(0).int()


def event_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_ceiling(reps: int) -> float:
    """TFLOP/s of a bf16 matmul at 8192^3."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / event_ms(lambda: a @ a, reps) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention needs a CUDA device")
    ceiling = matmul_ceiling(args.reps)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: bf16 matmul "
          f"{ceiling:.0f} TFLOP/s (measured now)")  # fmt: skip
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (heads, lengths) in CASES.items():
        case = Case(heads, lengths, generator)
        want = case.reference()
        for impl in IMPLEMENTATIONS:
            fn = getattr(case, impl)
            row = {"case": name, "implementation": impl}
            try:
                error = (fn().float() - want).abs().max().item()
            except Exception as refused:  # a kernel that does not take these shapes says why
                row["refused"] = f"{type(refused).__name__}: {str(refused).splitlines()[0]}"
                print(f"{name:36} {impl:14} refused: {row['refused']}", flush=True)
                rows.append(row)
                continue
            row["max_abs_error"] = error
            if not error < 2e-2:
                print(f"{name:36} {impl:14} WRONG: max abs error {error:.3g}", flush=True)
                rows.append(row)
                continue
            ms = event_ms(fn, args.reps)
            row |= {"ms": ms, "tflops": case.flops / ms / 1e9}
            print(f"{name:36} {impl:14} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s "
                  f"({row['tflops'] / ceiling:.2f} of the matmul ceiling)", flush=True)  # fmt: skip
            rows.append(row)
        del case, want
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "matmul_tflops": ceiling, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
