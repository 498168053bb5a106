"""The routed experts' combine as one operator, `ref_server::moe_weighted_sum`: each token's
weighted sum of its experts' output rows, summed in fp32 in slot order.

The reference serves every device but CUDA, where one Triton kernel gathers, weighs and sums
without the reference's host synchronization (nonzero) or per-slot fp32 copies: each program
takes one token and a block of hidden columns, gathers the token's k expert rows, weighs them
and sums them in fp32 registers in slot order, so the result is deterministic and the only
memory traffic is the rows read once and the output written once. triton is imported on the
first CUDA call only, so that this module imports without it.
"""

from __future__ import annotations

import functools

import torch

from ref_server.kernels.pdl import launch_options

# Columns per program: 1024 bf16 values are 16 bytes for each of 4 warps' threads.
MAX_BLOCK = 1024


def _weighted_sum_reference(
    y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each token's weighted sum of its rows of y: y `[m, hidden]` (bf16, fp16 or fp32),
    rows `[n, k]` int64 (token t's slot j is row rows[t, j] of y; -1: none, that slot is
    skipped and its weight never read), weights `[n, k]` fp32. The products are summed in fp32
    in slot order; out `[n, hidden]` in y's dtype. No row of y is read but those named."""
    n, k = rows.shape
    out = torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device)
    for slot in range(k):
        token = (rows[:, slot] >= 0).nonzero().squeeze(1)
        out.index_add_(0, token, y[rows[token, slot]].float() * weights[token, slot, None])
    return out.to(y.dtype)


moe_weighted_sum = torch.library.custom_op(
    "ref_server::moe_weighted_sum", _weighted_sum_reference, mutates_args=()
)


@moe_weighted_sum.register_kernel("cuda")
def _weighted_sum_cuda(y, rows, weights):
    return weighted_sum(y, rows, weights)


@moe_weighted_sum.register_fake
def _weighted_sum_fake(y, rows, weights):
    return y.new_empty(rows.shape[0], y.shape[1])


tl = None  # triton.language, once _triton_kernel() has imported it


@functools.cache
def _triton_kernel():
    """The compiled `_weighted_sum_kernel`: triton is imported here, on first use."""
    global tl
    import triton
    import triton.language as tl

    return triton.jit(_weighted_sum_kernel)


def _weighted_sum_kernel(
    y,
    rows,
    weights,
    out,
    hidden,
    y_stride,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (pdl.py)
):
    """Program (t, c): columns [c BLOCK, (c + 1) BLOCK) of out[t] = the sum over slots j of
    weights[t, j] * y[rows[t, j]]; y `[m, hidden]` with row stride y_stride, rows `[n, K]`
    int64, weights `[n, K]` fp32, out `[n, hidden]` contiguous."""
    if PDL:  # wait for the kernel before (pdl.py), then let the next one be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(K):
        row = tl.load(rows + token * K + slot)
        valid = row >= 0
        # a skipped slot loads nothing: its row and weight may hold anything, NaN included
        weight = tl.load(weights + token * K + slot, mask=valid, other=0.0)
        values = tl.load(y + row * y_stride + cols, mask=in_row & valid, other=0.0)
        total += values.to(tl.float32) * weight
    tl.store(out + token * hidden + cols, total.to(out.dtype.element_ty), mask=in_row)


def weighted_sum(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`moe_weighted_sum` on CUDA: y `[m, hidden]` (bf16, fp16 or fp32), rows `[n, k]` int64
    (-1: skip the slot), weights `[n, k]` fp32, all on one CUDA device; out `[n, hidden]` in
    y's dtype. One launch, no host synchronization: CUDA graphs can capture it."""
    n, k = rows.shape
    hidden = y.shape[1]
    if y.stride(1) != 1:
        y = y.contiguous()
    rows, weights = rows.contiguous(), weights.contiguous()
    out = torch.empty(n, hidden, dtype=y.dtype, device=y.device)
    if n == 0:
        return out
    block = min(MAX_BLOCK, 1 << (hidden - 1).bit_length())
    grid = (n, -(-hidden // block))
    with torch.cuda.device(y.device):
        _triton_kernel()[grid](
            y,
            rows,
            weights,
            out,
            hidden,
            y.stride(0),
            K=k,
            BLOCK=block,
            num_warps=block // 256 or 1,
            **launch_options(y.device),
        )
    return out
