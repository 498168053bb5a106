"""The low-latency `cuda` backend: our kernels over NVSHMEM puts and signals.

One NVSHMEM allocation of `num_rdma_bytes` holds two slots (LL calls alternate between them),
each a send area and a receive area; a second, small one holds each slot's signal words and the
buffer's failure word. Every call is a send kernel on the current stream and, when its
`receive()` is called, a receive kernel on the stream current then: no host synchronization, so
both are CUDA-graph capturable.

Protocol (csrc/low_latency/*.cuh). A slot counts its uses on the device (a host counter would
be frozen into a captured graph). A send of use u writes signals carrying u: dispatch counts
`(u << 32) | (rows + 1)` per (local expert, source rank), combine flags `u` per global expert;
receivers wait until a signal carries the current u, so nothing needs zeroing between calls.
When a receive has read the slot it acks every peer with u, and a send of use u waits for
`ack >= u - 1` from a peer before writing into it. DeepEP instead zeroes the next slot's
signals at the start of each call, which is only safe while no rank is more than one call
ahead; with acks a fast rank waits for a slow one instead of wiping signals it has yet to read.

Waits time out after `timeout`: the rank records what it waited for in host-mapped memory
(`failure`), tells every peer through the failure word, and from then on every wait of the
buffer gives up at once and receives poison their outputs (NaN) and set `error_flag`, until
`clean`.
"""

from __future__ import annotations

import ctypes
from datetime import timedelta

import torch

from ep_comm import nvshmem
from ep_comm.collectives import Collectives

MAX_EXPERTS = 4096  # signal words per slot
MESSAGE_HEADER = 16
ALIGN = 128
STEPS = {
    1: "dispatch (sending)",
    2: "dispatch (receiving)",
    3: "combine (sending)",
    4: "combine (receiving)",
}
STATUS_INTS = 8
WORDS_PER_SLOT = 8  # device words of a slot: its use counter, then 4 blocks-finished counters


def _aligned(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def message_bytes(hidden: int) -> int:
    """A dispatch message's stride: header, then room for a bf16 row (an FP8 row and its
    scales are shorter)."""
    return MESSAGE_HEADER + 2 * hidden


def slot_bytes(max_tokens: int, hidden: int, num_experts: int) -> tuple[int, int]:
    """(send area, receive area) bytes of one slot."""
    rows = num_experts * max_tokens  # E_local experts x R ranks x T tokens
    send = max(max_tokens * message_bytes(hidden), rows * 2 * hidden)
    recv = max(rows * message_bytes(hidden), rows * 2 * hidden)
    return _aligned(send), _aligned(recv)


class LLSlot(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int32),
        ("num_ranks", ctypes.c_int32),
        ("timeout_ns", ctypes.c_uint64),
        ("send", ctypes.c_void_p),
        ("recv", ctypes.c_void_p),
        ("dispatch_counts", ctypes.c_void_p),
        ("combine_flags", ctypes.c_void_p),
        ("acks", ctypes.c_void_p),
        ("failed", ctypes.c_void_p),
        ("use", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("recorded", ctypes.c_void_p),
        ("error_flag", ctypes.c_void_p),
        ("status", ctypes.c_void_p),
    ]


class LLDispatchParams(ctypes.Structure):
    _fields_ = [
        ("slot", LLSlot),
        ("x", ctypes.c_void_p),
        ("topk_idx", ctypes.c_void_p),
        ("expert_counters", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int32),
        ("num_topk", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("max_tokens", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("use_fp8", ctypes.c_int32),
        ("round_scale", ctypes.c_int32),
        ("use_ue8m0", ctypes.c_int32),
        ("message_bytes", ctypes.c_int64),
        ("recv_x", ctypes.c_void_p),
        ("recv_scales", ctypes.c_void_p),
        ("recv_count", ctypes.c_void_p),
        ("recv_src_info", ctypes.c_void_p),
        ("recv_layout_range", ctypes.c_void_p),
        ("cumulative_stats", ctypes.c_void_p),
        ("wait_cost_stats", ctypes.c_void_p),
    ]


class LLCombineParams(ctypes.Structure):
    _fields_ = [
        ("slot", LLSlot),
        ("x", ctypes.c_void_p),
        ("src_info", ctypes.c_void_p),
        ("layout_range", ctypes.c_void_p),
        ("topk_idx", ctypes.c_void_p),
        ("topk_weights", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("num_tokens", ctypes.c_int32),
        ("num_topk", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("max_tokens", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("zero_copy", ctypes.c_int32),
        ("wait_cost_stats", ctypes.c_void_p),
    ]


class _DeviceMemory:
    """Raw device bytes as a torch tensor (through the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _device_bytes(ptr: int, nbytes: int) -> torch.Tensor:
    return torch.as_tensor(_DeviceMemory(ptr, nbytes), device="cuda")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NvshmemLowLatency:
    """comm: the Buffer's collectives (bootstrap, timed barriers); num_rdma_bytes: the
    symmetric buffer (`rdma_size_hint`); timeout: how long any wait on a peer may take."""

    def __init__(self, comm: Collectives, num_rdma_bytes: int, timeout: timedelta) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.timeout = timeout.total_seconds()
        self.num_rdma_bytes = num_rdma_bytes
        self.slot_signal_bytes = _aligned(8 * (2 * MAX_EXPERTS + self.size))
        control_bytes = 2 * self.slot_signal_bytes + ALIGN  # + the failure word
        self.lib = nvshmem.initialize(comm, num_rdma_bytes + control_bytes)
        step = "low-latency Buffer(): nvshmem_malloc"
        self.data = nvshmem.collective(comm, step, self.lib.ep_ll_malloc, num_rdma_bytes)
        self.control = nvshmem.collective(comm, step, self.lib.ep_ll_malloc, control_bytes)
        if not self.data or not self.control:
            for allocation in (self.data, self.control):
                if allocation:
                    self._free(allocation)
            raise nvshmem.NvshmemUnavailable(
                f"nvshmem_malloc of {num_rdma_bytes} + {control_bytes} bytes failed on rank "
                f"{self.rank} (NVSHMEM_SYMMETRIC_SIZE is the heap per PE)"
            )
        self.control_bytes = control_bytes
        device = torch.device("cuda", torch.cuda.current_device())
        self.words = torch.zeros(2 * WORDS_PER_SLOT + 1, dtype=torch.int32, device=device)
        self.expert_counters = torch.zeros(2, MAX_EXPERTS, dtype=torch.int32, device=device)
        self.error_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.status = torch.zeros(STATUS_INTS, dtype=torch.int32, pin_memory=True)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.half = num_rdma_bytes // 2 // ALIGN * ALIGN

    def _slot(self, slot: int, send_bytes: int) -> LLSlot:
        signals = self.control + slot * self.slot_signal_bytes
        words = self.words.data_ptr() + 4 * WORDS_PER_SLOT * slot
        send = self.data + slot * self.half
        return LLSlot(
            rank=self.rank,
            num_ranks=self.size,
            timeout_ns=int(self.timeout * 1e9),
            send=send,
            recv=send + send_bytes,
            dispatch_counts=signals,
            combine_flags=signals + 8 * MAX_EXPERTS,
            acks=signals + 16 * MAX_EXPERTS,
            failed=self.control + 2 * self.slot_signal_bytes,
            use=words,
            done=words + 4,
            recorded=self.words.data_ptr() + 4 * 2 * WORDS_PER_SLOT,
            error_flag=self.error_flag.data_ptr(),
            status=self.status.data_ptr(),
        )

    def _layout(self, max_tokens: int, hidden: int, num_experts: int) -> int:
        """A slot's send area bytes for this call; ValueError if the buffer is too small."""
        if num_experts > MAX_EXPERTS:
            raise ValueError(
                f"the low-latency cuda backend has signals for {MAX_EXPERTS} experts, "
                f"got num_experts={num_experts}"
            )
        send, recv = slot_bytes(max_tokens, hidden, num_experts)
        if 2 * (send + recv) > self.num_rdma_bytes:
            raise ValueError(
                f"low-latency buffers for num_max_dispatch_tokens_per_rank={max_tokens}, "
                f"hidden={hidden}, num_experts={num_experts} need {2 * (send + recv)} bytes, "
                f"num_rdma_bytes={self.num_rdma_bytes} "
                "(Buffer.get_low_latency_rdma_size_hint)"
            )
        return send

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(
                f"launching the low-latency {what} kernel failed (CUDA error {status})"
            )

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def _sent(self, launch_receive, params, what: str, tensors: tuple):
        """The `receive()` of a send just enqueued on the current stream: it enqueues the
        receive kernel on the stream current when it is called, after the send (the receive
        reads what the send's last block wrote), keeping `tensors` alive until then."""
        sent_on, sent = torch.cuda.current_stream(), torch.cuda.Event()
        sent.record(sent_on)

        def receive() -> None:
            stream = torch.cuda.current_stream()
            if stream != sent_on:
                stream.wait_event(sent)
                for tensor in tensors:
                    if isinstance(tensor, torch.Tensor):
                        tensor.record_stream(stream)
            self._check(launch_receive(ctypes.byref(params), stream.cuda_stream), what)

        return receive

    def dispatch_send(self, slot: int, call, out):
        """call: a LowLatencyDispatchCall; `out` (a LowLatencyReceive) is filled by the
        returned `receive()`."""
        x, topk_idx, num_experts = call.x, call.topk_idx, call.num_experts
        num_max_dispatch_tokens_per_rank = call.num_max_dispatch_tokens_per_rank
        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats = call.stats
        hidden = x.shape[1]
        send_bytes = self._layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        p = LLDispatchParams(
            slot=self._slot(slot, send_bytes),
            x=x.data_ptr(),
            topk_idx=topk_idx.data_ptr(),
            expert_counters=self.expert_counters[slot].data_ptr(),
            num_tokens=x.shape[0],
            num_topk=topk_idx.shape[1],
            hidden=hidden,
            max_tokens=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts,
            use_fp8=int(call.use_fp8),
            round_scale=int(call.round_scale),
            use_ue8m0=int(call.use_ue8m0),
            message_bytes=message_bytes(hidden),
            recv_x=out.x.data_ptr(),
            recv_scales=_ptr(out.scales),
            recv_count=out.count.data_ptr(),
            recv_src_info=out.src_info.data_ptr(),
            recv_layout_range=out.layout_range.data_ptr(),
            cumulative_stats=_ptr(cumulative_local_expert_recv_stats),
            wait_cost_stats=_ptr(dispatch_wait_recv_cost_stats),
        )
        self._check(
            self.lib.ep_ll_dispatch_send(ctypes.byref(p), self._stream(), self.num_sms), "dispatch"
        )
        stats = (cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
        outputs = (out.x, out.scales, out.count, out.src_info, out.layout_range)
        tensors = (x, topk_idx, *stats, *outputs)
        return self._sent(self.lib.ep_ll_dispatch_recv, p, "dispatch", tensors)

    def combine_send(self, slot: int, call, out):
        """call: a LowLatencyCombineCall (x is the combine_buffer view when zero_copy); out
        [n, H] bf16 is filled by the returned `receive()`."""
        x, topk_idx, topk_weights, handle = call.x, call.topk_idx, call.topk_weights, call.handle
        combine_wait_recv_cost_stats = call.combine_wait_recv_cost_stats
        T, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
        send_bytes = self._layout(T, hidden, handle.num_experts)
        p = LLCombineParams(
            slot=self._slot(slot, send_bytes),
            x=x.data_ptr(),
            src_info=handle.src_info.data_ptr(),
            layout_range=handle.layout_range.data_ptr(),
            topk_idx=topk_idx.data_ptr(),
            topk_weights=topk_weights.data_ptr(),
            out=out.data_ptr(),
            num_tokens=topk_idx.shape[0],
            num_topk=topk_idx.shape[1],
            hidden=hidden,
            max_tokens=T,
            num_experts=handle.num_experts,
            zero_copy=int(call.zero_copy),
            wait_cost_stats=_ptr(combine_wait_recv_cost_stats),
        )
        self._check(self.lib.ep_ll_combine_send(ctypes.byref(p), self._stream()), "combine")
        tensors = (x, topk_idx, topk_weights, *handle[:2], combine_wait_recv_cost_stats, out)
        return self._sent(self.lib.ep_ll_combine_recv, p, "combine", tensors)

    def combine_buffer(self, slot: int, handle) -> torch.Tensor:
        """bf16 [E_local, R*T, H]: slot's send area, which a zero-copy combine on `slot` reads."""
        T, hidden, num_experts = (
            handle.num_max_dispatch_tokens_per_rank,
            handle.hidden,
            handle.num_experts,
        )
        self._layout(T, hidden, num_experts)
        nbytes = num_experts * T * 2 * hidden
        view = _device_bytes(self.data + slot * self.half, nbytes).view(torch.bfloat16)
        return view.view(num_experts // self.size, self.size * T, hidden)

    def _quiet(self) -> None:
        """This rank's kernels have ended and everything they sent has landed (their last
        signals and acks are not followed by a quiet of their own)."""
        status = self.lib.ep_ll_quiet()
        if status != 0:
            raise RuntimeError(
                f"completing the low-latency kernels' sends failed (CUDA error {status})"
            )

    def _barrier(self, step: str) -> None:
        """After this rank's kernels: they may have waited on peers for a timeout."""
        self.comm.all_gather(step, torch.zeros(1, dtype=torch.int32), self.comm.device_timeout)

    def clean(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Collective: forget every signal, ack and failure (no kernel may be in flight)."""
        self._layout(max_tokens, hidden, num_experts)
        self._quiet()
        self._barrier("clean_low_latency_buffer: every rank's kernels finished")
        _device_bytes(self.control, self.control_bytes).zero_()
        for t in (self.words, self.expert_counters, self.error_flag, self.status):
            t.zero_()
        torch.cuda.synchronize()
        self._barrier("clean_low_latency_buffer: every rank reset its signals")

    def failure(self) -> str | None:
        step, peer, expert, failed_rank, *_ = self.status.tolist()
        if not step:
            return None
        where = f"ep_comm rank {self.rank}/{self.size}: low-latency {STEPS[step]}"
        waited = f"rank {peer}" + (f" (expert {expert})" if expert >= 0 else "")
        advice = "clean_low_latency_buffer() or a new Buffer is needed"
        if failed_rank == self.rank:
            return f"{where} timed out after {self.timeout:g} s waiting for {waited}; {advice}"
        return f"{where} gave up waiting for {waited}: rank {failed_rank} timed out; {advice}"

    def destroy(self) -> None:
        """Collective: no rank frees what a peer may still write."""
        if not self.data:
            return
        self._quiet()
        self._barrier("low-latency Buffer.destroy(): every rank's kernels finished")
        self._free(self.control)
        self._free(self.data)
        self.data = self.control = None

    def _free(self, allocation: int) -> None:
        step = "low-latency Buffer.destroy(): nvshmem_free"
        nvshmem.collective(self.comm, step, self.lib.ep_ll_free, allocation)
