"""What the low-latency mode and its backends share: the buffer's size, the calls' arguments
and outputs, and the backend contract (`LowLatencyBackend`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ep_comm.config import BUFFER_ALIGNMENT, SCALE_BLOCK

# The cuda backend's signals per buffer: a 64-bit NVSHMEM signal per expert for the dispatch
# counts and another for the combine flags (DeepEP: one int per expert, shared).
SIGNAL_BYTES_PER_EXPERT = 16


def _aligned(n: int, alignment: int = BUFFER_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def dispatch_message_bytes(hidden: int) -> int:
    """A 16-byte header (the source token index), then BF16 values or FP8 values and scales."""
    return 16 + max(2 * hidden, hidden + 4 * hidden // SCALE_BLOCK)


def combine_message_bytes(hidden: int) -> int:
    """Room for LogFMT's per-128-channel metadata (as DeepEP's layout), then the BF16 row."""
    return 4 * hidden // SCALE_BLOCK + 2 * hidden


def signal_bytes(num_experts: int) -> int:
    return _aligned(SIGNAL_BYTES_PER_EXPERT * num_experts)


def rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Bytes of `num_rdma_bytes` the cuda backend needs for (T, H, R, E): DeepEP's layout of two
    buffers, each a signal area, a send area (T dispatch messages or E * T combine messages) and a
    receive area of E * T slots (`[E_local][R][T]`), rounded up to 128. R does not matter."""
    del num_ranks  # E * T slots hold [E_local][R][T] whatever R is
    tokens = num_max_dispatch_tokens_per_rank
    dispatch, combine = dispatch_message_bytes(hidden), combine_message_bytes(hidden)
    send = max(tokens * dispatch, num_experts * tokens * combine)
    receive = num_experts * tokens * max(dispatch, combine)
    return _aligned(2 * (signal_bytes(num_experts) + send + receive))


# The backend contract -------------------------------------------------------------------------


class LowLatencyHandle(NamedTuple):
    """What low_latency_combine needs from its dispatch: DeepEP's 5-tuple."""

    # [E_local, R * T] int32: each received row's token index on its source rank
    src_info: torch.Tensor
    # [E_local, R] int64: (begin << 32) | count; rows [begin, begin + count) of local expert e
    # came from rank r
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


@dataclass
class LowLatencyReceive:
    """A dispatch's outputs: allocated before the send, filled by the receive."""

    x: torch.Tensor  # [E_local, R * T, H] float8_e4m3fn (FP8) or bf16
    # FP8: fp32 [E_local, R * T, H / 128]; UE8M0: int32 [E_local, R * T, H / 512] (pack_ue8m0);
    # token stride 1 (the transpose of a contiguous [E_local, groups, R * T]); BF16: None
    scales: torch.Tensor | None
    count: torch.Tensor  # [E_local] int32, zeroed before the send
    src_info: torch.Tensor  # [E_local, R * T] int32
    layout_range: torch.Tensor  # [E_local, R] int64


@dataclass(frozen=True)
class LowLatencyDispatchCall:
    """One low_latency_dispatch's arguments, built once and handed to the checks and the
    backend (the shapes are those of `Buffer.low_latency_dispatch`)."""

    x: torch.Tensor  # [num_tokens, H] bf16
    topk_idx: torch.Tensor  # [num_tokens, k] int64, global expert ids or -1
    num_max_dispatch_tokens_per_rank: int  # T
    num_experts: int
    cumulative_local_expert_recv_stats: torch.Tensor | None  # [E_local] int32, added to
    dispatch_wait_recv_cost_stats: torch.Tensor | None  # [R] int64 ns, added to
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool

    @property
    def stats(self) -> tuple:
        return self.cumulative_local_expert_recv_stats, self.dispatch_wait_recv_cost_stats


@dataclass(frozen=True)
class LowLatencyCombineCall:
    """One low_latency_combine's arguments (shapes as in `Buffer.low_latency_combine`)."""

    x: torch.Tensor  # [E_local, R * T, H] bf16 (ignored with zero_copy)
    topk_idx: torch.Tensor  # [num_tokens, k] int64, as dispatched
    topk_weights: torch.Tensor  # [num_tokens, k] fp32
    handle: LowLatencyHandle
    zero_copy: bool
    combine_wait_recv_cost_stats: torch.Tensor | None  # [R] int64 ns, added to


class LowLatencyBackend(Protocol):
    """Moves the data. `slot` (0 or 1) is the double buffer a call uses: it flips at every LL
    call, on every rank alike."""

    # int32 [1] on the buffer's device: nonzero once an LL call of this buffer failed (until clean)
    error_flag: torch.Tensor

    def dispatch_send(
        self, slot: int, call: LowLatencyDispatchCall, out: LowLatencyReceive
    ) -> Callable[[], None]:
        """Enqueue the send on the current stream; the returned `receive` enqueues the receive
        on the stream current when it is called and fills `out` (and adds to the stats)."""
        ...

    def combine_send(
        self, slot: int, call: LowLatencyCombineCall, out: torch.Tensor
    ) -> Callable[[], None]:
        """call.x (with zero_copy: `combine_buffer(slot, handle)` instead); `receive` fills out
        `[num_tokens, H]` bf16 with sum_k w[t, k] * row(topk_idx[t, k], t), each product
        rounded to fp32 and added in k order (no fused multiply-add), skipping -1, rounded to
        bf16 once."""
        ...

    def combine_buffer(self, slot: int, handle: LowLatencyHandle) -> torch.Tensor:
        """A BF16 `[E_local, R * T, H]` view that a zero-copy combine on `slot` reads."""
        ...

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: reset the signals of both buffers and error_flag."""
        ...

    def failure(self) -> str | None:
        """An earlier call's failure (rank, step, peer), read on the host; None if none."""
        ...

    def destroy(self) -> None: ...
