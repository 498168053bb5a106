"""The paged latent cache and the description of one cached forward step.

A cache row holds one token of one layer as mla_kernels lays it out: the normalized KV latent
(kv_lora_rank values) then the rotated shared rope key (qk_rope_head_dim values). Pages are
`page_size` tokens; which pages a sequence owns is the caller's business (the engine's block
manager, or `generate`'s contiguous allocation), given as a block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ref_server.model.args import ModelArgs


class PagedKVCache:
    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        if problem := args.paged_decode_problem:
            raise ValueError(problem)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if page_size not in (16, 32, 64, 128):
            raise ValueError(f"page_size must be 16, 32, 64 or 128, got {page_size}")
        self.page_size = page_size
        self.num_blocks = num_blocks
        # One block past the others that no sequence owns: the padding rows of a CUDA-graph
        # decode step (`DecodeGraphs`) write and read there.
        self.padding_block = num_blocks
        shape = (num_blocks + 1, page_size, 1, args.cache_width)
        # [num_blocks + 1, page_size, 1, 576] per layer
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_hidden_layers)
        ]

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype


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
    def is_decode(self) -> bool:
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
