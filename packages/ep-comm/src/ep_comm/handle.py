"""The layout of one dispatch, kept for the combine that reverses it (and cached dispatches)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchHandle(NamedTuple):
    """A tuple, as in DeepEP: `handle[0]` is the rank prefix matrix."""

    # [num_ranks, num_ranks] int32: entry [i][j] counts the tokens ranks 0..i send to rank j
    rank_prefix_matrix: torch.Tensor
    # [received rows] int32 (num_worst_tokens rows, -1 padded): each received row's index on
    # its source rank
    recv_src_idx: torch.Tensor
    # [num_tokens, num_ranks] bool: where this rank's tokens went
    is_token_in_rank: torch.Tensor
    num_experts: int
    # [1] int32 with num_worst_tokens, else None
    actual_num_recv_tokens: torch.Tensor | None
    # what only the backend that made it reads: torch_backend.TorchLayout or
    # cuda_backend.CudaLayout
    backend_layout: tuple

    def counts(self) -> torch.Tensor:
        """[src, dst] tokens sent, on the host."""
        prefix = self.rank_prefix_matrix.cpu()
        return torch.diff(prefix, dim=0, prepend=torch.zeros_like(prefix[:1]))
