"""FP8 weights as DeepSeek-V3 stores them, and the block-scaled GEMM that uses them.

Weights are float8_e4m3fn with one fp32 scale per 128 x 128 block (`weight_scale_inv`, the
checkpoint's name: weight ~= values * scale); activations are quantized on the fly with one
scale per token and 128 channels (ep_comm's `per_token_cast_to_fp8`, the cast its FP8
dispatch uses). `fp8_block_gemm` multiplies the two with fp32 accumulation, through the
operator `ref_server::fp8_block_gemm` (`fp8_gemm`): a Triton kernel on CUDA (or, for linear
layers, torch._scaled_mm's blockwise scaling), the reference elsewhere (both operands
dequantized to fp32, then a matmul).

`use_fp8(model)` swaps a model's projections for `FP8Linear` and its routed experts for
`FP8Experts`; the loader then fills them from FP8 checkpoints as stored, or quantizes bf16
weights with `quantize_blocks`. Their GEMMs run through `fp8_block_gemm`, or any function of its
arguments given to `use_fp8` (DeepGEMM's, `ref_server.kernels.deepseek.DeepGemm`, with the model's
`kernels` "deepseek").
"""

from __future__ import annotations

import torch
from torch import nn

from ref_server.kernels.activation import silu_mul_fp8
from ref_server.kernels.expert_swiglu import expert_swiglu
from ref_server.kernels.fp8_cast import (
    BLOCK,
    FP8,
    blocks,
    dequantize_blocks,
    quantize_activations,
)
from ref_server.kernels.fp8_gemm import block_gemm
from ref_server.model.layers import FusedLinear, RowParts
from ref_server.model.moe import Experts, RoutedExperts


def fp8_block_gemm(
    x_fp8: torch.Tensor,
    x_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scales: torch.Tensor,
    offsets: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ w^T with fp32 accumulation, in out_dtype. x_fp8 e4m3 with x_scales fp32 from
    `quantize_activations`, w_fp8 e4m3 with w_scales fp32 from `quantize_blocks`, one of:
    - w `[n, k]`, scales `[ceil(n/128), ceil(k/128)]`; x `[..., m, k]`: a linear layer;
    - w `[e, n, k]`, scales `[e, ...]`; x `[e, m, k]`: one expert per batch (packed rows), and
      optionally counts `[e]` int32, the rows of each expert that matter (rows >= counts[g]
      come out unspecified, and cost nothing where whole tiles of them do);
    - the same w; x `[m, k]` with rows grouped by expert, group g ending at row offsets[g]
      (`[e]` int32, torch._grouped_mm's convention; rows past offsets[-1] come out unspecified).
    Out: `[..., m, n]`. ValueError on arguments that fit none of these.
    """
    return block_gemm(x_fp8, x_scales, w_fp8, w_scales, offsets, counts, out_dtype, "auto")


class FP8Linear(nn.Module):
    """A linear layer without bias in FP8: buffers `weight` `[out, in]` e4m3 and
    `weight_scale_inv` `[ceil(out/128), ceil(in/128)]` fp32 (the checkpoint's names). Inputs
    are quantized per token and 128 channels; outputs come in the input's dtype. With parts
    (as `FusedLinear`'s), it stacks those layers, each from a row that starts a block
    (`row_parts`; the padding rows between them are zero once `zero_padding` ran). gemm: what
    multiplies, `fp8_block_gemm` or a function of its arguments."""

    def __init__(self, in_features: int, out_features: int, parts=None, gemm=fp8_block_gemm):
        super().__init__()
        self.gemm = gemm
        if parts is not None:
            self.row_parts = RowParts(parts, align=BLOCK)
            out_features = self.row_parts.rows
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        scales = torch.empty(blocks(out_features), blocks(in_features), dtype=torch.float32)
        self.register_buffer("weight_scale_inv", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., in]` to `[..., out]`, both bf16 or fp32."""
        x_fp8, scales = quantize_activations(x)
        return self.gemm(x_fp8, scales, self.weight, self.weight_scale_inv, None, x.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight `[out, in]` in dtype (absorbed decode multiplies by it directly)."""
        return dequantize_blocks(self.weight, self.weight_scale_inv).to(dtype)

    def zero_padding(self) -> None:
        """Zero the rows between parts (no checkpoint tensor fills them; their outputs are
        dropped, and zeros keep the buffer's bytes deterministic)."""
        if hasattr(self, "row_parts"):
            zero_between_parts(self.weight, self.row_parts)


def zero_between_parts(weight: torch.Tensor, row_parts: RowParts) -> None:
    """Zero the rows of an FP8 weight `[..., rows, in]` after each part up to the next."""
    places = list(row_parts.at.values())
    starts = [first for first, _ in places[1:]] + [row_parts.rows]
    with torch.no_grad():
        for (first, rows), start in zip(places, starts, strict=True):
            weight[..., first + rows : start, :].view(torch.uint8).zero_()


class FP8Experts(RoutedExperts):
    """This rank's routed experts in FP8: gate_up_proj `[e, rows, hidden]`, each expert's
    gate_proj and up_proj stacked by rows as one GEMM (`gate_up_parts`; up_proj starts at a row
    that begins a 128-row block, so that each keeps the checkpoint's blocks, with zero rows
    between where inter is not a multiple of 128), and down_proj `[e, hidden, inter]`, e4m3,
    each with `<name>_scale_inv` `[e, ceil(out/128), ceil(in/128)]` fp32. gemm: as
    `FP8Linear`'s; with another than `fp8_block_gemm`, SwiGLU stays unfused (`fused_swiglu` is
    our Triton kernel's)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, gemm=fp8_block_gemm) -> None:
        super().__init__(num_experts)
        self.gemm = gemm
        self.fused_swiglu = self.fused_swiglu and gemm is fp8_block_gemm
        self.gate_up_parts = RowParts({"gate_proj": inter, "up_proj": inter}, align=BLOCK)
        shapes = {"gate_up_proj": (self.gate_up_parts.rows, hidden), "down_proj": (hidden, inter)}
        for name, (rows, cols) in shapes.items():
            self.register_buffer(name, torch.empty(num_experts, rows, cols, dtype=FP8))
            scales = torch.empty(num_experts, blocks(rows), blocks(cols), dtype=torch.float32)
            self.register_buffer(name + "_scale_inv", scales)

    takes_fp8_rows = True

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As `Experts.forward`, always through the grouped GEMMs."""
        return self.grouped(x, ids, weights)

    def packed(self, x, counts=None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """As `RoutedExperts.packed`; x may also be a low-latency dispatch's FP8 rows, (values
        e4m3 `[e, rows, hidden]`, scales fp32 `[e, rows, hidden / 128]`), cast as
        `quantize_activations` casts: dtype is then the activations' (the rows carry none)."""
        if isinstance(x, tuple):
            return self._mlp(x, dtype, None, counts)
        return self.mlp(x, counts=counts)

    def mlp(self, x: torch.Tensor, offsets=None, counts=None) -> torch.Tensor:
        return self._mlp(quantize_activations(x), x.dtype, offsets, counts)

    def _mlp(self, rows, dtype: torch.dtype, offsets, counts) -> torch.Tensor:
        """SwiGLU over quantized rows (values, scales), each GEMM's output in dtype."""

        def project(rows, name):
            weight, scales = getattr(self, name), getattr(self, name + "_scale_inv")
            return self.gemm(*rows, weight, scales, offsets, dtype, counts)

        if self.fused_swiglu:
            w, scales = self.gate_up_proj, self.gate_up_proj_scale_inv
            inter = self.down_proj.shape[-1]
            hidden = quantize_activations(
                expert_swiglu(*rows, w, scales, inter, offsets, counts, dtype)
            )
        else:
            hidden = silu_mul_fp8(*self.gate_up_parts.split(project(rows, "gate_up_proj")))
        return project(hidden, "down_proj")

    def zero_padding(self) -> None:
        """Zero gate_up_proj's rows between gate and up (see `FP8Linear.zero_padding`)."""
        zero_between_parts(self.gate_up_proj, self.gate_up_parts)


def use_fp8(model: nn.Module, gemm=fp8_block_gemm) -> None:
    """Swap, in place, what DeepSeek-V3 checkpoints store in FP8 for empty FP8 modules (on the
    current default device) whose GEMMs run through gemm: every `nn.Linear` but the output head
    and V3.2's indexer head weights (attention projections, the indexer's, dense and
    shared-expert MLPs) and every layer's routed `Experts`."""
    head = getattr(model, "lm_head", None)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, Experts):
                setattr(module, name, FP8Experts(*child.down_proj.shape, gemm))
            elif isinstance(child, nn.Linear) and child is not head and name != "weights_proj":
                parts = child.row_parts.parts if isinstance(child, FusedLinear) else None
                layer = FP8Linear(child.in_features, child.out_features, parts, gemm)
                setattr(module, name, layer)
