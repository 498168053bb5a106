"""The `cuda` backend's transport: our kernels write rows straight into peers' CUDA IPC buffers.

Every rank allocates `num_nvl_bytes` once and maps every peer's buffer (same host; the same
GPU or another one). Layout of a rank's buffer: barrier flags (one per peer), a count area
(one row per peer), then one data region per source rank. A transfer goes in rounds sized by
the regions: senders copy their next rows into each receiver's region for them
(`copy_segments`, `num_sms` blocks), all ranks meet at a GPU barrier, receivers copy the rows
out, and they meet again before the regions are reused. The host checks each barrier, so a
peer that never arrives is reported by rank and step within the timeout.
"""

from __future__ import annotations

import torch

from ep_comm.collectives import Collectives, EPCommError
from ep_comm.extension import load_extension

FLAG_BYTES = 256  # one uint64 epoch per peer, up to 32 ranks
COUNT_SLOTS = 2048  # int64 values per peer in the count area


def control_bytes(num_ranks: int) -> int:
    return FLAG_BYTES + num_ranks * COUNT_SLOTS * 8


class IpcTransport:
    def __init__(self, comm: Collectives, num_nvl_bytes: int) -> None:
        self.rank, self.size = comm.rank, comm.size
        self.timeout = comm.timeout.total_seconds()
        control = control_bytes(self.size)
        self.region = (num_nvl_bytes - control) // self.size // 16 * 16
        if self.region < 16:
            raise ValueError(
                f"num_nvl_bytes={num_nvl_bytes} leaves no data room for {self.size} ranks: the "
                f"cuda backend needs more than {control + 16 * self.size} "
                "(see Config.get_nvl_buffer_size_hint)"
            )
        self.ext = load_extension()
        self.ptr, handle = self.ext.ipc_alloc(num_nvl_bytes)
        handles = comm.all_gather("Buffer(): exchange CUDA IPC handles", handle)
        self.peers = [
            self.ptr if r == self.rank else self.ext.ipc_open(handles[r]) for r in range(self.size)
        ]
        device = torch.device("cuda", torch.cuda.current_device())
        self.peer_flags = torch.tensor(
            [p + 8 * self.rank for p in self.peers], dtype=torch.int64, device=device
        )
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = 0
        self.count_area = (
            self.ext.view_bytes(self.ptr + FLAG_BYTES, self.size * COUNT_SLOTS * 8)
            .view(torch.int64)
            .view(self.size, COUNT_SLOTS)
        )
        self.data = self.ext.view_bytes(self.ptr + control, self.region * self.size).view(
            self.size, self.region
        )
        self.control = control
        self.device = device

    def destroy(self) -> None:
        for r, p in enumerate(self.peers):
            if r != self.rank:
                self.ext.ipc_close(p)
        self.ext.ipc_free(self.ptr)
        self.peers = []

    def _barrier(self, step: str) -> None:
        self.epoch += 1
        self.ext.barrier(self.peer_flags, self.ptr, self.epoch, self.timeout, self.status)
        missing = int(self.status.item())  # waits for the barrier
        if missing:
            raise EPCommError(
                f"ep_comm rank {self.rank}/{self.size}: {step}: rank {missing - 1} did not reach "
                f"the GPU barrier within {self.timeout:g} s"
            )

    def _push(self, source: torch.Tensor, segments: list[tuple[int, int, int]], num_sms: int):
        """segments: (byte offset in source, destination address, bytes)."""
        if not segments:
            return
        table = torch.tensor(segments, dtype=torch.int64).t().contiguous().to(self.device)
        self.ext.copy_segments(source, table[0], table[1], table[2], num_sms)

    def all_gather(self, step: str, tensor: torch.Tensor) -> torch.Tensor:
        """`[size, n]` int64: every rank's `tensor` (n <= COUNT_SLOTS), through the count areas."""
        values = tensor.to(device=self.device, dtype=torch.int64).flatten()
        n = values.numel()
        if n > COUNT_SLOTS:
            raise ValueError(f"{step}: {n} counts exceed the count area ({COUNT_SLOTS})")
        padded = torch.zeros(n + n % 2, dtype=torch.int64, device=self.device)  # 16-byte units
        padded[:n] = values
        row = FLAG_BYTES + self.rank * COUNT_SLOTS * 8
        segments = [(0, peer + row, padded.numel() * 8) for peer in self.peers]
        self._push(padded.view(torch.uint8), segments, 1)
        self._barrier(step)
        return self.count_area[:, :n].clone().to(tensor.device)

    def all_to_all(
        self, step: str, rows: torch.Tensor, counts: torch.Tensor, num_sms: int
    ) -> torch.Tensor:
        """Rows (uint8, 16-byte multiples) grouped by destination in, grouped by source out.

        counts: `[src, dst]` rows every rank sends every rank (host), the same on all ranks.
        """
        width = rows.shape[1]
        capacity = self.region // width  # rows per round from one source
        if capacity == 0:
            raise ValueError(
                f"{step}: a {width}-byte token row does not fit the {self.region}-byte region per "
                "peer; raise num_nvl_bytes (Config.get_nvl_buffer_size_hint)"
            )
        send, recv = counts[self.rank].tolist(), counts[:, self.rank].tolist()
        send_start = [sum(send[:j]) for j in range(self.size)]
        recv_start = [sum(recv[:i]) for i in range(self.size)]
        rounds = max(1, -(-int(counts.max()) // capacity))
        out = torch.empty(sum(recv), width, dtype=torch.uint8, device=self.device)
        rows = rows.to(self.device)
        for k in range(rounds):
            first = k * capacity
            segments = []
            for j in range(self.size):
                n = min(max(send[j] - first, 0), capacity)
                if n:
                    where = self.peers[j] + self.control + self.rank * self.region
                    segments.append(((send_start[j] + first) * width, where, n * width))
            self._push(rows, segments, num_sms)
            self._barrier(f"{step} (round {k + 1}/{rounds}: rows written)")
            for i in range(self.size):
                n = min(max(recv[i] - first, 0), capacity)
                if n:
                    begin = recv_start[i] + first
                    out[begin : begin + n] = self.data[i, : n * width].view(n, width)
            self._barrier(f"{step} (round {k + 1}/{rounds}: rows read)")
        return out
