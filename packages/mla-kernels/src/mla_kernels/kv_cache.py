"""Writing new tokens into the paged MLA cache."""

from __future__ import annotations

import torch

from mla_kernels.fp8_layout import (
    FP8_CACHE_DTYPES,
    FP8_TOKEN_BYTES,
    LATENT_DIM,
    ROPE_DIM,
    quantize_fp8,
)
from mla_kernels.reference import HEAD_DIM


def write_kv_cache(
    k_cache: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_fp8_kvcache: bool = False,
    *,
    check_values: bool = True,
) -> None:
    """Scatter n new tokens into `k_cache` in place.

    k_cache: `[num_blocks, page_size, h_kv, 576]` (bf16/fp16), or with `is_fp8_kvcache`
        `[num_blocks, page_size, h_kv, 656]` float8_e4m3fn/uint8 (`mla_kernels.fp8_layout`).
    latent: `[n, h_kv, 512]` (or `[n, 512]` when h_kv = 1), any float dtype.
    rope: `[n, h_kv, 64]` (or `[n, 64]`), any float dtype.
    slot_mapping: int64 or int32 `[n]`, slot `block * page_size + offset` of each token;
        every slot distinct.
    check_values: check that every slot lies in the cache (a device-to-host synchronization;
        skipped while a CUDA graph is being captured).
    """
    if latent.dim() == 2:
        latent, rope = latent.unsqueeze(1), rope.unsqueeze(1)
    _check(k_cache, latent, rope, slot_mapping, is_fp8_kvcache)
    capturing = k_cache.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing:
        capacity = k_cache.shape[0] * k_cache.shape[1]
        bad = (slot_mapping < 0) | (slot_mapping >= capacity)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside the cache's "
                f"{capacity} slots"
            )
    torch.ops.mla_kernels.write_kv_cache(k_cache, latent, rope, slot_mapping, is_fp8_kvcache)


@torch.library.custom_op("mla_kernels::write_kv_cache", mutates_args=("k_cache",))
def _write_kv_cache(
    k_cache: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_fp8_kvcache: bool,
) -> None:
    num_blocks, page_size, h_kv, width = k_cache.shape
    if is_fp8_kvcache:  # copied as bytes: index_copy_ has no float8 kernels
        cache, rows = k_cache.view(torch.uint8), quantize_fp8(latent, rope).view(torch.uint8)
    else:
        cache, rows = k_cache, torch.cat([latent, rope], dim=-1).to(k_cache.dtype)
    cache.view(num_blocks * page_size, h_kv, width).index_copy_(0, slot_mapping.long(), rows)


def _check(k_cache, latent, rope, slot_mapping, is_fp8_kvcache) -> None:
    width = FP8_TOKEN_BYTES if is_fp8_kvcache else HEAD_DIM
    if k_cache.dim() != 4 or k_cache.shape[-1] != width or not k_cache.is_contiguous():
        raise ValueError(
            f"k_cache must be a contiguous [num_blocks, page_size, h_kv, {width}] tensor "
            f"(is_fp8_kvcache={is_fp8_kvcache}), got shape {tuple(k_cache.shape)}"
        )
    if is_fp8_kvcache and k_cache.dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"an FP8 k_cache must be float8_e4m3fn or uint8, got {k_cache.dtype}")
    if not is_fp8_kvcache and k_cache.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"k_cache must be bfloat16 or float16, got {k_cache.dtype}")
    h_kv = k_cache.shape[2]
    n = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    if slot_mapping.dtype not in (torch.int32, torch.int64) or n < 0:
        raise ValueError(
            f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} "
            f"of shape {tuple(slot_mapping.shape)}"
        )
    for name, tensor, dim in (("latent", latent, LATENT_DIM), ("rope", rope, ROPE_DIM)):
        if tuple(tensor.shape) != (n, h_kv, dim):
            raise ValueError(f"{name} must be [{n}, {h_kv}, {dim}], got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        if tensor.device != k_cache.device or slot_mapping.device != k_cache.device:
            raise ValueError(f"{name}, slot_mapping and k_cache must share a device")
