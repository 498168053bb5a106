"""Rotary embedding as one operator, `ref_server::rope`, with a Triton kernel on CUDA; and
`ref_server::rope_into`, the same written into a given view (say the rope columns of a query
buffer), or in place.

The math (`layers.rotate`'s before these operators): x `[..., n, heads, rope]` split into
pairs (x1, x2), the even and odd dims with interleave (DeepSeek's layout), else its two
halves; out = cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin]) with `Rope`'s cos and sin
`[n, 1, rope / 2]`, so that interleaved pairs come out de-interleaved (evens then odds).
Everything is in x's dtype, as torch computes it: each product rounded to that dtype, then
the sum or difference of the two rounded again. The kernel does exactly that: the product of
two values in fp32 (exact for fp16 and bf16), rounded to x's dtype (to nearest even), the two
products' sum in fp32 rounded to x's dtype. Torch's own half-precision arithmetic is that same
sequence, and fp32 is the dtype itself, so the kernel's output is the torch formula's bit for
bit, on the CPU and on CUDA; it is launched with floating-point fusion off, or the compiler
would fold a product into an fma and skip its rounding.

The default implementation, on any device, is that torch formula. On CUDA one Triton kernel
(`triton_rope`) replaces its seven or so elementwise kernels: each program reads a block of
one token's heads in place (rows any stride apart: q's rope columns, the rope key in the
latent projection's output) and writes them once. Nothing waits for the device, and neither
the token count nor the strides that change with it are specialized on, so CUDA graphs can
capture it (after one warm-up call, which compiles it for the dtype, rope width, head block
and layout).

There is no autograd formula: called with tensors that require grad, the operators run
forward, and a backward through them raises. triton is imported on the first CUDA call only,
so that this module imports without it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ref_server.kernels.pdl import launch_options

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Pairs a program rotates: 4 for each thread of 4 warps (16 heads of DeepSeek's 32 pairs).
# Wider rope, and other dtypes, take the default implementation on CUDA too.
PAIRS_PER_PROGRAM = 512
MAX_ROPE = 2 * PAIRS_PER_PROGRAM


def check_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError naming what is wrong with `rope`'s arguments (see `rope`)."""
    if x.dim() < 3:
        raise ValueError(f"x must be [..., n, heads, rope], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    rope = x.shape[-1]
    if rope % 2:
        raise ValueError(f"x's rope dim must be even (it rotates pairs), got {rope}")
    want = (x.shape[-3], 1, rope // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name} must be [n, 1, rope / 2] = {list(want)} for x of shape "
                f"{tuple(x.shape)}, got {tuple(t.shape)}"
            )
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must be in x's dtype ({x.dtype}), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(
                f"x and {name} must be on one device: x is on {x.device}, {name} on {t.device}"
            )


def check_destination(x: torch.Tensor, out: torch.Tensor, names=("x", "out")) -> None:
    """ValueError naming what is wrong with `rope_into`'s out for x (see `rope_into`); names:
    what the caller's arguments are called, for the message."""
    x_name, out_name = names
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(
            f"{out_name} must have {x_name}'s shape {tuple(x.shape)}, got {tuple(out.shape)}"
        )
    if out.dtype != x.dtype:
        raise ValueError(f"{out_name} must be in {x_name}'s dtype ({x.dtype}), got {out.dtype}")
    if out.device != x.device:
        raise ValueError(
            f"{x_name} and {out_name} must be on one device: {x_name} is on {x.device}, "
            f"{out_name} on {out.device}"
        )
    if out.numel() == 0:
        return
    if out.stride(-1) != 1:
        raise ValueError(f"{out_name}'s last dim must be contiguous, got strides {out.stride()}")
    try:
        _as_rows(out, copy=False)
    except RuntimeError:
        raise ValueError(
            f"{out_name}'s dims before [n, heads, rope] must merge into one (as a view), got "
            f"shape {tuple(out.shape)} and strides {out.stride()}"
        ) from None


def check_no_overlap(x: torch.Tensor, out: torch.Tensor, names=("x", "out")) -> None:
    """ValueError where out's memory overlaps x's other than as x itself (in place, where
    the kernel reads a program's values before it writes any): elsewhere the kernel's threads
    would write some values before others have read them. names as `check_destination`'s."""
    if x.numel() == 0 or out.numel() == 0 or same_view(x, out):
        return
    (x_start, x_end), (out_start, out_end) = _byte_span(x), _byte_span(out)
    if x_start < out_end and out_start < x_end:
        raise ValueError(f"{names[1]} must not overlap {names[0]} in memory")


def same_view(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether out is x's memory seen as x sees it (rotating in place)."""
    same_layout = (x.shape, x.stride(), x.dtype) == (out.shape, out.stride(), out.dtype)
    return same_layout and x.data_ptr() == out.data_ptr()


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [first, past the last) that a tensor with elements spans."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _as_rows(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """t `[..., n, heads, rope]` as `[batch, n, heads, rope]`: a view, or (copy) a copy where
    the leading dims do not merge; RuntimeError without copy."""
    shape = (-1, *t.shape[-3:])
    return t.reshape(shape) if copy else t.view(shape)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """The torch formula (see the module docstring): contiguous `[..., n, heads, rope]`."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    # contiguous as the fake and CUDA implementations say (torch keeps a permuted x's layout)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).contiguous()


def _rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x `[..., n, heads, rope]` (floating point, any strides) rotated by cos and sin
    `[n, 1, rope / 2]` (x's dtype and device, as `Rope` makes them): out, contiguous, x's
    shape and dtype. interleave: x's pairs are adjacent dims (they come out de-interleaved),
    else its two halves. See the module docstring for the rounding."""
    check_inputs(x, cos, sin)
    return _rotated(x, cos, sin, interleave)


def _rope_into_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, out: torch.Tensor
) -> None:
    """`rope` written into out, a view of x's shape and dtype on x's device (a slice of wider
    rows, say the rope columns of a query buffer): its last dim contiguous, its dims before
    `[n, heads, rope]` merging into one, the memory it spans apart from the memory x spans
    (other columns of x's own rows do not qualify), or x itself (in place). Only out's
    values are written."""
    check_inputs(x, cos, sin)
    check_destination(x, out)
    check_no_overlap(x, out)
    out.copy_(_rotated(x, cos, sin, interleave))


rope = torch.library.custom_op("ref_server::rope", _rope_reference, mutates_args=())
rope_into = torch.library.custom_op(
    "ref_server::rope_into", _rope_into_reference, mutates_args=("out",)
)


@rope.register_fake
def _(x, cos, sin, interleave):
    check_inputs(x, cos, sin)
    return x.new_empty(x.shape)


@rope_into.register_fake
def _(x, cos, sin, interleave, out):
    check_inputs(x, cos, sin)
    check_destination(x, out)


def _kernel_takes(x: torch.Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and x.dim() >= 3 and x.shape[-1] <= MAX_ROPE


@rope.register_kernel("cuda")
def _(x, cos, sin, interleave):
    if _kernel_takes(x):
        return triton_rope(x, cos, sin, interleave)
    return _rope_reference(x, cos, sin, interleave)


@rope_into.register_kernel("cuda")
def _(x, cos, sin, interleave, out):
    if _kernel_takes(x):
        triton_rope(x, cos, sin, interleave, out)
    else:
        _rope_into_reference(x, cos, sin, interleave, out)


def triton_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rope` (out None: a new contiguous tensor) or `rope_into` (out given) through the
    Triton kernel; returns out. x `[..., n, heads, rope]` fp16, bf16 or fp32, rope at most
    MAX_ROPE, cos and sin `[n, 1, rope / 2]` in x's dtype, all on one CUDA device (or on the
    CPU with TRITON_INTERPRET=1). x's rows may lie any stride apart (they are read in place);
    a last dim that is not contiguous, or leading dims that do not merge into one, are copied
    first."""
    check_inputs(x, cos, sin)
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the kernel takes x in {KERNEL_DTYPES}, got {x.dtype}")
    rope = x.shape[-1]
    if rope > MAX_ROPE:
        raise ValueError(f"the kernel takes a rope dim of at most {MAX_ROPE}, got {rope}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_destination(x, out)
        check_no_overlap(x, out)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    in_place = same_view(x, out)
    cos, sin = cos.contiguous(), sin.contiguous()
    rows, out_rows = _as_rows(x, copy=True), _as_rows(out, copy=False)
    batch, tokens, heads, _ = rows.shape
    triton, kernel = _triton_kernel()
    pair_block = triton.next_power_of_2(rope // 2)
    head_block = min(triton.next_power_of_2(heads), max(PAIRS_PER_PROGRAM // pair_block, 1))
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with device:
        kernel[(batch * tokens, triton.cdiv(heads, head_block))](
            rows,
            cos,
            sin,
            out_rows,
            tokens,
            heads,
            rope // 2,
            *rows.stride()[:3],
            *out_rows.stride()[:3],
            INTERLEAVE=interleave,
            IN_PLACE=in_place,
            HEAD_BLOCK=head_block,
            PAIR_BLOCK=pair_block,
            num_warps=max(head_block * pair_block // 128, 1),
            **launch_options(x.device),
            enable_fp_fusion=False,
        )
    return out


tl = None  # triton.language, once _triton_kernel() has imported it
rotate_pairs = None  # the jitted `_rotate_pairs`, once _triton_kernel() has made it


@functools.cache
def _triton_kernel():
    """(triton, the compiled `_rope_kernel`), and `rotate_pairs` for other kernels that rotate
    what they read: triton is imported here, on first use. The token count and the batch
    strides (which change with it) are not specialized on, so that a new batch size does not
    compile again."""
    global tl, rotate_pairs
    import triton
    import triton.language as tl

    rotate_pairs = triton.jit(_rotate_pairs)
    unspecialized = ["tokens", "x_batch_stride", "out_batch_stride"]
    return triton, triton.jit(_rope_kernel, do_not_specialize=unspecialized)


def _rope_kernel(
    x,  # [batch, tokens, heads, 2 * half]: x[b, t, h] (contiguous) at x + b * x_batch_stride
    # + t * x_token_stride + h * x_head_stride
    cos,  # [tokens, half], contiguous, x's dtype
    sin,  # [tokens, half], contiguous, x's dtype
    out,  # as x, with out's strides
    tokens,
    heads,
    half,
    x_batch_stride,
    x_token_stride,
    x_head_stride,
    out_batch_stride,
    out_token_stride,
    out_head_stride,
    INTERLEAVE: tl.constexpr,  # pair i is dims (2i, 2i + 1), else (i, half + i)
    IN_PLACE: tl.constexpr,  # out is x: every thread reads before any writes
    HEAD_BLOCK: tl.constexpr,  # heads a program rotates
    PAIR_BLOCK: tl.constexpr,  # the power of two at or above half
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program (row, j), row = b * tokens + t: heads [j HEAD_BLOCK, (j + 1) HEAD_BLOCK) of
    x[b, t] rotated by cos[t] and sin[t], each product and each sum rounded to x's dtype."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    batch, token = row // tokens, row % tokens
    head = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)[:, None]
    pair = tl.arange(0, PAIR_BLOCK)[None, :]
    in_pairs = pair < half
    inside = (head < heads) & in_pairs
    if INTERLEAVE:
        first, second = 2 * pair, 2 * pair + 1
    else:
        first, second = pair, half + pair
    x_head = x + batch * x_batch_stride + token * x_token_stride + head * x_head_stride
    x1 = tl.load(x_head + first, mask=inside).to(tl.float32)
    x2 = tl.load(x_head + second, mask=inside).to(tl.float32)
    c = tl.load(cos + token * half + pair, mask=in_pairs).to(tl.float32)
    s = tl.load(sin + token * half + pair, mask=in_pairs).to(tl.float32)
    if IN_PLACE:  # a thread's values are others' to write (the pairs de-interleave)
        tl.debug_barrier()
    rotated_first, rotated_second = rotate_pairs(x1, x2, c, s, out.dtype.element_ty)
    out_head = out + batch * out_batch_stride + token * out_token_stride + head * out_head_stride
    tl.store(out_head + pair, rotated_first, mask=inside)
    tl.store(out_head + half + pair, rotated_second, mask=inside)


def _rotate_pairs(x1, x2, c, s, dtype: tl.constexpr):
    """The pairs (x1, x2) of fp32 tiles (values of dtype) rotated by c and s (likewise):
    (x1 c - x2 s, x2 c + x1 s) in dtype, each product and each sum rounded to it."""
    first = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    second = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    return first.to(dtype), second.to(dtype)
