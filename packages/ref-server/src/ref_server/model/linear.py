"""Linear layers without bias as one operator, `ref_server::linear`: x @ w^T.

The default implementation, on any device, is torch's (`F.linear`; cuBLAS on CUDA). On CUDA,
for a decode step's few rows (TRITON_MAX_ROWS or fewer) of bf16 or fp16, `fp8_gemm`'s Triton
kernel multiplies the unscaled operands instead, in 16-row tiles (`TILES`). Launched with
programmatic dependent launch (`pdl.py`), each of its programs asks for its part of the weight
to be fetched into L2 before it waits for the kernel before it: a layer's weights do not
depend on that kernel, so their fetch overlaps it, where cuBLAS starts reading only once the
kernel before has ended. Reading the weights is all these products cost (a few rows against
megabytes of weight).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from ref_server.model.fp8_gemm import (
    UNSCALED_DTYPES,
    KernelConfig,
    check_inputs,
    triton_block_gemm,
)

# 16-row tiles, 512 channels a step: each program reads 32 KB of weight a step, and most layers
# need no k split, hence no second kernel to add partial sums.
TILES = KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=4, block_k=512)
TRITON_MAX_ROWS = TILES.block_m


def layout(x: torch.Tensor, w: torch.Tensor):
    """What `fp8_gemm.check_inputs` finds for x `[..., k]` and w `[n, k]` (ValueError naming
    what is wrong: dtypes, devices, k, w not 2-D)."""
    if w.dim() != 2:
        raise ValueError(f"w must be a linear layer's weight [n, k], got {tuple(w.shape)}")
    return check_inputs(x, None, w, None, None, None, x.dtype)


def _linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[..., k]` bf16, fp16 or fp32; w `[n, k]`, x's dtype. Out: x @ w^T `[..., n]` in x's
    dtype."""
    layout(x, w)
    return F.linear(x, w)


linear = torch.library.custom_op("ref_server::linear", _linear_reference, mutates_args=())


@linear.register_fake
def _(x, w):
    return x.new_empty(layout(x, w).out_shape)


@register_flop_formula(torch.ops.ref_server.linear)
def _(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """2 m n k, as torch's FLOP counter counts the mm the reference runs."""
    return 2 * math.prod(x_shape[:-1]) * math.prod(w_shape)


@linear.register_kernel("cuda")
def _(x, w):
    found = layout(x, w)
    if x.dtype in UNSCALED_DTYPES and 0 < found.rows <= TRITON_MAX_ROWS:
        return triton_block_gemm(x, None, w, None, out_dtype=x.dtype, config=TILES, layout=found)
    return F.linear(x, w)
