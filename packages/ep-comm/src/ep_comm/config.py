"""Performance knobs of the normal (throughput) mode and the buffer sizes they need.

Same fields, defaults and meaning as DeepEP V1's `Config`: `num_sms` SMs run the cuda backend's
kernels, two per channel (a sender and a receiver); a channel moves a contiguous range of each
rank's tokens through a ring of `num_max_nvl_chunked_recv_tokens` token slots per peer,
`num_max_nvl_chunked_send_tokens` at a time. The torch backend ignores them. The RDMA fields
exist for signature compatibility; this version is intranode only.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOPK = 16
SCALE_BLOCK = 128  # FP8 inputs carry one fp32 scale per 128 channels
BUFFER_ALIGNMENT = 128
MAX_CHANNELS = 64
# The cuda backend's buffer layout (csrc/layout.cuh; a GPU test checks they agree): a control
# area, then one ring per (channel, source rank) of `num_max_nvl_chunked_recv_tokens` slots.
CONTROL_BYTES = 1024 + 8 * 1024 * 4 + MAX_CHANNELS * 8 * 16


def _aligned16(n: int) -> int:
    return -(-n // 16) * 16


def dispatch_slot_bytes(row_bytes: list[int]) -> int:
    """A dispatch ring slot: each row piece 16-aligned, then the source token index."""
    return sum(_aligned16(b) for b in row_bytes) + 16


def combine_slot_bytes(hidden: int, num_topk: int) -> int:
    """A combine ring slot: the bf16 row, then the top-k weights."""
    return _aligned16(hidden * 2) + _aligned16(num_topk * 4)


@dataclass(frozen=True)
class Config:
    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_sms <= 0 or self.num_sms % 2:
            raise ValueError(f"num_sms must be a positive even number, got {self.num_sms}")
        if self.num_sms > 2 * MAX_CHANNELS:
            raise ValueError(f"num_sms must be at most {2 * MAX_CHANNELS}, got {self.num_sms}")
        send, recv = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        if not 0 < send < recv:
            raise ValueError(
                "need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "
                f"got {send} and {recv}"
            )

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def ring_bytes(self, num_channels: int, num_ranks: int, slot_bytes: int) -> int:
        """Bytes the cuda backend's rings need for one call, control area included."""
        return CONTROL_BYTES + num_channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * (
            slot_bytes
        )

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of intranode buffer a rank needs for tokens of `hidden_bytes` (BF16: hidden * 2),
        with this config, for any of: BF16 or FP8 dispatch with up to MAX_TOPK experts, and
        combine with weights."""
        hidden = hidden_bytes // 2
        topk = [MAX_TOPK * 8, MAX_TOPK * 4]
        slot = max(
            dispatch_slot_bytes([hidden_bytes, *topk]),
            dispatch_slot_bytes([hidden, hidden // SCALE_BLOCK * 4, *topk]),
            combine_slot_bytes(hidden, MAX_TOPK),
        )
        total = self.ring_bytes(self.num_channels, num_ranks, slot)
        return -(-total // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Always 0: internode (RDMA) transfers are not part of this version."""
        return 0


# DeepEP's recommended (send, recv) chunk sizes per intranode group size (its H800 tuning).
_RECOMMENDED = {
    "dispatch": {2: (24, 256), 4: (6, 256), 8: (6, 256)},
    "combine": {2: (10, 256), 4: (9, 256), 8: (4, 256)},
}


def recommended_config(kind: str, num_ranks: int, num_sms: int) -> Config:
    """`kind` is "dispatch" or "combine"; group sizes without an entry get the 8-rank one."""
    table = _RECOMMENDED[kind]
    send, recv = table.get(num_ranks, table[8])
    return Config(num_sms, send, recv)
