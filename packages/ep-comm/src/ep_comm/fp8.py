"""DeepEP's FP8 cast: e4m3 values with an fp32 scale per token and 128 channels (optionally a
power of two, UE8M0). The cuda kernels compute the same bits."""

from __future__ import annotations

import torch

from ep_comm.config import SCALE_BLOCK

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4


def per_token_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and their scales, per token and per 128 channels.

    x: `[num_tokens, hidden]` (hidden % 128 == 0), bf16 or fp32.
    Returns values `[num_tokens, hidden]` float8_e4m3fn and scale_inv `[num_tokens, hidden / 128]`
    fp32, with x ~= values * scale_inv. In fp32, IEEE-rounded: amax of the group floored at 1e-4,
    scale_inv = amax / 448 (with round_scale: the next power of two up), values = x * (1 /
    scale_inv) saturated to +-448, then rounded to e4m3.
    """
    num_tokens, hidden = x.shape
    groups = x.float().reshape(num_tokens, hidden // SCALE_BLOCK, SCALE_BLOCK)
    amax = groups.abs().amax(dim=2).clamp(min=AMAX_FLOOR)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a product by 1/448
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale_inv = ceil_to_power_of_two(scale_inv)
    scaled = groups * torch.reciprocal(scale_inv).unsqueeze(2)
    values = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(num_tokens, hidden), scale_inv


def ceil_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(x)) of positive normal fp32 x, exactly: carry any mantissa bit into the
    exponent, then clear the mantissa."""
    bits = x.view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales `[num_tokens, hidden / 128]` as their exponent bytes, four to an
    int32: `[num_tokens, hidden / 512]`, byte j of int i (little-endian) from group 4i + j."""
    exponents = ((scale_inv.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exponents.contiguous().view(torch.int32)
