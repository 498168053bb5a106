"""Moving a prompt's KV pages from a prefill instance into pages a decode instance reserved.

Two ways, chosen per prefill instance. When both caches are on CUDA devices of one host, the
decode instance maps the prefill instance's cache through CUDA IPC (once) and copies the
blocks GPU to GPU. Otherwise the pages come as a gRPC stream of bytes through host memory,
each with its index, handle and checksum, all checked before any is used.

The prefill instance holds the pages under a lease: `Locate` and `Pull` renew it, `Release`
ends it, and it answers NOT_FOUND when the lease ran out first. `Pull` reads the pages on the
prefill engine's thread while the lease holds. A CUDA IPC copy reads the prefill cache
directly, so it counts only if `Release` then finds the lease intact: pages freed during the
copy could have been overwritten by another prompt.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path

import grpc
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from ref_server.model import PagedKVCache
from ref_server.services.aio import background
from ref_server.services.messages import PAGE_DTYPES, page_tensor
from ref_server.services.security import internal_channel
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

TRANSFER_TIMEOUT = 60.0
MAX_MESSAGE_BYTES = 64 << 20
GRPC, CUDA_IPC = pb.KV_TRANSFER_METHOD_GRPC, pb.KV_TRANSFER_METHOD_CUDA_IPC


class TransferError(RuntimeError):
    """The KV could not be had (the request fails; the decode instance is fine)."""


def host_id() -> str:
    """Equal for two processes exactly when they run under one kernel (CUDA IPC's reach)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def new_cache_id() -> str:
    return uuid.uuid4().hex


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
    if m.dtype not in PAGE_DTYPES:
        raise RuntimeError(f"a shared cache of dtype {m.dtype!r}")
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(m.size),
        tuple(m.stride),
        m.offset,
        torch.UntypedStorage,
        PAGE_DTYPES[m.dtype],
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
    """The decode side: fills reserved blocks of `runner`'s cache from registered prefill
    instances (`set_peers`, called by the router); it dials no other address."""

    def __init__(self, runner, secret: str) -> None:
        self.runner = runner
        self.secret = secret
        args = runner.model.args
        self.page_shape = (args.num_hidden_layers, runner.cache.page_size, args.cache_width)
        self.peers: dict[str, grpc.aio.Channel] = {}
        self.mapped: dict[str, tuple[str, list[torch.Tensor]] | None] = {}  # None: not shareable

    def set_peers(self, addresses: list[str]) -> None:
        """Dial only these prefill instances; drop what was kept for others (their channels,
        the mapping of their caches)."""
        for address in set(self.peers) - set(addresses):
            background(self.peers.pop(address).close())
            self.mapped.pop(address, None)
        for address in addresses:
            if address not in self.peers:
                self.peers[address] = internal_channel(
                    address,
                    self.secret,
                    **{"grpc.max_receive_message_length": MAX_MESSAGE_BYTES},
                )

    @property
    def num_mapped(self) -> int:
        return sum(1 for m in self.mapped.values() if m is not None)

    async def pull(
        self, address: str, kv_handle: str, targets: list[tuple[int, int]], num_pages: int
    ) -> int:
        """Write pages `index` of the handle's `num_pages` into cache `block`, for each
        (index, block) of targets; returns the method. TransferError when the KV cannot be
        had: the prefill instance is unreachable, its lease ran out, a page is damaged."""
        if address not in self.peers:
            raise TransferError(f"{address} is not a registered prefill instance")
        transfer = rpc.KvTransferStub(self.peers[address])
        handle = pb.PullRequest(kv_handle=kv_handle)
        try:
            method = await self._copy_mapped(transfer, address, handle, targets, num_pages)
            if method is None:
                await self._stream(transfer, handle, targets, num_pages)
                method = GRPC
        except grpc.aio.AioRpcError as error:
            await self._release(transfer, kv_handle)
            raise TransferError(f"{error.code().name}: {error.details()}") from None
        except (ValueError, RuntimeError) as error:
            await self._release(transfer, kv_handle)
            raise TransferError(str(error)) from None
        released = await self._release(transfer, kv_handle)
        if method == CUDA_IPC and not released:  # a stream was read under the lease; a copy not
            raise TransferError("the prefill instance's lease on the KV ran out during the copy")
        return method

    async def _release(self, transfer, kv_handle: str) -> bool:
        """End the lease; whether it was still intact."""
        try:
            await transfer.Release(pb.ReleaseRequest(kv_handle=kv_handle), timeout=TRANSFER_TIMEOUT)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def _stream(self, transfer, handle, targets, num_pages: int) -> None:
        pages = []
        async for message in transfer.Pull(handle, timeout=TRANSFER_TIMEOUT):
            if message.index != len(pages) or message.kv_handle != handle.kv_handle:
                raise ValueError(f"page {message.index} of {message.kv_handle!r} out of order")
            pages.append(page_tensor(message, self.page_shape))
        if len(pages) != num_pages:
            raise ValueError(f"{len(pages)} pages came, {num_pages} were prefilled")
        await asyncio.to_thread(self._write, [(block, pages[index]) for index, block in targets])

    def _write(self, pages: list[tuple[int, torch.Tensor]]) -> None:
        for block, page in pages:
            self.runner.write_page(block, page)
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()

    async def _copy_mapped(self, transfer, address, handle, targets, num_pages) -> int | None:
        mapped = self.mapped.get(address)
        if self.runner.device.type != "cuda" or (mapped is None and address in self.mapped):
            return None  # this side, or that instance's cache found before, is not shareable
        located = await transfer.Locate(handle, timeout=TRANSFER_TIMEOUT)
        if mapped is None or mapped[0] != located.cache_id:  # first use, or a restarted instance
            mapped = self.mapped[address] = await self._map(transfer)
            if mapped is None or mapped[0] != located.cache_id:
                return None
        if len(located.blocks) != num_pages:
            raise ValueError(f"{len(located.blocks)} pages held, {num_pages} were prefilled")
        source = [located.blocks[index] for index, _ in targets]
        await asyncio.to_thread(self._copy_blocks, mapped[1], source, [b for _, b in targets])
        return CUDA_IPC

    def _copy_blocks(self, layers: list[torch.Tensor], source: list[int], target: list[int]):
        cache = self.runner.cache
        src = torch.tensor(source, device=layers[0].device)
        dst = torch.tensor(target, device=cache.device)
        for mapped, layer in zip(layers, cache.layers, strict=True):
            layer.index_copy_(0, dst, mapped.index_select(0, src).to(cache.device))
        for device in {layers[0].device, cache.device}:  # done before the lease is checked
            torch.cuda.current_stream(device).synchronize()

    async def _map(self, transfer) -> tuple[str, list[torch.Tensor]] | None:
        shared = await transfer.ShareCache(pb.ShareCacheRequest(), timeout=TRANSFER_TIMEOUT)
        if not shared.layers or shared.host_id != host_id():
            return None
        try:
            return shared.cache_id, [_open(layer) for layer in shared.layers]
        except RuntimeError:  # e.g. a device this process cannot see
            return None
