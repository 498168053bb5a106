"""Argument checks of the low-latency mode (DeepEP's preconditions, as ValueErrors naming
the argument). Each rank runs them on its own arguments; `LowLatencyMode` then agrees the
problems across ranks."""

from __future__ import annotations

import torch

from ep_comm import checks
from ep_comm.config import SCALE_BLOCK

MAX_TOPK = 11  # DeepEP's kNumMaxTopK for this mode
MAX_TOKENS_PER_RANK = 1024  # DeepEP's count protocol reserves 1024 as a tag
UE8M0_PER_INT = 4  # UE8M0 scales: four exponent bytes per int32


def check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}")


def check_layout(tokens, hidden, num_experts, num_ranks: int, use_ue8m0: bool = False) -> None:
    """(T, H, E) of one call."""
    check_int("num_max_dispatch_tokens_per_rank", tokens, 1, MAX_TOKENS_PER_RANK)
    check_int("hidden", hidden, 1)
    check_int("num_experts", num_experts, 1)
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})"
        )
    if (num_ranks * tokens) % 4:
        raise ValueError(
            f"num_ranks * num_max_dispatch_tokens_per_rank ({num_ranks} * {tokens}) must be a "
            "multiple of 4"
        )
    block = SCALE_BLOCK * UE8M0_PER_INT if use_ue8m0 else SCALE_BLOCK
    if hidden % block:
        why = "with use_ue8m0 " if use_ue8m0 else ""
        raise ValueError(f"hidden ({hidden}) must be a multiple of {block} {why}in this mode")


def check_topk(topk_idx, num_tokens: int | None, tokens: int, device: torch.device) -> None:
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError("topk_idx must be a [num_tokens, num_topk] int64 tensor")
    checks.check_tensor("topk_idx", topk_idx, torch.int64, (num_tokens, None), device)
    if topk_idx.shape[0] > tokens:
        raise ValueError(
            f"{topk_idx.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={tokens}"
        )
    if not 1 <= topk_idx.shape[1] <= MAX_TOPK:
        raise ValueError(f"num_topk must be in 1..{MAX_TOPK}, got {topk_idx.shape[1]}")


def check_expert_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Ids in [-1, E) and no expert twice in a token (it would take two of the expert's T slots
    for one source). Reads the values: skipped during CUDA graph capture."""
    if capturing():
        return
    checks.check_expert_ids(topk_idx, num_experts)
    ids = topk_idx.sort(dim=1).values
    if bool(((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any()):
        raise ValueError("topk_idx names an expert twice for one token")


def check_flags(async_finish, return_recv_hook) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook cannot both be set")


def check_stats(name: str, stats, dtype: torch.dtype, length: int, device) -> None:
    if stats is not None:
        checks.check_tensor(name, stats, dtype, (length,), device)


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def int_or_none(value) -> int | None:
    """What a signature compares: ints only (a bad value is its own rank's problem)."""
    return value if isinstance(value, int) else None
