"""One DeepSeek-V3.2 decode step's attention in one layer: dense MLA against DeepSeek Sparse
Attention (DSA: the lightning indexer's logits, their top-k, the cache slots, sparse MLA), over
the context length, each against the same run's bounds.

    python benchmarks/bench_dsa.py [--batches 32,64,128] [--contexts 4096,8192,...,131072]
                                   [--s-q 1] [--cache fp8] [--reps 20] [--json out.json]

CUDA only, the Triton paths on: REF_SERVER_INDEXER_TRITON=1 and MLA_KERNELS_SPARSE_BACKEND=triton
(`tools/gpu/pending.sh dsa-step` sets both); the dense call needs the sm_90a MLA kernel.

V3.2's shapes: 128 query heads of 576 (values 512) over the latent cache, 656-byte FP8 tokens
(--cache bf16: 1,152-byte ones, the model's cache today); the indexer's 64 heads of 128, FP8
keys with an fp32 scale, top-k 2,048. Every sequence of the batch holds the context's tokens,
its s_q new ones included, in pages of 64 tokens handed out in random order; the latent cache
and the index keys share the block table, as in the model's `PagedKVCache`. Random values.

The calls are the model's (`model/attention.py`, `model/indexer.py`), one layer's:
- dense: `flash_mla_with_kvcache` over the block table, causal, check_values off, its split-KV
  schedule computed beforehand (the model computes it once a step for every layer);
- DSA: `indexer_topk` (the paged logits, each query token a sequence of its own; the selection,
  `top_positions`, the earlier of tied tokens kept; `cache_slots`), then
  `flash_mla_with_kvcache(..., indices=)` over those slots (the operator the model's
  `sparse_attention` calls, there on a bf16 cache).
At s_q 2 (an MTP verify step) the indexer takes each query token as a row of its own, with its
sequence's block table row, as the model does; the dense call takes both tokens, causal.

Times: CUDA-graph replays, events, the median of --reps, the L2 cache overwritten before each
(`bench_expert_gemm.graph_ms`). Each part is replayed alone on the inputs the one before it
produced (logits, topk, slots, sparse MLA; beside topk, `index_topk`'s torch.topk over the same
logits, which the model does not take: it keeps the earlier of tied tokens); "DSA" is the whole
sequence in one graph, as the model runs it. The indexer's share is its three parts' sum over
the four parts' sum. The parts take all b * s_q query rows at once (`indexer_topk` takes 256
at a time: the same for every default case).

Work, n = b * s_q query rows, "seen" the (query, token) pairs of causal attention over the
context, "picked" the same at most top-k tokens a query:
- dense: FLOPs 2 * 128 * (576 + 512) * seen; bytes b * context * token bytes (each sequence's
  cache read once) + n * 128 * (576 + 512) * 2 (queries read, outputs written);
- logits: `bench_indexer.decode_work` (FLOPs 2 * 64 * 128 * seen; the keys, the queries and
  their weights read, 4 bytes a logit written);
- topk: n * context * 4 bytes (the logits read once) + n * 2048 * 4 (positions written);
- slots: n * 2048 * 8 bytes (positions read, slots written);
- sparse MLA: FLOPs 2 * 128 * (576 + 512) * picked; bytes picked * token bytes (no token shared
  between queries) + n * 128 * (576 + 512) * 2.
A bound is the slower of FLOPs over a matmul ceiling (FP8 `_scaled_mm` for the logits, bf16
for attention) and bytes over the copy ceiling (read + write), all measured in this run; DSA's
is the sum of its parts' (they run one after another).

Before timing, for each s_q: 4 sequences of 1,024 tokens (top-k >= context: DSA attends every
token the dense call does) through both paths; outputs that differ by more than 2 % of the
largest (a few bf16 roundings), or log-sum-exps by more than 1e-3, stop the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch
from bench_expert_gemm import ceilings, graph_ms  # this folder's: the same timing and ceilings
from bench_indexer import (
    DIM,
    HEADS,
    MLA_HEADS,
    MLA_QK,
    MLA_TOKEN_BYTES,
    MLA_V,
    PAGE,
    TOPK,
    decode_case,
    decode_work,
    fp8_matmul_ceiling,
)

import mla_kernels
from ref_server.kernels.indexer import cache_slots, index_topk, triton_by_environment
from ref_server.model.args import PRESETS, attended_pairs
from ref_server.model.cache import IndexKeys
from ref_server.model.indexer import _scores, indexer_topk, top_positions

SCALE = PRESETS["v3.2"].softmax_scale
TOKEN_BYTES = {"fp8": MLA_TOKEN_BYTES, "bf16": 2 * MLA_QK}
PARTS = ["logits", "topk", "slots", "sparse_mla"]  # DSA's, in the order they run
TIMES = ["dense", *PARTS, "torch_topk", "dsa"]
FLUSH_BYTES = 256 << 20  # more than any Hopper's L2 cache
WRITE_TOKENS = 1 << 20  # the random latent cache is written so many tokens at a time
CHECK_BATCH, CHECK_CONTEXT = 4, 1024


@dataclass
class Layer:
    """One layer's inputs of a decode step of b sequences with s_q new tokens each, n = b * s_q."""

    q: torch.Tensor  # bf16 [b, s_q, 128, 576]: the absorbed queries
    cache: torch.Tensor  # [pages, 64, 1, 656] e4m3 (FP8 layout) or [pages, 64, 1, 576] bf16
    block_table: torch.Tensor  # int32 [b, context / 64]
    seqlens: torch.Tensor  # int32 [b]
    schedule: tuple  # get_mla_metadata's, for the dense call
    index_q: torch.Tensor  # e4m3 [n, 64, 128], a row a query token
    index_weights: torch.Tensor  # fp32 [n, 64]
    index_keys: IndexKeys
    index_tables: torch.Tensor  # int32 [n, context / 64]: each query token's sequence's row
    positions: torch.Tensor  # int64 [n]

    @property
    def is_fp8(self) -> bool:
        return self.cache.dtype == torch.float8_e4m3fn


def dense(layer: Layer):
    """Out `[b, s_q, 128, 512]` and lse `[b, 128, s_q]` of attention over every cached token."""
    return mla_kernels.flash_mla_with_kvcache(
        layer.q, layer.cache, layer.block_table, layer.seqlens, MLA_V, *layer.schedule,
        softmax_scale=SCALE, causal=True, is_fp8_kvcache=layer.is_fp8, check_values=False,
    )  # fmt: skip


def sparse_mla(layer: Layer, slots: torch.Tensor):
    """Out and lse as `dense`'s, each query over the slots `[n, topk]` its indexer picked."""
    b, s_q = layer.q.shape[:2]
    return mla_kernels.flash_mla_with_kvcache(
        layer.q, layer.cache, None, None, MLA_V, None, None, softmax_scale=SCALE,
        is_fp8_kvcache=layer.is_fp8, indices=slots.view(b, s_q, -1),
    )  # fmt: skip


def dsa(layer: Layer):
    """The model's sparse attention: the indexer's picks, then sparse MLA over them."""
    slots = indexer_topk(
        layer.index_q, layer.index_weights, layer.index_keys, layer.index_tables,
        layer.positions, TOPK,
    )  # fmt: skip
    return sparse_mla(layer, slots)


@dataclass
class Context:
    """Caches and queries for `batch` sequences of `length` tokens with up to `s_q` new ones;
    `layer` takes the first sequences and new tokens of them."""

    length: int
    cache: torch.Tensor
    block_table: torch.Tensor
    q: torch.Tensor  # bf16 [batch, s_q, 128, 576]
    index_q: torch.Tensor  # e4m3 [batch, s_q, 64, 128]
    index_weights: torch.Tensor  # fp32 [batch, s_q, 64]
    index_keys: IndexKeys

    @classmethod
    def random(cls, batch, length, s_q, cache_dtype: str, generator) -> Context:
        index_q, weights, keys, key_scales, block_table, _ = decode_case(
            batch, length, s_q, generator
        )
        shape = (batch, s_q, MLA_HEADS, MLA_QK)
        q = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=generator)
        cache = latent_cache(keys.shape[0], cache_dtype == "fp8", generator)
        return cls(length, cache, block_table, q, index_q, weights, IndexKeys(keys, key_scales))

    def layer(self, batch: int, s_q: int) -> Layer:
        block_table = self.block_table[:batch]
        seqlens = torch.full((batch,), self.length, dtype=torch.int32, device="cuda")
        new = torch.arange(self.length - s_q, self.length, device="cuda")
        return Layer(
            q=self.q[:batch, :s_q].contiguous(),
            cache=self.cache,
            block_table=block_table,
            seqlens=seqlens,
            schedule=mla_kernels.get_mla_metadata(seqlens, s_q * MLA_HEADS, 1),
            index_q=self.index_q[:batch, :s_q].reshape(-1, HEADS, DIM),
            index_weights=self.index_weights[:batch, :s_q].reshape(-1, HEADS),
            index_keys=self.index_keys,
            index_tables=block_table.repeat_interleave(s_q, dim=0),
            positions=new.repeat(batch),
        )


def latent_cache(pages: int, fp8: bool, generator) -> torch.Tensor:
    """A paged latent cache of random tokens, every slot written (`write_kv_cache`)."""
    width = MLA_TOKEN_BYTES if fp8 else MLA_QK
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.empty(pages, PAGE, 1, width, dtype=dtype, device="cuda")
    slots = pages * PAGE
    for start in range(0, slots, WRITE_TOKENS):
        rows = torch.arange(start, min(start + WRITE_TOKENS, slots), device="cuda")
        shape = (len(rows), MLA_QK)
        tokens = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=generator)
        latent, rope = tokens.split([MLA_V, MLA_QK - MLA_V], dim=-1)
        mla_kernels.write_kv_cache(cache, latent, rope, rows, fp8, check_values=False)
    return cache


def attention_work(pairs: float, tokens_read: float, rows: int, token_bytes: int):
    """FLOPs and bytes of absorbed MLA: `rows` query rows, `pairs` (query, token) scores and
    values, `tokens_read` cache tokens read."""
    width = MLA_QK + MLA_V
    return 2 * MLA_HEADS * width * pairs, tokens_read * token_bytes + rows * MLA_HEADS * width * 2


def dense_work(batch: int, context: int, s_q: int, token_bytes: int):
    seen = batch * attended_pairs(s_q, context - s_q)
    return attention_work(seen, batch * context, batch * s_q, token_bytes)


def dsa_work(batch: int, context: int, s_q: int, token_bytes: int) -> dict[str, tuple]:
    """Each of DSA's parts' FLOPs and bytes (the module's docstring)."""
    rows = batch * s_q
    picked = batch * attended_pairs(s_q, context - s_q, TOPK)
    return {
        "logits": decode_work(batch, context, s_q),
        "topk": (0, rows * context * 4 + rows * TOPK * 4),
        "slots": (0, rows * TOPK * 8),
        "sparse_mla": attention_work(picked, picked, rows, token_bytes),
    }


def bound_us(part: str, work: tuple, limits: dict) -> float:
    """The slower of the FLOPs over the part's matmul ceiling and the bytes over the copy's."""
    flops, nbytes = work
    matmul = limits["fp8_flops"] if part == "logits" else limits["bf16_flops"]
    return max(flops / matmul, nbytes / limits["copy_bytes_per_s"]) * 1e6


def bounds_us(batch: int, context: int, s_q: int, cache: str, limits: dict) -> dict[str, float]:
    """Dense's bound, each DSA part's, and DSA's (the sum of its parts')."""
    token_bytes = TOKEN_BYTES[cache]
    bounds = {"dense": bound_us("dense", dense_work(batch, context, s_q, token_bytes), limits)}
    parts = dsa_work(batch, context, s_q, token_bytes)
    bounds |= {part: bound_us(part, work, limits) for part, work in parts.items()}
    return bounds | {"dsa": sum(bounds[part] for part in PARTS)}


def pays_from(rows: list[dict], dense_key: str, dsa_key: str) -> dict[str, int | None]:
    """For each batch and s_q: the shortest context from which DSA is faster than dense
    (row[dsa_key] below row[dense_key]) at it and at every longer one measured; None where it
    is not faster at the longest."""
    groups = {}
    for row in rows:
        groups.setdefault(f"b{row['batch']} s_q{row['s_q']}", []).append(row)
    found = {}
    for name, group in groups.items():
        found[name] = None
        for row in sorted(group, key=lambda r: r["context"], reverse=True):
            if row[dsa_key] >= row[dense_key]:
                break
            found[name] = row["context"]
    return found


def check_comparable(s_q: int, cache: str, generator) -> None:
    """Exits unless DSA with top-k >= context gives the dense output (the module's docstring)."""
    context = Context.random(CHECK_BATCH, CHECK_CONTEXT, s_q, cache, generator)
    layer = context.layer(CHECK_BATCH, s_q)
    (want, want_lse), (got, got_lse) = dense(layer), dsa(layer)
    error = (got.float() - want.float()).abs().max().item()
    lse_error = (got_lse - want_lse).abs().max().item()
    largest = want.float().abs().max().item()
    if not (error <= 2e-2 * largest and lse_error <= 1e-3):
        sys.exit(
            f"s_q {s_q}, {cache} cache: DSA over every token differs from dense attention: "
            f"out by up to {error:.3g} (largest {largest:.3g}), lse by {lse_error:.3g}"
        )


def timed_row(context: Context, batch: int, s_q: int, cache: str, limits: dict, reps: int):
    layer = context.layer(batch, s_q)

    def logits_call():
        return _scores(
            layer.index_q, layer.index_weights, layer.index_keys, layer.index_tables,
            layer.positions,
        )  # fmt: skip

    logits = logits_call()  # each part's input, as the part before it gives it
    positions = top_positions(logits, TOPK)
    slots = cache_slots(positions, layer.index_tables, PAGE)
    calls = {
        "dense": lambda: dense(layer),
        "logits": logits_call,
        "topk": lambda: top_positions(logits, TOPK),
        "slots": lambda: cache_slots(positions, layer.index_tables, PAGE),
        "sparse_mla": lambda: sparse_mla(layer, slots),
        "torch_topk": lambda: index_topk(logits, TOPK),
        "dsa": lambda: dsa(layer),
    }
    times = {name: graph_ms(call, reps, FLUSH_BYTES) * 1e3 for name, call in calls.items()}
    bounds = bounds_us(batch, context.length, s_q, cache, limits)
    indexer = times["logits"] + times["topk"] + times["slots"]
    row = dict(batch=batch, context=context.length, s_q=s_q, cache=cache)
    row |= {f"{name}_us": t for name, t in times.items()}
    row |= {f"{name}_bound_us": b for name, b in bounds.items()}
    row |= dict(
        speedup=times["dense"] / times["dsa"],
        indexer_share=indexer / (indexer + times["sparse_mla"]),
    )
    print(
        f"{batch:>5} {context.length:>7} {s_q:>3} "
        + " ".join(f"{times[name]:10.1f}" for name in TIMES)
        + f" {row['speedup']:9.2f} {row['indexer_share']:7.0%}"
        + f" {bounds['dense']:9.1f} {bounds['dsa']:9.1f}",
        flush=True,
    )
    return row


def _onwards(context: int | None) -> str:
    return f"from {context} tokens on" if context else "at no context measured"


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batches", type=integers, default=[32, 64, 128], help="comma-separated")
    parser.add_argument(
        "--contexts",
        type=integers,
        default=[4096, 8192, 16384, 32768, 65536, 131072],
        help="tokens a sequence holds, comma-separated",
    )
    parser.add_argument("--s-q", type=integers, default=[1], help="new tokens a sequence: 1, 2")
    parser.add_argument(
        "--cache", choices=sorted(TOKEN_BYTES), default="fp8", help="the latent cache's layout"
    )
    parser.add_argument("--reps", type=int, default=20, help="replays a median is taken of")
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    if min(options.batches) < 1 or options.reps < 1:
        parser.error("--batches and --reps must be positive")
    if any(c < TOPK or c % PAGE for c in options.contexts):
        parser.error(f"--contexts must be multiples of {PAGE}, at least top-k ({TOPK})")
    if not set(options.s_q) <= {1, 2}:
        parser.error(f"--s-q takes 1 and 2, got {options.s_q}")
    if not torch.cuda.is_available():
        sys.exit("bench_dsa needs a CUDA device")
    if not triton_by_environment() or mla_kernels.sparse_backend("cuda") != "triton":
        sys.exit(
            "bench_dsa times the Triton paths: set REF_SERVER_INDEXER_TRITON=1 and "
            "MLA_KERNELS_SPARSE_BACKEND=triton"
        )
    if mla_kernels.backend("cuda") != "cuda":
        sys.exit("bench_dsa's dense attention needs mla_kernels' sm_90a kernel (a Hopper GPU)")

    bf16_flops, copy_bytes_per_s = ceilings(options.reps)
    limits = dict(
        bf16_flops=bf16_flops,
        fp8_flops=fp8_matmul_ceiling(options.reps),
        copy_bytes_per_s=copy_bytes_per_s,
    )
    print(
        f"{torch.cuda.get_device_name()}: FP8 matmul {limits['fp8_flops'] / 1e12:.0f} TFLOP/s, "
        f"bf16 {bf16_flops / 1e12:.0f}, copy {copy_bytes_per_s / 1e9:.0f} GB/s; "
        f"{options.cache} latent cache"
    )
    generator = torch.Generator("cuda").manual_seed(0)
    for s_q in options.s_q:
        check_comparable(s_q, options.cache, generator)
    print("times and bounds (bd) in µs; indexer: its share of DSA's parts")
    print(
        f"{'batch':>5} {'context':>7} {'s_q':>3} "
        + " ".join(f"{name:>10}" for name in TIMES)
        + f" {'dense/DSA':>9} {'indexer':>7} {'dense bd':>9} {'DSA bd':>9}"
    )
    rows = []
    for length in options.contexts:
        context = Context.random(
            max(options.batches), length, max(options.s_q), options.cache, generator
        )
        for batch in options.batches:
            for s_q in options.s_q:
                rows.append(timed_row(context, batch, s_q, options.cache, limits, options.reps))
        del context
        torch.cuda.empty_cache()
    measured = pays_from(rows, "dense_us", "dsa_us")
    at_bounds = pays_from(rows, "dense_bound_us", "dsa_bound_us")
    for name, context in measured.items():
        print(f"{name}: DSA faster than dense {_onwards(context)}, its bound below dense's "
              f"{_onwards(at_bounds[name])}")  # fmt: skip
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    torch=torch.__version__,
                    commit=os.environ.get("BENCH_COMMIT", "unknown"),
                    ceilings=limits,
                    cache=options.cache,
                    reps=options.reps,
                    rows=rows,
                    pays_from=measured,
                    bound_pays_from=at_bounds,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
