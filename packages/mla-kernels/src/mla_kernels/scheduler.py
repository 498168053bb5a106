"""Split-KV tile scheduling: which CTA walks which stretch of which sequence.

The KV tokens of all sequences are cut into blocks of `BLOCK_TOKENS` and laid end to end.
Each of `num_parts` partitions (one per group of SMs) takes a contiguous run of that line,
balanced by cost: a block costs 1 and every sequence a partition starts or finishes costs
`FIXED_OVERHEAD_BLOCKS` more (its Q load, epilogue and, when split, the combine). A sequence
cut across partitions is computed in pieces whose partial results the combine kernel merges.

On a device where mla-kernels' CUDA kernel runs (`extension.backend`), one kernel of one block
computes it (`csrc/schedule_kernel.cuh`); elsewhere `schedule_reference`'s tensor ops do, on
the device of `cache_seqlens`. Neither synchronizes with the host, so CUDA graphs capture both.
"""

from __future__ import annotations

import torch

from mla_kernels.extension import backend, load_extension

BLOCK_TOKENS = 64
FIXED_OVERHEAD_BLOCKS = 5
BLOCK_M = 64  # query rows per CTA

# Columns of the metadata tensor, one row per partition. A partition covers the blocks from
# (begin_batch, begin_block) up to, exclusive, (end_batch, end_block); an empty partition has
# end_batch < begin_batch. begin_split is the index of its first piece among the pieces of
# begin_batch when that sequence is split.
BEGIN_BATCH, BEGIN_BLOCK, END_BATCH, END_BLOCK, BEGIN_SPLIT = range(5)
METADATA_WIDTH = 5


def num_sm_parts(device: torch.device, num_heads_per_head_k: int, num_heads_k: int) -> int:
    """Partitions per (query block, KV head) so that the grid fills the GPU once."""
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    m_blocks = -(-num_heads_per_head_k // BLOCK_M)
    return max(1, sm_count // num_heads_k // m_blocks)


def schedule(cache_seqlens: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition the KV blocks of `cache_seqlens` int32 `[b]` into `num_parts` runs.

    Returns the metadata int32 `[num_parts, 5]` (columns above) and the cumulative piece
    counts int32 `[b + 1]`: sequence i is computed in `splits[i + 1] - splits[i]` pieces
    (0 for an empty sequence).
    """
    if backend(cache_seqlens.device) == "cuda":
        load_extension()
        return torch.ops.mla_kernels_cuda.mla_schedule(cache_seqlens.contiguous(), num_parts)
    return schedule_reference(cache_seqlens, num_parts)


def schedule_reference(
    cache_seqlens: torch.Tensor, num_parts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`schedule` in tensor ops on any device."""
    seqlens = cache_seqlens.long()
    batch = seqlens.shape[0]
    device = seqlens.device
    zero = torch.zeros(1, dtype=torch.long, device=device)
    blocks = (seqlens + BLOCK_TOKENS - 1) // BLOCK_TOKENS
    block_start = torch.cat([zero, blocks.cumsum(0)])  # [b + 1]
    overhead = FIXED_OVERHEAD_BLOCKS * (blocks > 0)
    cost_start = torch.cat([zero, (blocks + overhead).cumsum(0)])
    total_cost = cost_start[-1]
    per_part = torch.clamp((total_cost + num_parts - 1) // num_parts, min=1)

    # Where on the block line each partition starts (and the last one ends).
    cost_points = torch.minimum(torch.arange(num_parts + 1, device=device) * per_part, total_cost)
    owner = torch.searchsorted(cost_start[1:], cost_points, right=True)
    owner_c = owner.clamp(max=batch - 1)
    into = (cost_points - cost_start[owner_c] - overhead[owner_c]).clamp(min=0)
    into = torch.minimum(into, blocks[owner_c])
    cuts = torch.where(owner < batch, block_start[owner_c] + into, block_start[-1])

    begin, end = cuts[:-1], cuts[1:]
    begin_batch = torch.searchsorted(block_start[1:], begin, right=True)
    end_batch = torch.searchsorted(block_start[1:], end - 1, right=True)
    begin_block = begin - block_start[begin_batch.clamp(max=batch - 1)]
    end_block = end - block_start[end_batch.clamp(max=batch - 1)]
    end_batch = torch.where(end > begin, end_batch, begin_batch - 1)

    # Sequence i is touched by partitions first[i] ..= last[i].
    first = torch.searchsorted(end, block_start[:-1], right=True)
    last = torch.searchsorted(begin, block_start[1:], right=False) - 1
    pieces = torch.where(blocks > 0, last - first + 1, 0)
    splits = torch.cat([zero, pieces.cumsum(0)])
    mid_sequence = begin_block > 0
    begin_split = torch.where(
        mid_sequence,
        torch.arange(num_parts, device=device) - first[begin_batch.clamp(max=batch - 1)],
        0,
    )
    metadata = torch.stack([begin_batch, begin_block, end_batch, end_block, begin_split], dim=1)
    return metadata.int(), splits.int()
