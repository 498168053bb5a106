"""Triton kernels of sparse MLA attention: each query row attends the cache slots it names.

One program per (query row, block of heads, split of the indices), as FlashMLA's sparse
kernels: it walks its split 32 slots at a time, gathers those tokens (dequantizing the FP8
layout in registers: 512 e4m3 values times the float32 scale of their 128-group, rounded to
bf16, and 64 bf16 rope values), and keeps an online softmax with both products on the tensor
cores (bf16 operands, float32 accumulation). With more than one split, each writes its
normalized output and lse in float32 and a second kernel combines them. The number of splits
fills the GPU's SMs when query rows and head blocks alone do not.

With `TRITON_INTERPRET=1` set before Triton is imported, the kernels run in Triton's
interpreter, on CPU tensors too (the tests' path). Triton 3.6's interpreter multiplies
bfloat16 matrices wrongly and truncates float32 to bfloat16, so there the values are rounded
to bf16 by hand and kept in float32 operands (`_bf16`): the same numbers as on the GPU.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mla_kernels.fp8_layout import LATENT_DIM, NUM_SCALES, ROPE_DIM, SCALE_GROUP

BLOCK_N = 32
COMBINE_BLOCK_H = 16
MAX_BLOCK_H = 64
LOG2_E = 1.4426950408889634
# Kernels read module globals only as constexprs.
LATENT: tl.constexpr = tl.constexpr(LATENT_DIM)
ROPE: tl.constexpr = tl.constexpr(ROPE_DIM)
SCALES: tl.constexpr = tl.constexpr(NUM_SCALES)
GROUP: tl.constexpr = tl.constexpr(SCALE_GROUP)
LN_2: tl.constexpr = tl.constexpr(1 / LOG2_E)


@triton.jit
def _bf16(x, INTERPRETED: tl.constexpr):
    """x rounded to bfloat16 (to nearest even), as a tensor-core operand."""
    if INTERPRETED:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _latent_group(latent_ptr, scales_ptr, slots, valid, latent_stride, GROUP_INDEX: tl.constexpr,
                  IS_FP8: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """Latent columns [128 g, 128 (g + 1)) of the tokens in `slots`, bf16 (zero where not
    valid): one FP8 scale group."""
    at = latent_ptr + slots[:, None] * latent_stride + GROUP_INDEX * GROUP
    at += tl.arange(0, GROUP)[None, :]
    if IS_FP8:
        raw = tl.load(at, mask=valid[:, None], other=0)
        scale_at = scales_ptr + slots * (latent_stride // 4) + LATENT // 4 + GROUP_INDEX
        scale = tl.load(scale_at, mask=valid, other=0.0)
        values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
        return _bf16(values, INTERPRETED)
    return _bf16(tl.load(at, mask=valid[:, None], other=0.0), INTERPRETED)


@triton.jit
def _store_group(at, values, head_ok, SPLIT: tl.constexpr, INTERPRETED: tl.constexpr):
    if SPLIT:
        tl.store(at, values, mask=head_ok[:, None])
    else:
        tl.store(at, _bf16(values, INTERPRETED), mask=head_ok[:, None])


@triton.jit
def _attend_kernel(
    q_ptr,  # bf16 [n, h_q, 576]
    latent_ptr,  # bf16 [num_slots, 576], or the FP8 layout's bytes [num_slots, 656]
    scales_ptr,  # the FP8 layout as float32 words [num_slots, 164] (unused for bf16)
    rope_ptr,  # bf16 view of the tokens: [num_slots, 576] or [num_slots, 328]
    indices_ptr,  # int32 [n, topk]
    out_ptr,  # [n, h_q, 512] bf16, or float32 [n, splits, h_q, 512] with SPLIT
    max_ptr,  # float32 [n, h_q], or [n, splits, h_q]
    lse_ptr,  # float32 [n, h_q], or [n, splits, h_q]
    h_q,
    topk,
    num_slots,
    scale_log2,  # softmax_scale * log2(e): the kernel works in base 2
    latent_stride,
    rope_stride,
    rope_offset,
    TOKENS_PER_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # The 512 latent columns go as four groups of 128 (the FP8 scale groups), each with its own
    # accumulator: a [BLOCK_H, 512] float32 accumulator and a dequantized [BLOCK_N, 512] tile
    # in one piece spilled registers (ptxas for sm_90a), four pieces hardly do.
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    head_ok = heads < h_q
    group_cols = tl.arange(0, GROUP)
    rope_cols = tl.arange(0, ROPE)

    q_at = q_ptr + (row * h_q + heads)[:, None] * (LATENT + ROPE) + group_cols[None, :]
    q0 = _bf16(tl.load(q_at, mask=head_ok[:, None], other=0.0), INTERPRETED)
    q1 = _bf16(tl.load(q_at + GROUP, mask=head_ok[:, None], other=0.0), INTERPRETED)
    q2 = _bf16(tl.load(q_at + 2 * GROUP, mask=head_ok[:, None], other=0.0), INTERPRETED)
    q3 = _bf16(tl.load(q_at + 3 * GROUP, mask=head_ok[:, None], other=0.0), INTERPRETED)
    q_rope_at = q_ptr + (row * h_q + heads)[:, None] * (LATENT + ROPE) + LATENT
    q_rope = tl.load(q_rope_at + rope_cols[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = _bf16(q_rope, INTERPRETED)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    for offset in range(0, TOKENS_PER_SPLIT, BLOCK_N):
        cols = split * TOKENS_PER_SPLIT + offset + tl.arange(0, BLOCK_N)
        slots = tl.load(indices_ptr + row * topk + cols, mask=cols < topk, other=-1)
        valid = (slots >= 0) & (slots < num_slots)
        slots = tl.where(valid, slots, 0).to(tl.int64)
        tile = (latent_ptr, scales_ptr, slots, valid, latent_stride)
        kv0 = _latent_group(*tile, 0, IS_FP8, INTERPRETED)
        kv1 = _latent_group(*tile, 1, IS_FP8, INTERPRETED)
        kv2 = _latent_group(*tile, 2, IS_FP8, INTERPRETED)
        kv3 = _latent_group(*tile, 3, IS_FP8, INTERPRETED)
        k_rope = tl.load(
            rope_ptr + slots[:, None] * rope_stride + rope_offset + rope_cols[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        scores = tl.dot(q_rope, tl.trans(_bf16(k_rope, INTERPRETED)))
        scores = tl.dot(q0, tl.trans(kv0), scores)
        scores = tl.dot(q1, tl.trans(kv1), scores)
        scores = tl.dot(q2, tl.trans(kv2), scores)
        scores = tl.dot(q3, tl.trans(kv3), scores)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no valid slot yet keeps max -inf; subtracting 0 keeps exp2 at 0.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        denominator = denominator * rescale + tl.sum(probs, axis=1)
        probs = _bf16(probs, INTERPRETED)
        acc0 = tl.dot(probs, kv0, acc0 * rescale[:, None])
        acc1 = tl.dot(probs, kv1, acc1 * rescale[:, None])
        acc2 = tl.dot(probs, kv2, acc2 * rescale[:, None])
        acc3 = tl.dot(probs, kv3, acc3 * rescale[:, None])
        running_max = new_max

    seen = denominator > 0
    inverse = 1.0 / tl.where(seen, denominator, 1.0)
    max_logits = running_max * LN_2
    lse = (running_max + tl.log2(tl.where(seen, denominator, 1.0))) * LN_2
    if SPLIT:
        lse = tl.where(seen, lse, float("-inf"))  # an empty split weighs nothing
        at = (row * num_splits + split) * h_q + heads
    else:
        lse = tl.where(seen, lse, float("inf"))
        at = row * h_q + heads
    out_at = out_ptr + at[:, None] * LATENT + group_cols[None, :]
    _store_group(out_at, acc0 * inverse[:, None], head_ok, SPLIT, INTERPRETED)
    _store_group(out_at + GROUP, acc1 * inverse[:, None], head_ok, SPLIT, INTERPRETED)
    _store_group(out_at + 2 * GROUP, acc2 * inverse[:, None], head_ok, SPLIT, INTERPRETED)
    _store_group(out_at + 3 * GROUP, acc3 * inverse[:, None], head_ok, SPLIT, INTERPRETED)
    tl.store(max_ptr + at, max_logits, mask=head_ok)
    tl.store(lse_ptr + at, lse, mask=head_ok)


@triton.jit
def _combine_kernel(
    partial_out_ptr,  # float32 [n, splits, h_q, 512]
    partial_max_ptr,  # float32 [n, splits, h_q]
    partial_lse_ptr,  # float32 [n, splits, h_q], -inf for a split that attended nothing
    out_ptr,  # bf16 [n, h_q, 512]
    max_ptr,  # float32 [n, h_q]
    lse_ptr,  # float32 [n, h_q]
    h_q,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < h_q
    cols = tl.arange(0, LATENT)

    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    max_logits = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        at = (row * NUM_SPLITS + split) * h_q + heads
        top = tl.maximum(top, tl.load(partial_lse_ptr + at, mask=head_ok, other=float("-inf")))
        part_max = tl.load(partial_max_ptr + at, mask=head_ok, other=float("-inf"))
        max_logits = tl.maximum(max_logits, part_max)
    seen = top > float("-inf")
    shift = tl.where(seen, top, 0.0)
    total = tl.zeros([BLOCK_H], tl.float32)
    for split in range(NUM_SPLITS):
        at = (row * NUM_SPLITS + split) * h_q + heads
        total += tl.exp(tl.load(partial_lse_ptr + at, mask=head_ok, other=float("-inf")) - shift)
    lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("inf"))
    out = tl.zeros([BLOCK_H, LATENT], tl.float32)
    for split in range(NUM_SPLITS):
        at = (row * NUM_SPLITS + split) * h_q + heads
        weight = tl.exp(tl.load(partial_lse_ptr + at, mask=head_ok, other=float("-inf")) - lse)
        part = tl.load(
            partial_out_ptr + at[:, None] * LATENT + cols[None, :],
            mask=head_ok[:, None],
            other=0.0,
        )
        out += weight[:, None] * part
    at = row * h_q + heads
    tl.store(out_ptr + at[:, None] * LATENT + cols[None, :], _bf16(out, INTERPRETED),
             mask=head_ok[:, None])  # fmt: skip
    tl.store(max_ptr + at, max_logits, mask=head_ok)
    tl.store(lse_ptr + at, lse, mask=head_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_h(h_q: int) -> int:
    """Heads per program: all of them up to 64 (at least 16, the smallest tensor-core tile)."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(h_q)))


def default_num_splits(rows: int, h_q: int, topk: int, num_sms: int) -> int:
    """Splits of each row's indices: the largest power of two that keeps the programs within
    one wave (a program takes a whole SM's registers at 64 heads), at most one per tile. A
    power of two, since each split count is a kernel of its own (its tokens per split are a
    constexpr)."""
    programs = rows * math.ceil(h_q / block_h(h_q))
    fits = max(1, num_sms // programs)
    return min(1 << (fits.bit_length() - 1), math.ceil(topk / BLOCK_N))


def sparse_attention(
    q: torch.Tensor,
    tokens: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    is_fp8_kvcache: bool,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.sparse_attention`'s contract (q bf16) by the Triton kernels.
    num_splits: default `default_num_splits`."""
    n, h_q, _ = q.shape
    topk = indices.shape[1]
    num_slots = tokens.shape[0]
    interpret = triton.knobs.runtime.interpret
    if q.device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"Triton kernels need a CUDA device (the tensors are on {q.device.type}), or "
            "TRITON_INTERPRET=1 set before Triton is imported"
        )
    if num_splits is None:
        num_sms = 1 if interpret else _num_sms(q.device)
        num_splits = default_num_splits(n, h_q, topk, num_sms)
    tokens_per_split = math.ceil(math.ceil(topk / num_splits) / BLOCK_N) * BLOCK_N
    num_splits = max(1, math.ceil(topk / tokens_per_split))

    if is_fp8_kvcache:
        raw = tokens.view(torch.uint8)
        latent, scales, rope = raw, raw.view(torch.float32), raw.view(torch.bfloat16)
        rope_offset = (LATENT_DIM + 4 * NUM_SCALES) // 2
    else:
        latent = scales = rope = tokens
        rope_offset = LATENT_DIM
    like = {"device": q.device, "dtype": torch.float32}
    out = torch.empty(n, h_q, LATENT_DIM, device=q.device, dtype=q.dtype)
    max_logits = torch.empty(n, h_q, **like)
    lse = torch.empty(n, h_q, **like)
    if n == 0:
        return out, max_logits, lse
    heads = block_h(h_q)
    grid = (n, math.ceil(h_q / heads), num_splits)
    if num_splits > 1:
        partial_out = torch.empty(n, num_splits, h_q, LATENT_DIM, **like)
        partial_max = torch.empty(n, num_splits, h_q, **like)
        partial_lse = torch.empty(n, num_splits, h_q, **like)
        targets = (partial_out, partial_max, partial_lse)
    else:
        targets = (out, max_logits, lse)
    _attend_kernel[grid](
        q, latent, scales, rope, indices, *targets,
        h_q, topk, num_slots, softmax_scale * LOG2_E,
        latent.shape[1], rope.shape[1], rope_offset,
        TOKENS_PER_SPLIT=tokens_per_split, BLOCK_N=BLOCK_N, IS_FP8=is_fp8_kvcache,
        SPLIT=num_splits > 1, BLOCK_H=heads, INTERPRETED=interpret,
        num_warps=8, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _combine_kernel[(n, math.ceil(h_q / COMBINE_BLOCK_H))](
            *targets,
            out,
            max_logits,
            lse,
            h_q,
            NUM_SPLITS=num_splits,
            BLOCK_H=COMBINE_BLOCK_H,
            INTERPRETED=interpret,
            num_warps=4,
        )
    return out, max_logits, lse
