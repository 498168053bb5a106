"""The one description of a cached forward step: the engine's runner prepares it, the model
consumes it.

`StepBatch` is what the runner (or `generate`, or a test) hands the model: the new tokens of
several sequences, flattened, their lengths and their pages. `StepMetadata` is its device form,
built once per step (or per microbatch) and shared by every layer. `StepBatch.split` cuts a batch
into two microbatches for two-batch overlap, a sequence possibly in two (its prefix first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

import mla_kernels


@dataclass
class StepBatch:
    """New tokens of several sequences, flattened; each sequence's cache holds its earlier
    tokens and receives the new ones.

    input_ids: `[n]` int64, the new tokens, sequence after sequence.
    query_lens: new tokens per sequence (sum n).
    context_lens: tokens in each sequence's cache after this step (>= its query_len).
    block_table: `[b, max_blocks]` int32, each sequence's pages in order.
    """

    input_ids: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_table: torch.Tensor

    def __post_init__(self) -> None:
        b = len(self.query_lens)
        if len(self.context_lens) != b or self.block_table.shape[0] != b:
            raise ValueError("query_lens, context_lens and block_table need one entry per sequence")
        if sum(self.query_lens) != self.input_ids.numel():
            raise ValueError(
                f"query_lens sum to {sum(self.query_lens)}, input_ids has "
                f"{self.input_ids.numel()} tokens"
            )
        if any(q < 1 or c < q for q, c in zip(self.query_lens, self.context_lens, strict=True)):
            raise ValueError("every sequence needs 1 <= query_len <= context_len")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: attention runs absorbed, through mla_kernels."""
        return all(q == 1 for q in self.query_lens)

    # Both on the CPU, from the Python lists: on the GPU they would wait for it.
    @cached_property
    def positions(self) -> torch.Tensor:
        """`[n]` int64 on the CPU: each new token's position in its sequence."""
        lens = zip(self.query_lens, self.context_lens, strict=True)
        return torch.cat([torch.arange(context - new, context) for new, context in lens])

    def slot_mapping(self, page_size: int) -> torch.Tensor:
        """`[n]` int64 on the CPU: each new token's cache row, `block * page_size + offset`."""
        positions = self.positions
        owner = torch.repeat_interleave(
            torch.arange(len(self.query_lens)), torch.tensor(self.query_lens)
        )
        table = self.block_table.cpu().long()
        blocks = table[owner, positions // page_size]
        return blocks * page_size + positions % page_size

    def split(self, split) -> tuple[StepBatch, StepBatch]:
        """Two microbatches of `split` (an `overlap_sched.Split`): A's tokens, then B's. A cut
        sequence's first `split.cut` new tokens go to A; B's part of it sees them in the cache."""
        halves = []
        for tokens, seqs in zip(split.tokens, split.seqs, strict=True):
            query = [self.query_lens[s] for s in seqs]
            context = [self.context_lens[s] for s in seqs]
            halves.append([tokens, seqs, query, context])
        if split.cut:
            a, b = halves
            whole = a[2][-1]
            a[2][-1] = split.cut
            a[3][-1] -= whole - split.cut
            b[2][0] = whole - split.cut
        return tuple(
            StepBatch(
                self.input_ids[tokens.start : tokens.stop],
                query,
                context,
                self.block_table[seqs.start : seqs.stop],
            )
            for tokens, seqs, query, context in halves
        )

    def metadata(self, cache, heads: int) -> StepMetadata:
        """This batch's device form on the cache's device (heads: the model's attention heads)."""
        device = cache.device
        positions = self.positions.to(device)
        slot_mapping = self.slot_mapping(cache.page_size).to(device)
        block_table = self.block_table.to(device=device, dtype=torch.int32)
        if self.is_decode:
            return StepMetadata.decode(positions, slot_mapping, block_table, heads)
        last_rows = torch.tensor(self.query_lens).cumsum(0).sub(1).to(device)
        return StepMetadata(
            False,
            positions,
            slot_mapping,
            block_table,
            last_rows,
            self.query_lens,
            self.context_lens,
        )


@dataclass
class StepMetadata:
    """What every layer of one cached step (or microbatch) shares, on the cache's device.

    is_decode: the batch's `StepBatch.is_decode`.
    positions, slot_mapping: `[n]` int64, each new token's position and cache row.
    block_table: `[b, max_blocks]` int32.
    last_rows: `[b]` int64, the rows whose logits the step returns; None: every row (decode).
    query_lens, context_lens: a prefill's lengths, which its per-sequence attention walks.
    cache_seqlens `[b]` int32, tile_scheduler_metadata, num_splits: a decode's kernel schedule.
    """

    is_decode: bool
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    last_rows: torch.Tensor | None = None
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    cache_seqlens: torch.Tensor | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def decode(cls, positions, slot_mapping, block_table, heads: int) -> StepMetadata:
        """One new token per sequence, from device tensors alone (so a CUDA graph can capture
        it): each sequence's cache then holds its token's position + 1 tokens."""
        cache_seqlens = (positions + 1).int()
        metadata, splits = mla_kernels.get_mla_metadata(cache_seqlens, heads, 1)
        return cls(
            True,
            positions,
            slot_mapping,
            block_table,
            None,
            None,
            None,
            cache_seqlens,
            metadata,
            splits,
        )
