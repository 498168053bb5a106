"""Sparse MLA: each query attends only the cache slots its indices name (DeepSeek Sparse
Attention's top-k tokens), with FlashMLA's two sparse call surfaces: decode through
`flash_mla_with_kvcache(..., indices=...)` and prefill through `flash_mla_sparse_fwd`.

Both are the op `torch.ops.mla_kernels.sparse_mla` over flat token slots: the Triton kernels
(`mla_kernels.sparse_triton`) or the torch reference (`reference.sparse_attention`), chosen by
`MLA_KERNELS_SPARSE_BACKEND`: `auto` (the default: the kernels on CUDA devices when Triton is
installed, the reference elsewhere), `reference`, or
`triton` (the kernels everywhere: on the CPU only in Triton's interpreter, TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from mla_kernels import reference
from mla_kernels.fp8_layout import FP8_CACHE_DTYPES, FP8_TOKEN_BYTES
from mla_kernels.reference import HEAD_DIM, HEAD_DIM_V

SPARSE_BACKENDS = ("reference", "auto", "triton")
MAX_HEADS = 128


def sparse_backend(device: torch.device | str) -> str:
    """`"triton"` when the Triton kernels serve tensors on `device`, else `"reference"`."""
    choice = os.environ.get("MLA_KERNELS_SPARSE_BACKEND", "auto")
    if choice not in SPARSE_BACKENDS:
        raise ValueError(
            f"MLA_KERNELS_SPARSE_BACKEND={choice!r}; expected one of {', '.join(SPARSE_BACKENDS)}"
        )
    has_triton = importlib.util.find_spec("triton") is not None
    if choice == "triton" and not has_triton:
        raise RuntimeError(
            "MLA_KERNELS_SPARSE_BACKEND=triton but Triton is not installed "
            "(pip install 'mla-kernels[triton]')"
        )
    if choice == "triton" or (
        choice == "auto" and has_triton and torch.device(device).type == "cuda"
    ):
        return "triton"
    return "reference"


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float | None,
    causal: bool,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_mla_with_kvcache` with `indices` (see there): out `[b, s_q, h_q, 512]` and lse
    `[b, h_q, s_q]`."""
    if causal:
        raise ValueError("causal must be False with indices: the indices choose the tokens")
    check_tensors(q=q, k_cache=k_cache, indices=indices)
    _check_q(q, "[b, s_q, h_q, 576]")
    b, s_q, h_q, _ = q.shape
    width = FP8_TOKEN_BYTES if is_fp8_kvcache else HEAD_DIM
    if k_cache.dim() != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != width:
        layout = "FP8 layout, " if is_fp8_kvcache else ""
        raise ValueError(
            f"k_cache must be [num_blocks, page_size, 1, {width}] ({layout}is_fp8_kvcache="
            f"{is_fp8_kvcache}), got {tuple(k_cache.shape)}"
        )
    if indices.dim() != 3 or indices.shape[:2] != (b, s_q):
        raise ValueError(f"indices must be [b={b}, s_q={s_q}, topk], got {tuple(indices.shape)}")
    out, _, lse = _attend(
        q.view(b * s_q, h_q, HEAD_DIM),
        k_cache.view(-1, width),
        indices.view(b * s_q, -1),
        head_dim_v,
        softmax_scale,
        is_fp8_kvcache,
        cache_name="k_cache",
    )
    return out.view(b, s_q, h_q, HEAD_DIM_V), lse.view(b, s_q, h_q).transpose(1, 2)


def flash_mla_sparse_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill attention: query token i attends the rows of kv that `indices[i]` names.

    q: `[s_q, h_q, 576]` bfloat16. kv: `[s_kv, 1, 576]` bfloat16, V its first 512 columns.
    indices: int32 `[s_q, 1, topk]`; an entry outside `[0, s_kv)` (-1 by convention) is not
    attended. sm_scale: the scale of the scores. d_v: 512.
    Returns out `[s_q, h_q, 512]` bfloat16, max_logits float32 `[s_q, h_q]` (the largest scaled
    score) and lse float32 `[s_q, h_q]` (natural log); a query that attends no token gets
    out = 0, max_logits = -inf and lse = +inf.
    """
    check_tensors(q=q, kv=kv, indices=indices)
    _check_q(q, "[s_q, h_q, 576]")
    s_q = q.shape[0]
    if kv.dim() != 3 or kv.shape[1:] != (1, HEAD_DIM):
        raise ValueError(f"kv must be [s_kv, 1, {HEAD_DIM}], got {tuple(kv.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != (s_q, 1):
        raise ValueError(f"indices must be [s_q={s_q}, 1, topk], got {tuple(indices.shape)}")
    return _attend(
        q, kv.view(-1, HEAD_DIM), indices.view(s_q, -1), d_v, sm_scale, False, cache_name="kv"
    )


def _attend(q, tokens, indices, head_dim_v, softmax_scale, is_fp8_kvcache, cache_name):
    if is_fp8_kvcache and tokens.dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"an FP8 {cache_name} must be float8_e4m3fn or uint8, got {tokens.dtype}")
    if not is_fp8_kvcache and tokens.dtype != q.dtype:
        raise ValueError(f"{cache_name} dtype {tokens.dtype} differs from q dtype {q.dtype}")
    if tokens.shape[0] == 0:
        raise ValueError(f"{cache_name} holds no tokens")
    if indices.dtype != torch.int32 or indices.shape[-1] == 0:
        raise ValueError(
            f"indices must be int32 with topk >= 1, got {indices.dtype} of shape "
            f"{tuple(indices.shape)}"
        )
    if head_dim_v != HEAD_DIM_V:
        raise ValueError(f"the value head dimension must be {HEAD_DIM_V}, got {head_dim_v}")
    scale = HEAD_DIM**-0.5 if softmax_scale is None else float(softmax_scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return torch.ops.mla_kernels.sparse_mla(q, tokens, indices, scale, bool(is_fp8_kvcache))


def check_tensors(q, **named) -> None:
    """Each of q and the named tensors is a contiguous tensor on q's device; else the error
    names it."""
    for name, tensor in {"q": q, **named}.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {tuple(tensor.shape)})")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")


def _check_q(q, shape: str) -> None:
    if q.dim() != len(shape.split(",")) or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must be {shape}, got {tuple(q.shape)}")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"q must be bfloat16, got {q.dtype}")
    if not 1 <= q.shape[-2] <= MAX_HEADS:
        raise ValueError(f"q must have 1..{MAX_HEADS} heads, got {q.shape[-2]}")


@torch.library.custom_op("mla_kernels::sparse_mla", mutates_args=())
def sparse_mla(
    q: torch.Tensor,
    tokens: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    is_fp8_kvcache: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q `[n, h_q, 576]`, tokens `[num_slots, 576 or 656]`, indices `[n, topk]` → out
    `[n, h_q, 512]`, max_logits and lse `[n, h_q]` (`reference.sparse_attention`)."""
    if sparse_backend(q.device) == "triton":
        from mla_kernels import sparse_triton

        return sparse_triton.sparse_attention(q, tokens, indices, softmax_scale, is_fp8_kvcache)
    return reference.sparse_attention(q, tokens, indices, softmax_scale, is_fp8_kvcache)


@sparse_mla.register_fake
def _sparse_mla_fake(q, tokens, indices, softmax_scale, is_fp8_kvcache):
    n, h_q, _ = q.shape
    return (
        q.new_empty(n, h_q, HEAD_DIM_V),
        q.new_empty(n, h_q, dtype=torch.float32),
        q.new_empty(n, h_q, dtype=torch.float32),
    )
