"""Sparse MLA on this GPU: the Triton kernels beside the torch reference, the GPU's measured
copy and matmul ceilings, and optionally FlashMLA's sparse kernels in the same run.

    python benchmarks/bench_sparse.py [--quick] [--peer] [--json results.json]

Decode (`flash_mla_with_kvcache(..., indices=...)`): b 64 and 128, s_q 1 and 2, h_q 64 and
128, topk 2048 over sequences of 8K tokens, FP8 cache (and its bf16 twin). Prefill
(`flash_mla_sparse_fwd`): 4096 queries, h_q 64 and 128, topk 2048 over 32K tokens. Each call
is replayed from a CUDA graph with the L2 flushed before it, the median of 30 after warm-up
(`bench_decode.times_ms`).

Per call, over the n = b * s_q query rows (prefill: s_q) and their topk indices:
FLOPs = 2 * n * h_q * topk * (576 + 512); bytes = n * topk * token_bytes + n * h_q *
(576 + 512) * 2, token_bytes 656 (FP8 layout) or 1152 (bf16): each row's tokens counted once,
as if no two rows shared one (the most a kernel without reuse reads).

With `--peer`, FlashMLA's sparse kernels run on the same inputs, interleaved with ours, after
a check that both give the same result. The peer is a module exposing FlashMLA's
`sparse_decode_fwd` and `sparse_prefill_fwd` with the signatures of its C++ interface (its
`flash_mla_cuda` ops): `flashmla_peer` by default (`bench_decode.import_peer`:
$FLASHMLA_PEER_BUILD on sys.path), another with $FLASHMLA_SPARSE_PEER=module.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
from dataclasses import replace

import torch
from bench_decode import import_peer, measured_ceilings, times_ms, write_results

import mla_kernels
from mla_kernels import reference
from mla_kernels.testing import SparseDecodeCase, dequantized, sparse_decode_case

TOPK = 2048
SCALE = 576**-0.5


def import_sparse_peer():
    """FlashMLA's sparse kernels (see the module's docstring), or None."""
    name = os.environ.get("FLASHMLA_SPARSE_PEER")
    if name is None:
        peer = import_peer()
    else:
        if os.environ.get("FLASHMLA_PEER_BUILD"):
            sys.path.insert(0, os.environ["FLASHMLA_PEER_BUILD"])
        peer = importlib.import_module(name)
    has_both = all(hasattr(peer, f) for f in ("sparse_decode_fwd", "sparse_prefill_fwd"))
    return peer if has_both else None


def decode_calls(case, peer) -> dict:
    paged = case.paged
    q, k_cache, indices = paged.q, paged.k_cache, case.indices
    b, s_q, h_q, _ = q.shape
    width = k_cache.shape[-1]

    def ours():
        return mla_kernels.flash_mla_with_kvcache(
            q, k_cache, None, None, 512, None, None, is_fp8_kvcache=paged.is_fp8_kvcache,
            indices=indices,
        )  # fmt: skip

    def torch_reference():
        out, _, lse = reference.sparse_attention(
            q.view(b * s_q, h_q, 576), k_cache.view(-1, width), indices.view(b * s_q, -1), SCALE,
            paged.is_fp8_kvcache,
        )  # fmt: skip
        return out.view(b, s_q, h_q, 512), lse.view(b, s_q, h_q).transpose(1, 2)

    calls = {"ours": ours, "reference": torch_reference}
    if peer is not None and paged.is_fp8_kvcache:  # FlashMLA's sparse decode reads FP8 only
        args = (None, None)
        rest = (None, None, None, 512, SCALE)
        _, _, metadata, splits = peer.sparse_decode_fwd(q, k_cache, indices, *args, None, None,
                                                        *rest)  # fmt: skip

        def flashmla():
            out, lse, _, _ = peer.sparse_decode_fwd(q, k_cache, indices, *args, metadata, splits,
                                                    *rest)  # fmt: skip
            return out, lse

        calls["flashmla"] = flashmla
    return calls


def prefill_calls(q, kv, indices, peer) -> dict:
    calls = {
        "ours": lambda: mla_kernels.flash_mla_sparse_fwd(q, kv, indices, SCALE),
        "reference": lambda: reference.sparse_attention(
            q, kv.view(-1, 576), indices.view(q.shape[0], -1), SCALE, False
        ),
    }
    if peer is not None:
        calls["flashmla"] = lambda: peer.sparse_prefill_fwd(q, kv, indices, SCALE, 512, None, None)
    return calls


def check_same(results: dict) -> dict[str, float]:
    """Largest |out difference| of each call against ours; raises where lse differs."""
    out, lse = results["ours"][0], results["ours"][-1]
    diffs = {}
    for name, result in results.items():
        other_out, other_lse = result[0], result[-1]
        seen = lse.isfinite()
        if not torch.equal(seen, other_lse.isfinite()):
            raise AssertionError(f"{name}: lse is infinite elsewhere than ours")
        lse_diff = (lse[seen] - other_lse[seen].float()).abs().max().item()
        diffs[name] = (out.float() - other_out.float()).abs().max().item()
        if not (diffs[name] < 5e-2 and lse_diff < 2e-3):
            raise AssertionError(f"{name} differs from ours: out {diffs[name]}, lse {lse_diff}")
    return diffs


def row_for(kind: str, shape: dict, calls: dict, rows: int, h_q: int, token_bytes: int,
            limits: dict) -> dict:  # fmt: skip
    diffs = check_same({name: call() for name, call in calls.items()})
    names = list(calls)
    flops = 2 * rows * h_q * TOPK * (576 + 512)
    moved = rows * TOPK * token_bytes + rows * h_q * (576 + 512) * 2
    floor_ms = max(flops / limits["matmul_TFLOPs"], moved / limits["copy_TBps"]) / 1e9
    row = {"kind": kind, **shape, "flops": flops, "bytes": moved, "max_diff": diffs}
    for name, ms in zip(names, times_ms([calls[n] for n in names]), strict=True):
        row[f"{name}_ms"] = ms
        row[f"{name}_TFLOPs"] = flops / ms / 1e9
        row[f"{name}_TBps"] = moved / ms / 1e9
        row[f"{name}_roofline_share"] = floor_ms / ms
    if "flashmla_ms" in row:
        row["ours_over_flashmla"] = row["flashmla_ms"] / row["ours_ms"]
    print_row(row, names)
    return row


def print_row(row: dict, names: list[str]) -> None:
    shape = " ".join(f"{k} {row[k]}" for k in ("b", "s_q", "h_q", "cache", "s_kv") if k in row)
    cells = [
        f"{name} {row[f'{name}_ms'] * 1e3:8.1f} us {row[f'{name}_TFLOPs']:5.0f} TFLOP/s "
        f"{row[f'{name}_TBps']:4.2f} TB/s ({row[f'{name}_roofline_share']:4.0%})"
        for name in names
    ]
    versus = f" | ours / FlashMLA {row['ours_over_flashmla']:.3f}" if "flashmla_ms" in row else ""
    print(f"{row['kind']:7} {shape:38} | " + " | ".join(cells) + versus, flush=True)


def first_queries(case: SparseDecodeCase, s_q: int, h_q: int) -> SparseDecodeCase:
    """The case's first s_q query tokens and h_q heads, over the same cache."""
    q = case.paged.q[:, :s_q, :h_q].contiguous()
    indices = case.indices[:, :s_q].contiguous()
    return SparseDecodeCase(replace(case.paged, q=q), indices, case.positions[:, :s_q])


def decode_rows(quick: bool, peer, limits: dict) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in (64,) if quick else (64, 128):
        fp8_case = sparse_decode_case([8192] * b, 2, 128, TOPK, is_fp8_kvcache=True,
                                      invalid=0.0, device="cuda", generator=generator)  # fmt: skip
        bf16_case = replace(fp8_case, paged=dequantized(fp8_case.paged))
        for case, cache in ((fp8_case, "fp8"), (bf16_case, "bf16")):
            for s_q, h_q in itertools.product((1, 2), (64, 128)):
                shape = {"b": b, "s_q": s_q, "h_q": h_q, "cache": cache}
                calls = decode_calls(first_queries(case, s_q, h_q), peer)
                token_bytes = 656 if cache == "fp8" else 1152
                rows.append(row_for("decode", shape, calls, b * s_q, h_q, token_bytes, limits))
        del fp8_case, bf16_case
        torch.cuda.empty_cache()
    return rows


def prefill_rows(quick: bool, peer, limits: dict) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    like = {"device": "cuda", "generator": generator}
    s_q, s_kv = (1024, 8192) if quick else (4096, 32768)
    kv = torch.randn(s_kv, 1, 576, **like).to(torch.bfloat16)
    indices = torch.stack([torch.randperm(s_kv, **like)[:TOPK] for _ in range(s_q)])
    indices = indices.to(torch.int32).view(s_q, 1, TOPK)
    rows = []
    for h_q in (64, 128):
        q = torch.randn(s_q, h_q, 576, **like).to(torch.bfloat16)
        shape = {"s_q": s_q, "h_q": h_q, "s_kv": s_kv}
        calls = prefill_calls(q, kv, indices, peer)
        rows.append(row_for("prefill", shape, calls, s_q, h_q, 1152, limits))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="b 64 only, a smaller prefill")
    parser.add_argument("--peer", action="store_true", help="also time FlashMLA's sparse kernels")
    parser.add_argument(
        "--json", default=os.environ.get("BENCH_JSON"), help="write the results here ($BENCH_JSON)"
    )
    args = parser.parse_args()
    os.environ["MLA_KERNELS_SPARSE_BACKEND"] = "triton"
    mla_kernels.sparse_backend("cuda")  # raises where Triton is missing
    peer = import_sparse_peer() if args.peer else None
    if args.peer and peer is None:
        parser.exit(2, "--peer: no module with sparse_decode_fwd and sparse_prefill_fwd\n")
    limits = measured_ceilings()
    rows = decode_rows(args.quick, peer, limits) + prefill_rows(args.quick, peer, limits)
    if args.json:
        write_results(args.json, limits, rows=rows)


if __name__ == "__main__":
    main()
