"""The paged latent cache.

A cache row holds one token of one layer as mla_kernels lays it out: the normalized KV latent
(kv_lora_rank values) then the rotated shared rope key (qk_rope_head_dim values). Pages are
`page_size` tokens; which pages a sequence owns is the caller's business (the engine's block
manager, or `generate`'s contiguous allocation), given as a block table.
"""

from __future__ import annotations

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
