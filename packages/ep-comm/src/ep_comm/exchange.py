"""What a dispatch takes and returns, and the interface both normal-mode backends implement."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ep_comm.config import Config
from ep_comm.handle import DispatchHandle
from ep_comm.layout import to_local_experts


def row_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * math.prod(tensor.shape[1:])


@dataclass
class DispatchInput:
    """A dispatch's arguments, built once by `Buffer.dispatch` before they are checked."""

    x: torch.Tensor  # [num_tokens, hidden] bf16 or float8_e4m3fn
    x_scales: torch.Tensor | None  # [num_tokens, hidden / 128] fp32 with FP8 x
    topk_idx: torch.Tensor | None  # [num_tokens, num_topk] int64, global expert ids or -1
    topk_weights: torch.Tensor | None  # [num_tokens, num_topk] fp32
    num_tokens_per_rank: torch.Tensor | None  # [num_ranks] int32 (None with a handle)
    is_token_in_rank: torch.Tensor | None  # [num_tokens, num_ranks] bool (None with a handle)
    num_tokens_per_expert: torch.Tensor | None  # [num_experts] int32 (None with a handle)
    expert_alignment: int
    num_worst_tokens: int
    handle: DispatchHandle | None  # an earlier dispatch's: send its layout again, x only

    @property
    def num_experts(self) -> int | None:
        if self.handle is not None:
            return self.handle.num_experts
        return last_dim(self.num_tokens_per_expert)

    def sources(self) -> list[torch.Tensor]:
        """The per-token tensors that travel: x, then the scales and top-k if given."""
        present = (self.x, self.x_scales, self.topk_idx, self.topk_weights)
        return [t for t in present if t is not None]

    def signature(self, config: Config) -> dict:
        """What every rank's call must agree on (compared across ranks before data moves)."""
        return {
            "hidden": last_dim(self.x),
            "x dtype": str(getattr(self.x, "dtype", type(self.x).__name__)),
            "FP8 scales": self.x_scales is not None,
            "cached handle": self.handle is not None,
            "num_experts": self.num_experts,
            "num_topk": last_dim(self.topk_idx),
            "num_worst_tokens": self.num_worst_tokens,
            "config": repr(config),
        }


def last_dim(tensor) -> int | None:
    """The size compared across ranks; None for what is not a tensor (its rank reports that)."""
    return int(tensor.shape[-1]) if isinstance(tensor, torch.Tensor) and tensor.dim() else None


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


class Exchange(ABC):
    """A normal-mode backend. `Buffer` checks the arguments, agrees them across ranks and runs
    these on its communication stream; a backend adds only what is its own."""

    @abstractmethod
    def failure(self) -> str | None:
        """What went wrong in an earlier call that could not raise itself, or None."""

    @property
    @abstractmethod
    def error_flag(self) -> torch.Tensor | None:
        """`[1]` int32 on the device, nonzero once a call's outputs were poisoned (None: every
        failure raises in the call where it happens)."""

    @abstractmethod
    def dispatch_problem(self, inp: DispatchInput, config: Config, handle) -> str | None:
        """Why this dispatch cannot run on this backend, or None."""

    @abstractmethod
    def combine_problem(self, x, topk_weights, config: Config, handle) -> str | None:
        """Why this combine cannot run on this backend, or None."""

    @abstractmethod
    def dispatch_outputs(self, inp: DispatchInput):
        """A dispatch's outputs where their size is known before any data moves (with
        num_worst_tokens or a cached handle), else None. `Buffer` allocates them before the
        ranks agree on the call, so that running out of memory fails the agreement."""

    @abstractmethod
    def combine_outputs(self, x, handle: DispatchHandle, topk_weights):
        """A combine's outputs, allocated before the ranks agree on it (as dispatch_outputs)."""

    @abstractmethod
    def dispatch(self, inp: DispatchInput, config: Config, outputs) -> DispatchOutput: ...

    @abstractmethod
    def dispatch_cached(self, inp: DispatchInput, handle: DispatchHandle, config: Config, outputs):
        """The rows of `handle`'s layout again: (recv_x, recv_x_scales or None)."""

    @abstractmethod
    def combine(self, x, handle: DispatchHandle, topk_weights, biases, config: Config, outputs):
        """(combined_x, combined_topk_weights or None)."""

    @abstractmethod
    def destroy(self) -> None:
        """Free what the backend holds; every rank calls it together (Buffer.destroy)."""
