"""The `cuda` backend: our notify, dispatch and combine kernels over CUDA IPC buffers.

Every rank allocates `num_nvl_bytes` once and maps every peer's buffer (same host; the same
GPU or another one). A dispatch is two kernels on the communication stream: notify (a barrier, then
every rank writes what it sends into its peers' buffers and reads what it receives) and dispatch
(per channel, a sender SM streams tokens into each peer's ring, a receiver SM drains its rings
into the outputs). Combine is a barrier and one kernel that runs the rings backwards and sums;
a dispatch with a cached handle, a barrier and the dispatch kernel. Only the outputs'
size needs the host: without `num_worst_tokens`, dispatch reads the received count after
notify; with it, nothing waits for the GPU and the calls can be captured in a CUDA graph.
Waits on peers inside the kernels time out; the first failure is kept in host-mapped memory and
raised by the next call (see `failure`). csrc/layout.cuh describes the buffer.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from ep_comm.collectives import Collectives
from ep_comm.config import Config, combine_slot_bytes, dispatch_slot_bytes
from ep_comm.exchange import DispatchInput, DispatchOutput, row_bytes
from ep_comm.extension import load_extension
from ep_comm.handle import DispatchHandle
from ep_comm.layout import aligned

MAX_RANKS = 8
NOTIFY_SLOTS = 1024
STEPS = {
    1: "the barrier starting a call",
    2: "notify",
    3: "dispatch (sending)",
    4: "dispatch (receiving)",
    5: "combine (sending)",
    6: "combine (receiving)",
}


class CudaExchange:
    def __init__(self, comm: Collectives, num_nvl_bytes: int, timeout: timedelta) -> None:
        self.rank, self.size = comm.rank, comm.size
        self.num_nvl_bytes = num_nvl_bytes
        self.timeout = timeout.total_seconds()
        self.state = load_extension().Intranode(self.rank, self.size, num_nvl_bytes, self.timeout)
        handles = comm.all_gather("Buffer(): exchange CUDA IPC handles", self.state.ipc_handle())
        self.state.connect(list(handles))
        self.num_device_sms = torch.cuda.get_device_properties().multi_processor_count

    def destroy(self) -> None:
        self.state.destroy()

    def failure(self) -> str | None:
        """What went wrong in an earlier call's kernels, if anything (a timeout stays)."""
        step, peer, channel, _, received_rows, *_ = self.state.status()
        where = f"ep_comm rank {self.rank}/{self.size}"
        if step:
            return (
                f"{where}: {STEPS[step]} timed out after {self.timeout:g} s waiting for rank "
                f"{peer} (channel {channel}); this Buffer cannot be used any more: destroy it "
                "and build a new one"
            )
        if received_rows:
            self.state.clear_overflow()
            return (
                f"{where}: an earlier dispatch received {received_rows} rows, more than its "
                "num_worst_tokens; the rows past it were dropped"
            )
        return None

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

    def dispatch_problem(self, x, x_scales, topk_idx, topk_weights, config, handle, num_experts):
        pieces = [t for t in (x, x_scales, topk_idx, topk_weights) if t is not None]
        slot = dispatch_slot_bytes([row_bytes(t) for t in pieces])
        channels = handle.channel_counts.shape[1] if handle is not None else config.num_channels
        return self.problem(config, channels, slot, num_experts)

    def combine_problem(self, x, topk_weights, config, handle):
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        slot = combine_slot_bytes(x.shape[1], num_topk)
        return self.problem(config, handle.channel_counts.shape[1], slot)

    def _exchange(self, sources, rows, is_token_in_rank, channel_counts, config, padded):
        """Each source's rows `[rows, ...]` as received, and their source token indices; padded:
        rows past the received ones hold -1 (ids) or 0 (values)."""
        outputs = []
        for source in sources:
            shape, kind = (rows, *source.shape[1:]), dict(dtype=source.dtype, device=source.device)
            if not padded:
                outputs.append(torch.empty(shape, **kind))
            elif source.dtype == torch.int64:  # expert ids
                outputs.append(torch.full(shape, -1, **kind))
            else:
                outputs.append(torch.zeros(shape, **kind))
        recv_src_idx = torch.full((rows,), -1, dtype=torch.int32, device=is_token_in_rank.device)
        self.state.dispatch(
            sources,
            outputs,
            recv_src_idx,
            is_token_in_rank,
            channel_counts,
            config.num_max_nvl_chunked_recv_tokens,
            config.num_max_nvl_chunked_send_tokens,
        )
        return outputs, recv_src_idx

    def dispatch(self, inp: DispatchInput, config: Config) -> DispatchOutput:
        device, size = inp.x.device, self.size
        rank_counts = torch.empty(size, size, dtype=torch.int32, device=device)
        channel_counts = torch.empty(size, config.num_channels, dtype=torch.int32, device=device)
        expert_counts = torch.empty(inp.num_experts // size, dtype=torch.int32, device=device)
        counts = (rank_counts, channel_counts, expert_counts)
        self.state.notify(inp.is_token_in_rank, inp.num_tokens_per_expert, *counts)
        worst = inp.num_worst_tokens
        rows = worst or int(channel_counts.sum())  # the host waits for notify here, only here
        received, recv_src_idx = self._exchange(
            inp.sources(), rows, inp.is_token_in_rank, channel_counts, config, padded=bool(worst)
        )
        out = DispatchOutput.from_rows(received, inp, self.rank, size)
        out.num_recv_tokens_per_expert = (
            [] if worst else [aligned(c, inp.expert_alignment) for c in expert_counts.tolist()]
        )
        out.handle = DispatchHandle(
            rank_prefix_matrix=rank_counts.cumsum(dim=0, dtype=torch.int32),
            recv_src_idx=recv_src_idx,
            is_token_in_rank=inp.is_token_in_rank,
            num_experts=inp.num_experts,
            actual_num_recv_tokens=(
                channel_counts.sum(dtype=torch.int32).reshape(1) if worst else None
            ),
            channel_counts=channel_counts,
        )
        return out

    def dispatch_cached(self, x, x_scales, handle: DispatchHandle, config: Config):
        self.state.barrier()
        sources = [x] if x_scales is None else [x, x_scales]
        received, _ = self._exchange(
            sources,
            handle.recv_src_idx.shape[0],
            handle.is_token_in_rank,
            handle.channel_counts,
            config,
            padded=handle.actual_num_recv_tokens is not None,
        )
        return received[0], (received[1] if x_scales is not None else None)

    def combine(self, x, handle: DispatchHandle, topk_weights, biases, config: Config):
        num_tokens = handle.is_token_in_rank.shape[0]
        combined_x = torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
        combined_weights = None
        if topk_weights is not None:
            shape = (num_tokens, topk_weights.shape[1])
            combined_weights = torch.empty(shape, dtype=torch.float32, device=x.device)
        self.state.barrier()
        self.state.combine(
            x,
            topk_weights,
            biases,
            handle.is_token_in_rank,
            handle.channel_counts,
            combined_x,
            combined_weights,
            config.num_max_nvl_chunked_recv_tokens,
            config.num_max_nvl_chunked_send_tokens,
        )
        return combined_x, combined_weights
