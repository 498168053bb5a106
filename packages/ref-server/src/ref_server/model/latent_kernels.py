"""A cached step's new latent rows into the paged cache as one operator,
`ref_server::cache_latent`, with a Triton kernel on CUDA.

The math: kv_a_proj_with_mqa's output row `[576]` of each new token is its latent (512) and its
shared rope key (64); the cache row is `ref_server::rms_norm` of the latent (kv_a_layernorm's
weight and eps) followed by `ref_server::rope` of the key (the step's cos and sin), in the
cache's dtype, written at the token's slot (`mla_kernels.write_kv_cache`'s layout: cache
`[blocks, page, 1, 576]`, slot = block * page + offset). The default implementation, on any
device, is those three operators' reference code. On CUDA one Triton kernel replaces the four
kernels of a norm, a rope, a concatenation and an index copy: a program per token reads its
row once, normalizes and rotates it in registers with the same roundings as the two
operators' kernels, and writes the cache row. Nothing waits for the device and the token count
is no argument of the kernel, so CUDA graphs can capture it (after one warm-up call). Slots are
not checked against the cache (as `write_kv_cache(check_values=False)`): the caller's step
metadata makes them.

There is no autograd formula. triton is imported on the first CUDA call only.
"""

from __future__ import annotations

import contextlib
import functools

import torch

import mla_kernels
from ref_server.model.norm_kernels import KERNEL_DTYPES, _rms_norm_reference
from ref_server.model.pdl import launch_options
from ref_server.model.rope_kernels import _rotated
from ref_server.model.rope_kernels import check_inputs as check_rope

LATENT, ROPE = 512, 64


def check_inputs(kv, weight, cos, sin, cache, slot_mapping) -> None:
    """ValueError naming what is wrong with `cache_latent`'s arguments."""
    n = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    if kv.dim() != 2 or tuple(kv.shape) != (n, LATENT + ROPE):
        raise ValueError(
            f"kv must be [n, {LATENT + ROPE}] with n = slot_mapping's {n} slots, got "
            f"{tuple(kv.shape)}"
        )
    if not kv.is_floating_point() or kv.stride(-1) != 1:
        raise ValueError(f"kv must be floating point with contiguous rows, got {kv.dtype}")
    if tuple(weight.shape) != (LATENT,):
        raise ValueError(f"weight must be [{LATENT}], got {tuple(weight.shape)}")
    check_rope(kv[:, None, LATENT:], cos, sin)
    if cache.dim() != 4 or cache.shape[2:] != (1, LATENT + ROPE) or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous [blocks, page, 1, {LATENT + ROPE}] tensor, got "
            f"{tuple(cache.shape)}"
        )
    if cache.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"cache must be bfloat16 or float16, got {cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    devices = {t.device for t in (kv, weight, cache, slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"kv, weight, cache and slot_mapping must share a device, got {devices}")


def _cache_latent_reference(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kv `[n, 576]` (floating point, rows any stride apart); weight `[512]`; cos and sin
    `[n, 1, 32]` in kv's dtype; cache `[blocks, page, 1, 576]` bf16 or fp16, written in place
    at slot_mapping `[n]` (int32 or int64, distinct slots in the cache): the rows
    `[rms_norm(latent), rope(key)]` in the cache's dtype. Other slots are left alone."""
    check_inputs(kv, weight, cos, sin, cache, slot_mapping)
    latent = _rms_norm_reference(kv[:, :LATENT], weight, eps)
    key = _rotated(kv[:, None, LATENT:], cos, sin, interleave)[:, 0]
    mla_kernels.write_kv_cache(cache, latent, key, slot_mapping, check_values=False)


cache_latent = torch.library.custom_op(
    "ref_server::cache_latent", _cache_latent_reference, mutates_args=("cache",)
)


@cache_latent.register_fake
def _(kv, weight, eps, cos, sin, interleave, cache, slot_mapping):
    check_inputs(kv, weight, cos, sin, cache, slot_mapping)


@cache_latent.register_kernel("cuda")
def _(kv, weight, eps, cos, sin, interleave, cache, slot_mapping):
    args = (kv, weight, eps, cos, sin, interleave, cache, slot_mapping)
    if kv.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES:
        triton_cache_latent(*args)
    else:
        _cache_latent_reference(*args)


def triton_cache_latent(kv, weight, eps, cos, sin, interleave, cache, slot_mapping) -> None:
    """`cache_latent` through the Triton kernel: kv and weight fp16, bf16 or fp32, on one CUDA
    device (or on the CPU with TRITON_INTERPRET=1)."""
    check_inputs(kv, weight, cos, sin, cache, slot_mapping)
    if kv.shape[0] == 0:
        return
    kernel = _triton_kernel()
    # rms_norm's output dtype, which the latent is rounded to before the cache's: fp32 or kv's
    norm_in_kv_dtype = torch.promote_types(weight.dtype, kv.dtype) == kv.dtype
    device = torch.cuda.device(kv.device) if kv.is_cuda else contextlib.nullcontext()
    with device:
        kernel[(kv.shape[0],)](
            kv,
            weight.contiguous(),
            cos.contiguous(),
            sin.contiguous(),
            cache,
            slot_mapping,
            kv.stride(0),
            eps,
            NORM_IN_KV_DTYPE=norm_in_kv_dtype,
            INTERLEAVE=interleave,
            LATENT=LATENT,
            HALF=ROPE // 2,
            num_warps=2,  # rms_norm's kernel's for 512 values: the mean's sum in its order
            enable_fp_fusion=False,
            **launch_options(kv.device),
        )


tl = None  # triton.language, once _triton_kernel() has imported it


@functools.cache
def _triton_kernel():
    """The compiled `_cache_latent_kernel` (triton is imported here, on first use); the token
    count is the grid's only."""
    global tl
    import triton
    import triton.language as tl

    return triton.jit(_cache_latent_kernel, do_not_specialize=["kv_stride"])


def _cache_latent_kernel(
    kv,  # [n, 576], row t at kv + t * kv_stride, contiguous within
    weight,  # [LATENT], contiguous
    cos,  # [n, HALF], contiguous, kv's dtype
    sin,  # [n, HALF], contiguous, kv's dtype
    cache,  # [slots, 576] (bf16 or fp16), contiguous
    slots,  # [n] int32 or int64
    kv_stride,
    eps,  # fp32
    NORM_IN_KV_DTYPE: tl.constexpr,  # rms_norm's output is in kv's dtype, else fp32
    INTERLEAVE: tl.constexpr,  # pair i is dims (2i, 2i + 1), else (i, HALF + i)
    LATENT: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program t: cache[slots[t]] = [rms_norm(kv[t, :LATENT]) in its output dtype, rope of
    kv[t, LATENT:] in kv's dtype], each rounded as the two operators' kernels round, then to
    the cache's dtype."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    row = kv + token * kv_stride
    dtype = kv.dtype.element_ty
    cols = tl.arange(0, LATENT)
    values = tl.load(row + cols).to(tl.float32)
    mean_square = tl.sum(values * values, axis=0) / LATENT
    normalized = (values * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    latent = normalized * tl.load(weight + cols).to(tl.float32)
    if NORM_IN_KV_DTYPE:
        latent = latent.to(dtype)
    pair = tl.arange(0, HALF)
    if INTERLEAVE:
        first, second = 2 * pair, 2 * pair + 1
    else:
        first, second = pair, HALF + pair
    x1 = tl.load(row + LATENT + first).to(tl.float32)
    x2 = tl.load(row + LATENT + second).to(tl.float32)
    c = tl.load(cos + token * HALF + pair).to(tl.float32)
    s = tl.load(sin + token * HALF + pair).to(tl.float32)
    rotated_first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    rotated_second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    out = cache + tl.load(slots + token).to(tl.int64) * (LATENT + 2 * HALF)
    cache_dtype = cache.dtype.element_ty
    tl.store(out + cols, latent.to(cache_dtype))
    tl.store(out + LATENT + pair, rotated_first.to(dtype).to(cache_dtype))
    tl.store(out + LATENT + HALF + pair, rotated_second.to(dtype).to(cache_dtype))
