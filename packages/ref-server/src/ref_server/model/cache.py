"""The paged latent cache.

A cache row holds one token of one layer as mla_kernels lays it out: the normalized KV latent
(kv_lora_rank values) then the rotated shared rope key (qk_rope_head_dim values). Pages are
`page_size` tokens; which pages a sequence owns is the caller's business (the engine's block
manager, or `generate`'s contiguous allocation), given as a block table. A DeepSeek-V3.2
model's layers also cache their lightning indexer's key of each token (`IndexKeys`), in a
tensor of their own with the same pages and slots: a page is its block in every tensor that
`PagedKVCache.page_tensors` lists, and moves between caches as those blocks' bytes. A model
with an MTP module (`ref_server.model.mtp`) has one more layer here, after its own, and a row
per page for the model's output hidden state of a prompt's last token (`prompt_hidden`): the
module's first draft reads it, so it moves with the pages from a prefill instance to a decode
instance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ref_server.kernels.fp8_cast import quantize_activations
from ref_server.model.args import ModelArgs

FP8 = torch.float8_e4m3fn


@dataclass
class IndexKeys:
    """One layer's indexer keys, a row per cache slot as the latent's: values
    `[num_blocks + 1, page_size, index_head_dim]`, e4m3 or unquantized, and scales
    `[num_blocks + 1, page_size]` float32, each row's (1 for unquantized ones)."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def is_fp8(self) -> bool:
        return self.values.dtype == FP8

    @property
    def page_size(self) -> int:
        return self.values.shape[1]

    def write(self, keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """keys `[n, index_head_dim]` into the rows slot_mapping `[n]` names, quantized to e4m3
        with a scale per row (amax / 448) in an FP8 cache."""
        scales = 1.0
        if self.is_fp8:
            keys, scales = quantize_activations(keys)
            scales = scales.squeeze(-1)
        self.values.flatten(0, 1)[slot_mapping] = keys.to(self.values.dtype)
        self.scales.flatten()[slot_mapping] = scales

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The keys at slots (any shape) `[*slots.shape, index_head_dim]`, float32."""
        values = self.values.flatten(0, 1)[slots].float()
        return values * self.scales.flatten()[slots].unsqueeze(-1)


def cache_bytes_per_token(
    args: ModelArgs, dtype: torch.dtype = torch.bfloat16, index_dtype: torch.dtype = FP8
) -> int:
    """What one token takes in a `PagedKVCache` of these dtypes, all layers together (the MTP
    module's too): its latent row and, in a sparse model, its index key and the key's float32
    scale (132 bytes a layer beside the latent's 1,152 at index_head_dim 128 in FP8 and bf16)."""
    per_layer = args.cache_width * dtype.itemsize
    if args.is_sparse:
        per_layer += args.index_head_dim * index_dtype.itemsize + torch.float32.itemsize
    return (args.num_hidden_layers + args.num_nextn_predict_layers) * per_layer


def cache_page_bytes(
    args: ModelArgs, page_size: int, dtype: torch.dtype = torch.bfloat16, index_dtype=FP8
) -> int:
    """What one page of a `PagedKVCache` of these dtypes holds: its tokens' rows and, with an
    MTP module, the page's float32 `prompt_hidden` row."""
    hidden = args.hidden_size * torch.float32.itemsize if args.num_nextn_predict_layers else 0
    return page_size * cache_bytes_per_token(args, dtype, index_dtype) + hidden


class PagedKVCache:
    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        index_dtype: torch.dtype = FP8,
    ) -> None:
        """index_dtype: the indexer's keys' (a V3.2 model's): e4m3 as DeepSeek keeps them, or
        a float dtype to keep them unquantized."""
        if problem := args.paged_decode_problem:
            raise ValueError(problem)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if page_size not in (16, 32, 64, 128):
            raise ValueError(f"page_size must be 16, 32, 64 or 128, got {page_size}")
        if not index_dtype.is_floating_point:
            raise ValueError(f"index_dtype must be a floating point dtype, got {index_dtype}")
        self.page_size = page_size
        self.num_blocks = num_blocks
        # One block past the others that no sequence owns: the padding rows of a CUDA-graph
        # decode step (`DecodeGraphs`) write and read there.
        self.padding_block = num_blocks
        shape = (num_blocks + 1, page_size, 1, args.cache_width)
        # [num_blocks + 1, page_size, 1, 576] per layer, the MTP module's last
        num_layers = args.num_hidden_layers + args.num_nextn_predict_layers
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.index_keys = [
            IndexKeys(
                torch.zeros(*shape[:2], args.index_head_dim, dtype=index_dtype, device=device),
                torch.ones(shape[:2], dtype=torch.float32, device=device),
            )
            if args.is_sparse
            else None
            for _ in range(num_layers)
        ]
        # In float32, which holds a bf16 or float32 model's hidden state exactly: instances on
        # any device agree on a page's bytes.
        self.prompt_hidden = (
            torch.zeros(num_blocks + 1, args.hidden_size, device=device)
            if args.num_nextn_predict_layers
            else None
        )

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds pages, indexed by block first: each layer's latent rows,
        then, in a sparse model, each layer's index keys and their scales, then, with an MTP
        module, `prompt_hidden`."""
        keys = [k for k in self.index_keys if k is not None]
        hidden = [] if self.prompt_hidden is None else [self.prompt_hidden]
        return self.layers + [k.values for k in keys] + [k.scales for k in keys] + hidden

    @property
    def page_bytes(self) -> int:
        """The bytes of one page (one block of every page tensor)."""
        return sum(t[0].nbytes for t in self.page_tensors)

    @property
    def page_contents(self) -> str:
        """What a page holds, in words (for errors about pages that do not fit here)."""
        parts = [f"{len(self.layers)} layers' latent rows"]
        if self.index_keys[0] is not None:
            parts.append("their index keys and scales")
        if self.prompt_hidden is not None:
            parts[0] += " (the MTP module's last)"
            parts.append(
                f"the {self.prompt_hidden.shape[1]} float32 values of a prompt's last hidden "
                "state, which the MTP module's first draft reads"
            )
        return f"{self.page_bytes} bytes: " + ", ".join(parts)

    def read_page(self, block: int) -> torch.Tensor:
        """Block `block` of every page tensor in turn, as bytes: `[page_bytes]` uint8 (CPU)."""
        return torch.cat([_bytes(t[block]) for t in self.page_tensors]).cpu()

    def write_page(self, block: int, data: torch.Tensor) -> None:
        """`read_page`'s bytes into block `block`."""
        if data.shape != (self.page_bytes,) or data.dtype != torch.uint8:
            raise ValueError(
                f"a page is [{self.page_bytes}] uint8, got {tuple(data.shape)} {data.dtype}"
            )
        tensors = self.page_tensors
        parts = data.split([t[0].nbytes for t in tensors])
        for tensor, part in zip(tensors, parts, strict=True):
            _bytes(tensor[block]).copy_(part)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, a view `[nbytes]` uint8."""
    return x.reshape(-1).view(torch.uint8)
