"""A cached step's new latent rows into the paged cache, and the rope of its queries, as one
operator, `ref_server::cache_latent`, with a Triton kernel on CUDA.

The math: kv_a_proj_with_mqa's output row `[576]` of each new token is its latent (512) and its
shared rope key (64); the cache row is `ref_server::rms_norm` of the latent (kv_a_layernorm's
weight and eps) followed by `ref_server::rope` of the key (the step's cos and sin), in the
cache's dtype, written at the token's slot (`mla_kernels.write_kv_cache`'s layout: cache
`[blocks, page, 1, 576]`, slot = block * page + offset). Given the queries' rope columns q
`[n, heads, 64]`, the operator also writes what `ref_server::rope_into(q, cos, sin,
interleave, q_out)` writes: the rotated queries, into the rope columns of the absorbed query
(decode) or in place (prefill). The default implementation, on any device, is those
operators' reference code. On CUDA one Triton kernel replaces the kernels of a norm, two
ropes, a concatenation and an index copy: a program per token reads its row once, normalizes
and rotates it in registers with the same roundings as the operators' kernels, writes the
cache row, then rotates the token's query heads a block at a time. At batch 1 a decode step's
time is mostly its kernels' count, hence one kernel rather than two. Nothing waits for the
device and the token count is no argument of the kernel, so CUDA graphs can capture it (after
one warm-up call). Slots are not checked against the cache (as
`write_kv_cache(check_values=False)`): the caller's step metadata makes them.

There is no autograd formula. triton is imported on the first CUDA call only.
"""

from __future__ import annotations

import contextlib
import functools

import torch

import mla_kernels
from ref_server.kernels import rope
from ref_server.kernels.norm import KERNEL_DTYPES, _rms_norm_reference
from ref_server.kernels.pdl import launch_options
from ref_server.kernels.rope import (
    PAIRS_PER_PROGRAM,
    _rotated,
    check_destination,
    check_no_overlap,
    same_view,
)
from ref_server.kernels.rope import check_inputs as check_rope

LATENT, ROPE = 512, 64
QUERY_NAMES = ("q", "q_out")  # rope_into's x and out, as this operator calls them


def check_inputs(kv, weight, cos, sin, cache, slot_mapping, q=None, q_out=None) -> None:
    """ValueError naming what is wrong with `cache_latent`'s arguments, but for q_out's memory
    overlapping q's (`check_no_overlap`, which the fake implementation cannot check)."""
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
    if (q is None) != (q_out is None):
        raise ValueError("q and q_out go together: give both (q_out may be q, in place) or neither")
    if q is None:
        return
    if q.dim() != 3 or tuple(q.shape) != (n, q.shape[1], ROPE):
        raise ValueError(
            f"q must be [n, heads, {ROPE}] with n = slot_mapping's {n} slots, got {tuple(q.shape)}"
        )
    if q.dtype != kv.dtype or q.device != kv.device:
        raise ValueError(
            f"q must be in kv's dtype and on its device ({kv.dtype}, {kv.device}), got "
            f"{q.dtype} on {q.device}"
        )
    check_destination(q, q_out, QUERY_NAMES)


def _cache_latent_reference(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q: torch.Tensor | None,
    q_out: torch.Tensor | None,
) -> None:
    """kv `[n, 576]` (floating point, rows any stride apart); weight `[512]`; cos and sin
    `[n, 1, 32]` in kv's dtype; cache `[blocks, page, 1, 576]` bf16 or fp16, written in place
    at slot_mapping `[n]` (int32 or int64, distinct slots in the cache): the rows
    `[rms_norm(latent), rope(key)]` in the cache's dtype. Other slots are left alone.

    q `[n, heads, 64]` (kv's dtype and device, any strides: the rope columns of the queries)
    and q_out, both tensors or both None: q rotated by cos and sin into q_out, as
    `rope_into(q, cos, sin, interleave, q_out)` rotates it. q_out: q's shape and dtype, its
    last dim contiguous, apart in memory from q or q itself (in place), apart from kv and the
    cache (which is not checked: without q_lora, q and kv are columns of one projection's
    rows)."""
    check_inputs(kv, weight, cos, sin, cache, slot_mapping, q, q_out)
    if q is not None:
        check_no_overlap(q, q_out, QUERY_NAMES)
        q_out.copy_(_rotated(q, cos, sin, interleave))
    latent = _rms_norm_reference(kv[:, :LATENT], weight, eps)
    key = _rotated(kv[:, None, LATENT:], cos, sin, interleave)[:, 0]
    mla_kernels.write_kv_cache(cache, latent, key, slot_mapping, check_values=False)


# q and q_out have no defaults: torch 2.11's wrapper of a mutating custom op indexes every
# mutated argument among those passed, and fails (IndexError) where q_out was left out.
cache_latent = torch.library.custom_op(
    "ref_server::cache_latent", _cache_latent_reference, mutates_args=("cache", "q_out")
)


@cache_latent.register_fake
def _(kv, weight, eps, cos, sin, interleave, cache, slot_mapping, q, q_out):
    check_inputs(kv, weight, cos, sin, cache, slot_mapping, q, q_out)


@cache_latent.register_kernel("cuda")
def _(kv, weight, eps, cos, sin, interleave, cache, slot_mapping, q, q_out):
    args = (kv, weight, eps, cos, sin, interleave, cache, slot_mapping, q, q_out)
    if kv.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES:
        triton_cache_latent(*args)
    else:
        _cache_latent_reference(*args)


def triton_cache_latent(kv, weight, eps, cos, sin, interleave, cache, slot_mapping, q, q_out):
    """`cache_latent` through the Triton kernel: kv and weight fp16, bf16 or fp32, on one CUDA
    device (or on the CPU with TRITON_INTERPRET=1). q's rows and heads are read in place, any
    stride apart; a last dim that is not contiguous is copied first (as `triton_rope` does)."""
    check_inputs(kv, weight, cos, sin, cache, slot_mapping, q, q_out)
    if q is not None:
        check_no_overlap(q, q_out, QUERY_NAMES)
    if kv.shape[0] == 0:
        return
    triton, kernel = _triton_kernel()
    if q is None:  # no heads: the kernel's loop over them reads and writes nothing
        heads, q = 0, kv[:, None, LATENT:]
        q_out = q
    else:
        heads = q.shape[1]
        q = q if q.stride(-1) == 1 else q.contiguous()
    # rms_norm's output dtype, which the latent is rounded to before the cache's: fp32 or kv's
    norm_in_kv_dtype = torch.promote_types(weight.dtype, kv.dtype) == kv.dtype
    head_block = min(triton.next_power_of_2(max(heads, 1)), PAIRS_PER_PROGRAM // (ROPE // 2))
    device = torch.cuda.device(kv.device) if kv.is_cuda else contextlib.nullcontext()
    with device:
        kernel[(kv.shape[0],)](
            kv,
            weight.contiguous(),
            cos.contiguous(),
            sin.contiguous(),
            cache,
            slot_mapping,
            q,
            q_out,
            kv.stride(0),
            eps,
            *q.stride()[:2],
            *q_out.stride()[:2],
            NORM_IN_KV_DTYPE=norm_in_kv_dtype,
            INTERLEAVE=interleave,
            IN_PLACE=same_view(q, q_out),
            HEADS=heads,
            HEAD_BLOCK=head_block,
            LATENT=LATENT,
            HALF=ROPE // 2,
            num_warps=2,  # rms_norm's kernel's for 512 values: the mean's sum in its order
            enable_fp_fusion=False,
            **launch_options(kv.device),
        )


tl = None  # triton.language, once _triton_kernel() has imported it


@functools.cache
def _triton_kernel():
    """(triton, the compiled `_cache_latent_kernel`): triton is imported here, on first use (and
    rope's `rotate_pairs` made). The token count is the grid's only."""
    global tl
    import triton
    import triton.language as tl

    rope._triton_kernel()
    return triton, triton.jit(_cache_latent_kernel, do_not_specialize=["kv_stride"])


def _cache_latent_kernel(
    kv,  # [n, 576], row t at kv + t * kv_stride, contiguous within
    weight,  # [LATENT], contiguous
    cos,  # [n, HALF], contiguous, kv's dtype
    sin,  # [n, HALF], contiguous, kv's dtype
    cache,  # [slots, 576] (bf16 or fp16), contiguous
    slots,  # [n] int32 or int64
    q,  # [n, HEADS, 2 * HALF] in kv's dtype: q[t, h] (contiguous) at q + t * q_token_stride
    # + h * q_head_stride
    q_out,  # as q, with q_out's strides
    kv_stride,
    eps,  # fp32
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    NORM_IN_KV_DTYPE: tl.constexpr,  # rms_norm's output is in kv's dtype, else fp32
    INTERLEAVE: tl.constexpr,  # pair i is dims (2i, 2i + 1), else (i, HALF + i)
    IN_PLACE: tl.constexpr,  # q_out is q: every thread reads before any writes
    HEADS: tl.constexpr,  # 0: no queries to rotate
    HEAD_BLOCK: tl.constexpr,  # query heads rotated at a time
    LATENT: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program t: cache[slots[t]] = [rms_norm(kv[t, :LATENT]) in its output dtype, rope of
    kv[t, LATENT:] in kv's dtype], each rounded as the two operators' kernels round, then to
    the cache's dtype; q_out[t] = the rope of q[t], as rope's kernel rounds it."""
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
    rotated_first, rotated_second = rope.rotate_pairs(x1, x2, c, s, dtype)
    out = cache + tl.load(slots + token).to(tl.int64) * (LATENT + 2 * HALF)
    cache_dtype = cache.dtype.element_ty
    tl.store(out + cols, latent.to(cache_dtype))
    tl.store(out + LATENT + pair, rotated_first.to(cache_dtype))
    tl.store(out + LATENT + HALF + pair, rotated_second.to(cache_dtype))
    q_token, out_token = q + token * q_token_stride, q_out + token * out_token_stride
    for head_start in range(0, HEADS, HEAD_BLOCK):
        head = head_start + tl.arange(0, HEAD_BLOCK)[:, None]
        inside = head < HEADS
        q_head = q_token + head * q_head_stride
        # names of their own: Triton's compiler (not its interpreter) rejects a loop that
        # gives the key's [HALF] values a [HEAD_BLOCK, HALF] shape
        q1 = tl.load(q_head + first[None, :], mask=inside).to(tl.float32)
        q2 = tl.load(q_head + second[None, :], mask=inside).to(tl.float32)
        if IN_PLACE:  # a thread's values are others' to write (the pairs de-interleave)
            tl.debug_barrier()
        q_first, q_second = rope.rotate_pairs(q1, q2, c[None, :], s[None, :], dtype)
        out_head = out_token + head * out_head_stride
        tl.store(out_head + pair[None, :], q_first, mask=inside)
        tl.store(out_head + HALF + pair[None, :], q_second, mask=inside)
