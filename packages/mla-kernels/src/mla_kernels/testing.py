"""Random paged-cache problems, as the tests and benchmarks build them.

Pages are handed out in a random order, slots past each sequence's end and every unused
page are filled with NaN (a kernel that reads them produces NaN), and an FP8 cache is written
through `write_kv_cache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_kernels.fp8_layout import FP8_TOKEN_BYTES, dequantize_fp8
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

    slots = _token_slots(block_table, seqlens, page_size)
    tokens = torch.randn(slots.numel(), h_kv, HEAD_DIM, dtype=dtype, **like)

    width = FP8_TOKEN_BYTES if is_fp8_kvcache else HEAD_DIM
    cache_dtype = torch.float8_e4m3fn if is_fp8_kvcache else dtype
    k_cache = torch.empty(num_blocks, page_size, h_kv, width, dtype=cache_dtype, device=device)
    k_cache.view(torch.uint8).fill_(NAN_BYTE)
    write_kv_cache(k_cache, tokens[..., :512], tokens[..., 512:], slots, is_fp8_kvcache)

    q = torch.randn(batch, s_q, h_q, HEAD_DIM, dtype=dtype, **like)
    return DecodeCase(q, k_cache, block_table, cache_seqlens, is_fp8_kvcache)


def poison_cuda_allocator(shapes, dtypes) -> None:
    """Leave NaN-filled blocks of these shapes and dtypes in torch's CUDA caching allocator:
    the next allocations of those sizes get memory full of NaN, so unwritten elements show."""
    for shape in shapes:
        for dtype in dtypes:
            torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def long_tail_seqlens(batch: int, generator: torch.Generator | None = None) -> list[int]:
    """Lengths as a real decode batch has them: half the sequences at 512-2K tokens, 7/16
    log-uniform over 2K-32K, 1/16 (at least one) at 32K-64K, in a random order."""
    device = generator.device if generator is not None else "cpu"
    like = {"generator": generator, "device": device}
    long = max(1, batch // 16)
    short = batch // 2
    middle = batch - short - long
    lengths = torch.cat(
        [
            torch.randint(512, 2049, (short,), **like).double(),
            torch.exp(
                torch.empty(middle, dtype=torch.float64, device=device).uniform_(
                    math.log(2048), math.log(32768), generator=generator
                )
            ),
            torch.randint(32768, 65537, (long,), **like).double(),
        ]
    )
    return [int(n) for n in lengths[torch.randperm(batch, **like)].tolist()]


def _token_slots(block_table: torch.Tensor, seqlens: list[int], page_size: int) -> torch.Tensor:
    """The cache slot (block * page_size + offset) of every token, sequence after sequence."""
    in_page = torch.arange(page_size, device=block_table.device)
    return torch.cat(
        [
            (
                block_table[i, : math.ceil(n / page_size)].long().view(-1, 1) * page_size + in_page
            ).view(-1)[:n]
            for i, n in enumerate(seqlens)
        ]
    )


def repage(
    case: DecodeCase, page_size: int, generator: torch.Generator | None = None
) -> DecodeCase:
    """The same tokens (bytes for bytes, FP8 layout included) and queries in a cache of another
    page size, its pages handed out in a new random order, unused slots NaN."""
    seqlens = case.cache_seqlens.tolist()
    old_page, h_kv, width = case.k_cache.shape[1:]
    rows = case.k_cache.view(-1, h_kv, width)[_token_slots(case.block_table, seqlens, old_page)]
    max_blocks = max(1, math.ceil(max(seqlens) / page_size))
    num_blocks = len(seqlens) * max_blocks + 3
    device = case.k_cache.device
    order = torch.randperm(num_blocks, generator=generator, device=device)
    block_table = order[: len(seqlens) * max_blocks].view(-1, max_blocks).to(torch.int32)
    k_cache = case.k_cache.new_empty(num_blocks, page_size, h_kv, width)
    k_cache.view(torch.uint8).fill_(NAN_BYTE)
    k_cache.view(-1, h_kv, width)[_token_slots(block_table, seqlens, page_size)] = rows
    return DecodeCase(case.q, k_cache, block_table, case.cache_seqlens, case.is_fp8_kvcache)


def dequantized(case: DecodeCase) -> DecodeCase:
    """An FP8 case's cache as the queries' dtype holds it (value * scale rounded to that dtype):
    the bf16/fp16 cache whose attention the FP8 one computes."""
    k_cache = dequantize_fp8(case.k_cache).to(case.q.dtype)
    return DecodeCase(case.q, k_cache, case.block_table, case.cache_seqlens, False)


@dataclass
class SparseDecodeCase:
    paged: DecodeCase  # q (bf16) and the paged cache (h_kv = 1), with its block table
    indices: torch.Tensor  # int32 [b, s_q, topk]: cache slots, -1 for none
    positions: torch.Tensor  # int64 [b, s_q, topk]: the same tokens as positions in their sequence


def random_positions(
    seqlens: list[int], s_q: int, topk: int, invalid: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Distinct token positions of each sequence for each query, as an indexer's top-k picks
    them: `[b, s_q, topk]`, -1 where a sequence has fewer than topk tokens and for a fraction
    `invalid` of the entries."""
    device = generator.device if generator is not None else "cpu"
    like = {"generator": generator, "device": device}
    rows = []
    for n in seqlens:
        order = torch.rand(s_q, n, **like).argsort(dim=-1)[:, :topk]
        rows.append(torch.nn.functional.pad(order, (0, topk - order.shape[1]), value=-1))
    positions = torch.stack(rows)
    dropped = torch.rand(positions.shape, **like) < invalid
    return positions.masked_fill(dropped, -1)


def slots_of(positions: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots (block * page_size + offset) of token positions `[b, ...]`; -1 stays -1."""
    b = positions.shape[0]
    flat = positions.reshape(b, -1).clamp(min=0)
    blocks = block_table.long().gather(1, flat // page_size)
    slots = (blocks * page_size + flat % page_size).view(positions.shape)
    return torch.where(positions >= 0, slots, -1).to(torch.int32)


def sparse_decode_case(
    seqlens: list[int],
    s_q: int,
    h_q: int,
    topk: int,
    page_size: int = 64,
    is_fp8_kvcache: bool = False,
    invalid: float = 0.1,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> SparseDecodeCase:
    """A paged cache as `decode_case` builds it (NaN in every unwritten slot) and each query's
    topk tokens of its sequence (`random_positions`) as cache slots."""
    case = decode_case(
        seqlens, s_q, h_q, 1, page_size, torch.bfloat16, is_fp8_kvcache, device, generator
    )
    positions = random_positions(seqlens, s_q, topk, invalid, generator)
    indices = slots_of(positions, case.block_table, page_size)
    return SparseDecodeCase(case, indices, positions)
