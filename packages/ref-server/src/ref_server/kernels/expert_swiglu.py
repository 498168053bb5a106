"""The routed experts' gate and up projections with SwiGLU's activation as one operator,
`ref_server::expert_swiglu`: silu(x @ gate^T) * (x @ up^T) per expert, in the grouped and
batched layouts of `fp8_gemm`, for half-precision operands (as `expert_gemm` takes them) and
FP8 block-scaled ones (as `fp8_block_gemm` takes them).

Each expert's gate and up weights are stacked by rows, gate's `inter` rows first and up's
`inter` rows last (`Experts.gate_up_proj`; in FP8 up starts a 128-row block, with padding rows
between where inter is not a multiple of 128: `FP8Experts.gate_up_proj`). Every implementation
rounds as the unfused composition does (each product to the output dtype, then `silu_mul`), so
where the products are summed in the same order the results are that composition's bit for
bit. The default implementation, on any device, is that composition (`expert_gemm` or
`fp8_block_gemm`, then `silu_mul`). On CUDA, where those GEMMs would take `fp8_gemm`'s Triton
kernel (decode: few rows an expert, or counts), that kernel computes gate and up together and
writes only silu(gate) * up: one kernel and one round trip of the `[rows, 2 inter]` products
fewer (`triton_block_gemm`'s swiglu_inter). Where they would not (many rows an expert:
torch._grouped_mm or CUTLASS), the composition serves on CUDA too.

`Experts` and `FP8Experts` take it where the environment variable REF_SERVER_FUSED_SWIGLU is 1
when they are built; off by default, until measured on a GPU.
"""

from __future__ import annotations

import os

import torch

from ref_server.kernels.activation import silu_mul
from ref_server.kernels.expert_gemm import expert_gemm, takes_triton
from ref_server.kernels.fp8_gemm import (
    FP8,
    Layout,
    block_gemm,
    check_inputs,
    check_swiglu_rows,
    pick_backend,
    triton_block_gemm,
)

SWITCH = "REF_SERVER_FUSED_SWIGLU"


def fused_by_environment() -> bool:
    """Whether REF_SERVER_FUSED_SWIGLU asks for the fused operator: "1" yes, "0" or unset no;
    ValueError naming the variable on anything else."""
    value = os.environ.get(SWITCH, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def check_swiglu(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype):
    """What `fp8_gemm.check_inputs` finds for the stacked weights, and the output's shape;
    ValueError naming what is wrong."""
    if w.dim() != 3:
        raise ValueError(
            f"w must be the experts' stacked gate and up weights [e, rows, k], got {tuple(w.shape)}"
        )
    layout = check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype)
    scaled = x_scales is not None
    if not scaled and out_dtype != x.dtype:
        raise ValueError(f"half-precision operands give x's dtype {x.dtype}, not {out_dtype}")
    check_swiglu_rows(layout.n, inter, scaled)
    return layout, (*layout.out_shape[:-1], inter)


def _expert_swiglu_reference(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    w: torch.Tensor,
    w_scales: torch.Tensor | None,
    inter: int,
    offsets: torch.Tensor | None,
    counts: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """silu_mul(x @ gate^T, x @ up^T) per expert, each product in out_dtype. x bf16, fp16 or
    fp32 (out_dtype then x's), w `[e, rows, k]` in x's dtype, scales None; or x e4m3 with
    x_scales fp32, w e4m3 with w_scales fp32, as `fp8_block_gemm` takes them, out_dtype bf16,
    fp16 or fp32. Gate is each expert's first `inter` rows of w, up its last `inter`. x
    `[m, k]` grouped by expert (offsets `[e]` int32, cumulative ends) or `[e, rows, k]` (counts
    `[e]` int32 or None). Out `[m, inter]` or `[e, rows, inter]`; rows past offsets[-1] or past
    a count come out unspecified."""
    check_swiglu(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype)
    if x_scales is None:
        gate_up = expert_gemm(x, w, offsets, counts)
    else:
        gate_up = block_gemm(x, x_scales, w, w_scales, offsets, counts, out_dtype, "auto")
    return silu_mul(gate_up[..., :inter], gate_up[..., -inter:])


expert_swiglu = torch.library.custom_op(
    "ref_server::expert_swiglu", _expert_swiglu_reference, mutates_args=()
)


@expert_swiglu.register_fake
def _(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype):
    _, shape = check_swiglu(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype)
    return x.new_empty(shape, dtype=out_dtype)


def takes_fused_kernel(layout: Layout, dtype: torch.dtype, counted: bool) -> bool:
    """Whether the CUDA implementation takes the fused Triton kernel for operands of dtype
    (FP8: e4m3) in this layout (`check_swiglu`'s): where `expert_gemm` or `fp8_block_gemm`
    would take the Triton kernel."""
    if dtype == FP8:
        return pick_backend(layout) == "triton"
    return takes_triton(layout, dtype, counted)


@expert_swiglu.register_kernel("cuda")
def _(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype):
    layout, _ = check_swiglu(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype)
    if not takes_fused_kernel(layout, x.dtype, counts is not None):
        return _expert_swiglu_reference(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype)
    return triton_block_gemm(
        x, x_scales, w, w_scales, offsets, counts, out_dtype, layout=layout, swiglu_inter=inter
    )
