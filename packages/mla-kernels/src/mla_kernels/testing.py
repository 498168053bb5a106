"""Random paged-cache problems, as the tests and benchmarks build them.

Pages are handed out in a random order, slots past each sequence's end and every unused
page are filled with NaN (a kernel that reads them produces NaN), and an FP8 cache is written
through `write_kv_cache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_kernels.fp8_layout import FP8_TOKEN_BYTES
from mla_kernels.kv_cache import write_kv_cache
from mla_kernels.reference import HEAD_DIM

NAN_BYTE = 0xFF  # NaN as e4m3, as the bytes of a float32 scale and of a bf16 rope value


@dataclass
class DecodeCase:
    q: torch.Tensor  # [b, s_q, h_q, 576]
    k_cache: torch.Tensor  # [num_blocks, page_size, h_kv, 576 or 656]
    block_table: torch.Tensor  # int32 [b, max_blocks]
    cache_seqlens: torch.Tensor  # int32 [b]
    is_fp8_kvcache: bool


def varlen_seqlens(
    batch: int, mean: int, s_q: int, generator: torch.Generator | None = None
) -> list[int]:
    """FlashMLA's variable lengths: normal(mean, mean / 2), at least s_q."""
    device = generator.device if generator is not None else "cpu"
    lengths = torch.normal(float(mean), mean / 2, (batch,), generator=generator, device=device)
    return [max(s_q, int(n)) for n in lengths.tolist()]


def decode_case(
    seqlens: list[int],
    s_q: int,
    h_q: int,
    h_kv: int = 1,
    page_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    is_fp8_kvcache: bool = False,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    spare_blocks: int = 3,
) -> DecodeCase:
    batch = len(seqlens)
    max_blocks = max(1, math.ceil(max(seqlens) / page_size))
    num_blocks = batch * max_blocks + spare_blocks
    like = {"device": device, "generator": generator}
    order = torch.randperm(num_blocks, **like)[: batch * max_blocks]
    block_table = order.view(batch, max_blocks).to(torch.int32)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)

    in_page = torch.arange(page_size, device=device)
    slots = torch.cat(
        [
            (
                block_table[i, : math.ceil(n / page_size)].long().view(-1, 1) * page_size + in_page
            ).view(-1)[:n]
            for i, n in enumerate(seqlens)
        ]
    )
    tokens = torch.randn(slots.numel(), h_kv, HEAD_DIM, dtype=dtype, **like)

    width = FP8_TOKEN_BYTES if is_fp8_kvcache else HEAD_DIM
    cache_dtype = torch.float8_e4m3fn if is_fp8_kvcache else dtype
    k_cache = torch.empty(num_blocks, page_size, h_kv, width, dtype=cache_dtype, device=device)
    k_cache.view(torch.uint8).fill_(NAN_BYTE)
    write_kv_cache(k_cache, tokens[..., :512], tokens[..., 512:], slots, is_fp8_kvcache)

    q = torch.randn(batch, s_q, h_q, HEAD_DIM, dtype=dtype, **like)
    return DecodeCase(q, k_cache, block_table, cache_seqlens, is_fp8_kvcache)
