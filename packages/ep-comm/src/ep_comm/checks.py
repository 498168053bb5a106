"""Argument checks. Each raises ValueError naming the argument and what was expected."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ep_comm.config import MAX_TOPK, SCALE_BLOCK
from ep_comm.exchange import DispatchInput
from ep_comm.handle import DispatchHandle
from ep_comm.layout import experts_per_rank


def problem_of(check: Callable[..., None], *args) -> str | None:
    """The message of the ValueError `check` raises, or None: ranks exchange it first."""
    try:
        check(*args)
    except ValueError as error:
        return str(error)
    return None


def check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=False)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {wanted}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_x(x, x_scales) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a [num_tokens, hidden] tensor or an (FP8, scales) tuple")
    num_tokens, hidden = x.shape
    if x_scales is None:
        check_tensor("x", x, torch.bfloat16, (None, None), x.device)
        if hidden % 8:
            raise ValueError(f"hidden ({hidden}) must be a multiple of 8 (16-byte rows)")
    else:
        check_tensor("x (FP8)", x, torch.float8_e4m3fn, (None, None), x.device)
        if hidden % SCALE_BLOCK:
            raise ValueError(f"FP8 x needs hidden ({hidden}) to be a multiple of {SCALE_BLOCK}")
        shape = (num_tokens, hidden // SCALE_BLOCK)
        check_tensor("x scales", x_scales, torch.float32, shape, x.device)


def check_topk(
    topk_idx, topk_weights, num_experts: int, num_ranks: int, num_tokens: int | None
) -> None:
    experts_per_rank(num_experts, num_ranks)
    device = topk_idx.device if isinstance(topk_idx, torch.Tensor) else None
    check_tensor("topk_idx", topk_idx, torch.int64, (num_tokens, None), device)
    num_topk = topk_idx.shape[1]
    if not 1 <= num_topk <= MAX_TOPK:
        raise ValueError(f"num_topk must be in 1..{MAX_TOPK}, got {num_topk}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk), device)


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        value = int(topk_idx[bad][0])
        raise ValueError(
            f"topk_idx holds expert id {value}, outside [0, {num_experts}) (-1 means no expert)"
        )


def check_dispatch(inp: DispatchInput, num_ranks: int, check_values: bool = True) -> None:
    """check_values=False skips what reads tensor contents (a host synchronization), as
    during CUDA graph capture."""
    check_x(inp.x, inp.x_scales)
    num_tokens, device = inp.x.shape[0], inp.x.device
    alignment, worst = inp.expert_alignment, inp.num_worst_tokens
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"expert_alignment must be an int >= 1, got {alignment!r}")
    if not isinstance(worst, int) or worst < 0:
        raise ValueError(f"num_worst_tokens must be an int >= 0, got {worst!r}")
    handle = inp.handle
    if handle is not None:
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"handle must come from Buffer.dispatch, got {type(handle).__name__}")
        if inp.topk_idx is not None or inp.topk_weights is not None:
            raise ValueError("a dispatch with a cached handle takes no topk_idx / topk_weights")
        if handle.is_token_in_rank.shape[0] != num_tokens:
            raise ValueError(
                f"x has {num_tokens} tokens, the handle's dispatch had "
                f"{handle.is_token_in_rank.shape[0]}"
            )
        return
    for name in ("num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert"):
        if getattr(inp, name) is None:
            raise ValueError(f"dispatch without a handle needs {name} (from get_dispatch_layout)")
    per_rank, in_rank = inp.num_tokens_per_rank, inp.is_token_in_rank
    check_tensor("num_tokens_per_rank", per_rank, torch.int32, (num_ranks,), device)
    check_tensor("is_token_in_rank", in_rank, torch.bool, (num_tokens, num_ranks), device)
    check_tensor("num_tokens_per_expert", inp.num_tokens_per_expert, torch.int32, (None,), device)
    experts_per_rank(inp.num_experts, num_ranks)
    if check_values and not torch.equal(in_rank.sum(dim=0, dtype=torch.int32), per_rank):
        raise ValueError("num_tokens_per_rank does not match is_token_in_rank's column sums")
    if (inp.topk_idx is None) != (inp.topk_weights is None):
        raise ValueError("topk_idx and topk_weights go together: give both or neither")
    if inp.topk_idx is not None:
        check_topk(inp.topk_idx, inp.topk_weights, inp.num_experts, num_ranks, num_tokens)
        if check_values:
            check_expert_ids(inp.topk_idx, inp.num_experts)


def check_combine(x, handle, topk_weights, biases: list) -> None:
    if not isinstance(handle, DispatchHandle):
        raise ValueError(f"handle must come from Buffer.dispatch, got {type(handle).__name__}")
    rows = handle.recv_src_idx.shape[0]
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a tensor, got {type(x).__name__}")
    check_tensor("x", x, torch.bfloat16, (rows, None), x.device)
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, torch.float32, (rows, None), x.device)
    if len(biases) > 2:
        raise ValueError(f"bias takes at most two tensors, got {len(biases)}")
    num_tokens = handle.is_token_in_rank.shape[0]
    for b in biases:
        check_tensor("bias", b, torch.bfloat16, (num_tokens, x.shape[1]), x.device)
