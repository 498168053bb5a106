"""FlashMLA's call surface: `get_mla_metadata` and `flash_mla_with_kvcache`.

The attention itself is the op `torch.ops.mla_kernels.mla_decode`: the sm_90a kernel on
Hopper GPUs, the torch reference on every other device, a fake implementation for tracing.
"""

from __future__ import annotations

import torch

from mla_kernels import reference, scheduler, sparse
from mla_kernels.extension import backend, fp8_in_registers, load_extension
from mla_kernels.fp8_layout import FP8_CACHE_DTYPES, FP8_TOKEN_BYTES
from mla_kernels.reference import HEAD_DIM, HEAD_DIM_V

Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_S_Q = 4
MAX_HEADS = 128
MAX_KV_HEADS = 8
PAGE_SIZES = (16, 32, 64, 128)


def get_mla_metadata(
    cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Schedule the split-KV work of one decode step, once per step (no host sync: CUDA graphs
    may capture it; on Hopper one kernel, `scheduler.schedule`).

    cache_seqlens: int32 `[b]`, tokens in each sequence's cache.
    num_heads_per_head_k: query rows per KV head, `s_q * h_q // h_kv`.
    num_heads_k: KV heads, h_kv.
    Returns tile_scheduler_metadata int32 `[num_parts, 5]` and num_splits int32 `[b + 1]`
    (see `mla_kernels.scheduler`); pass both to `flash_mla_with_kvcache` unchanged.
    """
    _check_seqlens(cache_seqlens)
    for name, value in (
        ("num_heads_per_head_k", num_heads_per_head_k),
        ("num_heads_k", num_heads_k),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    parts = scheduler.num_sm_parts(cache_seqlens.device, num_heads_per_head_k, num_heads_k)
    return scheduler.schedule(cache_seqlens, parts)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor | None,
    num_splits: torch.Tensor | None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    *,
    check_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of `q` over the paged MLA cache: dense over each sequence's tokens,
    or sparse over the tokens `indices` names.

    q: `[b, s_q, h_q, 576]` bfloat16 or float16, s_q <= 4, h_q a multiple of h_kv, <= 128.
    k_cache: `[num_blocks, page_size, h_kv, 576]` in q's dtype, or with `is_fp8_kvcache`
        `[num_blocks, page_size, h_kv, 656]` float8_e4m3fn/uint8 in the FP8 layout
        (`mla_kernels.fp8_layout`); V is the first 512 columns. page_size 16, 32, 64 or 128.
    block_table: int32 `[b, max_blocks]`, the cache blocks of each sequence in order.
    cache_seqlens: int32 `[b]`, at most `max_blocks * page_size` each.
    head_dim_v: 512.
    tile_scheduler_metadata, num_splits: from `get_mla_metadata` for these cache_seqlens.
    softmax_scale: default 576 ** -0.5.
    causal: with s_q > 1, query s sees the first `seqlen - s_q + s + 1` tokens.
    indices: sparse attention: int32 `[b, s_q, topk]`, each the cache slot
        `block * page_size + offset` of a token query (b, s) attends; an entry outside the
        cache (-1 by convention) is not attended. Then h_kv must be 1, q bfloat16, causal
        False, and block_table, cache_seqlens, tile_scheduler_metadata and num_splits are
        ignored (None will do); see `mla_kernels.sparse`.
    check_values: a debugging aid: raise ValueError for cache_seqlens beyond the block table
        and for block_table entries a sequence uses that lie outside the cache, at the cost of
        a device-to-host synchronization; skipped while a CUDA graph is being captured.
        Unchecked (the default), such tokens are not attended.
    Returns out `[b, s_q, h_q, 512]` in q's dtype and lse float32 `[b, h_q, s_q]`; a query that
    sees no token gets out = 0 and lse = +inf.
    """
    if indices is not None:
        return sparse.sparse_decode(
            q, k_cache, indices, head_dim_v, softmax_scale, causal, is_fp8_kvcache
        )
    _check_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache)
    _check_metadata(tile_scheduler_metadata, num_splits, q)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing:
        _check_values(k_cache, block_table, cache_seqlens)
    scale = HEAD_DIM**-0.5 if softmax_scale is None else float(softmax_scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return torch.ops.mla_kernels.mla_decode(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        tile_scheduler_metadata,
        num_splits,
        scale,
        bool(causal),
        bool(is_fp8_kvcache),
    )


def _reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.mla_decode(
        q, k_cache, block_table, cache_seqlens, softmax_scale, causal, is_fp8_kvcache
    )


# The reference is the implementation for every device without a kernel of its own.
mla_decode = torch.library.custom_op("mla_kernels::mla_decode", _reference_decode, mutates_args=())


@mla_decode.register_kernel("cuda")
def _mla_decode_cuda(*args):
    if backend(args[0].device) == "reference":
        return _reference_decode(*args)
    load_extension()
    return torch.ops.mla_kernels_cuda.mla_decode(*args, fp8_in_registers())


@mla_decode.register_fake
def _mla_decode_fake(q, *rest):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, HEAD_DIM_V), q.new_empty(b, h_q, s_q, dtype=torch.float32)


def _check_seqlens(cache_seqlens: torch.Tensor) -> None:
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 or cache_seqlens.numel() == 0:
        raise ValueError(
            f"cache_seqlens must be a non-empty 1-D int32 tensor, got {cache_seqlens.dtype} "
            f"of shape {tuple(cache_seqlens.shape)}"
        )


def _check_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache) -> None:
    sparse.check_tensors(q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens)
    _check_seqlens(cache_seqlens)
    if head_dim_v != HEAD_DIM_V:
        raise ValueError(f"head_dim_v must be {HEAD_DIM_V}, got {head_dim_v}")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    if q.dim() != 4 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must be [b, s_q, h_q, {HEAD_DIM}], got {tuple(q.shape)}")
    b, s_q, h_q, _ = q.shape
    if not 1 <= s_q <= MAX_S_Q:
        raise ValueError(f"s_q must be in 1..{MAX_S_Q}, got {s_q}")
    width = FP8_TOKEN_BYTES if is_fp8_kvcache else HEAD_DIM
    if k_cache.dim() != 4 or k_cache.shape[-1] != width:
        layout = "FP8 layout, " if is_fp8_kvcache else ""
        raise ValueError(
            f"k_cache must be [num_blocks, page_size, h_kv, {width}] ({layout}is_fp8_kvcache="
            f"{is_fp8_kvcache}), got {tuple(k_cache.shape)}"
        )
    if is_fp8_kvcache and k_cache.dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"an FP8 k_cache must be float8_e4m3fn or uint8, got {k_cache.dtype}")
    if not is_fp8_kvcache and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} differs from q dtype {q.dtype}")
    num_blocks, page_size, h_kv, _ = k_cache.shape
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {page_size}")
    if not 1 <= h_kv <= MAX_KV_HEADS:
        raise ValueError(f"h_kv must be in 1..{MAX_KV_HEADS}, got {h_kv}")
    if h_q % h_kv or h_q > MAX_HEADS:
        raise ValueError(
            f"h_q must be a multiple of h_kv={h_kv} and at most {MAX_HEADS}, got {h_q}"
        )
    if num_blocks == 0:
        raise ValueError("k_cache has no blocks")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(
            f"block_table must be int32 [b={b}, max_blocks], got {block_table.dtype} "
            f"of shape {tuple(block_table.shape)}"
        )
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries, q has b={b}")


def _check_metadata(tile_scheduler_metadata, num_splits, q) -> None:
    b = q.shape[0]
    for name, tensor in (
        ("tile_scheduler_metadata", tile_scheduler_metadata),
        ("num_splits", num_splits),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be the int32 tensor returned by get_mla_metadata")
        if tensor.device != q.device or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous and on {q.device}")
    if (
        tile_scheduler_metadata.dim() != 2
        or tile_scheduler_metadata.shape[1] != scheduler.METADATA_WIDTH
    ):
        raise ValueError(
            f"tile_scheduler_metadata must be [num_parts, {scheduler.METADATA_WIDTH}], "
            f"got {tuple(tile_scheduler_metadata.shape)}"
        )
    if tuple(num_splits.shape) != (b + 1,):
        raise ValueError(
            f"num_splits must have b + 1 = {b + 1} entries, got {tuple(num_splits.shape)}"
        )


def _check_values(k_cache, block_table, cache_seqlens) -> None:
    num_blocks, page_size = k_cache.shape[:2]
    max_blocks = block_table.shape[1]
    seqlens = cache_seqlens.long()
    bad_length = (seqlens < 0) | (seqlens > max_blocks * page_size)
    used = torch.arange(max_blocks, device=block_table.device) < (
        (seqlens + page_size - 1) // page_size
    ).unsqueeze(1)
    bad_block = used & ((block_table < 0) | (block_table >= num_blocks))
    any_bad_length, any_bad_block = torch.stack([bad_length.any(), bad_block.any()]).tolist()
    if any_bad_length:
        i = int(bad_length.nonzero()[0])
        raise ValueError(
            f"cache_seqlens[{i}] = {int(seqlens[i])} is outside 0..max_blocks * page_size = "
            f"{max_blocks * page_size}"
        )
    if any_bad_block:
        row, col = (int(i) for i in bad_block.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {col}] = {int(block_table[row, col])} is outside the cache's "
            f"{num_blocks} blocks"
        )
