"""Expert-parallel MoE through ep_comm: rank r of R holds expert slots [r P/R, (r+1) P/R).

The P slots are the routed experts (P = E), or, where the instance balances them, a layer's
`ExpertLocation`'s physical experts: the exchange moves rows by slot either way.

Attention is data-parallel (every rank runs its own tokens through all of it); in each MoE layer
every rank's tokens travel to the ranks holding their experts (dispatch), are processed there,
and come back summed (combine). Two ways, as DeepSeek serves:

- Prefill: ep_comm's normal mode (`dispatch`, `combine`) moves bf16 rows. On CUDA both calls
  run on ep_comm's communication stream and return an event (`async_finish`) without waiting
  for the transfer: the caller waits on it where it reads the result, so compute queued
  meanwhile (the other microbatch's) overlaps it. (Without `num_worst_tokens` a dispatch still
  waits on the host for its counts, as DeepEP's normal mode does.)
- Decode: the low-latency mode (`low_latency_dispatch`, `low_latency_combine`) once
  `use_low_latency` has set T, the most tokens a rank sends in one decode microbatch. Rows land
  in fixed-shape per-expert blocks, nothing waits on the host, and each call returns a receive
  hook: the send is queued at once, the receive only when the hook is called, so no SM spins
  while the other microbatch computes. Its results equal the normal mode's but for the order
  of the combine's sum (it weighs each token's expert rows on the token's own rank).

After a failure that ep_comm could not raise at once (a CUDA-graph replay, an asynchronous
call), `raise_if_failed` raises `EPCommError` on every rank and `reset` rebuilds the buffer.
An instance that lost ranks `leave`s its group and `regroup`s over the survivors; a rank that
joins one starts without a group (`joining`) and `regroup`s with them.

With `deep_ep` (the model's `kernels` "deepseek"), DeepEP's `deep_ep.Buffer` (its V1 API, which
ep_comm's copies) moves the rows instead (`deepseek.deep_ep_buffer`): its kernels never wait on
the host where ep_comm's cuda backend does not either, and it keeps no failure to agree on
(`raise_if_failed` checks nothing; a failing call raises, or the process aborts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_comm import Buffer, Config, EventOverlap
from ep_comm.config import SCALE_BLOCK
from ep_comm.low_latency_checks import MAX_TOKENS_PER_RANK, MAX_TOPK
from ref_server.kernels.deepseek import deep_ep_buffer


@dataclass
class Dispatched:
    """Rows received by this rank's experts: x `[m, hidden]`, local expert ids `[m, k]` (-1:
    another rank's), weights `[m, k]`; handle: ep_comm's, for the way back (None: one rank)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    handle: object


@dataclass
class Packed:
    """Rows a low-latency dispatch gave this rank's experts: x `[E_local, R * T, hidden]` bf16,
    or with FP8 the pair (values e4m3, scales fp32 `[E_local, R * T, hidden / 128]`), of which
    the first count[e] rows of expert e are valid (the combine reads no others);
    handle: ep_comm's; ids and weights `[n, k]`: this rank's own tokens' choices, which the
    combine applies on the way back."""

    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    count: torch.Tensor
    handle: object
    ids: torch.Tensor
    weights: torch.Tensor


class ExpertParallel:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_experts: int,
        hidden_size: int,
        *,
        backend: str | None = None,
        timeout: timedelta = timedelta(seconds=300),
        deep_ep=None,
        joining: tuple[int, int] | None = None,
    ) -> None:
        """backend, timeout: ep_comm's `Buffer`'s; deep_ep: the imported DeepEP, whose buffer
        moves the rows instead (None: ep_comm's). joining (rank, ranks) instead of a group: a
        rank that joins a running instance, laid out as that rank of the instance as it
        started; it has neither group nor buffer until `regroup`."""
        rank, size = joining or (group.rank(), group.size())
        if num_experts % size:
            raise ValueError(f"{num_experts} routed experts do not split over {size} ranks")
        self.group = group
        self.num_experts = num_experts
        self.initial_per_rank = num_experts // size  # a grown-back instance's slots per rank
        self.hidden_size = hidden_size
        self.rank_and_size = (rank, size)
        self.backend, self.timeout = backend, timeout
        self.deep_ep = deep_ep
        self.max_decode_tokens = 0  # T of the low-latency mode; 0: decode uses the normal mode
        self.why_not_low_latency = "no decode batch size was given (use_low_latency)"
        self.buffer = None if group is None else self._new_buffer()

    def _new_buffer(self) -> Buffer:
        size, tokens = self.rank_and_size[1], self.max_decode_tokens
        if self.deep_ep is not None:
            return deep_ep_buffer(
                self.deep_ep, self.group, self.hidden_size, self.num_experts, tokens
            )
        nvl_bytes = rdma_bytes = 0
        if torch.cuda.is_available():
            nvl_bytes = Config().get_nvl_buffer_size_hint(self.hidden_size * 2, size)
        if tokens:
            rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
                tokens, self.hidden_size, size, self.num_experts
            )
        return Buffer(
            self.group,
            nvl_bytes,
            rdma_bytes,
            low_latency_mode=bool(tokens),
            backend=self.backend,
            timeout=self.timeout,
        )

    def use_low_latency(self, max_tokens: int, num_topk: int) -> bool:
        """Let decode microbatches of at most T tokens per rank go through the low-latency
        mode (T: max_tokens rounded up to a multiple of 4, at most 1024; larger ones keep the
        normal mode): a new buffer, built by every rank together. False, with the reason in
        `why_not_low_latency`, where the mode cannot move these rows."""
        self.why_not_low_latency = None
        if self.hidden_size % SCALE_BLOCK:
            self.why_not_low_latency = (
                f"hidden_size {self.hidden_size} is not a multiple of {SCALE_BLOCK}"
            )
        elif num_topk > MAX_TOPK:
            self.why_not_low_latency = f"{num_topk} experts per token, more than {MAX_TOPK}"
        else:
            self.max_decode_tokens = min(-(-max_tokens // 4) * 4, MAX_TOKENS_PER_RANK)
            if self.buffer is not None:  # else `regroup` builds it so
                self.buffer.destroy()
                self.buffer = self._new_buffer()
        return self.low_latency

    @property
    def low_latency(self) -> bool:
        return self.max_decode_tokens > 0

    def low_latency_fits(self, num_tokens: int) -> bool:
        """Whether a decode microbatch of num_tokens tokens on a rank can go low-latency."""
        return self.low_latency and num_tokens <= self.max_decode_tokens

    @property
    def capturable(self) -> bool:
        """Whether a decode step's exchange can be captured in a CUDA graph: in the low-latency
        mode through ep_comm's cuda low-latency backend, else in the normal mode through its
        cuda backend (with num_worst_tokens), or through DeepEP. The torch backends wait on the
        host."""
        if self.deep_ep is not None:
            return True
        if self.low_latency:
            return self.buffer.low_latency_backend == "cuda"
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

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        use_fp8: bool = False,
        recv_stats: torch.Tensor | None = None,
    ) -> tuple[Packed, Callable[[], None]]:
        """x `[n, hidden]` (n <= T) and its global expert ids and weights `[n, k]` to this
        rank's experts' packed rows, in bf16, or with use_fp8 cast to e4m3 with a scale per
        token and 128 channels before they travel (half the bytes; what FP8 experts would
        compute from the bf16 rows anyway). Only sends: the rows are there once the returned
        hook has been called. recv_stats `[E_local]` int32: += the rows each local expert
        received."""
        recv_x, count, handle, _, hook = self.buffer.low_latency_dispatch(
            x.to(torch.bfloat16),
            ids,
            self.max_decode_tokens,
            self.num_experts,
            use_fp8=use_fp8,
            cumulative_local_expert_recv_stats=recv_stats,
            return_recv_hook=True,
        )
        return Packed(recv_x, count, handle, ids, weights.float()), hook

    def low_latency_combine(
        self, expert_out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, handle
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Each token's weighted sum of its experts' rows `[n, hidden]` bf16, back on its rank:
        expert_out `[E_local, R * T, hidden]` are the experts' outputs for `Packed.x`,
        unweighted. The sum is there once the returned hook has been called."""
        combined, _, hook = self.buffer.low_latency_combine(
            expert_out.to(torch.bfloat16), ids, weights, handle, return_recv_hook=True
        )
        return combined, hook

    def raise_if_failed(self) -> None:
        """Raise EPCommError on every rank if any rank's buffer failed in a call that could not
        raise. Collective; waits for this rank's work on the current stream first. With DeepEP,
        nothing: it records no failures."""
        if self.deep_ep is not None:
            return
        if self.buffer.device is not None:
            torch.cuda.current_stream().synchronize()
        self.buffer.raise_if_failed()

    def leave(self) -> None:
        """Drop the buffer and the group (without destroying the buffer: a destroy waits for
        every rank, and some are gone). Once nothing else holds the group it closes its
        connections, so that the ranks still waiting on this one fail at once."""
        self.buffer = self.group = None

    def regroup(self, group: dist.ProcessGroup, num_experts: int) -> None:
        """A buffer over `group`, the ranks left after some were lost or with one that joins,
        for num_experts slots (a multiple of its size); every rank of it together. The caller
        places the slots."""
        if num_experts % group.size():
            raise ValueError(f"{num_experts} expert slots do not split over {group.size()} ranks")
        self.group, self.num_experts = group, num_experts
        self.rank_and_size = (group.rank(), group.size())
        self.buffer = self._new_buffer()

    def reset(self) -> None:
        """Rebuild the buffer after a failure; collective. CUDA graphs that captured the old
        one must be captured again."""
        if self.deep_ep is None:
            self.buffer.reset()
            return
        self.buffer.destroy()  # which waits for the device
        self.buffer = self._new_buffer()


def group_of(expert_parallel: ExpertParallel | None) -> dist.ProcessGroup | None:
    """The ranks an instance's experts are spread over (None: one rank)."""
    return expert_parallel.group if expert_parallel else None


def ranks_of(expert_parallel: ExpertParallel | None) -> int:
    return expert_parallel.rank_and_size[1] if expert_parallel else 1
