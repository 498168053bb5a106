"""`Buffer`: DeepEP V1's expert-parallel communication object, normal (throughput) mode.

Arguments are checked on each rank and then compared across ranks before any data moves, so a
bad argument on one rank raises `ValueError` on all of them. See docs/ep-comm.md.
"""

from __future__ import annotations

import os
import socket
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_comm import checks
from ep_comm.collectives import Collectives
from ep_comm.config import CONTROL_BYTES, Config, recommended_config
from ep_comm.cuda_backend import MAX_RANKS, CudaExchange
from ep_comm.event import EventOverlap, capture
from ep_comm.exchange import DispatchInput
from ep_comm.handle import DispatchHandle
from ep_comm.layout import dispatch_layout
from ep_comm.streams import CommStream
from ep_comm.torch_backend import TorchExchange

BACKENDS = ("auto", "cuda", "torch")


def _why_not_cuda(num_nvl_bytes: int, num_ranks: int) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if num_ranks > MAX_RANKS:
        return f"it runs at most {MAX_RANKS} ranks (one host), the group has {num_ranks}"
    if num_nvl_bytes <= CONTROL_BYTES:
        return (
            f"num_nvl_bytes={num_nvl_bytes} leaves no room for its rings "
            "(Config.get_nvl_buffer_size_hint)"
        )
    try:
        from ep_comm.extension import load_extension

        load_extension()
    except Exception as error:  # a missing toolkit, a failed build: the torch backend still works
        return f"the cuda backend's extension did not build ({error})"
    return None


class Buffer:
    """Dispatch tokens to the ranks holding their experts, and combine the results back.

    group: the expert-parallel process group (gloo or NCCL); every rank constructs its Buffer
        together, like a collective.
    num_nvl_bytes: intranode buffer bytes for the `cuda` backend
        (`Config.get_nvl_buffer_size_hint`); unused by the `torch` backend.
    num_rdma_bytes, low_latency_mode: internode and low-latency modes are not in this version:
        0 and False only.
    backend: "auto" (default, or $EP_COMM_BACKEND), "cuda" or "torch"; `Buffer.backend` says
        which runs. "auto" takes "cuda" when every rank has CUDA, all ranks are on one host,
        there are at most 8 ranks, num_nvl_bytes leaves room for rings and the extension
        builds; otherwise "torch".
    timeout: how long a rank waits for the others in any step (host or GPU) before raising
        `EPCommError`; the cuda backend raises a timeout inside its kernels on the next call.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        *,
        backend: str | None = None,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        if num_rdma_bytes != 0 or low_latency_mode:
            raise ValueError(
                "ep-comm 0.1 has the intranode normal mode only: num_rdma_bytes must be 0 and "
                "low_latency_mode False"
            )
        if num_nvl_bytes < 0:
            raise ValueError(f"num_nvl_bytes must be >= 0, got {num_nvl_bytes}")
        del num_qps_per_rank  # RDMA queue pairs: internode only
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = 0
        self.low_latency_mode = False
        requested = backend or os.environ.get("EP_COMM_BACKEND", "auto")
        if requested not in BACKENDS:
            raise ValueError(f"unknown ep_comm backend {requested!r}; expected one of {BACKENDS}")
        self._comm = Collectives(group, timeout)
        self.backend = self._choose_backend(requested, num_nvl_bytes)
        self._impl = (
            CudaExchange(self._comm, num_nvl_bytes, timeout)
            if self.backend == "cuda"
            else TorchExchange(self._comm)
        )
        self._streams = CommStream()

    def _choose_backend(self, requested: str, num_nvl_bytes: int) -> str:
        """The same answer on every rank: cuda only if it can run on all of them."""
        reason = None if requested == "torch" else _why_not_cuda(num_nvl_bytes, self.group_size)
        host = zlib.crc32(socket.gethostname().encode())
        local = torch.tensor([reason is None, host], dtype=torch.int64)
        everyone = self._comm.all_gather("Buffer(): choose the backend", local)
        one_host = bool((everyone[:, 1] == everyone[0, 1]).all())
        cuda_everywhere = bool(everyone[:, 0].all()) and one_host
        if requested == "cuda" and not cuda_everywhere:
            why = reason or ("the ranks span several hosts" if not one_host else None)
            why = why or "another rank cannot run it"
            raise ValueError(f"backend 'cuda' was requested but {why}")
        return "cuda" if requested != "torch" and cuda_everywhere else "torch"

    def destroy(self) -> None:
        """Free the cuda backend's buffers now (else they live until the process exits)."""
        if self.backend == "cuda":
            self._impl.destroy()

    def _device_problem(self, x) -> str | None:
        on_cuda = isinstance(x, torch.Tensor) and x.is_cuda
        if self.backend == "cuda" and not on_cuda:
            return "the cuda backend moves CUDA tensors; x is not on a CUDA device"
        return None

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs the `cuda` backend's normal-mode kernels use (even, as in DeepEP)."""
        Config(num_sms=new_num_sms)  # raises ValueError for a bad count
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return capture()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return recommended_config("dispatch", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return recommended_config("combine", num_ranks, Buffer.num_sms)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Local counts for `dispatch`, no communication.

        topk_idx: `[num_tokens, num_topk]` int64, expert ids in [0, num_experts) or -1.
        Returns num_tokens_per_rank `[num_ranks]` int32, None (no RDMA ranks),
        num_tokens_per_expert `[num_experts]` int32, is_token_in_rank `[num_tokens, num_ranks]`
        bool, and an EventOverlap.
        """
        checks.check_topk(topk_idx, None, num_experts, self.group_size, None)
        if not _capturing():
            checks.check_expert_ids(topk_idx, num_experts)

        def work():
            per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
            return per_rank, None, per_expert, in_rank

        return self._streams.run(
            work, (topk_idx,), previous_event, async_finish, allocate_on_comm_stream
        )

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each token once to every rank holding one of its experts.

        x: `[num_tokens, hidden]` bf16, or (`[num_tokens, hidden]` float8_e4m3fn,
            `[num_tokens, hidden / 128]` fp32 scales).
        With `handle` (from an earlier dispatch): the same layout again, x only; returns
        (recv_x, None, None, None, None, event).
        Otherwise: num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert from
        `get_dispatch_layout`; topk_idx / topk_weights `[num_tokens, num_topk]` (int64 / fp32)
        optional. Returns recv_x (rows grouped by source rank, in source order; a tuple for
        FP8), recv_topk_idx (local expert ids, -1 for experts on other ranks), recv_topk_weights
        (0 where recv_topk_idx is -1), the received tokens per local expert as a list aligned
        up to `expert_alignment` (empty with `num_worst_tokens`), the handle and an event.
        num_worst_tokens > 0: outputs have that many rows (-1 / 0 padded past the received
        count, which the handle's `actual_num_recv_tokens` holds).
        """
        del num_tokens_per_rdma_rank  # internode only
        config = config or self.get_dispatch_config(self.group_size)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        cached = handle is not None
        problem = checks.problem_of(
            checks.check_dispatch,
            x,
            x_scales,
            handle,
            num_tokens_per_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
            self.group_size,
            not _capturing(),
        ) or self._device_problem(x)
        num_experts = handle.num_experts if cached else _last_dim(num_tokens_per_expert)
        if problem is None and self.backend == "cuda":
            problem = self._impl.dispatch_problem(
                x, x_scales, topk_idx, topk_weights, config, handle, num_experts
            )
        signature = {
            "hidden": _last_dim(x),
            "x dtype": str(getattr(x, "dtype", type(x).__name__)),
            "FP8 scales": x_scales is not None,
            "cached handle": cached,
            "num_experts": num_experts,
            "num_topk": _last_dim(topk_idx),
            "num_worst_tokens": num_worst_tokens,
            "config": repr(config),
        }
        self._comm.agree("dispatch: check arguments", signature, problem, self._impl.failure())

        inputs = (x, x_scales, topk_idx, topk_weights)
        if cached:

            def cached_work():
                recv_x, recv_x_scales = self._impl.dispatch_cached(x, x_scales, handle, config)
                received = recv_x if x_scales is None else (recv_x, recv_x_scales)
                return received, None, None, None, None

            return self._streams.run(
                cached_work, inputs, previous_event, async_finish, allocate_on_comm_stream
            )
        inp = DispatchInput(
            x,
            x_scales,
            topk_idx,
            topk_weights,
            num_tokens_per_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            expert_alignment,
            num_worst_tokens,
        )

        def work():
            out = self._impl.dispatch(inp, config)
            return (
                out.recv_x if x_scales is None else (out.recv_x, out.recv_x_scales),
                out.recv_topk_idx,
                out.recv_topk_weights,
                out.num_recv_tokens_per_expert,
                out.handle,
            )

        return self._streams.run(
            work, inputs, previous_event, async_finish, allocate_on_comm_stream
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Sum each token's rows back from the ranks it was dispatched to (no weights applied).

        x: `[num_recv_tokens, hidden]` bf16, in the order `dispatch` returned them; typically
            each row is the sum of its local experts' outputs times their weights.
        topk_weights: `[num_recv_tokens, num_topk]` fp32, summed the same way (optional).
        bias: zero, one or two `[num_tokens, hidden]` bf16 tensors added to the result.
        Returns combined_x `[num_tokens, hidden]` bf16, combined_topk_weights (or None), event.
        """
        config = config or self.get_combine_config(self.group_size)
        biases = [] if bias is None else list(bias) if isinstance(bias, tuple) else [bias]
        problem = checks.problem_of(checks.check_combine, x, handle, topk_weights, biases)
        problem = problem or self._device_problem(x)
        if problem is None and self.backend == "cuda":
            problem = self._impl.combine_problem(x, topk_weights, config, handle)
        signature = {
            "hidden": _last_dim(x),
            "x dtype": str(getattr(x, "dtype", type(x).__name__)),
            "topk_weights given": topk_weights is not None,
            "config": repr(config),
        }
        self._comm.agree("combine: check arguments", signature, problem, self._impl.failure())
        return self._streams.run(
            lambda: self._impl.combine(x, handle, topk_weights, biases, config),
            (x, topk_weights, *biases),
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _last_dim(tensor) -> int | None:
    """The size compared across ranks; None for what is not a tensor (its rank reports that)."""
    return int(tensor.shape[-1]) if isinstance(tensor, torch.Tensor) and tensor.dim() else None
