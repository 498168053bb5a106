"""The small pieces every layer uses: RMS norm, rotary embeddings (YaRN), linear layers that
share an input as one GEMM, the SwiGLU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from ref_server.kernels.activation import silu_mul
from ref_server.kernels.norm import add_rms_norm, rms_norm
from ref_server.kernels.rope import rope
from ref_server.model.args import ModelArgs, yarn_mscale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., dim]` to `[..., dim]` through `ref_server::rms_norm` (one Triton kernel on
        CUDA, the torch ops elsewhere), in the dtype self.weight and x promote to."""
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, residual2=None):
        """(x + residual [+ residual2], that sum normalized): x and the updates `[..., dim]` of
        one dtype, in one kernel on CUDA (`ref_server::add_rms_norm`)."""
        return add_rms_norm(x, residual, self.weight, self.eps, residual2)


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rope dims and the factor on cos/sin (YaRN if rope_factor > 1)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    # on the CPU explicitly: models are built under torch.device("meta") before loading
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    extrapolation = 1.0 / base**exponents
    if args.rope_factor <= 1:
        return extrapolation, 1.0
    factor = args.rope_factor

    def correction_dim(rotations: float) -> float:
        length = args.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    steps = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = (steps - low) / max(high - low, 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = extrapolation / factor * (1 - keep) + extrapolation * keep
    if args.mscale and args.mscale_all_dim:
        attention_factor = yarn_mscale(factor, args.mscale) / yarn_mscale(
            factor, args.mscale_all_dim
        )
    else:
        attention_factor = yarn_mscale(factor, 1.0)
    return inv_freq, attention_factor


class Rope(nn.Module):
    """cos and sin of the rope angles at given positions, computed once per pass and shared by
    every layer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inv_freq, self.attention_factor = rope_inv_freq(args)  # not a buffer: stays fp32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions `[n]` to (cos, sin), each `[n, 1, rope / 2]` of `dtype`."""
        if self.inv_freq.device != positions.device:  # once: a copy per call would sync the host
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        cos = (angles.cos() * self.attention_factor).to(dtype).unsqueeze(-2)
        sin = (angles.sin() * self.attention_factor).to(dtype).unsqueeze(-2)
        return cos, sin


def rotate(x: torch.Tensor, rotation, interleave: bool) -> torch.Tensor:
    """x `[..., n, heads, rope]` rotated by `Rope`'s (cos, sin) `[n, 1, rope / 2]` (x's dtype)
    through `ref_server::rope` (one Triton kernel on CUDA, the torch ops elsewhere);
    interleaved pairs come out de-interleaved (evens then odds), as in the reference
    implementation."""
    cos, sin = rotation
    return rope(x, cos, sin, interleave)


class RowParts:
    """Where the checkpoint's linear layers lie in a weight that stacks them by rows: part
    name to (first row, rows), in order, each part's first row a multiple of align (FP8
    weights keep their parts' 128 x 128 blocks so; the rows between parts are padding)."""

    def __init__(self, parts: dict[str, int], align: int = 1) -> None:
        self.parts, self.align = dict(parts), align
        self.at, row = {}, 0
        for name, rows in self.parts.items():
            row = -(-row // align) * align
            self.at[name] = (row, rows)
            row += rows
        self.rows = row

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The stacked layer's output `[..., rows]` as each part's `[..., its rows]` (views)."""
        return [y[..., first : first + rows] for first, rows in self.at.values()]

    def views(self, weight: torch.Tensor, scales: torch.Tensor | None = None):
        """(part name, its rows of weight `[rows, in]`, its rows of an FP8 weight's block
        scales `[ceil(rows / 128), ceil(in / 128)]` where align is that block, else None)."""
        for name, (first, rows) in self.at.items():
            scale_rows = None
            if scales is not None:
                scale_rows = scales[first // self.align :][: -(-rows // self.align)]
            yield name, weight[first : first + rows], scale_rows


class FusedLinear(nn.Linear):
    """Linear layers without bias that read one input, as one GEMM: `row_parts` says where
    each (by its checkpoint name) lies in the weight, and splits the output."""

    def __init__(self, in_features: int, parts: dict[str, int]) -> None:
        self.row_parts = RowParts(parts)
        super().__init__(in_features, self.row_parts.rows, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": inter, "up_proj": inter})
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.row_parts.split(self.gate_up_proj(x))
        return self.down_proj(silu_mul(gate, up))
