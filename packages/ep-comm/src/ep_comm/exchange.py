"""What a dispatch takes and returns, the same for both backends."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ep_comm.handle import DispatchHandle
from ep_comm.layout import to_local_experts


def row_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * math.prod(tensor.shape[1:])


@dataclass
class DispatchInput:
    x: torch.Tensor  # [num_tokens, hidden] bf16 or float8_e4m3fn
    x_scales: torch.Tensor | None  # [num_tokens, hidden / 128] fp32 with FP8 x
    topk_idx: torch.Tensor | None  # [num_tokens, num_topk] int64, global expert ids or -1
    topk_weights: torch.Tensor | None  # [num_tokens, num_topk] fp32
    num_tokens_per_rank: torch.Tensor  # [num_ranks] int32
    is_token_in_rank: torch.Tensor  # [num_tokens, num_ranks] bool
    num_tokens_per_expert: torch.Tensor  # [num_experts] int32
    expert_alignment: int
    num_worst_tokens: int

    @property
    def num_experts(self) -> int:
        return self.num_tokens_per_expert.shape[0]

    def sources(self) -> list[torch.Tensor]:
        """The per-token tensors that travel: x, then the scales and top-k if given."""
        present = (self.x, self.x_scales, self.topk_idx, self.topk_weights)
        return [t for t in present if t is not None]


@dataclass
class DispatchOutput:
    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None  # local expert ids or -1
    recv_topk_weights: torch.Tensor | None  # 0 where recv_topk_idx is -1
    num_recv_tokens_per_expert: list[int] = field(default_factory=list)
    handle: DispatchHandle | None = None

    @classmethod
    def from_rows(cls, received: list[torch.Tensor], inp: DispatchInput, rank: int, size: int):
        """received: the rows of `inp.sources()`, in that order, as this rank got them."""
        received = list(received)
        recv_x = received.pop(0)
        recv_x_scales = received.pop(0) if inp.x_scales is not None else None
        recv_topk_idx = recv_topk_weights = None
        if inp.topk_idx is not None:
            recv_topk_idx, recv_topk_weights = to_local_experts(
                received[0], received[1], rank, inp.num_experts // size
            )
        return cls(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights)
