"""The block-scaled FP8 GEMM through CUTLASS's grouped sm90 kernel (`ref_server/csrc/`).

CUTLASS's persistent warp-specialized kernel with blockwise scaling reads the operands as
DeepSeek-V3 keeps them (e4m3 rows with a scale per token and 128 channels, e4m3 weights with a
scale per 128 x 128 block); a producer warp loads tiles through TMA while two consumer warp
groups multiply and rescale, and the kernel stays resident while it walks the tiles of every
group (1.2-1.5x the Triton kernel on V3's expert shapes). One launch serves each layout of
`fp8_gemm`: grouped rows (prefill), fixed-size expert blocks with counts (decode's low-latency
layout) and a plain linear layer (one group). A small kernel turns the group sizes, which stay
on the device, into CUTLASS's per-group arguments, so nothing waits for the device and CUDA
graphs capture the call.

Built just in time on the first call (nvcc and the `nvidia-cutlass` headers, about a minute)
into `REF_SERVER_CACHE_DIR` (default `~/.cache/ref-server`), in a folder named by a hash of the
sources; `REF_SERVER_BUILD_VERBOSE=1` shows the compiler. `REF_SERVER_CUTLASS=0` turns it off:
the Triton kernel then serves every layout.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parents[1] / "csrc"


def unavailable(device: torch.device) -> str | None:
    """Why the CUTLASS kernel cannot run on `device` (None: it can, once built)."""
    if os.environ.get("REF_SERVER_CUTLASS", "1") == "0":
        return "REF_SERVER_CUTLASS=0"
    if device.type != "cuda":
        return f"the tensors are on {device.type}, not a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "the kernel is built for Hopper (sm_90a) only"
    return None


@functools.cache
def built() -> str | None:
    """Build (or reuse) and load the extension; None, or why it could not be built (warned
    once: callers then use the Triton kernel)."""
    from mla_kernels.extension import load_sm90a_ops

    cache = Path(os.environ.get("REF_SERVER_CACHE_DIR", Path.home() / ".cache" / "ref-server"))
    verbose = os.environ.get("REF_SERVER_BUILD_VERBOSE", "0") == "1"
    try:
        load_sm90a_ops("ref_server_cuda", CSRC, cache, verbose)
    except Exception as error:  # a missing nvcc or CUTLASS, a compiler error: all say why
        reason = f"{type(error).__name__}: {error}"
        message = f"the CUTLASS FP8 GEMM could not be built, Triton serves instead ({reason})"
        warnings.warn(message, stacklevel=2)
        return reason
    return None


def takes(n: int, k: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `cutlass_block_gemm` runs a GEMM with n outputs over k channels into out_dtype
    on device: bf16 out, n and k multiples of 16 (16-byte rows for the bulk copies), a Hopper
    GPU and a kernel that built."""
    return (
        out_dtype == torch.bfloat16
        and n % 16 == 0
        and k % 16 == 0
        and unavailable(device) is None
        and built() is None
    )


def cutlass_block_gemm(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    offsets: torch.Tensor | None,
    counts: torch.Tensor | None,
    kind: str,
    group_rows: int,
) -> torch.Tensor:
    """x @ w^T in bf16 (where `takes`), for arguments `fp8_gemm.check_inputs` found valid:
    x e4m3 `[..., k]`, x_scales fp32 `[..., ceil(k/128)]`, w e4m3 `[n, k]` or `[e, n, k]`,
    w_scales fp32 `[(e,) ceil(n/128), ceil(k/128)]`; kind "dense", "batched" (x `[e, m, k]`,
    optional counts `[e]` int32) or "grouped" (x `[m, k]`, offsets `[e]` int32); group_rows:
    m (batched; unused otherwise). Out `[rows, n]`, rows = x's rows as a matrix; rows outside
    every group come out unspecified. The kernel takes 128 x 128 tiles."""
    k = x.shape[-1]
    x = x.reshape(-1, k)
    x_scales = x_scales.reshape(x.shape[0], -1)
    if w.dim() == 2:
        w, w_scales = w[None], w_scales[None]
    if kind == "dense":
        group_rows = x.shape[0]
    operands = [aligned(t) for t in (x, x_scales, w, w_scales, offsets, counts)]
    return torch.ops.ref_server_cuda.fp8_grouped_gemm(*operands, group_rows)


def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """t contiguous from a 16-byte aligned address (the op's bulk copies and its checks want
    both; a view that starts mid-row of a larger tensor is copied)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
