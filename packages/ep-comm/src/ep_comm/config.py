"""Performance knobs of the normal (throughput) mode and the buffer sizes they need.

Same fields, defaults and meaning as DeepEP V1's `Config`: `num_sms` SMs run the kernels, two
per channel; a channel moves a contiguous range of each rank's tokens through a ring of
`num_max_nvl_chunked_recv_tokens` token slots per peer, `num_max_nvl_chunked_send_tokens` at a
time. The RDMA fields exist for signature compatibility; this version is intranode only.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOPK = 16
SCALE_BLOCK = 128  # FP8 inputs carry one fp32 scale per 128 channels
BUFFER_ALIGNMENT = 128


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
        send, recv = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        if not 0 < send < recv:
            raise ValueError(
                "need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "
                f"got {send} and {recv}"
            )

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of intranode buffer a rank needs for tokens of `hidden_bytes` (BF16: hidden * 2).

        Per channel and peer: a ring of token slots (the token, its FP8 scales, top-k ids and
        weights, its source index) and four control integers; plus the count matrices.
        """
        hidden = hidden_bytes // 2
        slot = hidden_bytes + (hidden // SCALE_BLOCK) * 4 + MAX_TOPK * (8 + 4) + 4
        slot = -(-slot // 16) * 16
        rings = self.num_channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * slot
        control = self.num_channels * num_ranks * 4 * 4 + num_ranks * num_ranks * 4
        total = rings + control
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
