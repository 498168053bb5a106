"""FlashMLA's decode sweep on this GPU: our kernel beside a plain-torch bmm baseline, the
GPU's measured copy and matmul ceilings, and FlashMLA's own figures on our H200 box.

    python benchmarks/bench_decode.py [--quick] [--peer] [--json results.json]

With `--peer`, FlashMLA's own kernel (`flashmla_peer`, built by
../shared/peers/flashmla/build.py, never by this script) runs beside ours on the same inputs
in the same run, interleaved: the ratio table of issue 17.

Also the whole eager call as a user makes it (`get_mla_metadata`, then
`flash_mla_with_kvcache`, with and without `check_values`) beside the kernel replayed from a
CUDA graph, at b = 128, s_k = 4K.

Per call (dtype size 2): FLOPs = 2 * s_q * h_q * sum(seqlen) * (576 + 512);
bytes = sum(seqlen) * h_kv * token_bytes + b * s_q * h_q * (576 + 512) * 2, where
token_bytes is 1152 for a bf16 cache and 656 for the FP8 layout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

import mla_kernels
from mla_kernels.testing import decode_case, varlen_seqlens

BATCH = 128
# FlashMLA built from source on our H200 box (../shared/anchors.md): b = 128, s_q = 1,
# fixed lengths, bf16 cache. h_q = 16 is quoted in TB/s, h_q = 128 in TFLOP/s.
FLASHMLA_H200 = {
    (16, 4096): 3.67, (16, 8192): 3.91, (16, 16384): 4.01, (16, 32768): 4.16,
    (128, 4096): 586, (128, 8192): 558, (128, 16384): 579, (128, 32768): 601,
}  # fmt: skip


def times_ms(fns: list, reps: int = 30, graph: bool = True) -> list[float]:
    """Median time of each of `fns`, called in turn (interleaved, so that clocks and neighbours
    weigh on each alike), the L2 cache overwritten before each call.

    With `graph`, each is replayed from a CUDA graph, which keeps host-side work (argument
    checks, launches) out of the figure: timing eager calls between two events would count the
    GPU idling while Python runs. The ceilings run eagerly: a captured copy becomes a copy-engine
    transfer, slower than the copy kernel.
    """
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    replays = []
    for fn in fns:
        fn()  # compile, load and allocate outside the capture
        replay = fn
        if graph:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                fn()
            replay = captured.replay
        for _ in range(3):
            replay()
        replays.append(replay)
    times = [[] for _ in fns]
    for _ in range(reps):
        for replay, spent in zip(replays, times, strict=True):
            flush.zero_()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            replay()
            end.record()
            end.synchronize()
            spent.append(start.elapsed_time(end))
    return [statistics.median(spent) for spent in times]


def time_ms(fn, reps: int = 30, graph: bool = True) -> float:
    return times_ms([fn], reps, graph)[0]


def ceilings() -> dict[str, float]:
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), graph=False)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = time_ms(lambda: a @ b, graph=False)
    return {
        "copy_TBps": 2 * src.numel() * 4 / copy_ms / 1e9,
        "matmul_TFLOPs": 2 * 8192**3 / matmul_ms / 1e9,
    }


def bmm_baseline_ms(seqlen: int, s_q: int, h_q: int) -> float:
    """Attention as two batched matmuls over a contiguous (unpaged) cache: torch's best case."""
    kv = torch.randn(BATCH, seqlen, 576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(BATCH, s_q * h_q, 576, device="cuda", dtype=torch.bfloat16)

    def attend():
        scores = torch.bmm(q, kv.transpose(1, 2)).float() * 576**-0.5
        return torch.bmm(torch.softmax(scores, dim=-1).bfloat16(), kv[..., :512])

    return time_ms(attend)


def measure(case, s_q: int, h_q: int, limits: dict[str, float]) -> dict:
    q = case.q[:, :s_q, :h_q].contiguous()
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, s_q * h_q, 1)
    fp8 = case.is_fp8_kvcache
    ms = time_ms(
        lambda: mla_kernels.flash_mla_with_kvcache(
            q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
            causal=True, is_fp8_kvcache=fp8, check_values=False,
        )
    )  # fmt: skip
    total = int(case.cache_seqlens.sum())
    flops = 2 * s_q * h_q * total * (576 + 512)
    moved = total * (656 if fp8 else 1152) + BATCH * s_q * h_q * (576 + 512) * 2
    floor_ms = max(flops / limits["matmul_TFLOPs"], moved / limits["copy_TBps"]) / 1e9
    return {
        "s_q": s_q,
        "h_q": h_q,
        "ms": ms,
        "TFLOPs": flops / ms / 1e9,
        "TBps": moved / ms / 1e9,
        "roofline_share": floor_ms / ms,
    }


def import_peer():
    """FlashMLA's dense decode built as `flashmla_peer` (../shared/peers/flashmla/build.py;
    its build folder on sys.path or in $FLASHMLA_PEER_BUILD), or None."""
    if os.environ.get("FLASHMLA_PEER_BUILD"):
        sys.path.insert(0, os.environ["FLASHMLA_PEER_BUILD"])
    try:
        import flashmla_peer
    except ImportError:
        return None
    return flashmla_peer


def peer_row(peer, case, h_q: int) -> dict:
    """Ours and FlashMLA on one case's first h_q heads: the same result first, then the times
    (CUDA graphs, interleaved)."""
    q = case.q[:, :, :h_q].contiguous()
    s_k = int(case.cache_seqlens[0])
    args = (case.cache_seqlens, case.block_table, 576**-0.5, False)
    _, _, peer_metadata, peer_splits = peer.dense_decode_fwd(
        q, case.k_cache, 512, *args, None, None
    )
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, h_q, 1)

    def ours():
        return mla_kernels.flash_mla_with_kvcache(
            q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
            check_values=False,
        )  # fmt: skip

    def theirs():
        out, lse, _, _ = peer.dense_decode_fwd(
            q, case.k_cache, 512, *args, peer_metadata, peer_splits
        )
        return out, lse

    (out, lse), (peer_out, peer_lse) = ours(), theirs()
    out_diff = (out.float() - peer_out.float()).abs().max().item()
    lse_diff = (lse - peer_lse.float()).abs().max().item()
    if not (out_diff < 2e-2 and lse_diff < 1e-3):
        raise AssertionError(
            f"h_q {h_q} s_k {s_k}: ours and FlashMLA differ by {out_diff:.2e} (out), "
            f"{lse_diff:.2e} (lse)"
        )
    ms, peer_ms = times_ms([ours, theirs])
    flops = 2 * h_q * BATCH * s_k * (576 + 512)
    moved = BATCH * s_k * 1152
    row = {"h_q": h_q, "s_k": s_k, "ms": ms, "flashmla_ms": peer_ms}
    row |= {"ours_over_flashmla": peer_ms / ms, "max_abs_diff": [out_diff, lse_diff]}
    row |= {"TFLOPs": flops / ms / 1e9, "TBps": moved / ms / 1e9}
    row |= {"flashmla_TFLOPs": flops / peer_ms / 1e9, "flashmla_TBps": moved / peer_ms / 1e9}
    print(
        f"peer h_q {h_q:3} s_k {s_k:5} | ours {ms:7.3f} ms {row['TFLOPs']:6.1f} TFLOP/s "
        f"{row['TBps']:5.2f} TB/s | FlashMLA {peer_ms:7.3f} ms {row['flashmla_TFLOPs']:6.1f} "
        f"TFLOP/s {row['flashmla_TBps']:5.2f} TB/s | ours / FlashMLA speed "
        f"{row['ours_over_flashmla']:5.3f}",
        flush=True,
    )
    return row


def peer_rows(peer, quick: bool) -> list[dict]:
    """Ours beside FlashMLA on the same inputs in this run: b = 128, s_q = 1, page 64, bf16,
    fixed lengths; the ratio table at the end."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    lengths = [4096, 16384] if quick else [4096, 8192, 16384, 32768]
    heads = [16, 128] if quick else [16, 32, 64, 128]
    rows = []
    for s_k in lengths:
        case = decode_case([s_k] * BATCH, 1, 128, device="cuda", generator=generator)
        rows += [peer_row(peer, case, h_q) for h_q in heads]
        del case
        torch.cuda.empty_cache()
    print("ours / FlashMLA speed, same run | " + " | ".join(f"{n // 1024}K" for n in lengths))
    for h_q in heads:
        ratios = [f"{r['ours_over_flashmla']:.3f}" for r in rows if r["h_q"] == h_q]
        print(f"h_q {h_q:3} | " + " | ".join(ratios))
    return rows


def eager_call_ms(case, h_q: int, check_values: bool) -> float:
    """Back-to-back eager calls, host and GPU together: wall time per call over a run of calls
    that ends in one synchronization (a user's loop)."""
    q = case.q[:, :1, :h_q].contiguous()

    def call():
        metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, h_q, 1)
        mla_kernels.flash_mla_with_kvcache(
            q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
            causal=True, check_values=check_values,
        )  # fmt: skip

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(times)


def eager_rows(limits: dict[str, float]) -> list[dict]:
    """The eager call beside the same kernel replayed from a CUDA graph, b = 128, s_k = 4K."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    case = decode_case([4096] * BATCH, 2, 128, device="cuda", generator=generator)
    rows = []
    for h_q, check_values in itertools.product((16, 128), (False, True)):
        eager = eager_call_ms(case, h_q, check_values)
        kernel = measure(case, 1, h_q, limits)["ms"]
        row = {"h_q": h_q, "check_values": check_values, "eager_ms": eager, "graph_ms": kernel}
        rows.append(row | {"eager_over_graph": eager / kernel})
        print(
            f"eager call, b {BATCH} s_k 4096 h_q {h_q:3} check_values {check_values!s:5} | "
            f"{eager:7.3f} ms a call, the kernel from a graph {kernel:7.3f} ms: "
            f"{eager / kernel:5.2f}x (1.2x asked)",
            flush=True,
        )
    return rows


def sweep(quick: bool, limits: dict[str, float]) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    lengths = [4096, 16384] if quick else [4096, 8192, 16384, 32768]
    heads = [16, 128] if quick else [16, 32, 64, 128]
    for fp8, varlen, mean in itertools.product((False, True), (False, True), lengths):
        seqlens = varlen_seqlens(BATCH, mean, 2, generator) if varlen else [mean] * BATCH
        case = decode_case(seqlens, 2, 128, is_fp8_kvcache=fp8, device="cuda", generator=generator)
        for s_q, h_q in itertools.product((1, 2), heads):
            row = {"cache": "fp8" if fp8 else "bf16", "lengths": "varlen" if varlen else "fixed"}
            row |= {"s_k": mean} | measure(case, s_q, h_q, limits)
            if not fp8 and not varlen:
                base = bmm_baseline_ms(mean, s_q, h_q)
                row["bmm_ms"] = base
                row["bmm_TFLOPs"] = row["TFLOPs"] * row["ms"] / base
                row["bmm_TBps"] = row["TBps"] * row["ms"] / base
                if s_q == 1 and (h_q, mean) in FLASHMLA_H200:
                    row["flashmla_h200"] = FLASHMLA_H200[(h_q, mean)]
            rows.append(row)
            print_row(row)
        del case
        torch.cuda.empty_cache()
    return rows


def print_row(row: dict) -> None:
    anchor = ""
    if "flashmla_h200" in row:
        ours = row["TBps"] if row["h_q"] == 16 else row["TFLOPs"]
        unit = "TB/s" if row["h_q"] == 16 else "TFLOP/s"
        anchor = f"FlashMLA {row['flashmla_h200']} {unit}, ratio {ours / row['flashmla_h200']:.2f}"
    base = ""
    if "bmm_ms" in row:
        base = (
            f"bmm {row['bmm_ms']:7.3f} ms {row['bmm_TFLOPs']:6.1f} TF {row['bmm_TBps']:5.2f} TB/s"
        )
    shape = f"{row['cache']:4} {row['lengths']:6} s_k {row['s_k']:5} s_q {row['s_q']}"
    shape += f" h_q {row['h_q']:3}"
    print(
        f"{shape} | "
        f"{row['ms']:7.3f} ms {row['TFLOPs']:6.1f} TFLOP/s {row['TBps']:5.2f} TB/s "
        f"{row['roofline_share']:4.0%} of roofline | {base} | {anchor}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer lengths and head counts")
    parser.add_argument(
        "--peer",
        action="store_true",
        help="also time FlashMLA (flashmla_peer, built by ../shared/peers/flashmla/build.py; its "
        "folder on sys.path or in $FLASHMLA_PEER_BUILD) beside ours, interleaved, same inputs",
    )
    parser.add_argument(
        "--json", default=os.environ.get("BENCH_JSON"), help="write the results here ($BENCH_JSON)"
    )
    args = parser.parse_args()
    assert mla_kernels.backend("cuda") == "cuda", "needs a Hopper GPU and the sm_90a kernel"
    peer = import_peer() if args.peer else None
    if args.peer and peer is None:
        why = "flashmla_peer is not importable; build it with ../shared/peers/flashmla/build.py"
        parser.exit(2, f"--peer: {why} and set FLASHMLA_PEER_BUILD\n")
    limits = ceilings()
    print(
        f"{torch.cuda.get_device_name()}: copy {limits['copy_TBps']:.2f} TB/s, "
        f"bf16 matmul {limits['matmul_TFLOPs']:.0f} TFLOP/s (measured now)"
    )
    peers = peer_rows(peer, args.quick) if peer else []
    eager = eager_rows(limits)
    rows = sweep(args.quick, limits)
    if args.json:
        document = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "commit": os.environ.get("BENCH_COMMIT", "unknown"),
            "ceilings": limits,
            "rows": rows,
            "eager": eager,
            "peer": peers,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
