"""SwiGLU's activation, silu(gate) * up, as one operator, `ref_server::silu_mul`, and fused
with the FP8 cast of its result, `ref_server::silu_mul_fp8`, each one Triton kernel on CUDA.

The math is torch's `F.silu(gate) * up`, rounding for rounding: silu(g) = g / (1 + exp(-g)) in
fp32 (IEEE division), rounded to the activations' dtype (F.silu's output), then its product
with up in fp32, rounded to that dtype again. The default implementation, on any device, is
that torch code. On CUDA one kernel replaces its two and is bit for bit torch's CUDA kernels:
exp is libdevice's expf, which torch's silu calls (Triton's `tl.exp` is an approximation and
`/` an approximate division, so the kernel takes `libdevice.exp` and `tl.math.div_rn`), linked
without flushing subnormals to zero, as nvcc compiles torch. Torch's CPU silu takes Sleef's
exp, which may differ from CUDA's in the last bit: each device's result is its own torch
formula's. Triton's interpreter has no libdevice and takes numpy's exp; it also truncates fp32
to bf16 instead of rounding: its results are the formula's within those differences.

`silu_mul_fp8` is `fp8_cast.cast_activations(silu_mul(gate, up))` bit for bit, e4m3 values and
fp32 scales per token and 128 channels; its kernel never writes the product: each program
computes a [BLOCK_ROWS, 128] tile of it, rounded to the activations' dtype as `silu_mul` stores
it, and casts it with fp8_cast's `cast_tile`, the math of fp8_cast's own kernel.

Nothing waits for the device and no size depends on device values; the row count is no
specialized argument (silu_mul's is the grid's, silu_mul_fp8's unspecialized), so CUDA graphs
capture both after one warm-up call, which compiles them. There is no autograd formula, and
triton is imported on the first kernel call only, so that this module imports without it.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from ep_comm.fp8 import AMAX_FLOOR, FP8_MAX
from ref_server.kernels import fp8_cast
from ref_server.kernels.fp8_cast import BLOCK_ROWS, NUM_WARPS, blocks, cast_activations
from ref_server.kernels.pdl import launch_options

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Columns per program of silu_mul: 1024 values are 8 for each thread of 4 warps (16 bytes of
# bf16 at a time).
MAX_BLOCK = 1024


def check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    """ValueError naming what is wrong with `silu_mul`'s or `silu_mul_fp8`'s arguments."""
    if gate.dim() == 0:
        raise ValueError("gate must be [..., inter], got a scalar")
    for name, t in (("gate", gate), ("up", up)):
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} must be one of {DTYPES}, got {t.dtype}")
    if up.dtype != gate.dtype:
        raise ValueError(f"gate and up must have one dtype: gate is {gate.dtype}, up {up.dtype}")
    if up.shape != gate.shape:
        raise ValueError(
            f"gate and up must have one shape: gate is {tuple(gate.shape)}, up {tuple(up.shape)}"
        )
    if up.device != gate.device:
        raise ValueError(
            f"gate and up must be on one device: gate is on {gate.device}, up on {up.device}"
        )


def _silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: gate and up `[..., inter]` of one dtype (bf16, fp16 or fp32), any
    strides; out `[..., inter]` contiguous in that dtype, rounded as the module docstring says.
    ValueError on other dtypes, shapes that differ, a scalar or two devices."""
    check_inputs(gate, up)
    # contiguous as the fake and CUDA implementations say (torch keeps a permuted gate's layout)
    return (F.silu(gate) * up).contiguous()


silu_mul = torch.library.custom_op("ref_server::silu_mul", _silu_mul_reference, mutates_args=())


@silu_mul.register_fake
def _(gate, up):
    check_inputs(gate, up)
    return gate.new_empty(gate.shape)


@silu_mul.register_kernel("cuda")
def _(gate, up):
    return triton_silu_mul(gate, up)  # which checks them


def _silu_mul_fp8_reference(
    gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul(gate, up)` `[..., inter]` cast to FP8 as `fp8_cast.cast_activations` casts it
    (so as `fp8.quantize_activations`): e4m3 values `[..., inter]` and fp32 scales
    `[..., ceil(inter/128)]`, both contiguous. Arguments and errors as `silu_mul`'s."""
    return cast_activations(silu_mul(gate, up))


silu_mul_fp8 = torch.library.custom_op(
    "ref_server::silu_mul_fp8", _silu_mul_fp8_reference, mutates_args=()
)
# on fake (and meta) tensors the composition gives the outputs, through its operators' fakes
silu_mul_fp8.register_fake(_silu_mul_fp8_reference)


@silu_mul_fp8.register_kernel("cuda")
def _(gate, up):
    return triton_silu_mul_fp8(gate, up)  # which checks them


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` through its Triton kernel, on one CUDA device (or on the CPU with
    TRITON_INTERPRET=1): gate and up `[..., inter]` bf16, fp16 or fp32; out `[..., inter]`
    contiguous. Rows are read in place wherever the leading dims flatten to one row stride (as
    the halves of `gate_up.chunk(2, -1)` do, 2-D or batched); other layouts are copied first."""
    check_inputs(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    gate_rows, up_rows = _rows(gate), _rows(up)
    inter = gate.shape[-1]
    triton, kernel, _ = _triton_kernels()
    block = min(MAX_BLOCK, triton.next_power_of_2(inter))
    with _on_device_of(gate):
        kernel[(gate_rows.shape[0], triton.cdiv(inter, block))](
            gate_rows,
            up_rows,
            out,
            inter,
            gate_rows.stride(0),
            up_rows.stride(0),
            LIBDEVICE=gate.is_cuda,
            BLOCK=block,
            num_warps=block // 256 or 1,
            enable_reflect_ftz=False,
            **launch_options(gate.device),
        )
    return out


def triton_silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_fp8` through its Triton kernel, on one CUDA device (or on the CPU with
    TRITON_INTERPRET=1), gate and up as `triton_silu_mul` takes them: e4m3 values
    `[..., inter]` and fp32 scales `[..., ceil(inter/128)]`, rounded to e4m3 as fp8_cast's
    kernel rounds on that device."""
    check_inputs(gate, up)
    inter = gate.shape[-1]
    values = torch.empty(gate.shape, dtype=fp8_cast.FP8, device=gate.device)
    scales = torch.empty((*gate.shape[:-1], blocks(inter)), dtype=torch.float32, device=gate.device)
    rows = math.prod(gate.shape[:-1])
    if rows == 0 or inter == 0:
        return values, scales
    gate_rows, up_rows = _rows(gate), _rows(up)
    _, _, kernel = _triton_kernels()
    with _on_device_of(gate):
        kernel[(-(-rows // BLOCK_ROWS) * blocks(inter),)](
            gate_rows,
            up_rows,
            values.view(torch.uint8),
            scales,
            rows,
            inter,
            blocks(inter),
            gate_rows.stride(0),
            up_rows.stride(0),
            AMAX_FLOOR=AMAX_FLOOR,
            FP8_MAX=FP8_MAX,
            NATIVE_CAST=fp8_cast.native_cast_on(gate.device),
            LIBDEVICE=gate.is_cuda,
            BLOCK_ROWS=BLOCK_ROWS,
            num_warps=NUM_WARPS,
            enable_reflect_ftz=False,
            **launch_options(gate.device),
        )
    return values, scales


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x `[..., inter]` (not empty) as `[rows, inter]` with contiguous channels: a view where
    the layout allows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _on_device_of(x: torch.Tensor):
    """Triton launches on the current device (the interpreter, on the CPU, has none)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


tl = None  # triton.language, once _triton_kernels() has imported it
libdevice = None  # triton.language.extra.libdevice, likewise
silu_mul_tile = None  # the jitted `_silu_mul_tile`, once _triton_kernels() has made it


@functools.cache
def _triton_kernels():
    """(triton, the compiled `_silu_mul_kernel`, the compiled `_silu_mul_fp8_kernel`): triton
    is imported here, on first use. silu_mul_fp8's row count is not specialized on (Triton
    would compile again for each new multiple of 16, say a decode batch size first seen after
    the warm-up)."""
    global tl, libdevice, silu_mul_tile
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    fp8_cast._triton_kernel()  # which makes fp8_cast.cast_tile
    silu_mul_tile = triton.jit(_silu_mul_tile)
    fp8_kernel = triton.jit(_silu_mul_fp8_kernel, do_not_specialize=["rows"])
    return triton, triton.jit(_silu_mul_kernel), fp8_kernel


def _silu_mul_tile(
    gate,  # a tile of any shape, bf16, fp16 or fp32
    up,  # of gate's shape and dtype
    LIBDEVICE: tl.constexpr,  # exp as libdevice's expf (CUDA); else tl.exp (the interpreter)
):
    """silu(gate) * up in gate's dtype, rounded as torch rounds (the module docstring)."""
    g = gate.to(tl.float32)
    exp = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + exp).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def _silu_mul_kernel(
    gate,  # [rows, inter], row r at gate + r * gate_stride, its values contiguous
    up,  # [rows, inter] in gate's dtype, rows up_stride apart
    out,  # [rows, inter] contiguous, in gate's dtype
    inter,
    gate_stride,
    up_stride,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program (r, c): columns [c BLOCK, (c + 1) BLOCK) of out[r] = silu(gate[r]) * up[r]."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < inter
    g = tl.load(gate + row * gate_stride + cols, mask=in_row)
    u = tl.load(up + row * up_stride + cols, mask=in_row)
    tl.store(out + row * inter + cols, silu_mul_tile(g, u, LIBDEVICE), mask=in_row)


def _silu_mul_fp8_kernel(
    gate,  # bf16, fp16 or fp32 [rows, inter], rows gate_stride apart, channels contiguous
    up,  # [rows, inter] in gate's dtype, rows up_stride apart
    values,  # uint8 [rows, inter] contiguous: the e4m3 bits
    scales,  # fp32 [rows, groups] contiguous
    rows,
    inter,
    groups,  # ceil(inter / 128)
    gate_stride,
    up_stride,
    AMAX_FLOOR: tl.constexpr,
    FP8_MAX: tl.constexpr,
    NATIVE_CAST: tl.constexpr,  # round with Triton's fp32 -> e4m3 conversion (sm90 and later)
    LIBDEVICE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program p, with t, c = divmod(p, groups): tokens [t BLOCK_ROWS, (t + 1) BLOCK_ROWS),
    channels [128 c, 128 (c + 1)) of silu(gate) * up, cast to values and scales."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    GROUP: tl.constexpr = 128
    pid = tl.program_id(0)
    group = pid % groups
    row_ids = (pid // groups) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col_ids = group * GROUP + tl.arange(0, GROUP)
    row_ok = row_ids < rows
    mask = row_ok[:, None] & (col_ids < inter)[None, :]
    row_ids = row_ids.to(tl.int64)
    # zeros past inter give zeros (silu(0) * 0), which leave the last group's amax alone
    g = tl.load(gate + row_ids[:, None] * gate_stride + col_ids[None, :], mask=mask, other=0.0)
    u = tl.load(up + row_ids[:, None] * up_stride + col_ids[None, :], mask=mask, other=0.0)
    hidden = silu_mul_tile(g, u, LIBDEVICE)
    e4m3, scale = fp8_cast.cast_tile(hidden, AMAX_FLOOR, FP8_MAX, NATIVE_CAST)
    tl.store(values + row_ids[:, None] * inter + col_ids[None, :], e4m3, mask=mask)
    tl.store(scales + row_ids * groups + group, scale, mask=row_ok)
