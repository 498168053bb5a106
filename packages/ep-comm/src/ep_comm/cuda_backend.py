"""The `cuda` backend: our notify, dispatch and combine kernels over CUDA IPC buffers.

Every rank allocates `num_nvl_bytes` once and maps every peer's buffer (same host; the same
GPU or another one). A dispatch is two kernels on the communication stream: notify (a barrier, then
every rank writes what it sends into its peers' buffers and reads what it receives) and dispatch
(per channel, a sender SM streams tokens into each peer's ring, a receiver SM drains its rings
into the outputs). Combine is a barrier and one kernel that runs the rings backwards and sums;
a dispatch with a cached handle, a barrier and the dispatch kernel. Only the outputs'
size needs the host: without `num_worst_tokens`, dispatch reads the received count after
notify; with it, nothing waits for the GPU and the calls can be captured in a CUDA graph.
Waits on peers inside the kernels time out. A timeout or an overflow is kept (in the buffer for
the kernels, in host-mapped memory for `failure`): a poison kernel after every call then fills
its outputs with NaN (-1 for indices) and sets `error_flag`, and every later call raises until
the buffer is rebuilt. csrc/layout.h describes the buffer.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NamedTuple

import torch

from ep_comm.collectives import Collectives
from ep_comm.config import Config, combine_slot_bytes, dispatch_slot_bytes
from ep_comm.exchange import DispatchInput, DispatchOutput, Exchange, row_bytes
from ep_comm.extension import load_extension
from ep_comm.handle import DispatchHandle
from ep_comm.layout import aligned

MAX_RANKS = 8
# The handle keeps a dispatch's real channel counts even after an overflow, so that the
# overflowed rank's combine returns NaN rows to every peer instead of none, which left each
# peer waiting out the timeout. Off until it has run on a GPU (NOTES.md).
_OVERFLOW_RETURNS_ROWS = os.environ.get("EP_COMM_OVERFLOW_RETURNS_ROWS", "0") == "1"
NOTIFY_SLOTS = 1024
STEPS = {
    1: "the barrier starting a call",
    2: "notify",
    3: "dispatch (sending)",
    4: "dispatch (receiving)",
    5: "combine (sending)",
    6: "combine (receiving)",
}


# What the poison kernel writes into a failed call's outputs, per dtype (4 bytes at a time).
POISON = {
    torch.bfloat16: 0x7FC07FC0,
    torch.float32: 0x7FC00000,
    torch.float8_e4m3fn: 0x7F7F7F7F,
    torch.int64: 0xFFFFFFFF,
    torch.int32: 0xFFFFFFFF,
}


class CudaLayout(NamedTuple):
    # [num_ranks, num_channels] int32: rows received from each rank through each channel
    channel_counts: torch.Tensor


def peer_problem(device_uuids: list[str], rank: int) -> str | None:
    """Why this rank cannot map every rank's buffer, given each rank's GPU UUID, or None: a
    peer's GPU must be visible in this process (CUDA IPC opens it here) and, if it is not ours,
    reachable by peer access."""
    visible = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    mine = torch.cuda.current_device()
    for peer, uuid in enumerate(device_uuids):
        if uuid not in visible:
            return (
                f"rank {rank} cannot see rank {peer}'s GPU {uuid} (CUDA_VISIBLE_DEVICES hides it)"
            )
        other = visible[uuid]
        if other != mine and not torch.cuda.can_device_access_peer(mine, other):
            return f"rank {rank}'s GPU {mine} has no peer access to GPU {other} (rank {peer})"
    return None


class CudaExchange(Exchange):
    def __init__(self, comm: Collectives, num_nvl_bytes: int, timeout: timedelta) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.num_nvl_bytes = num_nvl_bytes
        self.timeout = timeout.total_seconds()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.state = load_extension().Intranode(self.rank, self.size, num_nvl_bytes, self.timeout)
        handles = comm.all_gather("Buffer(): exchange CUDA IPC handles", self.state.ipc_handle())
        self.state.connect(list(handles))
        self.num_device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._error_flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._host_failure: str | None = None  # one the host saw before the kernels record it

    @property
    def error_flag(self) -> torch.Tensor:
        return self._error_flag

    def destroy(self) -> None:
        """No rank frees its buffer while a peer still maps it: all close their mappings, meet,
        then free. A peer that does not come raises EPCommError and leaves the memory mapped
        (it is freed with the process)."""
        self.state.close_peers()  # after this rank's kernels, which give up within a timeout
        step = "Buffer.destroy(): wait until every rank unmapped"
        self.comm.all_gather(step, torch.zeros(1), timeout=self.comm.device_timeout)
        self.state.free_buffer()

    def failure(self) -> str | None:
        """What went wrong in an earlier call's kernels, if anything; it stays until the buffer
        is rebuilt."""
        if self._host_failure:
            return self._host_failure
        step, peer, channel, _, received_rows, *_ = self.state.status()
        where = f"ep_comm rank {self.rank}/{self.size}"
        rebuild = "its outputs since are NaN; rebuild the buffer (Buffer.reset() on every rank)"
        if step:
            return (
                f"{where}: {STEPS[step]} timed out after {self.timeout:g} s waiting for rank "
                f"{peer} (channel {channel}); {rebuild}"
            )
        if received_rows:
            return (
                f"{where}: an earlier dispatch received {received_rows} rows, more than its "
                f"num_worst_tokens, and dropped the rest; {rebuild}"
            )
        return None

    def _poison(self, *outputs) -> None:
        present = [t for t in outputs if t is not None and t.numel()]
        self.state.poison(present, [POISON[t.dtype] for t in present], self._error_flag)

    def problem(self, config: Config, num_channels: int, slot_bytes: int, num_experts=0):
        """Why this call cannot run on the buffer, or None."""
        if 2 * num_channels > self.num_device_sms:
            return (
                f"{2 * num_channels} SMs for {num_channels} channels, the GPU has "
                f"{self.num_device_sms} (Buffer.set_num_sms, Config.num_sms)"
            )
        if self.size + num_channels + num_experts // self.size > NOTIFY_SLOTS:
            return f"{num_experts // self.size} experts per rank is too many for the cuda backend"
        needed = config.ring_bytes(num_channels, self.size, slot_bytes)
        if needed > self.num_nvl_bytes:
            return (
                f"the cuda backend's rings need {needed} bytes for {num_channels} channels x "
                f"{self.size} ranks x {config.num_max_nvl_chunked_recv_tokens} tokens of "
                f"{slot_bytes} bytes, the buffer has num_nvl_bytes={self.num_nvl_bytes} "
                "(Config.get_nvl_buffer_size_hint)"
            )
        return None

    def dispatch_problem(self, inp: DispatchInput, config: Config, handle) -> str | None:
        slot = dispatch_slot_bytes([row_bytes(t) for t in inp.sources()])
        channels = _channels(handle) if handle is not None else config.num_channels
        return self.problem(config, channels, slot, inp.num_experts)

    def combine_problem(self, x, topk_weights, config, handle) -> str | None:
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        slot = combine_slot_bytes(x.shape[1], num_topk)
        return self.problem(config, _channels(handle), slot)

    def _outputs(self, sources, rows: int, padded: bool):
        """Each source's received rows `[rows, ...]` and the source token index `[rows]`;
        padded: rows past the received ones hold -1 (ids, indices) or 0 (values)."""
        outputs = []
        for source in sources:
            shape, kind = (rows, *source.shape[1:]), dict(dtype=source.dtype, device=self.device)
            if not padded:
                outputs.append(torch.empty(shape, **kind))
            elif source.dtype == torch.int64:  # expert ids
                outputs.append(torch.full(shape, -1, **kind))
            else:
                outputs.append(torch.zeros(shape, **kind))
        recv_src_idx = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
        return outputs, recv_src_idx

    def _exchange(self, sources, received, is_token_in_rank, channel_counts, config, *counts):
        """The dispatch kernel, then the poison kernel over its outputs and `counts`."""
        outputs, recv_src_idx = received
        self.state.dispatch(
            sources,
            outputs,
            recv_src_idx,
            is_token_in_rank,
            channel_counts,
            config.num_max_nvl_chunked_recv_tokens,
            config.num_max_nvl_chunked_send_tokens,
        )
        self._poison(*outputs, recv_src_idx, *counts)

    def dispatch_outputs(self, inp: DispatchInput):
        handle, sources = inp.handle, inp.sources()
        if handle is not None:
            padded = handle.actual_num_recv_tokens is not None
            return self._outputs(sources, handle.recv_src_idx.shape[0], padded)
        if inp.num_worst_tokens:
            return self._outputs(sources, inp.num_worst_tokens, padded=True)
        return None  # sized by notify

    def combine_outputs(self, x, handle: DispatchHandle, topk_weights):
        num_tokens = handle.is_token_in_rank.shape[0]
        combined_x = torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=self.device)
        combined_weights = None
        if topk_weights is not None:
            shape = (num_tokens, topk_weights.shape[1])
            combined_weights = torch.empty(shape, dtype=torch.float32, device=self.device)
        return combined_x, combined_weights

    def dispatch(self, inp: DispatchInput, config: Config, outputs) -> DispatchOutput:
        size, sources, worst = self.size, inp.sources(), inp.num_worst_tokens
        kind = dict(dtype=torch.int32, device=self.device)
        rank_counts = torch.empty(size, size, **kind)
        channel_counts = torch.empty(size, config.num_channels, **kind)
        expert_counts = torch.empty(inp.num_experts // size, **kind)
        received = outputs
        self.state.notify(
            inp.is_token_in_rank,
            inp.num_tokens_per_expert,
            rank_counts,
            channel_counts,
            expert_counts,
        )
        if not worst:
            rows = int(channel_counts.sum())  # the host waits for notify here, only here
            received, failure = self.comm.allocated("dispatch", self._outputs, sources, rows, False)
            if failure and not self._host_failure:  # notify has run: only a rebuild is known good
                self._host_failure = f"{failure}; rebuild the buffer (Buffer.reset() on every rank)"
            # No rank launches the dispatch kernel unless every rank's notify worked (else its
            # counts are garbage) and every rank has room for its rows: all raise here.
            self.comm.agree("dispatch: notify", {}, None, self.failure(), self.comm.device_timeout)
        # The poison kernel overwrites the counts after a failure; with _OVERFLOW_RETURNS_ROWS,
        # their total instead of the channel counts, which the handle keeps for combine.
        total = None
        if worst and _OVERFLOW_RETURNS_ROWS:
            total = channel_counts.sum(dtype=torch.int32).reshape(1)
        poisoned = total if _OVERFLOW_RETURNS_ROWS else channel_counts
        self._exchange(
            sources,
            received,
            inp.is_token_in_rank,
            channel_counts,
            config,
            rank_counts,
            expert_counts,
            poisoned,
        )
        if worst and total is None:
            total = channel_counts.sum(dtype=torch.int32).reshape(1)
        out = DispatchOutput.from_rows(received[0], inp, self.rank, size)
        out.num_recv_tokens_per_expert = (
            [] if worst else [aligned(c, inp.expert_alignment) for c in expert_counts.tolist()]
        )
        out.handle = DispatchHandle(
            rank_prefix_matrix=rank_counts.cumsum(dim=0, dtype=torch.int32),
            recv_src_idx=received[1],
            is_token_in_rank=inp.is_token_in_rank,
            num_experts=inp.num_experts,
            actual_num_recv_tokens=total,
            backend_layout=CudaLayout(channel_counts),
        )
        return out

    def dispatch_cached(self, inp: DispatchInput, handle: DispatchHandle, config: Config, received):
        sources = inp.sources()
        self.state.barrier()
        channel_counts = handle.backend_layout.channel_counts
        self._exchange(sources, received, handle.is_token_in_rank, channel_counts, config)
        outputs = received[0]
        return outputs[0], (outputs[1] if inp.x_scales is not None else None)

    def combine(self, x, handle: DispatchHandle, topk_weights, biases, config: Config, outputs):
        combined_x, combined_weights = outputs
        self.state.barrier()
        self.state.combine(
            x,
            topk_weights,
            biases,
            handle.is_token_in_rank,
            handle.backend_layout.channel_counts,
            combined_x,
            combined_weights,
            config.num_max_nvl_chunked_recv_tokens,
            config.num_max_nvl_chunked_send_tokens,
        )
        self._poison(combined_x, combined_weights)
        return combined_x, combined_weights


def _channels(handle: DispatchHandle) -> int:
    return handle.backend_layout.channel_counts.shape[1]
