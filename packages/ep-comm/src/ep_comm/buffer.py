"""`Buffer`: DeepEP V1's expert-parallel communication object, normal (throughput) mode.

Arguments are checked on each rank and then compared across ranks before any data moves, so a
bad argument on one rank raises `ValueError` on all of them. See docs/ep-comm.md.
"""

from __future__ import annotations

import os
import socket
import warnings
import zlib
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_comm import checks, cuda_backend
from ep_comm.collectives import Collectives
from ep_comm.config import CONTROL_BYTES, Config, recommended_config
from ep_comm.cuda_backend import MAX_RANKS, CudaExchange
from ep_comm.event import EventOverlap, capture
from ep_comm.exchange import DispatchInput, Exchange, last_dim
from ep_comm.handle import DispatchHandle
from ep_comm.layout import dispatch_layout
from ep_comm.low_latency import LowLatencyMode
from ep_comm.low_latency_backend import LowLatencyHandle, rdma_size_hint
from ep_comm.streams import CommStream
from ep_comm.torch_backend import TorchExchange

BACKENDS = ("auto", "cuda", "torch")
UUID_BYTES = 48  # a GPU UUID as text, padded


def shared_nvshmem_problem(votes: torch.Tensor) -> str | None:
    """Why the ranks cannot run NVSHMEM together, from each rank's vote `[ranks, 2]`: whether
    it can run NVSHMEM here, and the NVSHMEM world it runs in (`nvshmem.world`, 0: none yet).
    None where they can: every one starts it, or all run in one world."""
    if not votes[:, 0].all():
        return "another rank cannot run it"
    if len(set(votes[:, 1].tolist())) > 1:
        return (
            "the ranks' processes are not those NVSHMEM started with (a rank was replaced; "
            "NVSHMEM starts once per process)"
        )
    return None


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
        there are at most 8 ranks, num_nvl_bytes leaves room for rings, the extension builds and
        every rank can open every other rank's GPU memory (the peer's GPU visible in the
        process, peer access between different GPUs); otherwise "torch", with a warning saying
        why (`Buffer.why_not_cuda`).
    timeout: how long a rank waits for the others in any step (host or GPU) before raising
        `EPCommError`; host steps that follow kernels which may have waited on peers
        (`raise_if_failed`, `reset`, a dispatch's counts) wait 2 x timeout + 5 s.

    Failures: a call that synchronizes with the host raises `EPCommError` on every rank. One
    that cannot (a CUDA-graph replay, `async_finish`, a combine) poisons its outputs instead:
    NaN values, -1 indices, `error_flag` nonzero; the next call (or `raise_if_failed`) raises
    on every rank. A failed buffer stays failed until `reset()`.
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
        if num_rdma_bytes < 0:
            raise ValueError(f"num_rdma_bytes must be >= 0, got {num_rdma_bytes}")
        if num_rdma_bytes and not low_latency_mode:
            raise ValueError(
                "num_rdma_bytes > 0 needs low_latency_mode=True: ep-comm has no internode "
                "normal mode"
            )
        if num_nvl_bytes < 0:
            raise ValueError(f"num_nvl_bytes must be >= 0, got {num_nvl_bytes}")
        del num_qps_per_rank  # RDMA queue pairs: internode only
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        requested = backend or os.environ.get("EP_COMM_BACKEND", "auto")
        if requested not in BACKENDS:
            raise ValueError(f"unknown ep_comm backend {requested!r}; expected one of {BACKENDS}")
        self.timeout = timeout
        self._comm = Collectives(group, timeout)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        if low_latency_mode and num_nvl_bytes == 0:  # DeepEP's low-latency-only buffer
            self.backend, self.why_not_cuda = "torch", "num_nvl_bytes is 0 (low-latency only)"
        else:
            self.backend, self.why_not_cuda = self._choose_backend(requested, num_nvl_bytes)
        self._impl = self._exchange()
        self._streams = CommStream()
        self.low_latency_backend = None
        if low_latency_mode:
            self.low_latency_backend = self._choose_low_latency_backend(requested)
        self._low_latency = self._low_latency_mode_impl()

    def _low_latency_mode_impl(self) -> LowLatencyMode | None:
        if not self.low_latency_mode:
            return None
        backend, rdma_bytes = self.low_latency_backend, self.num_rdma_bytes
        return LowLatencyMode(self._comm, backend, rdma_bytes, self.timeout, self._streams)

    def _choose_low_latency_backend(self, requested: str) -> str:
        """cuda (NVSHMEM) when every rank can build and load it, the same answer everywhere."""
        reason = "the torch backend was requested" if requested == "torch" else None
        if reason is None and not torch.cuda.is_available():
            reason = "CUDA is not available"
        if reason is None and self.num_rdma_bytes <= 0:
            reason = "num_rdma_bytes is 0 (Buffer.get_low_latency_rdma_size_hint)"
        world = 0
        if reason is None:
            try:
                from ep_comm import nvshmem

                nvshmem.load()
                reason = nvshmem.why_not_start(tuple(dist.get_process_group_ranks(self.group)))
                world = nvshmem.world()
            except Exception as error:  # no wheel, no toolkit, a failed build: torch still works
                reason = f"NVSHMEM is not usable here ({error})"
        votes = self._comm.all_gather(
            "Buffer(): choose the low-latency backend", torch.tensor([reason is None, world])
        )
        why = reason or shared_nvshmem_problem(votes)
        if why is None:
            return "cuda"
        if requested == "cuda":
            raise ValueError(f"backend 'cuda' was requested for low-latency mode but {why}")
        if requested == "auto" and torch.cuda.is_available():
            warnings.warn(f"ep_comm low-latency mode uses the torch backend: {why}", stacklevel=3)
        return "torch"

    def _exchange(self) -> Exchange:
        if self.backend == "cuda":
            return CudaExchange(self._comm, self.num_nvl_bytes, self.timeout)
        return TorchExchange(self._comm)

    def _choose_backend(self, requested: str, num_nvl_bytes: int) -> tuple[str, str | None]:
        """The same answer on every rank, and why not cuda: cuda only if every rank can run it
        and map every other rank's buffer."""
        reason = (
            "the torch backend was requested"
            if requested == "torch"
            else _why_not_cuda(num_nvl_bytes, self.group_size)
        )
        host = zlib.crc32(socket.gethostname().encode())
        uuid = str(torch.cuda.get_device_properties(self.device).uuid) if reason is None else ""
        local = torch.zeros(2 + UUID_BYTES // 8, dtype=torch.int64)
        local[:2] = torch.tensor([reason is None, host])
        local[2:] = torch.frombuffer(
            bytearray(uuid.encode().ljust(UUID_BYTES, b"\0")), dtype=torch.int64
        )
        everyone = self._comm.all_gather("Buffer(): choose the backend", local)
        one_host = bool((everyone[:, 1] == everyone[0, 1]).all())
        cuda_everywhere = False
        if not one_host:
            reason = reason or "the ranks span several hosts"
        elif bool(everyone[:, 0].all()):
            # every rank could run cuda; can each one open every peer's memory?
            uuids = [bytes(row[2:].numpy().tobytes()).rstrip(b"\0").decode() for row in everyone]
            reason = cuda_backend.peer_problem(uuids, self.rank)
            verdicts = self._comm.all_gather(
                "Buffer(): check peer access", torch.tensor([reason is None])
            )
            cuda_everywhere = bool(verdicts.all())
        why = None if cuda_everywhere else reason or "another rank cannot run it"
        if requested == "cuda" and not cuda_everywhere:
            raise ValueError(f"backend 'cuda' was requested but {why}")
        if requested == "auto" and not cuda_everywhere and torch.cuda.is_available():
            warnings.warn(f"ep_comm Buffer uses the torch backend: {why}", stacklevel=3)
        return ("cuda" if requested != "torch" and cuda_everywhere else "torch"), why

    def destroy(self) -> None:
        """Free the backends' memory now (else it lives until the process exits). Collective:
        every rank calls it; no rank frees memory a peer still maps."""
        self._impl.destroy()
        if self._low_latency is not None:
            self._low_latency.destroy()

    def reset(self) -> None:
        """Rebuild the backends after a failure (a timeout or an overflow poisons a buffer for
        good): collective, every rank calls it; the processes and the group stay. CUDA graphs
        captured with the old buffer must be captured again."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)  # this rank's kernels have given up or ended
        self.destroy()
        self._impl = self._exchange()
        self._low_latency = self._low_latency_mode_impl()

    @property
    def error_flag(self) -> torch.Tensor | None:
        """`[1]` int32 on the device, nonzero once a normal-mode call's outputs were poisoned
        (the cuda backend: 1 timeout, 2 overflow); None for the torch backend, whose calls
        raise. Low-latency mode has its own: `low_latency_error_flag`."""
        return self._impl.error_flag

    @property
    def low_latency_error_flag(self) -> torch.Tensor:
        """`[1]` int32, nonzero once a low-latency call's outputs were poisoned."""
        return self._low_latency_mode().impl.error_flag

    def failure(self) -> str | None:
        """This rank's record of a failed call that could not raise, or None (no communication;
        `raise_if_failed` tells every rank)."""
        failures = [self._impl.failure()]
        if self._low_latency is not None:
            failures.append(self._low_latency.impl.failure())
        return next((f for f in failures if f), None)

    def raise_if_failed(self) -> None:
        """Raise EPCommError on every rank if any rank's buffer failed in a call that could not
        raise (graph replays, async calls, the last call of a step). Collective; waits for the
        others as long as their kernels may wait on peers (`Collectives.device_timeout`)."""
        comm = self._comm
        comm.agree("Buffer.raise_if_failed", {}, None, self.failure(), comm.device_timeout)

    def _device_problem(self, x) -> str | None:
        if not isinstance(x, torch.Tensor):
            return None  # the argument checks name it
        if self.backend == "cuda" and x.device != self.device:
            return f"x is on {x.device}; this cuda-backend Buffer moves tensors on {self.device}"
        if x.is_cuda and x.device != self.device:
            return f"x is on {x.device}; this Buffer was built on {self.device}"
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

        return self._run(work, (topk_idx,), previous_event, async_finish, allocate_on_comm_stream)

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
            handle,
        )
        problem = (
            checks.problem_of(checks.check_dispatch, inp, self.group_size, not _capturing())
            or self._device_problem(x)
            or self._impl.dispatch_problem(inp, config, handle)
        )
        outputs, failure = None, None
        if problem is None:
            outputs, failure = self._allocate(
                "dispatch", allocate_on_comm_stream, self._impl.dispatch_outputs, inp
            )
        self._agree("dispatch: check arguments", inp.signature(config), problem, failure)

        if handle is not None:

            def work():
                recv_x, recv_x_scales = self._impl.dispatch_cached(inp, handle, config, outputs)
                received = recv_x if x_scales is None else (recv_x, recv_x_scales)
                return received, None, None, None, None

        else:

            def work():
                out = self._impl.dispatch(inp, config, outputs)
                return (
                    out.recv_x if x_scales is None else (out.recv_x, out.recv_x_scales),
                    out.recv_topk_idx,
                    out.recv_topk_weights,
                    out.num_recv_tokens_per_expert,
                    out.handle,
                )

        inputs = (x, x_scales, topk_idx, topk_weights, outputs)
        return self._run(work, inputs, previous_event, async_finish, allocate_on_comm_stream)

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
        problem = (
            checks.problem_of(checks.check_combine, x, handle, topk_weights, biases)
            or self._device_problem(x)
            or self._impl.combine_problem(x, topk_weights, config, handle)
        )
        signature = {
            "hidden": last_dim(x),
            "x dtype": str(getattr(x, "dtype", type(x).__name__)),
            "topk_weights given": topk_weights is not None,
            "config": repr(config),
        }
        outputs, failure = None, None
        if problem is None:
            outputs, failure = self._allocate(
                "combine",
                allocate_on_comm_stream,
                self._impl.combine_outputs,
                x,
                handle,
                topk_weights,
            )
        self._agree("combine: check arguments", signature, problem, failure)
        return self._run(
            lambda: self._impl.combine(x, handle, topk_weights, biases, config, outputs),
            (x, topk_weights, *biases, outputs),
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def _agree(self, step: str, signature: dict, problem: str | None, failure: str | None):
        """Raise on every rank if any rank's arguments are bad, its buffer failed earlier or it
        could not allocate this call's outputs (`failure`)."""
        self._comm.agree(step, signature, problem, self.failure() or failure)

    def _device(self):
        return torch.cuda.device(self.device) if self.device is not None else nullcontext()

    def _allocate(self, step: str, allocate_on_comm_stream: bool, allocate, *args):
        """A call's outputs and None, or None and why not (`Collectives.allocated`)."""
        with self._device(), self._streams.allocating(allocate_on_comm_stream):
            return self._comm.allocated(step, allocate, *args)

    def _run(self, work, inputs, previous_event, async_finish, allocate_on_comm_stream):
        """`work` on the communication stream of this buffer's device, whichever is current."""
        with self._device():
            return self._streams.run(
                work, inputs, previous_event, async_finish, allocate_on_comm_stream
            )

    # Low-latency mode (ep_comm.low_latency)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """`num_rdma_bytes` the cuda backend's low-latency mode needs for (T, H, R, E)."""
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def _low_latency_mode(self) -> LowLatencyMode:
        if self._low_latency is None:
            raise ValueError("this Buffer was built without low_latency_mode=True")
        return self._low_latency

    def low_latency_dispatch(
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
        """Send each (token, k) to the rank of expert topk_idx[t, k], into fixed-shape outputs.

        x: `[num_tokens, H]` bf16, num_tokens <= T = num_max_dispatch_tokens_per_rank (the same
            T on every rank and every call), H % 128 == 0 (% 512 with use_ue8m0).
        topk_idx: `[num_tokens, num_topk]` int64, expert ids in [0, num_experts) or -1, no expert
            twice in a token; 1 <= num_topk <= 11.
        cumulative_local_expert_recv_stats: `[E_local]` int32, += the rows each local expert
            received. dispatch_wait_recv_cost_stats: `[R]` int64, += nanoseconds waited for each
            source rank (the torch backend: the wait for the whole exchange, on every entry).
        use_fp8: cast to e4m3 with a scale per token and 128 channels (`per_token_cast_to_fp8`;
            round_scale: power-of-two scales; use_ue8m0: those scales as packed exponent bytes).
        return_recv_hook: send only (on the current stream) and return `hook`, which receives
            (on the stream current when called). Exclusive with async_finish.
        Returns recv_x `[E_local, R * T, H]` (bf16, or e4m3 with scales `[E_local, R * T, H /
        128]` fp32 / `[E_local, R * T, H / 512]` int32 UE8M0, token stride 1) of which the first
        recv_count[e] rows of expert e are valid; recv_count `[E_local]` int32; the handle for
        low_latency_combine; an EventOverlap; hook (or None).
        """
        return self._low_latency_mode().dispatch(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            use_fp8,
            round_scale,
            use_ue8m0,
            async_finish,
            return_recv_hook,
        )

    def low_latency_combine(
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
        """Return the experts' rows to their tokens and sum them with the top-k weights.

        x: `[E_local, R * T, H]` bf16, row i of expert e the output for row i of the dispatch's
            recv_x (rows past recv_count[e] are not read). With zero_copy, the rows are read
            from `get_next_low_latency_combine_buffer(handle)` instead.
        topk_idx: `[num_tokens, num_topk]` int64 and topk_weights `[num_tokens, num_topk]` fp32,
            as dispatched. out: `[num_tokens, H]` bf16 to write into (optional).
        combine_wait_recv_cost_stats: `[R]` int64, += nanoseconds waited per source rank.
        use_logfmt is not supported. return_recv_hook / async_finish as in low_latency_dispatch.
        Returns combined_x `[num_tokens, H]` bf16: sum over k of topk_weights[t, k] times expert
        topk_idx[t, k]'s row for t, in fp32 in k order (-1 skipped), rounded to bf16 once; an
        EventOverlap; hook (or None).
        """
        return self._low_latency_mode().combine(
            x,
            topk_idx,
            topk_weights,
            handle,
            use_logfmt,
            zero_copy,
            async_finish,
            return_recv_hook,
            out,
            combine_wait_recv_cost_stats,
        )

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Collective: reset the low-latency signals (after normal-mode calls, after a failure,
        before changing T, H or E); the next low-latency calls take these values."""
        self._low_latency_mode().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The BF16 `[E_local, R * T, H]` tensor the next low_latency_combine with zero_copy=True
        reads its rows from."""
        return self._low_latency_mode().next_combine_buffer(handle)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
