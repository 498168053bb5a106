"""The FP8 KV-cache layout: 656 bytes per token and KV head.

| bytes      | content                                                        |
|------------|----------------------------------------------------------------|
| [0, 512)   | latent[0:512] as float8 e4m3, value / scale of its 128-group   |
| [512, 528) | 4 float32 scales, scale_g = max(amax_g, 1e-4) / 448            |
| [528, 656) | rope[0:64] as bfloat16                                         |

The cache tensor holding it has dtype float8_e4m3fn (or uint8) and last dimension 656.
Attention reads a latent value as value * scale rounded to the queries' dtype.
"""

from __future__ import annotations

import torch

LATENT_DIM = 512
ROPE_DIM = 64
SCALE_GROUP = 128
NUM_SCALES = LATENT_DIM // SCALE_GROUP
FP8_TOKEN_BYTES = LATENT_DIM + 4 * NUM_SCALES + 2 * ROPE_DIM
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def quantize_fp8(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """latent `[..., 512]` and rope `[..., 64]` → float8_e4m3fn `[..., 656]` in the FP8 layout."""
    lead = latent.shape[:-1]
    groups = latent.float().reshape(*lead, NUM_SCALES, SCALE_GROUP)
    scales = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / E4M3_MAX
    values = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    packed = torch.empty(*lead, FP8_TOKEN_BYTES, dtype=torch.uint8, device=latent.device)
    packed[..., :LATENT_DIM] = values.view(torch.uint8).reshape(*lead, LATENT_DIM)
    packed[..., LATENT_DIM : LATENT_DIM + 4 * NUM_SCALES] = scales.contiguous().view(torch.uint8)
    packed[..., LATENT_DIM + 4 * NUM_SCALES :] = (
        rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    )
    return packed.view(torch.float8_e4m3fn)


def dequantize_fp8(packed: torch.Tensor) -> torch.Tensor:
    """FP8-layout tokens `[..., 656]` → float32 `[..., 576]` (latent then rope)."""
    raw = packed.view(torch.uint8)
    lead = raw.shape[:-1]
    values = raw[..., :LATENT_DIM].view(torch.float8_e4m3fn).float()
    scales = raw[..., LATENT_DIM : LATENT_DIM + 4 * NUM_SCALES].view(torch.float32)
    latent = values.reshape(*lead, NUM_SCALES, SCALE_GROUP) * scales.unsqueeze(-1)
    rope = raw[..., LATENT_DIM + 4 * NUM_SCALES :].view(torch.bfloat16).float()
    return torch.cat([latent.reshape(*lead, LATENT_DIM), rope], dim=-1)
