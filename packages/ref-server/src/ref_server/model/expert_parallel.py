"""Expert-parallel MoE through ep_comm: rank r of R holds routed experts [r E/R, (r+1) E/R).

Attention is data-parallel (every rank runs its own tokens through all of it); in each MoE layer
every rank's tokens travel to the ranks holding their experts (`dispatch`), are processed there,
and come back summed (`combine`). ep_comm moves bf16 rows. On CUDA both calls run on ep_comm's
communication stream and return an event (`async_finish`) without waiting for the transfer:
the caller waits on it where it reads the result, so compute queued meanwhile (the other
microbatch's) overlaps it. (Without `num_worst_tokens` a dispatch still waits on the host for
its counts, as DeepEP's normal mode does.)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_comm import Buffer, Config, EventOverlap


@dataclass
class Dispatched:
    """Rows received by this rank's experts: x `[m, hidden]`, local expert ids `[m, k]` (-1:
    another rank's), weights `[m, k]`; handle: ep_comm's, for the way back (None: one rank)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    handle: object


class ExpertParallel:
    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        hidden_size: int,
        *,
        backend: str | None = None,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        size = group.size()
        if num_experts % size:
            raise ValueError(f"{num_experts} routed experts do not split over {size} ranks")
        self.group = group
        self.num_experts = num_experts
        self.rank_and_size = (group.rank(), size)
        nvl_bytes = 0
        if torch.cuda.is_available():
            nvl_bytes = Config().get_nvl_buffer_size_hint(hidden_size * 2, size)
        self.buffer = Buffer(group, nvl_bytes, backend=backend, timeout=timeout)

    @property
    def capturable(self) -> bool:
        """Whether the calls can be captured in a CUDA graph (with num_worst_tokens)."""
        return self.buffer.backend == "cuda"

    def dispatch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_worst_tokens: int = 0
    ) -> tuple[Dispatched, EventOverlap]:
        """x `[n, hidden]`, global expert ids and weights `[n, k]`, to the rows this rank's
        experts receive. num_worst_tokens > 0: outputs of that many rows, padded, with no
        host synchronization (what CUDA graphs need); at least n x ranks rows."""
        buffer = self.buffer
        # The layout is ready on this stream when dispatch reads it (its checks read values).
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_weights, _, handle, event = buffer.dispatch(
            x.to(torch.bfloat16),
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=weights.float(),
            num_worst_tokens=num_worst_tokens,
            async_finish=x.is_cuda,
        )
        return Dispatched(recv_x, recv_ids, recv_weights, handle), event

    def combine(self, partial: torch.Tensor, handle) -> tuple[torch.Tensor, EventOverlap]:
        """The sums of each token's expert outputs `[n, hidden]` bf16, back where it came
        from: partial `[m, hidden]` are the rows `dispatch` gave this rank, weighted."""
        combined, _, event = self.buffer.combine(
            partial.to(torch.bfloat16), handle, async_finish=partial.is_cuda
        )
        return combined, event
