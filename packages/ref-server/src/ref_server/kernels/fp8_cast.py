"""The FP8 cast of activations as one operator, `ref_server::fp8_cast_activations`.

x `[..., k]` becomes e4m3 values `[..., k]` and fp32 scales `[..., ceil(k/128)]`, one per token
and 128 channels, with x ~= values * scale: bit for bit ep_comm's `per_token_cast_to_fp8`, the
cast its FP8 dispatch uses (a partial last group counts as padded with zeros, which leave its
amax alone). Per group, in fp32: amax = max |x| floored at 1e-4, scale = amax / 448 (IEEE
division), values = x * (1 / scale) (IEEE reciprocal, then an IEEE product) saturated to +-448
and rounded to e4m3, to nearest even. A group holding a NaN gets a NaN scale and NaN values,
as in torch (the NaNs' sign bits may differ); one holding an infinity gets an infinite scale.

Implementations: the default one, on any device, is torch's: `per_token_cast_to_fp8` on the
rows padded to whole groups, about nine passes over memory. On CUDA one Triton kernel reads x
once: each program loads a [BLOCK_ROWS, 128] tile (that many tokens, one group), reduces it to
their amaxes and writes the tile's values and scales. Bit-exactness takes care in Triton: `/`
on fp32 compiles to an approximate division, so both divisions are `tl.math.div_rn`; the
rounding to e4m3 is the hardware's (`cvt.rn.satfinite.e4m3x2.f32`) on sm90 and later, and
integer arithmetic elsewhere: Triton converts through fp16 before sm90 (rounding twice) and its
interpreter truncates the mantissa, adds half an e4m3 step and drops the carry. Nothing waits
for the device and no size depends on device values, so the operator can be captured in a
CUDA graph (after one warm-up call, which compiles the kernel).

triton is imported on the first CUDA call only, so that this module imports without it.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from ep_comm.fp8 import AMAX_FLOOR, FP8_MAX, per_token_cast_to_fp8
from ref_server.kernels.pdl import launch_options

BLOCK = 128  # channels per scale
FP8 = torch.float8_e4m3fn
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Tokens per program: a [32, 128] tile is 32 values for each of 4 warps' threads, which load
# them 16 bytes at a time.
BLOCK_ROWS = 32
NUM_WARPS = 4


def blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def check_input(x: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError("x must be [..., k], got a scalar")
    if x.dtype not in IN_DTYPES:
        raise ValueError(f"x must be one of {IN_DTYPES}, got {x.dtype}")


@torch.library.custom_op("ref_server::fp8_cast_activations", mutates_args=())
def cast_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., k]` (bf16, fp16 or fp32) to e4m3 values `[..., k]` and fp32 scales
    `[..., ceil(k/128)]` (see the module docstring). ValueError on other dtypes or a scalar.

    This body is the reference, on any device: `per_token_cast_to_fp8` on zero-padded rows."""
    check_input(x)
    k = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    if k % BLOCK:
        rows = F.pad(rows, (0, blocks(k) * BLOCK - k))
    values, scales = per_token_cast_to_fp8(rows)
    return values[:, :k].contiguous().view(x.shape), scales.view(*x.shape[:-1], blocks(k))


@cast_activations.register_fake
def _(x):
    check_input(x)
    scales = x.new_empty((*x.shape[:-1], blocks(x.shape[-1])), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=FP8), scales


@cast_activations.register_kernel("cuda")
def _(x):
    return triton_cast_activations(x)  # which checks x


def native_cast_on(device: torch.device) -> bool:
    """Whether Triton's fp32 -> e4m3 conversion on device is the hardware's single rounding
    to nearest even: NVIDIA sm90 and later."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def triton_cast_activations(
    x: torch.Tensor, *, native_cast: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast_activations` through the Triton kernel, on a CUDA device (or on the CPU with
    TRITON_INTERPRET=1): x `[..., k]` bf16, fp16 or fp32; values e4m3 `[..., k]` and scales
    fp32 `[..., ceil(k/128)]`, both contiguous. native_cast: round to e4m3 with Triton's
    conversion (the default where `native_cast_on` the device) or with integer arithmetic."""
    check_input(x)
    if native_cast is None:
        native_cast = native_cast_on(x.device)
    elif native_cast and not native_cast_on(x.device):
        raise ValueError(
            f"native_cast needs an NVIDIA GPU of sm90 or later (Triton rounds twice before, "
            f"and its interpreter truncates); x is on {x.device}"
        )
    k = x.shape[-1]
    values = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty((*x.shape[:-1], blocks(k)), dtype=torch.float32, device=x.device)
    rows = math.prod(x.shape[:-1])
    if rows == 0 or k == 0:
        return values, scales
    x = x.reshape(rows, k)
    if x.stride(1) != 1:
        x = x.contiguous()

    kernel = _triton_kernel()
    grid = (-(-rows // BLOCK_ROWS) * blocks(k),)
    # Triton launches on the current device (the interpreter on the CPU has none)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](
            x,
            values.view(torch.uint8),
            scales,
            rows,
            k,
            blocks(k),
            x.stride(0),
            AMAX_FLOOR=AMAX_FLOOR,
            FP8_MAX=FP8_MAX,
            NATIVE_CAST=native_cast,
            BLOCK_ROWS=BLOCK_ROWS,
            num_warps=NUM_WARPS,
            **launch_options(x.device),
        )
    return values, scales


tl = None  # triton.language, once _triton_kernel() has imported it
cast_tile = None  # the jitted `_cast_tile`, once _triton_kernel() has made it


@functools.cache
def _triton_kernel():
    """The compiled `_cast_kernel`, and `cast_tile` for other kernels that cast what they
    compute: triton is imported here, on first use. Row counts are not specialized on (Triton
    would compile again for each new multiple of 16, say a decode batch size first seen after
    the warm-up)."""
    global tl, cast_tile
    import triton
    import triton.language as tl

    cast_tile = triton.jit(_cast_tile)
    return triton.jit(_cast_kernel, do_not_specialize=["rows"])


def _cast_kernel(
    x,  # bf16, fp16 or fp32 [rows, k], row stride stride_x, channels contiguous
    values,  # uint8 [rows, k] contiguous: the e4m3 bits
    scales,  # fp32 [rows, groups] contiguous
    rows,
    k,
    groups,  # ceil(k / 128)
    stride_x,
    AMAX_FLOOR: tl.constexpr,
    FP8_MAX: tl.constexpr,
    NATIVE_CAST: tl.constexpr,  # round with Triton's fp32 -> e4m3 conversion (sm90 and later)
    BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    GROUP: tl.constexpr = 128
    pid = tl.program_id(0)
    group = pid % groups
    row_ids = (pid // groups) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col_ids = group * GROUP + tl.arange(0, GROUP)
    row_ok = row_ids < rows
    mask = row_ok[:, None] & (col_ids < k)[None, :]
    row_ids = row_ids.to(tl.int64)
    tile = tl.load(x + row_ids[:, None] * stride_x + col_ids[None, :], mask=mask, other=0.0)
    e4m3, scale = cast_tile(tile, AMAX_FLOOR, FP8_MAX, NATIVE_CAST)
    tl.store(values + row_ids[:, None] * k + col_ids[None, :], e4m3, mask=mask)
    tl.store(scales + row_ids * groups + group, scale, mask=row_ok)


def _cast_tile(
    tile,  # bf16, fp16 or fp32 [tokens, 128]: one group of channels (zeros past k)
    AMAX_FLOOR: tl.constexpr,
    FP8_MAX: tl.constexpr,
    NATIVE_CAST: tl.constexpr,  # round with Triton's fp32 -> e4m3 conversion (sm90 and later)
):
    """(e4m3 bits uint8 [tokens, 128], fp32 scales [tokens]): the tile cast as the module
    docstring says."""
    tile = tile.to(tl.float32)
    # |x| as integers orders as the floats do, NaN above infinity: the integer max is the
    # amax, and NaN wherever a NaN is, in the interpreter and on the GPU alike (a float max
    # drops NaNs on the GPU).
    magnitude = tile.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(magnitude, 1).to(tl.float32, bitcast=True)
    amax = tl.maximum(amax, AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    inverse = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    scaled = tile * inverse[:, None]
    scaled = tl.clamp(scaled, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)

    if NATIVE_CAST:
        e4m3 = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = scaled.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        # from 2^-6 up: rebias the exponent (127 -> 7), round the mantissa to 3 bits, ties to even
        normal = (magnitude - (120 << 23) + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
        # below, e4m3's subnormals: adding 2^14 rounds to the nearest (even) multiple of 2^-9,
        # one subnormal step, and leaves that multiple in the low mantissa bits
        subnormal = (tl.abs(scaled) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        e4m3 = tl.where(magnitude < (121 << 23), subnormal, normal)
        e4m3 = tl.where(magnitude > 0x7F800000, 0x7F, e4m3)  # NaN (saturated: no infinities)
        e4m3 = (e4m3 | ((bits >> 24) & 0x80)).to(tl.uint8)
    return e4m3, scale


# The block-scaled formats DeepSeek-V3's FP8 weights and activations come in, and their
# plain-torch inverses (the GEMMs' reference path).


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w `[..., out, in]` (any float dtype) to e4m3 values `[..., out, in]` and scale_inv
    `[..., ceil(out/128), ceil(in/128)]` fp32: per 128 x 128 block (the last ones partial),
    scale_inv = amax / 448 (amax floored at 1e-4), values = w / scale_inv saturated to +-448."""
    rows, cols = w.shape[-2:]
    padded = F.pad(w.float(), (0, blocks(cols) * BLOCK - cols, 0, blocks(rows) * BLOCK - rows))
    tiles = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [.., R, 128, C, 128]
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR)
    scale_inv = amax / FP8_MAX
    values = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.flatten(-4, -3).flatten(-2)[..., :rows, :cols].contiguous(), scale_inv


def dequantize_blocks(w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 `[..., out, in]` times its block scales `[..., ceil(out/128), ceil(in/128)]`: fp32."""
    rows, cols = w_fp8.shape[-2:]
    scale = scale_inv.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return w_fp8.float() * scale[..., :rows, :cols]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., k]` (bf16, fp16 or fp32) to e4m3 values `[..., k]` and scales
    `[..., ceil(k/128)]` fp32, one per token and 128 channels (`per_token_cast_to_fp8`, bit for
    bit; a partial last group is padded with zeros, which leave its amax alone), through the
    operator `ref_server::fp8_cast_activations` (`fp8_cast`): one Triton kernel on CUDA."""
    return cast_activations(x)


def dequantize_activations(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 `[..., k]` times its scales `[..., ceil(k/128)]`: fp32."""
    return x_fp8.float() * scales.repeat_interleave(BLOCK, -1)[..., : x_fp8.shape[-1]]
