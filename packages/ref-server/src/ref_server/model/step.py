"""The one description of a cached forward step: the engine's runner prepares it, the model
consumes it.

`StepBatch` is what the runner (or `generate`, or a test) hands the model: the new tokens of
several sequences, flattened, their lengths and their pages. `StepMetadata` is its device form,
built once per step (or per microbatch) on the CPU from the Python lists, copied to the device in
one transfer and shared by every layer. `StepBatch.split` cuts a batch into two microbatches for
two-batch overlap, a sequence possibly in two (its prefix first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import numpy as np
import torch


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
        """One new token per sequence: attention runs absorbed over the latent cache."""
        return all(q == 1 for q in self.query_lens)

    # All on the CPU, from the Python lists, in numpy: on the GPU they would wait for it, and
    # each torch op on the CPU costs microseconds of dispatch, a decode step's host time.
    @cached_property
    def positions(self) -> torch.Tensor:
        """`[n]` int64 on the CPU: each new token's position in its sequence."""
        context = np.asarray(self.context_lens, dtype=np.int64)
        if self.is_decode:
            return torch.from_numpy(context - 1)
        starts = np.repeat(context - self.query_lens, self.query_lens)
        return torch.from_numpy(starts + _ranks_within(self.query_lens))

    def slot_mapping(self, page_size: int) -> torch.Tensor:
        """`[n]` int64 on the CPU: each new token's cache row, `block * page_size + offset`."""
        return self._cache_rows(self.query_lens, self.positions.numpy(), page_size)

    def context_rows(self, page_size: int) -> torch.Tensor:
        """`[sum(context_lens)]` int64 on the CPU: the cache rows of every sequence's whole
        context (positions 0 .. context - 1, the new tokens' included), sequence after
        sequence."""
        return self._cache_rows(self.context_lens, _ranks_within(self.context_lens), page_size)

    def _cache_rows(self, lens: list[int], positions: np.ndarray, page_size: int):
        """The cache rows of `positions` `[sum(lens)]` int64, the first lens[0] of sequence 0,
        the next lens[1] of sequence 1, and so on."""
        owner = np.repeat(np.arange(len(lens)), lens)
        blocks = self.block_table.cpu().numpy()[owner, positions // page_size]
        return torch.from_numpy(blocks.astype(np.int64) * page_size + positions % page_size)

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

    def metadata(self, cache, every_row: bool = False) -> StepMetadata:
        """This batch's device form on the cache's device (cache: anything with `device` and
        `page_size`, such as a `PagedKVCache`); every_row: the step returns the logits of every
        new token, not each sequence's last one's."""
        page = cache.page_size
        host = dict(
            positions=self.positions,
            slot_mapping=self.slot_mapping(page),
            block_table=self.block_table.cpu().int(),
        )
        if self.is_decode:
            return StepMetadata.decode(**_to_device(host, cache.device))
        cu_seqlens_q, cu_seqlens_k = (
            torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
            for lens in (self.query_lens, self.context_lens)
        )
        if not every_row:
            host["last_rows"] = cu_seqlens_q[1:].long() - 1
        host |= dict(
            context_rows=self.context_rows(page),
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
        )
        return StepMetadata(
            is_decode=False,
            query_lens=self.query_lens,
            context_lens=self.context_lens,
            **_to_device(host, cache.device),
        )


def _ranks_within(lens: list[int]) -> np.ndarray:
    """`[sum(lens)]` int64: 0 .. lens[0] - 1, then 0 .. lens[1] - 1, and so on."""
    total = sum(lens)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return np.arange(total, dtype=np.int64) - starts


def _to_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """CPU integer tensors on `device`, each in its shape and dtype, through one copy: a copy
    from pageable host memory waits for the device's queue, so once, not once per tensor."""
    flat = torch.cat([t.flatten().long() for t in tensors.values()]).to(device)
    parts = flat.split([t.numel() for t in tensors.values()])
    return {
        name: part.view(t.shape).to(t.dtype)
        for (name, t), part in zip(tensors.items(), parts, strict=True)
    }


@dataclass
class StepMetadata:
    """What every layer of one cached step (or microbatch) shares, on the cache's device.

    is_decode: attention through the decode kernel, absorbed over the latent cache: the
    batch's `StepBatch.is_decode`, or `decode`'s s_q tokens a sequence.
    positions, slot_mapping: `[n]` int64, each new token's position and cache row.
    block_table: `[b, max_blocks]` int32.
    last_rows: `[b]` int64, the rows whose logits the step returns; None: every row (decode).
    A prefill's, for its attention over all sequences at once (None in decode):
    - query_lens, context_lens: the batch's lengths (Python lists, as the host needs them);
    - context_rows: `[sum(context_lens)]` int64, the cache rows of every sequence's context;
    - cu_seqlens_q, cu_seqlens_k: `[b + 1]` int32, where each sequence's new tokens and its
      context start in the flattened rows (0, then the running sums of the lengths).
    A decode's cache_seqlens `[b]` int32, each sequence's cached tokens after the step, and
    s_q, its new tokens per sequence (n = b * s_q; more than 1 in speculative decoding's verify
    step: a sequence's newest token and its drafts, attending causally among themselves).
    real_rows: `[n]` bool, the rows that are tokens (a CUDA graph's padding rows are not);
    None: every row.
    """

    is_decode: bool
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    last_rows: torch.Tensor | None = None
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    context_rows: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    real_rows: torch.Tensor | None = None
    s_q: int = 1

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)

    @classmethod
    def decode(cls, positions, slot_mapping, block_table, real_rows=None, s_q=1) -> StepMetadata:
        """s_q new tokens per sequence (rows i * s_q .. (i + 1) * s_q - 1 are sequence i's),
        from device tensors alone (so a CUDA graph can capture it): each sequence's cache then
        holds its last row's position + 1 tokens."""
        return cls(
            is_decode=True,
            positions=positions,
            slot_mapping=slot_mapping,
            block_table=block_table,
            cache_seqlens=(positions[s_q - 1 :: s_q] + 1).int(),
            real_rows=real_rows,
            s_q=s_q,
        )
