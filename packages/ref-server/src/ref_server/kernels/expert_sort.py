"""The routed experts' bookkeeping as one operator, `ref_server::moe_sort_by_expert`, with
Triton kernels on CUDA.

From ids `[n, k]` (each token's k local expert ids, -1 for an expert on another rank) it gives
what grouped GEMMs over the rows sorted by expert need: `order`, the stable sort of the n * k
slots by expert with the -1 slots last; `offsets`, the cumulative end of each expert's rows
(torch._grouped_mm's convention); `rows`, each slot's place in the sorted order (-1 for the -1
slots, whose rows lie past the last group). Ids outside [-1, num_experts) count as -1, on every
device: their slots sort last and their rows are -1, so no consumer reads or writes past the
groups. `moe_sort_by_expert_and_gather` also gives x's rows in that order, `x[order // k]`.

The default implementation, on any device, is `RoutedExperts.grouped`'s torch code from before
this operator (about 12 kernels: a radix sort, searchsorted, the inverse permutation), but for
ids above the experts, which it too counts as -1. On CUDA a counting sort in Triton gives the
same tensors bit for bit. Each slot has a bin (its expert, or num_experts for -1) and a sorted
place: the slots before it in (bin, index) order. The slots fall into chunks of CHUNK; a placing
program takes BLOCK slots, loads every slot of their chunk and counts, for each of its slots,
those with a smaller (bin, index) pair, packed into one int32 so that this is one comparison a
pair. Up to CHUNK slots (every decode batch) that is the place, and the whole operator one
launch: more programs give the experts' ends, offsets[e], as the places of a (bin e + 1, index
-1) that is no slot. Above CHUNK slots, two launches before it add the chunks' bases: one
program per chunk counts its slots of each bin, then one program sums those counts into, for
each chunk and bin, the slots that come before the chunk's own. The work is slots x CHUNK
comparisons spread over slots / BLOCK programs (at 130k slots about 270M, some 20 us on an
H200 by arithmetic, not measured), not one serial program.

`moe_sort_by_expert_and_gather` also copies x's rows into their sorted places, `x[order // k]`
(one gather and one division in torch): each placing program copies the rows of its BLOCK
slots, so the copy is spread over as many programs as the placing.

Nothing waits for the device, no size depends on a value, and slot counts are no
specialization of the kernels (they compile once for each num_experts, for each power of two of
slots up to CHUNK, where one chunk holds them all and is only that wide, and for more chunks,
and for the gathered rows' dtype and width), so CUDA graphs capture them after one warm-up call
at any batch size. Ids past the experts, and -1, never make a kernel read or write out of its
tensors. triton is imported on the first CUDA call only, so that this module imports without
it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ref_server.kernels.pdl import launch_options

CHUNK = 2048  # slots ranked together: every decode batch (256 tokens x 8) is one chunk
BLOCK = 16  # slots (or experts) a placing program ranks
MAX_EXPERTS = 1023  # the kernels count one bin per expert and one for -1, 1024 bins at most
SCAN_ROWS = 8  # chunks' counts the scan sums at once
GATHER_BYTES = 1024  # of each row x's copy moves at once


def check_inputs(ids: torch.Tensor, num_experts: int, x: torch.Tensor | None = None) -> None:
    """ValueError naming what is wrong with arguments of `moe_sort_by_expert(_and_gather)`."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"ids must be [n, k], got {shape}")
    if ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64, got {ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if x is not None:
        if x.dim() != 2 or x.shape[0] != ids.shape[0]:
            raise ValueError(
                f"x must be [n, hidden] with n = {ids.shape[0]} (one row per token of ids), "
                f"got {tuple(x.shape)}"
            )
        if x.device != ids.device:
            raise ValueError(
                f"x and ids must be on one device: x is on {x.device}, ids on {ids.device}"
            )


def _sort_by_expert_reference(
    ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids `[n, k]` int64, local expert ids in [0, num_experts) or -1 (other values count as
    -1) to (order `[n * k]` int64, the flat slots sorted by expert, stably, -1 last; offsets
    `[num_experts]` int32, the end of each expert's sorted rows; rows `[n, k]` int64, each
    slot's index in order, -1 for the -1 slots)."""
    check_inputs(ids, num_experts)
    n, k = ids.shape
    flat = ids.flatten()
    valid = (flat >= 0) & (flat < num_experts)
    expert = torch.where(valid, flat, num_experts)
    order = expert.argsort(stable=True)
    ends = torch.arange(1, num_experts + 1, device=ids.device)
    offsets = torch.searchsorted(expert[order], ends, out_int32=True)
    sorted_at = torch.arange(n * k, device=ids.device)
    rows = torch.empty_like(order).scatter_(0, order, sorted_at)  # the inverse of the sort
    rows = torch.where(valid, rows, -1).view(n, k)
    return order, offsets, rows


moe_sort_by_expert = torch.library.custom_op(
    "ref_server::moe_sort_by_expert", _sort_by_expert_reference, mutates_args=()
)


@moe_sort_by_expert.register_fake
def _(ids, num_experts):
    check_inputs(ids, num_experts)
    n, k = ids.shape
    return ids.new_empty(n * k), ids.new_empty(num_experts, dtype=torch.int32), ids.new_empty(n, k)


@moe_sort_by_expert.register_kernel("cuda")
def _(ids, num_experts):
    if num_experts <= MAX_EXPERTS:
        return triton_moe_sort_by_expert(ids, num_experts)
    return _sort_by_expert_reference(ids, num_experts)


def _sort_and_gather_reference(
    ids: torch.Tensor, num_experts: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_sort_by_expert`'s (order, offsets, rows), then x `[n, hidden]` (any dtype) in that
    order: gathered `[n * k, hidden]` = x[order // k], contiguous."""
    check_inputs(ids, num_experts, x)
    order, offsets, rows = _sort_by_expert_reference(ids, num_experts)
    return order, offsets, rows, x[order // ids.shape[1]]


moe_sort_by_expert_and_gather = torch.library.custom_op(
    "ref_server::moe_sort_by_expert_and_gather", _sort_and_gather_reference, mutates_args=()
)


@moe_sort_by_expert_and_gather.register_fake
def _(ids, num_experts, x):
    check_inputs(ids, num_experts, x)
    n, k = ids.shape
    gathered = x.new_empty(n * k, x.shape[1])
    return (
        ids.new_empty(n * k),
        ids.new_empty(num_experts, dtype=torch.int32),
        ids.new_empty(n, k),
        gathered,
    )


@moe_sort_by_expert_and_gather.register_kernel("cuda")
def _(ids, num_experts, x):
    if num_experts <= MAX_EXPERTS:
        return triton_moe_sort_by_expert(ids, num_experts, x)
    return _sort_and_gather_reference(ids, num_experts, x)


def triton_moe_sort_by_expert(
    ids: torch.Tensor, num_experts: int, x: torch.Tensor | None = None, chunk: int = CHUNK
) -> tuple[torch.Tensor, ...]:
    """`moe_sort_by_expert(ids, num_experts)` through the Triton kernels, or with x `[n,
    hidden]`, `moe_sort_by_expert_and_gather(ids, num_experts, x)`: ids `[n, k]` int64 on one
    CUDA device (or on the CPU with TRITON_INTERPRET=1), num_experts at most MAX_EXPERTS. chunk:
    the slots each slot is ranked among, a power of two from BLOCK to CHUNK (smaller values
    serve tests of several chunks at small sizes)."""
    check_inputs(ids, num_experts, x)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the kernels take at most {MAX_EXPERTS} experts, got {num_experts}")
    if not BLOCK <= chunk <= CHUNK or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two from {BLOCK} to {CHUNK}, got {chunk}")
    n, k = ids.shape
    slots = n * k
    device = ids.device
    order = torch.empty(slots, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    rows = torch.empty(n, k, dtype=torch.int64, device=device)
    gathered, hidden, columns = None, 0, 1
    if x is not None:
        if x.stride(1) != 1:
            x = x.contiguous()
        hidden = x.shape[1]
        gathered = torch.empty(slots, hidden, dtype=x.dtype, device=device)
        # the power of two at or above hidden, at most GATHER_BYTES of it
        columns = min(1 << max(hidden - 1, 0).bit_length(), GATHER_BYTES // x.element_size())
    outputs = (order, offsets, rows) if x is None else (order, offsets, rows, gathered)
    if slots == 0:
        offsets.zero_()
        return outputs
    ids = ids.contiguous()
    triton, count_kernel, scan_kernel, place_kernel = _triton_kernels()
    if slots <= chunk:  # one chunk, only as wide as the slots: each program compares fewer
        chunk = max(BLOCK, triton.next_power_of_2(slots))
    chunks = triton.cdiv(slots, chunk)
    bins = 1 << num_experts.bit_length()  # a power of two above num_experts: bin E holds -1
    bases = None
    cuda = torch.cuda.device(device) if ids.is_cuda else contextlib.nullcontext()
    with cuda:
        if chunks > 1:
            counts = torch.empty(chunks, bins, dtype=torch.int32, device=device)
            pdl = launch_options(ids.device)
            count_kernel[(chunks,)](ids, counts, slots, num_experts, CHUNK=chunk, BINS=bins, **pdl)
            bases = torch.empty(chunks, bins, dtype=torch.int32, device=device)
            scan_kernel[(1,)](counts, bases, chunks, ROWS=SCAN_ROWS, BINS=bins, num_warps=8, **pdl)
        grid = (triton.cdiv(slots, BLOCK) + triton.cdiv(num_experts, BLOCK),)
        place_kernel[grid](
            ids,
            bases,
            order,
            offsets,
            rows,
            x,
            gathered,
            slots,
            num_experts,
            k,
            x.stride(0) if x is not None else 0,
            CHUNK=chunk,
            BLOCK=BLOCK,
            BINS=bins,
            HIDDEN=hidden,
            COLUMNS=columns,
            SINGLE_CHUNK=chunks == 1,
            num_warps=4,
            **launch_options(ids.device),
        )
    return outputs


tl = None  # triton.language, once _triton_kernels() has imported it


@functools.cache
def _triton_kernels():
    """(triton, the compiled `_count_kernel`, `_scan_kernel` and `_place_kernel`): triton is
    imported here, on first use. Slot and chunk counts are not specialized on (Triton would
    compile again for each new multiple of 16, say a decode batch size first seen after the
    warm-up)."""
    global tl
    import triton
    import triton.language as tl

    return (
        triton,
        triton.jit(_count_kernel, do_not_specialize=["slots"]),
        triton.jit(_scan_kernel, do_not_specialize=["chunks"]),
        triton.jit(_place_kernel, do_not_specialize=["slots"]),
    )


def _count_kernel(
    ids,  # int64 [slots], contiguous
    counts,  # int32 [cdiv(slots, CHUNK), BINS], out
    slots,
    num_experts,
    CHUNK: tl.constexpr,
    BINS: tl.constexpr,  # a power of two above num_experts
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program c: counts[c, b] = the slots of chunk c in bin b (bin e: expert e; bin
    num_experts: -1 or an id out of range; the bins above: none)."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    chunk = tl.program_id(0)
    slot = chunk * CHUNK + tl.arange(0, CHUNK)
    live = slot < slots
    expert = tl.load(ids + slot, mask=live, other=-1)
    key = tl.where((expert >= 0) & (expert < num_experts), expert, num_experts).to(tl.int32)
    tl.store(counts + chunk * BINS + tl.arange(0, BINS), tl.histogram(key, BINS, mask=live))


def _scan_kernel(
    counts,  # int32 [chunks, BINS] from _count_kernel
    bases,  # int32 [chunks, BINS], out
    chunks,
    ROWS: tl.constexpr,  # chunks summed at once
    BINS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """One program: bases[c, b] = the slots in bins below b, plus those in bin b of chunks
    before c, minus those of chunk c in bins below b. A slot's sorted place is then
    bases[its chunk, its bin] plus the slots of its chunk that sort before it."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bins = tl.arange(0, BINS)
    totals = tl.zeros([BINS], dtype=tl.int32)
    first = 0
    while first < chunks:
        chunk = first + tl.arange(0, ROWS)[:, None]
        totals += tl.sum(tl.load(counts + chunk * BINS + bins, mask=chunk < chunks, other=0), 0)
        first += ROWS
    first_place = tl.cumsum(totals, 0) - totals  # of each bin, for the chunks from `first` on
    first = 0
    while first < chunks:
        chunk = first + tl.arange(0, ROWS)[:, None]
        block = tl.load(counts + chunk * BINS + bins, mask=chunk < chunks, other=0)
        before = first_place + tl.cumsum(block, 0) - block
        below = tl.cumsum(block, 1) - block
        tl.store(bases + chunk * BINS + bins, before - below, mask=chunk < chunks)
        first_place += tl.sum(block, 0)
        first += ROWS


def _place_kernel(
    ids,  # int64 [slots], contiguous
    bases,  # int32 [cdiv(slots, CHUNK), BINS] from _scan_kernel; None with SINGLE_CHUNK
    order,  # int64 [slots], out
    offsets,  # int32 [num_experts], out
    rows,  # int64 [slots], out
    x,  # [slots / k, HIDDEN], row stride x_stride, columns contiguous; or None
    gathered,  # [slots, HIDDEN] of x's dtype, contiguous, out; or None (then x is None too)
    slots,
    num_experts,
    k,
    x_stride,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,  # slots, or experts, of one program
    BINS: tl.constexpr,  # a power of two above num_experts: bin num_experts holds the -1 slots
    HIDDEN: tl.constexpr,
    COLUMNS: tl.constexpr,  # of x copied at once
    SINGLE_CHUNK: tl.constexpr,  # slots <= CHUNK: every base is 0
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """The first cdiv(slots, BLOCK) programs place BLOCK slots each: order[place] = slot,
    rows[slot] = place (-1 for a -1 slot) and, with x, gathered[place] = x[slot // k]. The
    others each give BLOCK experts' ends, offsets[e] = the place of a slot of bin e + 1 that
    came before every other (so the slots of bins up to e). Slot i of bin b sorts after the
    slots with a smaller (bin, index) pair: each program counts those of the chunk it lies in
    (chunk 0 for the ends) and adds the chunk's base for b (see _scan_kernel)."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    program = tl.program_id(0)
    slot_programs = tl.cdiv(slots, BLOCK)
    places_slots = program < slot_programs
    lane = tl.arange(0, BLOCK)
    slot = program * BLOCK + lane
    is_slot = places_slots & (slot < slots)
    expert_end = (program - slot_programs) * BLOCK + lane + 1
    is_end = (program >= slot_programs) & (expert_end <= num_experts)
    chunk = tl.where(places_slots, program * BLOCK // CHUNK, 0)
    expert = tl.load(ids + slot, mask=is_slot, other=-1)
    key = tl.where((expert >= 0) & (expert < num_experts), expert, num_experts).to(tl.int32)
    query_bin = tl.where(places_slots, key, expert_end)
    query = query_bin * CHUNK + tl.where(places_slots, slot - chunk * CHUNK, 0)

    index = tl.arange(0, CHUNK)
    in_chunk = chunk * CHUNK + index < slots
    others = tl.load(ids + chunk * CHUNK + index, mask=in_chunk, other=-1)
    other_bin = tl.where((others >= 0) & (others < num_experts), others, num_experts)
    # (bin, index) packed in one int32; past the slots, after every query
    packed = tl.where(in_chunk, other_bin.to(tl.int32) * CHUNK + index, BINS * CHUNK)
    place = tl.sum((packed[None, :] < query[:, None]).to(tl.int32), axis=1)
    if not SINGLE_CHUNK:
        place += tl.load(bases + chunk * BINS + query_bin, mask=is_slot | is_end, other=0)

    tl.store(order + place, slot.to(tl.int64), mask=is_slot)
    tl.store(rows + slot, tl.where(key < num_experts, place, -1).to(tl.int64), mask=is_slot)
    tl.store(offsets + expert_end - 1, place, mask=is_end)
    if gathered is not None:
        token = (slot // k).to(tl.int64)[:, None]
        target = place.to(tl.int64)[:, None] * HIDDEN
        for start in range(0, HIDDEN, COLUMNS):
            cols = start + tl.arange(0, COLUMNS)[None, :]
            copied = is_slot[:, None] & (cols < HIDDEN)
            values = tl.load(x + token * x_stride + cols, mask=copied)
            tl.store(gathered + target + cols, values, mask=copied)
