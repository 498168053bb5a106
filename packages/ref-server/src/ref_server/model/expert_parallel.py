"""Expert-parallel MoE through ep_comm: rank r of R holds routed experts [r E/R, (r+1) E/R).

Attention is data-parallel (every rank runs its own tokens through all of it); in each MoE layer
every rank's tokens travel to the ranks holding their experts (`Buffer.dispatch`), are
processed there, and come back summed (`Buffer.combine`). ep_comm moves bf16 rows.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ep_comm import Buffer, Config


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

    def exchange(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, run_experts):
        """x `[n, hidden]`, global expert ids and weights `[n, k]`: the weighted sums of each
        token's experts, computed by `run_experts(rows, local_ids, weights)` where they live."""
        buffer = self.buffer
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            x.to(torch.bfloat16),
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=weights.float(),
        )
        partial = run_experts(recv_x.to(x.dtype), recv_ids, recv_weights)
        combined, _, _ = buffer.combine(partial.to(torch.bfloat16), handle)
        return combined.to(x.dtype)
