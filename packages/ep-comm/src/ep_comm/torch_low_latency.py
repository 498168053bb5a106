"""The `torch` backend of the low-latency mode, over torch.distributed (gloo or NCCL).

Dispatch: every (token, k) with an expert becomes one row of int32 words (its values, FP8
scales, the token's index), sorted by expert, then token, then k. The per-expert counts travel
first, in a blocking all-gather (the ranks are in step anyway: the arguments' agreement precedes
every call); the rows follow in an asynchronous all-to-all, which `receive` waits for. Combine
returns each row to its source the same way, tagged with its expert and token. gloo stages CUDA
tensors through the host; a host synchronization per call, so no CUDA graphs.

Order of a local expert's rows: source rank 0's first, then rank 1's, ...; within a source, by
token index (the cuda backend's order is arrival order). The wait-cost stats get the host
nanoseconds spent waiting for the whole all-to-all, on every source's entry: all sources arrive
together here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ep_comm.collectives import Collectives
from ep_comm.fp8 import pack_ue8m0, per_token_cast_to_fp8
from ep_comm.low_latency_backend import (
    LowLatencyCombineCall,
    LowLatencyDispatchCall,
    LowLatencyHandle,
    LowLatencyReceive,
)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """A `[rows, n]` tensor's rows as int32 words (every row here is a multiple of 4 bytes)."""
    return tensor.contiguous().view(torch.int32)


def _blocks(sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows laid out as consecutive blocks of `sizes` rows: each row's block, and its index
    inside the block."""
    block = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    starts = sizes.cumsum(0) - sizes
    return block, torch.arange(int(sizes.sum())) - starts[block]


class _Transfer:
    """An asynchronous all_to_all_single of int32 rows; `wait` returns them on `device` and the
    nanoseconds the host spent waiting."""

    def __init__(self, comm: Collectives, step: str, rows, send_counts, recv_counts) -> None:
        self.comm, self.step, self.device = comm, step, rows.device
        self.send = rows.to(comm.device)  # kept: the process group reads it until done
        self.received = torch.empty(
            (sum(recv_counts), rows.shape[1]), dtype=torch.int32, device=comm.device
        )
        self.work = dist.all_to_all_single(
            self.received,
            self.send,
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=comm.group,
            async_op=True,
        )

    def wait(self) -> tuple[torch.Tensor, int]:
        start = time.perf_counter_ns()
        self.comm.wait(self.step, self.work)
        waited = time.perf_counter_ns() - start
        return self.received.to(self.device), waited


class TorchLowLatency:
    """`LowLatencyBackend` over the process group. Failures (timeouts) raise `EPCommError` in
    the call they happen in, so `error_flag` (a CPU tensor) stays 0 and `failure()` None."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.error_flag = torch.zeros(1, dtype=torch.int32)
        self._combine_buffers: dict[int, torch.Tensor] = {}

    def failure(self) -> str | None:
        return None

    def destroy(self) -> None:
        self._combine_buffers.clear()

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        del num_max_dispatch_tokens_per_rank, hidden, num_experts  # nothing sized by them persists
        self.comm.all_gather("clean_low_latency_buffer: barrier", torch.zeros(1))
        self.error_flag.zero_()

    def combine_buffer(self, slot: int, handle: LowLatencyHandle) -> torch.Tensor:
        tokens, hidden, num_experts = handle[2:]
        shape = (num_experts // self.size, self.size * tokens, hidden)
        device = handle.src_info.device
        buffer = self._combine_buffers.get(slot)
        if buffer is None or buffer.shape != shape or buffer.device != device:
            buffer = torch.empty(shape, dtype=torch.bfloat16, device=device)
            self._combine_buffers[slot] = buffer
        return buffer

    def dispatch_send(self, slot: int, call: LowLatencyDispatchCall, out: LowLatencyReceive):
        del slot  # each call has its own tensors
        x, topk_idx, num_experts = call.x, call.topk_idx, call.num_experts
        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats = call.stats
        local_experts = num_experts // self.size
        token, expert = _messages(topk_idx)
        pieces = [x]
        if call.use_fp8:
            values, scale_inv = per_token_cast_to_fp8(x, call.round_scale)
            pieces = [values, pack_ue8m0(scale_inv) if call.use_ue8m0 else scale_inv]
        words = [_words(p) for p in pieces]
        widths = [w.shape[1] for w in words]
        rows = torch.cat([torch.cat(words, dim=1)[token], token.to(torch.int32).unsqueeze(1)], 1)
        sent = torch.bincount(expert, minlength=num_experts)
        step = "low_latency_dispatch: exchange counts"
        counts = self.comm.all_gather(step, sent).cpu()  # [source rank, global expert]
        per_rank = counts.view(self.size, self.size, local_experts).sum(dim=2)  # [source, dest]
        mine = counts[:, self.rank * local_experts : (self.rank + 1) * local_experts]
        step = "low_latency_dispatch: exchange rows"
        transfer = _Transfer(
            self.comm, step, rows, per_rank[self.rank].tolist(), per_rank[:, self.rank].tolist()
        )

        def receive() -> None:
            received, waited = transfer.wait()
            *received_words, source_token = received.split([*widths, 1], dim=1)
            _place(out, received_words, source_token.squeeze(1), mine)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(out.count)
            if dispatch_wait_recv_cost_stats is not None:
                dispatch_wait_recv_cost_stats.add_(waited)

        return receive

    def combine_send(self, slot: int, call: LowLatencyCombineCall, out: torch.Tensor):
        x, topk_idx, topk_weights, handle = call.x, call.topk_idx, call.topk_weights, call.handle
        tokens = handle.num_max_dispatch_tokens_per_rank
        rows_of = self.combine_buffer(slot, handle) if call.zero_copy else x
        local_experts = handle.num_experts // self.size
        layout = handle.layout_range.cpu()
        begin, count = layout >> 32, layout & 0xFFFFFFFF  # [local expert, source rank]
        # back to each source in rank order, each source's rows by expert (then token, then k)
        block, offset = _blocks(count.t().flatten())
        expert = block % local_experts
        row = begin.t().flatten()[block] + offset
        expert, row = expert.to(x.device), row.to(x.device)
        global_expert = (expert + self.rank * local_experts).to(torch.int32).unsqueeze(1)
        source_token = handle.src_info[expert, row].unsqueeze(1)
        rows = torch.cat([_words(rows_of[expert, row]), global_expert, source_token], dim=1)
        step = "low_latency_combine: exchange counts"
        counts = self.comm.all_gather(step, count.sum(dim=0)).cpu()  # [sender, receiver]
        step = "low_latency_combine: exchange rows"
        transfer = _Transfer(
            self.comm, step, rows, counts[self.rank].tolist(), counts[:, self.rank].tolist()
        )

        def receive() -> None:
            received, waited = transfer.wait()
            words, expert, token = received.split([received.shape[1] - 2, 1, 1], dim=1)
            values = words.contiguous().view(torch.bfloat16)
            key = expert.squeeze(1).long() * tokens + token.squeeze(1).long()
            out.copy_(_weighted_sum(values, key, topk_idx, topk_weights, tokens))
            if call.combine_wait_recv_cost_stats is not None:
                call.combine_wait_recv_cost_stats.add_(waited)

        return receive


def _messages(topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs with an expert, sorted by expert, then token, then k: each pair's
    token and expert (int64)."""
    flat = topk_idx.flatten()
    chosen = (flat >= 0).nonzero().squeeze(1)  # token-then-k order
    pair = chosen[torch.sort(flat[chosen], stable=True).indices]
    return pair // topk_idx.shape[1], flat[pair]


def _place(
    out: LowLatencyReceive, pieces: list[torch.Tensor], source_token: torch.Tensor, mine
) -> None:
    """Received rows (by source rank, then local expert, token, k) into DeepEP's packed layout.

    pieces: int32 words of the values (and scales); mine: `[source rank, local expert]` rows
    received (host)."""
    local_experts = mine.shape[1]
    begin = mine.cumsum(0) - mine  # where each source's rows start, per expert
    block, offset = _blocks(mine.flatten())
    expert = (block % local_experts).to(out.x.device)
    row = (begin.flatten()[block] + offset).to(out.x.device)
    values = out.x.view(torch.int32)
    values.zero_()
    values[expert, row] = pieces[0]
    if out.scales is not None:
        out.scales.zero_()
        out.scales.view(torch.int32)[expert, row] = pieces[1]
    out.src_info.fill_(-1)
    out.src_info[expert, row] = source_token
    out.count.copy_(mine.sum(dim=0))
    out.layout_range.copy_((begin.t() << 32) | mine.t())


def _weighted_sum(
    values: torch.Tensor, key: torch.Tensor, topk_idx, topk_weights, tokens: int
) -> torch.Tensor:
    """sum_k w[t, k] * the row of (topk_idx[t, k], t) in fp32, k in order, -1 skipped, as bf16.

    values: `[rows, H]` bf16, the row of (expert e, token t) has key e * tokens + t. A pair with
    no row (not dispatched) adds nothing."""
    num_tokens, num_topk = topk_idx.shape
    total = torch.zeros((num_tokens, values.shape[1]), dtype=torch.float32, device=values.device)
    if values.shape[0] == 0:
        return total.to(torch.bfloat16)
    sorted_keys, order = key.sort()
    wanted = topk_idx * tokens + torch.arange(num_tokens, device=topk_idx.device).unsqueeze(1)
    position = torch.searchsorted(sorted_keys, wanted).clamp(max=len(sorted_keys) - 1)
    found = (sorted_keys[position] == wanted) & (topk_idx >= 0)
    for k in range(num_topk):
        row = values[order[position[:, k]]].float()
        added = total + topk_weights[:, k : k + 1] * row
        total = torch.where(found[:, k : k + 1], added, total)
    return total.to(torch.bfloat16)
