"""RMS norm as one operator, `ref_server::rms_norm`, with a Triton kernel on CUDA; and
`ref_server::add_rms_norm`, the residual stream's add (of one or two updates) and the next norm
in that kernel.

The math (DeepSeek-V3's): x in fp32, times rsqrt(mean(x^2) + eps) over the last dim, rounded
to x's dtype, then times the weight in the dtype the two promote to (the product of the two
values in fp32, rounded once). The default implementation, on any device, is `RMSNorm`'s torch
code from before this operator, bit for bit. On CUDA one Triton kernel (`triton_rms_norm`)
replaces its six or so elementwise and reduction kernels: each program holds one row in
registers, reads it and the weight once and writes the result once; only the order of the
mean's sum differs from torch's. Nothing waits for the device and the row count is no
argument of the kernel, so CUDA graphs can capture it (after one warm-up call, which compiles
it for the row width and dtypes). `add_rms_norm` returns x + residual too (rounded to their
dtype as torch's add rounds it), and normalizes that rounded sum: the same values as an add
followed by `rms_norm`, in one pass. With a second update (an MoE layer's shared experts'
output beside the routed experts'), the three are summed in fp32 and rounded once.

There is no autograd formula: called with tensors that require grad, the operator runs
forward, and a backward through it raises. triton is imported on the first CUDA call only,
so that this module imports without it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ref_server.kernels.pdl import launch_options

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Widest row the kernel holds in registers: 32 fp32 values for each thread of 16 warps. Wider
# rows, and other dtypes, take the default implementation on CUDA too.
MAX_BLOCK = 16384


def check_inputs(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The output dtype of valid arguments (see `rms_norm`); ValueError naming what is wrong."""
    if x.dim() == 0:
        raise ValueError("x must be [..., dim], got a scalar")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(
            f"weight must be [{x.shape[-1]}] (one per channel of x), got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(
            f"x and weight must be on one device: x is on {x.device}, weight on {weight.device}"
        )
    return torch.promote_types(weight.dtype, x.dtype)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[..., dim]` (floating point) RMS-normalized over its last dim, times weight `[dim]`
    (floating point): out `[..., dim]`, contiguous, in the dtype weight and x promote to. eps:
    added to the mean square. See the module docstring for the rounding."""
    check_inputs(x, weight)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # contiguous as the fake and CUDA implementations say (torch keeps a permuted x's layout)
    return (weight * x32.to(x.dtype)).contiguous()


rms_norm = torch.library.custom_op("ref_server::rms_norm", _rms_norm_reference, mutates_args=())


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=check_inputs(x, weight))


def kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and x.shape[-1] <= MAX_BLOCK


@rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    if x.dim() > 0 and kernel_takes(x, weight):
        return triton_rms_norm(x, weight, eps)
    return _rms_norm_reference(x, weight, eps)


def check_updates(x: torch.Tensor, *updates: torch.Tensor | None) -> None:
    for name, t in zip(("residual", "residual2"), updates, strict=False):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(
                f"{name} must be x's shape and dtype {tuple(x.shape)} {x.dtype}, got "
                f"{tuple(t.shape)} {t.dtype}"
            )


def _add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual [+ residual2], rms_norm of that sum): x and the updates `[..., dim]`, one
    floating-point dtype, summed in fp32 (or x's wider dtype) in that order and rounded to it
    once (for two terms, as torch adds) before the sum is normalized; both out contiguous."""
    check_updates(x, residual, residual2)
    wide = torch.promote_types(x.dtype, torch.float32)
    total = x.to(wide) + residual.to(wide)
    if residual2 is not None:
        total += residual2.to(wide)
    total = total.to(x.dtype)
    return total, _rms_norm_reference(total, weight, eps)


# The pre-norm residual stream: a block's output added to its input, and the next norm of
# that sum, in one kernel on CUDA (one pass over both instead of an add and a norm).
add_rms_norm = torch.library.custom_op(
    "ref_server::add_rms_norm", _add_rms_norm_reference, mutates_args=()
)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, residual2=None):
    check_updates(x, residual, residual2)
    out_dtype = check_inputs(x, weight)
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype)


@add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps, residual2=None):
    if x.dim() > 0 and kernel_takes(x, weight):
        return triton_add_rms_norm(x, residual, weight, eps, residual2)  # which checks them
    return _add_rms_norm_reference(x, residual, weight, eps, residual2)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` through the Triton kernel: x `[..., dim]` and weight `[dim]` fp16, bf16 or
    fp32, dim at most MAX_BLOCK, on one CUDA device (or on the CPU with TRITON_INTERPRET=1).
    Rows may lie any stride apart (a slice of wider rows is read in place); a last dim that is
    not contiguous is copied first."""
    return _launch(x, None, weight, eps)[1]


def triton_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` through the Triton kernel, which adds the rows in fp32, rounds the sum to
    x's dtype (as torch does), writes it and normalizes it: arguments as `triton_rms_norm`'s,
    residual (and residual2, if given) x's shape and dtype."""
    check_updates(x, residual, residual2)
    return _launch(x, residual, weight, eps, residual2)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t `[..., dim]` as rows `[-1, dim]` with contiguous values (a view where it can be)."""
    return (t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, dim)


def _launch(x, residual, weight, eps, residual2=None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the sum x + residual [+ residual2], or None without residual; the normalized rows)."""
    out_dtype = check_inputs(x, weight)
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"the kernel takes {name} in {KERNEL_DTYPES}, got {t.dtype}")
    dim = x.shape[-1]
    if dim > MAX_BLOCK:
        raise ValueError(f"the kernel takes rows of at most {MAX_BLOCK} values, got {dim}")
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    total = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return total, out
    rows = _rows(x, dim)
    updates = [_rows(t, dim) if t is not None else rows for t in (residual, residual2)]
    triton, kernel = _triton_kernel()
    block = triton.next_power_of_2(dim)
    # about 8 values (16 bytes of bf16) per thread, in 1 to 16 warps
    num_warps = min(max(block // 256, 1), 16)
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with device:
        kernel[(rows.shape[0],)](
            rows,
            *updates,
            weight.contiguous(),
            out,
            out if total is None else total,
            dim,
            rows.stride(0),
            *(t.stride(0) for t in updates),
            eps,
            ADD=residual is not None,
            ADD2=residual2 is not None,
            BLOCK=block,
            num_warps=num_warps,
            **launch_options(x.device),
        )
    return total, out


tl = None  # triton.language, once _triton_kernel() has imported it


@functools.cache
def _triton_kernel():
    """(triton, the compiled `_rms_norm_kernel`): triton is imported here, on first use."""
    global tl
    import triton
    import triton.language as tl

    return triton, triton.jit(_rms_norm_kernel)


def _rms_norm_kernel(
    x,  # [rows, dim], row r at x + r * x_stride, its values contiguous
    residual,  # with ADD: as x, row r at residual + r * residual_stride
    residual2,  # with ADD2: as residual
    weight,  # [dim], contiguous
    out,  # [rows, dim], contiguous
    total,  # with ADD: [rows, dim] contiguous, x's dtype
    dim,
    x_stride,
    residual_stride,
    residual2_stride,
    eps,  # fp32
    ADD: tl.constexpr,  # normalize x + residual (rounded to x's dtype) and write it to total
    ADD2: tl.constexpr,  # with ADD: x + residual + residual2, summed in fp32, rounded once
    BLOCK: tl.constexpr,  # the power of two at or above dim
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program r: out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps) in fp32, rounded to x's dtype)
    times weight, computed in fp32 and rounded to out's dtype; with ADD, x[r] is first
    x[r] + residual[r] (+ residual2[r] with ADD2), rounded to x's dtype and stored in total[r]."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < dim
    values = tl.load(x + row * x_stride + cols, mask=in_row, other=0.0)
    if ADD:
        added = tl.load(residual + row * residual_stride + cols, mask=in_row, other=0.0)
        values = values.to(tl.float32) + added.to(tl.float32)
        if ADD2:
            added = tl.load(residual2 + row * residual2_stride + cols, mask=in_row, other=0.0)
            values += added.to(tl.float32)
        values = values.to(x.dtype.element_ty)
        tl.store(total + row * dim + cols, values, mask=in_row)
    values = values.to(tl.float32)
    mean_square = tl.sum(values * values, axis=0) / dim
    normalized = (values * tl.rsqrt(mean_square + eps)).to(x.dtype.element_ty)
    w = tl.load(weight + cols, mask=in_row, other=0.0).to(tl.float32)
    product = normalized.to(tl.float32) * w
    tl.store(out + row * dim + cols, product.to(out.dtype.element_ty), mask=in_row)
