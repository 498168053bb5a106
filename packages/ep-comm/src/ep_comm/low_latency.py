"""The low-latency (LL) mode: DeepEP V1's `low_latency_dispatch` and `low_latency_combine`.

Decode-sized batches of at most T (`num_max_dispatch_tokens_per_rank`) tokens per rank. Every
(token, k) pair with an expert is one message to the expert's rank, which places it in a
fixed-shape output `[E_local, R * T, H]`; combine returns each row to its source and sums a
token's k results there. This module is the mode's side that both backends share: the argument
checks that all ranks agree on, the hook and double-buffer protocol, the outputs' allocation. A
backend (`low_latency_backend.LowLatencyBackend`) moves the data: `torch_low_latency` over
torch.distributed, `cuda_low_latency` over NVSHMEM. See docs/ep-comm.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from ep_comm import checks
from ep_comm import low_latency_checks as llchecks
from ep_comm.collectives import Collectives
from ep_comm.config import SCALE_BLOCK
from ep_comm.event import EventOverlap
from ep_comm.exchange import last_dim
from ep_comm.low_latency_backend import (
    LowLatencyBackend,
    LowLatencyCombineCall,
    LowLatencyDispatchCall,
    LowLatencyHandle,
    LowLatencyReceive,
    rdma_size_hint,
)
from ep_comm.streams import CommStream
from ep_comm.torch_low_latency import TorchLowLatency


def low_latency_backend(
    name: str, comm: Collectives, num_rdma_bytes: int, timeout: timedelta
) -> LowLatencyBackend:
    """The LL backend called `name` ("torch" or "cuda"); collective, as Buffer() is."""
    if name == "torch":
        return TorchLowLatency(comm)
    if name == "cuda":
        try:
            from ep_comm.cuda_low_latency import NvshmemLowLatency
        except Exception as error:  # not installed or not built: say so, not a traceback
            raise ValueError(
                f"the cuda backend's low-latency mode is not available ({error})"
            ) from error
        if num_rdma_bytes <= 0:
            raise ValueError(
                "the cuda backend's low-latency mode needs num_rdma_bytes > 0 "
                "(Buffer.get_low_latency_rdma_size_hint)"
            )
        return NvshmemLowLatency(comm, num_rdma_bytes, timeout)
    raise ValueError(f"unknown low-latency backend {name!r}; expected 'torch' or 'cuda'")


# The common layer -----------------------------------------------------------------------------


@dataclass
class _PendingReceive:
    """An LL op issued with return_recv_hook=True, until its hook runs."""

    op: str  # "low_latency_dispatch" or "low_latency_combine"
    call: int  # its number among the buffer's LL calls since the last clean
    receive: Callable[[], None]
    state: str = "pending"  # then "received", or "cleaned" by clean_low_latency_buffer

    def hook(self) -> None:
        if self.state != "pending":
            why = "was already called" if self.state == "received" else "expired"
            raise ValueError(
                f"the receive hook of {self.op} (LL call {self.call}) {why}: a hook runs once, "
                "before the buffer is cleaned"
            )
        self.state = "received"
        self.receive()


class LowLatencyMode:
    """What `Buffer`'s low-latency methods delegate to (their docstrings describe the calls).

    Every call checks its arguments, then all ranks agree on them (and on any earlier backend
    failure) before anything moves, so a problem on one rank raises on all. Two buffers
    alternate, one per call: op k + 2 reuses op k's, so op k's receive hook must have run by then.
    """

    def __init__(
        self,
        comm: Collectives,
        backend: str,
        num_rdma_bytes: int,
        timeout: timedelta,
        streams: CommStream,
    ) -> None:
        self.comm = comm
        self.backend = backend
        self.num_rdma_bytes = num_rdma_bytes
        self.impl = low_latency_backend(backend, comm, num_rdma_bytes, timeout)
        # the torch backend runs where its first call's tensors are (CPU with gloo, or CUDA)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else None
        )
        self._streams = streams
        self._slot = 0
        self._calls = 0
        self._pending: list[_PendingReceive | None] = [None, None]
        self._layout: tuple[int, int, int] | None = None  # (T, H, E) since the last clean
        self._staged_for: int | None = None  # the call the zero-copy buffer was handed out for

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        step = "low_latency_dispatch"
        call = LowLatencyDispatchCall(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            use_fp8,
            round_scale,
            use_ue8m0,
        )
        tokens = num_max_dispatch_tokens_per_rank
        hidden = int(x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() == 2 else None
        problem = checks.problem_of(self._check_dispatch, call, async_finish, return_recv_hook)
        signature = {
            "num_topk": last_dim(topk_idx),
            "use_fp8": bool(use_fp8),
            "round_scale": bool(round_scale),
            "use_ue8m0": bool(use_ue8m0),
            "async_finish": bool(async_finish),
            "return_recv_hook": bool(return_recv_hook),
        }
        out, failure = None, None
        if problem is None:
            receive = (tokens, x, num_experts, use_fp8, use_ue8m0)
            out, failure = self.comm.allocated(step, self._allocate_receive, *receive)
        slot = self._agree(step, (tokens, hidden, num_experts), problem, signature, x, failure)
        outputs = (out.x, out.scales, out.count, out.src_info, out.layout_range)
        tensors = (x, topk_idx, *call.stats, *outputs)
        send = functools.partial(self.impl.dispatch_send, slot, call, out)
        event, hook = self._run(step, slot, send, tensors, async_finish, return_recv_hook)
        recv_x = (out.x, out.scales) if use_fp8 else out.x
        handle = LowLatencyHandle(out.src_info, out.layout_range, tokens, hidden, num_experts)
        return recv_x, out.count, handle, event, hook

    def combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        step = "low_latency_combine"
        call = LowLatencyCombineCall(
            x, topk_idx, topk_weights, handle, zero_copy, combine_wait_recv_cost_stats
        )
        problem = checks.problem_of(
            self._check_combine, call, use_logfmt, async_finish, return_recv_hook, out
        )
        layout = tuple(handle[2:]) if isinstance(handle, LowLatencyHandle) else (None,) * 3
        signature = {
            "num_topk": last_dim(topk_idx),
            "zero_copy": bool(zero_copy),
            "async_finish": bool(async_finish),
            "return_recv_hook": bool(return_recv_hook),
        }
        failure = None
        if problem is None and out is None:
            shape = (topk_idx.shape[0], handle.hidden)
            kind = dict(dtype=torch.bfloat16, device=x.device)
            out, failure = self.comm.allocated(step, torch.empty, shape, **kind)
        slot = self._agree(step, layout, problem, signature, x, failure)
        send = functools.partial(self.impl.combine_send, slot, call, out)
        tensors = (x, topk_idx, topk_weights, *handle[:2], combine_wait_recv_cost_stats, out)
        event, hook = self._run(step, slot, send, tensors, async_finish, return_recv_hook)
        return out, event, hook

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective. Pending receive hooks expire; the next calls take this (T, H, E)."""
        step = "clean_low_latency_buffer"
        layout = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        problem = checks.problem_of(llchecks.check_layout, *layout, self.comm.size)
        problem = problem or self._size_problem(*layout)
        signature = dict(
            zip(("T", "hidden", "num_experts"), map(llchecks.int_or_none, layout), strict=True)
        )
        # no backend failure here: cleaning is how a buffer recovers from one
        self.comm.agree(f"{step}: check arguments", signature, problem)
        for pending in self._pending:
            if pending is not None and pending.state == "pending":
                pending.state = "cleaned"
        self._pending = [None, None]
        self._slot, self._calls, self._layout = 0, 0, layout
        self._staged_for = None
        self.impl.clean(*layout)

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A BF16 `[E_local, R * T, H]` view the next low_latency_combine reads with zero_copy."""
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(_handle_problem(handle))
        problem = self._size_problem(*handle[2:])
        if problem:
            raise ValueError(problem)
        self._staged_for = self._calls
        return self.impl.combine_buffer(self._slot, handle)

    def destroy(self) -> None:
        self.impl.destroy()

    def _check_dispatch(self, call: LowLatencyDispatchCall, async_finish, return_recv_hook) -> None:
        x, topk_idx, tokens = call.x, call.topk_idx, call.num_max_dispatch_tokens_per_rank
        num_experts, use_ue8m0 = call.num_experts, call.use_ue8m0
        cumulative_stats, wait_stats = call.stats
        num_ranks = self.comm.size
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a [num_tokens, hidden] bf16 tensor")
        checks.check_tensor("x", x, torch.bfloat16, (None, None), x.device)
        if use_ue8m0 and not (call.use_fp8 and call.round_scale):
            raise ValueError("use_ue8m0 needs use_fp8=True and round_scale=True")
        llchecks.check_layout(tokens, x.shape[1], num_experts, num_ranks, use_ue8m0)
        llchecks.check_topk(topk_idx, x.shape[0], tokens, x.device)
        llchecks.check_flags(async_finish, return_recv_hook)
        local_experts = num_experts // num_ranks
        name = "cumulative_local_expert_recv_stats"
        llchecks.check_stats(name, cumulative_stats, torch.int32, local_experts, x.device)
        name = "dispatch_wait_recv_cost_stats"
        llchecks.check_stats(name, wait_stats, torch.int64, num_ranks, x.device)
        self._check_device(x.device)
        llchecks.check_expert_values(topk_idx, num_experts)

    def _check_combine(
        self, call: LowLatencyCombineCall, use_logfmt, async_finish, return_recv_hook, out
    ) -> None:
        x, topk_idx, topk_weights, handle = call.x, call.topk_idx, call.topk_weights, call.handle
        wait_stats = call.combine_wait_recv_cost_stats
        num_ranks = self.comm.size
        if use_logfmt:
            raise ValueError("use_logfmt=True is not supported in this version")
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(_handle_problem(handle))
        tokens, hidden, num_experts = handle[2:]
        llchecks.check_layout(tokens, hidden, num_experts, num_ranks)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a tensor, got {type(x).__name__}")
        shape = (num_experts // num_ranks, num_ranks * tokens, hidden)
        checks.check_tensor("x", x, torch.bfloat16, shape, x.device)
        llchecks.check_topk(topk_idx, None, tokens, x.device)
        num_tokens, num_topk = topk_idx.shape
        shape = (num_tokens, num_topk)
        checks.check_tensor("topk_weights", topk_weights, torch.float32, shape, x.device)
        if out is not None:
            checks.check_tensor("out", out, torch.bfloat16, (num_tokens, hidden), x.device)
        llchecks.check_stats(
            "combine_wait_recv_cost_stats", wait_stats, torch.int64, num_ranks, x.device
        )
        llchecks.check_flags(async_finish, return_recv_hook)
        self._check_device(x.device)
        llchecks.check_expert_values(topk_idx, num_experts)
        if call.zero_copy and self._staged_for != self._calls:
            raise ValueError(
                "zero_copy=True reads what was written into get_next_low_latency_combine_buffer"
                "(handle), which must come right before this call: "
                + (
                    "it was never called"
                    if self._staged_for is None
                    else "another low-latency op ran in between, on the other buffer"
                )
            )

    def _check_device(self, device: torch.device) -> None:
        if self.device is not None and device != self.device:
            raise ValueError(f"x is on {device}, this buffer's low-latency mode on {self.device}")

    def _size_problem(self, tokens, hidden, num_experts) -> str | None:
        if self.backend != "cuda":
            return None  # the torch backend allocates per call
        need = rdma_size_hint(tokens, hidden, self.comm.size, num_experts)
        if self.num_rdma_bytes >= need:
            return None
        return (
            f"num_rdma_bytes={self.num_rdma_bytes} is smaller than get_low_latency_rdma_size_hint("
            f"{tokens}, {hidden}, {self.comm.size}, {num_experts}) = {need}"
        )

    def _protocol_problem(self, step: str, layout: tuple) -> str | None:
        """The double-buffer rule, the fixed (T, H, E) and the buffer's size."""
        pending = self._pending[self._slot]
        if pending is not None and pending.state == "pending":
            return (
                f"{step}: the {pending.op} two calls back (LL call {pending.call}), on the same "
                "buffer, has not had its receive hook called; call it before issuing a third LL op"
            )
        if self._layout is not None and layout != self._layout:
            return (
                f"{step}: (num_max_dispatch_tokens_per_rank, hidden, num_experts) = {layout} "
                f"differs from {self._layout} of the earlier LL calls on this buffer; call "
                "clean_low_latency_buffer with the new values on every rank first"
            )
        return self._size_problem(*layout)

    def _agree(self, step: str, layout: tuple, problem, signature: dict, x, failure) -> int:
        """All ranks agree on the call (failure: this rank's allocation of its outputs failed);
        returns the buffer slot it uses."""
        if problem is None:
            problem = self._protocol_problem(step, layout)
        signature = {
            "op": step,
            "slot": self._slot,
            "num_max_dispatch_tokens_per_rank": llchecks.int_or_none(layout[0]),
            "hidden": llchecks.int_or_none(layout[1]),
            "num_experts": llchecks.int_or_none(layout[2]),
            **signature,
        }
        failure = self.impl.failure() or failure
        self.comm.agree(f"{step}: check arguments", signature, problem, failure)
        if self.device is None:
            self.device = x.device
        self._layout = layout
        slot, self._slot = self._slot, 1 - self._slot
        self._calls += 1
        return slot

    def _allocate_receive(
        self, tokens: int, x: torch.Tensor, num_experts: int, use_fp8: bool, use_ue8m0: bool
    ) -> LowLatencyReceive:
        num_ranks, device, hidden = self.comm.size, self.device or x.device, x.shape[1]
        local_experts, rows = num_experts // num_ranks, num_ranks * tokens
        dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        x = torch.empty((local_experts, rows, hidden), dtype=dtype, device=device)
        scales = None
        if use_fp8:
            per_scale = SCALE_BLOCK * (llchecks.UE8M0_PER_INT if use_ue8m0 else 1)
            scale_dtype = torch.int32 if use_ue8m0 else torch.float32
            shape = (local_experts, hidden // per_scale, rows)
            scales = torch.empty(shape, dtype=scale_dtype, device=device).transpose(1, 2)
        return LowLatencyReceive(
            x=x,
            scales=scales,
            count=torch.zeros(local_experts, dtype=torch.int32, device=device),
            src_info=torch.empty((local_experts, rows), dtype=torch.int32, device=device),
            layout_range=torch.empty((local_experts, num_ranks), dtype=torch.int64, device=device),
        )

    def _run(
        self,
        step: str,
        slot: int,
        send: Callable[[], Callable[[], None]],
        tensors: tuple,
        async_finish: bool,
        return_recv_hook: bool,
    ) -> tuple[EventOverlap, Callable[[], None] | None]:
        """With a hook: the send on the current stream, the receive when the hook is called.
        Else both on the communication stream, which the current stream then waits for unless
        async_finish (the event keeps `tensors` alive)."""
        if return_recv_hook:
            pending = _PendingReceive(step, self._calls, send())
            self._pending[slot] = pending
            return EventOverlap(), pending.hook

        def send_and_receive() -> tuple:
            send()()
            return ()

        (event,) = self._streams.run(send_and_receive, tensors, None, async_finish, False)
        return event, None


def _handle_problem(handle) -> str:
    got = type(handle).__name__
    return f"handle must be the LowLatencyHandle low_latency_dispatch returned, got {got}"
