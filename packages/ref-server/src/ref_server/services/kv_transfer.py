"""Moving a prompt's KV pages from a prefill instance to a decode instance.

Two ways, chosen per prefill instance. When both caches are on CUDA devices of one host, the
decode instance maps the prefill instance's cache through CUDA IPC (once) and copies the pages
GPU to GPU. Otherwise the pages come as a gRPC stream of bytes through host memory. Either way
the prefill instance holds the pages until the decode instance releases them.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import grpc
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from ref_server.model import PagedKVCache
from ref_server.services.messages import page_tensor
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

TRANSFER_TIMEOUT = 60.0
GRPC, CUDA_IPC = pb.KV_TRANSFER_METHOD_GRPC, pb.KV_TRANSFER_METHOD_CUDA_IPC


def host_id() -> str:
    """Equal for two processes exactly when they run under one kernel (CUDA IPC's reach)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def shared_cache(cache: PagedKVCache, cache_id: str) -> pb.SharedCache:
    """The prefill side: IPC handles of each layer (none for a cache in host memory)."""
    message = pb.SharedCache(cache_id=cache_id, host_id=host_id())
    if cache.device.type == "cuda":
        for layer in cache.layers:
            (_, size, stride, offset, _, dtype, device, handle, nbytes, byte_offset, _) = (
                fields := reduce_tensor(layer)[1]
            )[:11]
            counter_handle, counter_offset, event_handle, event_sync = fields[11:]
            message.layers.add(
                size=size,
                stride=stride,
                offset=offset,
                dtype=str(dtype).removeprefix("torch."),
                device=device,
                handle=handle,
                storage_size_bytes=nbytes,
                storage_offset_bytes=byte_offset,
                ref_counter_handle=counter_handle,
                ref_counter_offset=counter_offset,
                event_handle=event_handle,
                event_sync_required=event_sync,
            )
    return message


def _open(m: pb.CudaIpcTensor) -> torch.Tensor:
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(m.size),
        tuple(m.stride),
        m.offset,
        torch.UntypedStorage,
        getattr(torch, m.dtype),
        m.device,
        m.handle,
        m.storage_size_bytes,
        m.storage_offset_bytes,
        False,
        m.ref_counter_handle,
        m.ref_counter_offset,
        m.event_handle,
        m.event_sync_required,
    )


class KvPuller:
    """The decode side: pulls a handle's pages, each `[layers, page_size, 576]` on `device`."""

    def __init__(self, page_shape: tuple[int, ...], device: torch.device) -> None:
        self.page_shape = page_shape
        self.device = device
        self.channels: dict[str, grpc.Channel] = {}
        self.mapped: dict[str, tuple[str, list[torch.Tensor]] | None] = {}  # by address

    def pull(self, address: str, kv_handle: str) -> tuple[list[torch.Tensor], int]:
        """(pages, method); the prefill instance frees the pages afterwards, pulled or not."""
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address)
        transfer = rpc.KvTransferStub(self.channels[address])
        handle = pb.PullRequest(kv_handle=kv_handle)
        try:
            pages = self._copy_mapped(transfer, address, handle)
            if pages is not None:
                return pages, CUDA_IPC
            stream = transfer.Pull(handle, timeout=TRANSFER_TIMEOUT)
            return [page_tensor(m, self.page_shape) for m in stream], GRPC
        finally:
            transfer.Release(pb.ReleaseRequest(kv_handle=kv_handle), timeout=TRANSFER_TIMEOUT)

    def _copy_mapped(self, transfer, address: str, handle: pb.PullRequest):
        mapped = self.mapped.get(address)
        if self.device.type != "cuda" or (mapped is None and address in self.mapped):
            return None  # this side, or that instance's cache found before, is not shareable
        located = transfer.Locate(handle, timeout=TRANSFER_TIMEOUT)
        if mapped is None or mapped[0] != located.cache_id:  # first use, or a restarted instance
            mapped = self.mapped[address] = self._map(transfer)
            if mapped is None or mapped[0] != located.cache_id:
                return None
        source = mapped[1][0].device
        blocks = torch.tensor(list(located.blocks), device=source)
        pages = torch.stack([layer[blocks, :, 0] for layer in mapped[1]], dim=1).to(self.device)
        for device in {source, self.device}:  # copied before the prefill instance frees them
            torch.cuda.current_stream(device).synchronize()
        return list(pages.unbind(0))

    def _map(self, transfer) -> tuple[str, list[torch.Tensor]] | None:
        shared = transfer.ShareCache(pb.ShareCacheRequest(), timeout=TRANSFER_TIMEOUT)
        if not shared.layers or shared.host_id != host_id():
            return None
        try:
            return shared.cache_id, [_open(layer) for layer in shared.layers]
        except RuntimeError:  # e.g. a device this process cannot see
            return None


def new_cache_id() -> str:
    return uuid.uuid4().hex
