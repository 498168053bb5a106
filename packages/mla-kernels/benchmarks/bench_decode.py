"""FlashMLA's decode sweep on this GPU: our kernel beside a plain-torch bmm baseline, the
GPU's measured copy and matmul ceilings, and FlashMLA's own figures on our H200 box.

    python benchmarks/bench_decode.py [--quick] [--peer [--tables T,...]] [--json results.json]

With `--peer`, FlashMLA's own kernel (`flashmla_peer`, built by
../shared/peers/flashmla/build.py, never by this script) runs beside ours on the same tokens in
the same run, interleaved, each case timed two ways: one call replayed from a CUDA graph after
an L2 flush ("flush"), and ten calls back to back in one graph without a flush ("burst"). Its
tables, ours / FlashMLA speed with the goal each should meet:
  uniform  b = 128, fixed s_k 4K-32K, s_q 1, h_q 16-128
  mixed    a long-tailed batch of 128 (half at 512-2K tokens, a few at 32K-64K), and the
           four prompts of 1.7K-45K tokens at s_q 4, h_q 16 that ThunderMLA reports
  s_q      2 and 4 query tokens (speculative decoding's verification), causal
  page     ours at pages of 16, 32, 64 and 128 tokens, FlashMLA at 64 (the only one it takes)
  fp8      ours on the FP8 cache / ours on its bf16 twin (FlashMLA timed on the twin too)
  fp8-registers  the same at h_q 16 with MLA_KERNELS_FP8_IN_REGISTERS=1 (the experimental
           narrow kernel that dequantizes in registers); only with --tables
`--tables` runs only the peer tables named (and neither the eager call nor the sweep below).

Also the whole eager call as a user makes it (`get_mla_metadata`, then
`flash_mla_with_kvcache`, with and without `check_values`) beside the kernel replayed from a
CUDA graph, at b = 128, s_k = 4K.

Per call (dtype size 2): FLOPs = 2 * s_q * h_q * sum(seqlen) * (576 + 512);
bytes = sum(seqlen) * h_kv * token_bytes + b * s_q * h_q * (576 + 512) * 2, where
token_bytes is 1152 for a bf16 cache and 656 for the FP8 layout.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import mla_kernels
from mla_kernels.testing import decode_case, dequantized, long_tail_seqlens, repage, varlen_seqlens

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


def measured_ceilings() -> dict[str, float]:
    """`ceilings()`, printed as the run's first line."""
    limits = ceilings()
    print(
        f"{torch.cuda.get_device_name()}: copy {limits['copy_TBps']:.2f} TB/s, "
        f"bf16 matmul {limits['matmul_TFLOPs']:.0f} TFLOP/s (measured now)"
    )
    return limits


def write_results(path: str, limits: dict[str, float], **tables) -> None:
    """The run's device, torch, commit ($BENCH_COMMIT), ceilings and tables, as JSON."""
    document = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": os.environ.get("BENCH_COMMIT", "unknown"),
        "ceilings": limits,
        **tables,
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=1)


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


@dataclass
class PeerCase:
    """One comparison of ours against FlashMLA (page 64, bf16 cache) on the same tokens."""

    table: str  # one of TABLES
    label: str
    seqlens: list[int]
    s_q: int
    h_q: int
    page_size: int = 64  # ours; FlashMLA always reads the page-64 cache
    fp8: bool = False  # ours reads the FP8 cache; FlashMLA and "ours_bf16" its dequantized twin
    fp8_in_registers: bool = False  # ours with MLA_KERNELS_FP8_IN_REGISTERS=1


# ThunderMLA's post (Hazy Research, 2025-03) reports FlashMLA at 52 us and its own kernel at
# 41 us on an H100 for four prompts of 1.7K-45K tokens, 4 query tokens, 16 heads.
THUNDERMLA_LENGTHS = [4641, 45118, 1730, 1696]

# Same-run goals: ours / FlashMLA speed; for the fp8 table ours FP8 / ours bf16, by h_q.
GOALS = {"uniform": 1.0, "mixed": 1.2, "s_q": 1.0, "page": 1.0}
UNIFORM_GOAL_128 = 1.15
FP8_GOALS = {16: 1.6, 128: 1.0}
TABLES = ("uniform", "mixed", "s_q", "page", "fp8", "fp8-registers")
DEFAULT_TABLES = TABLES[:-1]


def peer_cases(quick: bool, generator: torch.Generator) -> list[PeerCase]:
    lengths = [4096, 16384] if quick else [4096, 8192, 16384, 32768]
    heads = [16, 128] if quick else [16, 32, 64, 128]
    tail = long_tail_seqlens(BATCH, generator)
    cases = [
        PeerCase("uniform", f"s_k {n // 1024}K", [n] * BATCH, 1, h) for n in lengths for h in heads
    ]
    cases += [PeerCase("mixed", "long tail", tail, 1, h) for h in heads]
    cases += [PeerCase("mixed", "long tail", tail, s_q, 16) for s_q in (2, 4)]
    cases.append(PeerCase("mixed", "ThunderMLA's four", THUNDERMLA_LENGTHS, 4, 16))
    cases += [PeerCase("s_q", "s_k 8K", [8192] * BATCH, s_q, h) for s_q in (2, 4) for h in heads]
    cases += [
        PeerCase("page", f"{name}, page {page}", seqlens, 1, h, page_size=page)
        for name, seqlens in (("s_k 8K", [8192] * BATCH), ("long tail", tail))
        for page in (16, 32, 64, 128)
        for h in (16, 128)
    ]
    cases += [
        PeerCase("fp8", f"s_k {n // 1024}K", [n] * BATCH, 1, h, fp8=True)
        for n in lengths
        for h in heads
    ]
    cases += [
        PeerCase(
            "fp8-registers",
            f"s_k {n // 1024}K",
            [n] * BATCH,
            1,
            16,
            fp8=True,
            fp8_in_registers=True,
        )
        for n in lengths
    ]
    return cases


@contextlib.contextmanager
def fp8_kernel(in_registers: bool):
    """MLA_KERNELS_FP8_IN_REGISTERS for the calls and CUDA graph captures inside."""
    name = "MLA_KERNELS_FP8_IN_REGISTERS"
    previous = os.environ.get(name)
    os.environ[name] = "1" if in_registers else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def burst_times_ms(fns: list, calls: int = 10, reps: int = 15) -> list[float]:
    """Median time per call of each of `fns`: `calls` calls back to back in one CUDA graph with
    no L2 flush between them (as a decode step's attention layers run), interleaved."""
    graphs = []
    for fn in fns:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        graphs.append(graph)
    times = [[] for _ in fns]
    for _ in range(reps):
        for graph, spent in zip(graphs, times, strict=True):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            spent.append(start.elapsed_time(end) / calls)
    return [statistics.median(spent) for spent in times]


def build_inputs(case: PeerCase, generator: torch.Generator):
    """Ours' case, FlashMLA's (page 64, bf16) and, for an FP8 case, our bf16 one: same tokens."""
    base = decode_case(case.seqlens, case.s_q, case.h_q, is_fp8_kvcache=case.fp8,
                       device="cuda", generator=generator)  # fmt: skip
    if case.fp8:
        twin = dequantized(base)
        return {"ours": base, "flashmla": twin, "ours_bf16": twin}
    ours = repage(base, case.page_size, generator) if case.page_size != 64 else base
    return {"ours": ours, "flashmla": base}


def ours_call(case):
    s_q, h_q = case.q.shape[1:3]
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, s_q * h_q, 1)

    def call():
        return mla_kernels.flash_mla_with_kvcache(
            case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
            causal=s_q > 1, is_fp8_kvcache=case.is_fp8_kvcache, check_values=False,
        )  # fmt: skip

    return call


def peer_call(peer, case):
    args = (case.cache_seqlens, case.block_table, 576**-0.5, case.q.shape[1] > 1)
    _, _, metadata, splits = peer.dense_decode_fwd(case.q, case.k_cache, 512, *args, None, None)

    def call():
        out, lse, _, _ = peer.dense_decode_fwd(case.q, case.k_cache, 512, *args, metadata, splits)
        return out, lse

    return call


def max_diffs(result, other) -> list[float]:
    """Largest |difference| of out, and of lse where finite (+inf: no token seen) in both."""
    (out, lse), (other_out, other_lse) = result, other
    seen = lse.isfinite()
    if not torch.equal(seen, other_lse.isfinite()):
        return [math.inf, math.inf]
    lse_diff = (lse[seen] - other_lse[seen].float()).abs().max().item() if seen.any() else 0.0
    return [(out.float() - other_out.float()).abs().max().item(), lse_diff]


def peer_row(peer, case: PeerCase, limits: dict[str, float], generator) -> dict:
    """Ours and FlashMLA (and ours on an FP8 cache's bf16 twin) on one case: the same result
    first, then both timings, the kernels interleaved."""
    with fp8_kernel(case.fp8_in_registers):  # read at every call of ours
        inputs = build_inputs(case, generator)
        calls = {name: ours_call(c) for name, c in inputs.items() if name != "flashmla"}
        calls["flashmla"] = peer_call(peer, inputs["flashmla"])
        results = {name: call() for name, call in calls.items()}
        # FP8 against its dequantized twin differs only by the order of roundings.
        diffs = max_diffs(results["ours"], results["flashmla"])
        if not (diffs[0] < 2e-2 and diffs[1] < 1e-3):
            raise AssertionError(f"{case}: ours and FlashMLA differ by {diffs} (out, lse)")
        total = sum(case.seqlens)
        flops = 2 * case.s_q * case.h_q * total * (576 + 512)
        io = len(case.seqlens) * case.s_q * case.h_q * (576 + 512) * 2
        moved = {name: total * 1152 + io for name in calls}
        moved["ours"] = total * (656 if case.fp8 else 1152) + io
        row = {"table": case.table, "label": case.label, "b": len(case.seqlens), "s_q": case.s_q}
        row |= {"h_q": case.h_q, "page_size": case.page_size, "fp8": case.fp8, "max_diff": diffs}
        row["fp8_in_registers"] = case.fp8_in_registers
        row |= {"sum_seqlen": total, "flops": flops, "bytes": moved}
        names = list(calls)
        fns = [calls[name] for name in names]
        for timing, times in (("flush", times_ms(fns)), ("burst", burst_times_ms(fns))):
            for name, ms in zip(names, times, strict=True):
                floor = (
                    max(flops / limits["matmul_TFLOPs"], moved[name] / limits["copy_TBps"]) / 1e9
                )
                row[f"{timing}_{name}_ms"] = ms
                row[f"{timing}_{name}_roofline_share"] = floor / ms
            ours_ms = row[f"{timing}_ours_ms"]
            row[f"{timing}_ours_over_flashmla"] = row[f"{timing}_flashmla_ms"] / ours_ms
            base = "ours_bf16" if case.fp8 else "flashmla"
            row[f"{timing}_ratio"] = row[f"{timing}_{base}_ms"] / ours_ms
        print_peer_row(row)
        return row


def goal(row: dict) -> float | None:
    if row["fp8"]:
        return FP8_GOALS.get(row["h_q"])
    if row["table"] == "uniform" and row["h_q"] == 128:
        return UNIFORM_GOAL_128
    return GOALS[row["table"]]


def print_peer_row(row: dict) -> None:
    versus = "ours FP8 / ours bf16" if row["fp8"] else "ours / FlashMLA"
    parts = [
        f"{timing}: ours {row[f'{timing}_ours_ms'] * 1e3:8.1f} us "
        f"({row[f'{timing}_ours_roofline_share']:4.0%} of roofline), FlashMLA "
        f"{row[f'{timing}_flashmla_ms'] * 1e3:8.1f} us "
        f"({row[f'{timing}_flashmla_roofline_share']:4.0%}), {versus} {row[f'{timing}_ratio']:5.3f}"
        for timing in ("flush", "burst")
    ]
    print(
        f"{row['table']:7} {row['label']:22} b {row['b']:3} s_q {row['s_q']} h_q {row['h_q']:3} | "
        + " | ".join(parts),
        flush=True,
    )


def print_peer_tables(rows: list[dict]) -> None:
    """Each table's ratios, a column per head count, cells 'flush / burst', * where the goal
    is missed under either timing."""
    for table in TABLES:
        selected = [r for r in rows if r["table"] == table]
        if not selected:
            continue
        heads = sorted({r["h_q"] for r in selected})
        title = "ours FP8 / ours bf16" if table.startswith("fp8") else "ours / FlashMLA speed"
        print(
            f"\n{table}: {title}, same run, flush / burst | "
            + " | ".join(f"h_q {h}" for h in heads)
        )
        by_key = {(r["label"], r["s_q"], r["h_q"]): r for r in selected}
        for label, s_q in dict.fromkeys((r["label"], r["s_q"]) for r in selected):
            cells = []
            for h in heads:
                r = by_key.get((label, s_q, h))
                if r is None:
                    cells.append("-")
                    continue
                target = goal(r)
                missed = target is not None and min(r["flush_ratio"], r["burst_ratio"]) < target
                cells.append(
                    f"{r['flush_ratio']:.2f} / {r['burst_ratio']:.2f}{' *' if missed else ''}"
                )
            print(f"{label}, s_q {s_q} | " + " | ".join(cells))
    print(
        "\ngoals: uniform >= 1.0 (>= 1.15 at h_q 128), mixed >= 1.2, s_q >= 1.0, every page size "
        "as page 64, fp8 >= 1.6 at h_q 16 and >= 1.0 at h_q 128; * = missed"
    )


def peer_rows(peer, quick: bool, limits: dict[str, float], tables) -> list[dict]:
    """Ours beside FlashMLA on the same inputs in this run, every case of `tables` under both
    timings."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for case in [c for c in peer_cases(quick, generator) if c.table in tables]:
        rows.append(peer_row(peer, case, limits, generator))
        torch.cuda.empty_cache()
    print_peer_tables(rows)
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
        "--tables",
        help=f"with --peer, only these tables, comma-separated (of {', '.join(TABLES)}), and "
        "neither the eager call nor the sweep",
    )
    parser.add_argument(
        "--json", default=os.environ.get("BENCH_JSON"), help="write the results here ($BENCH_JSON)"
    )
    args = parser.parse_args()
    tables = DEFAULT_TABLES if args.tables is None else args.tables.split(",")
    if not set(tables) <= set(TABLES) or (args.tables and not args.peer):
        parser.error(
            f"--tables takes --peer and names among {', '.join(TABLES)}, got {args.tables!r}"
        )
    assert mla_kernels.backend("cuda") == "cuda", "needs a Hopper GPU and the sm_90a kernel"
    peer = import_peer() if args.peer else None
    if args.peer and peer is None:
        why = "flashmla_peer is not importable; build it with ../shared/peers/flashmla/build.py"
        parser.exit(2, f"--peer: {why} and set FLASHMLA_PEER_BUILD\n")
    limits = measured_ceilings()
    peers = peer_rows(peer, args.quick, limits, tables) if peer else []
    eager = eager_rows(limits) if args.tables is None else []
    rows = sweep(args.quick, limits) if args.tables is None else []
    if args.json:
        write_results(args.json, limits, rows=rows, eager=eager, peer=peers)


if __name__ == "__main__":
    main()
