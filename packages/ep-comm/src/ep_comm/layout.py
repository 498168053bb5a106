"""Where each token goes: the dispatch layout, in plain tensor ops.

Rank r holds experts [r * E / R, (r + 1) * E / R). A token goes to a rank once if any of its
top-k experts lives there, whatever the number of those experts; `-1` in `topk_idx` means no
expert. Both backends and the tests use these functions.
"""

from __future__ import annotations

import torch


def experts_per_rank(num_experts: int, num_ranks: int) -> int:
    if num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be a positive multiple of the group size "
            f"({num_ranks})"
        )
    return num_experts // num_ranks


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts and membership of one rank's tokens.

    topk_idx: `[num_tokens, num_topk]` int64, expert ids or -1.
    Returns num_tokens_per_rank `[num_ranks]` int32, num_tokens_per_expert `[num_experts]` int32,
    is_token_in_rank `[num_tokens, num_ranks]` bool.
    """
    per_rank = experts_per_rank(num_experts, num_ranks)
    # Fixed shapes and no boolean indexing: nothing waits for the GPU (CUDA graph capture).
    valid = (topk_idx >= 0).to(torch.int32)
    experts = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
    num_tokens_per_expert.scatter_add_(0, experts.flatten(), valid.flatten())
    hits = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.int32, device=topk_idx.device)
    is_token_in_rank = hits.scatter_add_(1, experts // per_rank, valid) > 0
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def to_local_experts(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, rank: int, per_rank: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Global expert ids to this rank's local ids, -1 (and weight 0) for experts elsewhere."""
    local = topk_idx - rank * per_rank
    is_local = (topk_idx >= 0) & (local >= 0) & (local < per_rank)
    local_idx = torch.where(is_local, local, torch.full_like(local, -1))
    if topk_weights is None:
        return local_idx, None
    return local_idx, torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))


def aligned(count: int, alignment: int) -> int:
    return -(-count // alignment) * alignment


def rank_prefix_matrix(counts: torch.Tensor) -> torch.Tensor:
    """counts `[src, dst]` tokens sent; entry [i][j] of the result: tokens ranks 0..i send to j.

    Rank j's received rows from source rank i are rows [prefix[i-1][j], prefix[i][j]).
    """
    return counts.cumsum(dim=0, dtype=torch.int32)
