"""The routed experts' half-precision GEMMs as one operator, `ref_server::expert_gemm`.

x @ w^T per expert, in the two layouts of `fp8_gemm` (grouped: x `[m, k]` with rows grouped by
expert, group g ending at offsets[g]; batched: x `[e, rows, k]`, optionally with counts, each
expert's rows that hold tokens), with fp32 accumulation. The default implementation, on any
device, is torch's (`torch._grouped_mm`, `torch.bmm`). On CUDA, for bf16 and fp16 operands
where experts get few rows each (decode) or counts are given, `fp8_gemm`'s Triton kernel
multiplies the unscaled operands instead: CUTLASS's grouped GEMM took 31 µs a call at batch 1
on V2-Lite (six experts of one row each) where reading their weights takes 12. The Triton
kernel works out each tile's expert on the device and splits k when few tiles hold rows; with
counts it skips rows past each expert's count, which bmm computes. Rows past offsets[-1], or
past a count, come out unspecified. Nothing waits for the device: CUDA graphs can capture it.
"""

from __future__ import annotations

import torch

from ref_server.kernels.fp8_gemm import UNSCALED_DTYPES, Layout, check_inputs, triton_block_gemm

# Rows per expert (on average) up to which the CUDA implementation takes the Triton kernel
# (bench_expert_gemm.py on the H200: it is faster than CUTLASS's grouped GEMM below).
TRITON_MAX_GROUP_ROWS = 64


def layout(x: torch.Tensor, w: torch.Tensor, offsets, counts):
    """What `fp8_gemm.check_inputs` finds for unscaled operands (ValueError if invalid)."""
    if w.dim() != 3:
        raise ValueError(f"w must be the experts' weights [e, n, k], got {tuple(w.shape)}")
    return check_inputs(x, None, w, None, offsets, counts, x.dtype)


def _expert_gemm_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x bf16, fp16 or fp32, `[m, k]` grouped by expert (offsets `[e]` int32, cumulative ends)
    or `[e, rows, k]` (counts `[e]` int32 or None); w `[e, n, k]`, x's dtype. Out: x @ w^T per
    expert, `[m, n]` or `[e, rows, n]` in x's dtype, through torch's GEMMs."""
    layout(x, w, offsets, counts)
    if offsets is not None:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    return torch.bmm(x, w.transpose(1, 2))


expert_gemm = torch.library.custom_op(
    "ref_server::expert_gemm", _expert_gemm_reference, mutates_args=()
)


@expert_gemm.register_fake
def _(x, w, offsets=None, counts=None):
    return x.new_empty(layout(x, w, offsets, counts).out_shape)


def takes_triton(found: Layout, dtype: torch.dtype, counted: bool) -> bool:
    """Whether the CUDA implementation multiplies operands of dtype in this layout (`layout`'s)
    through the Triton kernel: bf16 or fp16, few rows an expert or counts given."""
    few_rows = found.group_rows <= TRITON_MAX_GROUP_ROWS or counted
    return dtype in UNSCALED_DTYPES and few_rows


@expert_gemm.register_kernel("cuda")
def _(x, w, offsets=None, counts=None):
    found = layout(x, w, offsets, counts)
    if takes_triton(found, x.dtype, counts is not None):
        return triton_block_gemm(x, None, w, None, offsets, counts, x.dtype, layout=found)
    return _expert_gemm_reference(x, w, offsets, counts)
