"""Moving a prompt's KV pages from a prefill instance into pages a decode instance reserved.

Three ways, chosen per prefill instance by the decode instance's `--kv-transfer` (METHODS).
When both caches are on CUDA devices of one host, the decode instance maps the prefill
instance's cache through CUDA IPC (once) and copies the blocks GPU to GPU (auto, cuda_ipc).
Through NIXL (`nixl_transfer`; auto across hosts, nixl anywhere), each instance registers its
cache with an agent of its own; the agents' metadata cross once per instance pair
(`ShareCache`), a request's page descriptors with `Locate`, and the decode instance reads the
pages one-sided into its blocks. Otherwise, or when the chosen way is not available (an agent
that did not start, another host for CUDA IPC), the pages come as a gRPC stream of bytes
through host memory, each with its index, handle and checksum, all checked before any is
used. The way each prefill instance's pages come, and why, is logged when it is first used
and whenever it changes.

The prefill instance holds the pages under a lease: `Locate` and `Pull` renew it, `Release`
ends it, and it answers NOT_FOUND when the lease ran out first. `Pull` reads the pages on the
prefill engine's thread while the lease holds. A CUDA IPC copy and a NIXL read take the
prefill cache's memory directly, so they count only if `Release` then finds the lease intact:
pages freed during the copy could have been overwritten by another prompt. Whatever fails,
the lease is released and the request fails (`TransferError`); the decode instance frees the
pages it reserved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc
import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from ref_server.model import PagedKVCache
from ref_server.services.aio import background
from ref_server.services.messages import PAGE_DTYPES, page_tensor
from ref_server.services.nixl_transfer import NixlCache, NixlError, NixlUnavailable, Pages
from ref_server.services.security import internal_channel
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT = 60.0
RECONNECT_TIMEOUT = 5.0
# A channel to a prefill instance retries connecting at most this often while it is down, so
# that a restarted instance is reached within about a second.
RECONNECT_BACKOFF = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}
MAX_MESSAGE_BYTES = 64 << 20
STREAM_WRITE_PAGES = 4  # streamed pages checked and written at a time
GRPC, CUDA_IPC = pb.KV_TRANSFER_METHOD_GRPC, pb.KV_TRANSFER_METHOD_CUDA_IPC
NIXL = pb.KV_TRANSFER_METHOD_NIXL
METHODS = ("auto", "nixl", "cuda_ipc", "grpc")
NAMES = {GRPC: "a gRPC stream", CUDA_IPC: "CUDA IPC", NIXL: "a NIXL read"}


class TransferError(RuntimeError):
    """The KV could not be had (the request fails; the decode instance is fine)."""


HOST_ID_ENV = "REF_SERVER_HOST_ID"


def host_id() -> str:
    """Equal for two processes exactly when they run under one kernel (CUDA IPC's reach), or
    what HOST_ID_ENV says (so that processes of one machine can act as two hosts' would)."""
    if named := os.environ.get(HOST_ID_ENV):
        return named
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def new_cache_id() -> str:
    return uuid.uuid4().hex


def check_page_tensors(cache: PagedKVCache, sizes: list[int]) -> None:
    """ValueError, saying what a page holds here, unless a prefill instance's page tensors
    (`sizes`: the bytes of each one's block) are those of `cache`: another model's pages, or
    pages without the prompt's last hidden state an MTP module's first draft reads."""
    if sizes != [t[0].nbytes for t in cache.page_tensors]:
        raise ValueError(
            f"the prefill instance's pages hold {sum(sizes)} bytes in {len(sizes)} tensors, "
            f"not this instance's {cache.page_contents}"
        )


def nixl_targets(cache: PagedKVCache, located: pb.KvBlocks, targets, num_pages: int) -> Pages:
    """The NIXL descriptors of the targets' pages (index, block) among a prefill instance's
    `located` ones; ValueError unless they are pages of `cache`."""
    if len(located.blocks) != num_pages or not located.nixl_pages.rows:
        raise ValueError(f"{len(located.blocks)} pages located, {num_pages} were prefilled")
    rows = np.frombuffer(located.nixl_pages.rows, dtype="<i8")
    if rows.size % (3 * num_pages):
        raise ValueError(f"{rows.size / 3:g} page descriptors for {num_pages} pages")
    rows = rows.reshape(-1, num_pages, 3)
    check_page_tensors(cache, rows[:, 0, 1].tolist())
    wanted = rows[:, [index for index, _ in targets]]
    return Pages(located.nixl_pages.kind, np.ascontiguousarray(wanted).tobytes())


def shared_cache(cache: PagedKVCache, cache_id: str) -> pb.SharedCache:
    """The prefill side: IPC handles of each page tensor (`PagedKVCache.page_tensors`; none
    for a cache in host memory)."""
    message = pb.SharedCache(cache_id=cache_id, host_id=host_id())
    if cache.device.type == "cuda":
        for tensor in cache.page_tensors:
            (_, size, stride, offset, _, dtype, device, handle, nbytes, byte_offset, _) = (
                fields := reduce_tensor(tensor)[1]
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


@dataclass(frozen=True)
class NixlPeer:
    """A prefill instance's NIXL agent as this side knows it (from one `ShareCache`)."""

    cache_id: str
    agent: str  # its name in this side's agent
    same_host: bool


class _Link(NamedTuple):
    """A pull's way to a prefill instance: the channel registered for its address when the pull
    began (the pull keeps it if `set_peers` drops the address meanwhile) and a stub on it."""

    address: str
    channel: grpc.aio.Channel
    transfer: rpc.KvTransferStub


class KvPuller:
    """The decode side: fills reserved blocks of `runner`'s cache from registered prefill
    instances (`set_peers`, called by the router); it dials no other address. method: one of
    METHODS (see the module docstring)."""

    def __init__(self, runner, secret: str, method: str = "auto") -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.runner = runner
        self.secret = secret
        self.method = method
        self.peers: dict[str, grpc.aio.Channel] = {}
        self.pulling: Counter[grpc.aio.Channel] = Counter()  # pulls under way on each channel
        self.mapped: dict[str, tuple[str, list[torch.Tensor]] | None] = {}  # None: not shareable
        self.nixl = None  # this side's agent, started when a transfer first wants one
        self.why_not_nixl: str | None = None  # why it could not start
        self.nixl_peers: dict[str, NixlPeer | None] = {}  # None: no NIXL from that instance
        self.meeting = asyncio.Lock()  # pulls that start together meet a new peer once
        self.chosen: dict[str, tuple[int, str]] = {}  # address -> (method, why), as logged
        self.closing = asyncio.Event()  # set by `close`: no new pull, none waits for a channel

    def set_peers(self, addresses: list[str]) -> None:
        """Dial only these prefill instances; drop what was kept for others (their channels,
        once no pull uses them; the mapping of their caches)."""
        for address in set(self.peers) - set(addresses):
            self._close_if_unused(self.peers.pop(address))
            self.mapped.pop(address, None)
            self.nixl_peers.pop(address, None)
            self.chosen.pop(address, None)
        for address in addresses:
            if address not in self.peers:
                self.peers[address] = internal_channel(
                    address,
                    self.secret,
                    **{"grpc.max_receive_message_length": MAX_MESSAGE_BYTES},
                    **RECONNECT_BACKOFF,
                )

    async def close(self) -> None:
        """At shutdown: refuse new pulls, close every channel (the pulls under way end in
        TransferErrors), wait up to RECONNECT_TIMEOUT for them to end, then stop this side's
        NIXL agent (left to the process's exit while a read still runs on a worker thread)."""
        self.closing.set()
        channels = set(self.peers.values()) | set(self.pulling)
        self.peers.clear()
        self.mapped.clear()
        self.nixl_peers.clear()
        await asyncio.gather(*(channel.close() for channel in channels))
        deadline = asyncio.get_running_loop().time() + RECONNECT_TIMEOUT
        while any(self.pulling.values()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.nixl is not None and any(self.pulling.values()):
            log.warning("NIXL agent left running: a read outlasted the shutdown's wait")
        elif self.nixl is not None:
            self.nixl.close()
            self.nixl = None

    @property
    def num_mapped(self) -> int:
        return sum(1 for m in self.mapped.values() if m is not None)

    async def pull(
        self, address: str, kv_handle: str, targets: list[tuple[int, int]], num_pages: int
    ) -> int:
        """Write pages `index` of the handle's `num_pages` into cache `block`, for each
        (index, block) of targets; returns the method. TransferError when the KV cannot be
        had: the prefill instance is unreachable, its lease ran out, a page is damaged."""
        if self.closing.is_set():
            raise TransferError("this instance is shutting down")
        if address not in self.peers:
            raise TransferError(f"{address} is not a registered prefill instance")
        channel = self.peers[address]
        self.pulling[channel] += 1
        try:
            link = _Link(address, channel, rpc.KvTransferStub(channel))
            return await self._pull(link, kv_handle, targets, num_pages)
        finally:
            self.pulling[channel] -= 1
            self._close_if_unused(channel)

    def _current(self, link: _Link) -> bool:
        """Whether link's channel is still the one registered for its address (what a pull
        learns about an instance is kept only then)."""
        return self.peers.get(link.address) is link.channel

    def _close_if_unused(self, channel: grpc.aio.Channel) -> None:
        """A dropped instance's channel closes when its last pull ends (closing a channel
        cancels the calls on it)."""
        if not self.pulling[channel] and channel not in self.peers.values():
            del self.pulling[channel]
            background(channel.close())

    async def _pull(self, link: _Link, kv_handle, targets, num_pages) -> int:
        address, transfer = link.address, link.transfer
        handle = pb.PullRequest(kv_handle=kv_handle)
        try:
            try:
                method, why = await self._move(link, handle, targets, num_pages)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # The instance answered the router a moment ago: this channel may still be in
                # its reconnect backoff (the instance restarted). Once it connects, again.
                await self._reconnect(link, error)
                method, why = await self._move(link, handle, targets, num_pages)
        except grpc.aio.AioRpcError as error:
            await self._release(transfer, kv_handle)
            raise TransferError(f"{error.code().name}: {error.details()}") from None
        except grpc.aio.UsageError:  # `close` closed the channel under the pull
            raise TransferError(f"the channel to {address} closed: shutting down") from None
        except (ValueError, RuntimeError) as error:
            await self._release(transfer, kv_handle)
            raise TransferError(str(error)) from None
        released = await self._release(transfer, kv_handle)
        if method != GRPC and not released:  # a stream was read under the lease; a copy not
            raise TransferError("the prefill instance's lease on the KV ran out during the copy")
        if self.chosen.get(address) != (method, why):
            self.chosen[address] = (method, why)
            log.info("KV from %s comes by %s (%s)", address, NAMES[method], why)
        return method

    async def _move(self, link: _Link, handle, targets, num_pages) -> tuple[int, str]:
        """The pages into their blocks by the first way that serves: (method, why)."""
        method, why = None, f"--kv-transfer {self.method}"
        if self.method in ("auto", "cuda_ipc"):
            method = await self._copy_mapped(link, handle, targets, num_pages)
            why = "both caches on CUDA devices of one host" if method else why
        if method is None and self.method in ("auto", "nixl"):
            method, why = await self._read_nixl(link, handle, targets, num_pages)
        if method is None:
            await self._stream(link.transfer, handle, targets, num_pages)
            method = GRPC
        return method, why

    async def _reconnect(self, link: _Link, error: grpc.aio.AioRpcError) -> None:
        if not self._current(link):
            raise TransferError(
                f"{link.address} left the registered prefill instances: {error.details()}"
            )
        ready = asyncio.ensure_future(link.channel.channel_ready())
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            done, _ = await asyncio.wait(
                {ready, closing}, timeout=RECONNECT_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            closing.cancel()
        if closing in done:
            raise TransferError(f"the channel to {link.address} closed: shutting down")
        if ready not in done:
            raise TransferError(
                f"{link.address} unreachable for {RECONNECT_TIMEOUT:g} s: {error.details()}"
            )
        ready.result()

    async def _read_nixl(self, link: _Link, handle, targets, num_pages):
        """(NIXL, why) once the pages are read into their blocks, or (None, why NIXL was not
        used). The peer's agent is met once per pair (again after it restarts)."""
        peer = await self._nixl_peer(link)
        if peer is None:
            return None, self.why_not_nixl or "no NIXL from that instance"
        if self.method == "auto" and peer.same_host:
            return (
                None,
                "one host, the caches not both on CUDA devices; auto uses NIXL across hosts",
            )
        asked = pb.PullRequest(kv_handle=handle.kv_handle, nixl_pages=True)
        located = await link.transfer.Locate(asked, timeout=TRANSFER_TIMEOUT)
        if located.cache_id != peer.cache_id:  # it restarted since: meet its new agent
            if self._current(link):
                self.nixl_peers.pop(link.address, None)
            return None, "the prefill instance restarted"
        pages = nixl_targets(self.runner.cache, located, targets, num_pages)
        blocks = [block for _, block in targets]
        try:
            await asyncio.to_thread(self.nixl.read, peer.agent, pages, blocks, TRANSFER_TIMEOUT)
        except NixlError as error:
            raise TransferError(str(error)) from None
        return NIXL, "across hosts" if self.method == "auto" else "--kv-transfer nixl"

    async def _nixl_peer(self, link: _Link) -> NixlPeer | None:
        """The prefill instance's agent, met on first use: None where NIXL is not for it (auto
        on one host, where neither agent starts) or cannot be (an agent did not start)."""
        async with self.meeting:
            if link.address in self.nixl_peers:
                return self.nixl_peers[link.address]
            peer = await self._meet(link.transfer, link.address)
            if self._current(link):
                self.nixl_peers[link.address] = peer
            return peer

    async def _meet(self, transfer, address) -> NixlPeer | None:
        peer = None
        # The prefill instance starts its agent when asked: not unless this side's runs.
        share = pb.ShareCacheRequest(nixl=self.method == "nixl" and self._start_nixl())
        shared = await transfer.ShareCache(share, timeout=TRANSFER_TIMEOUT)
        same_host = shared.host_id == host_id()
        if self.method == "auto" and same_host:
            peer = NixlPeer(shared.cache_id, "", same_host)
        elif self._start_nixl():
            if not share.nixl:
                share.nixl = True
                shared = await transfer.ShareCache(share, timeout=TRANSFER_TIMEOUT)
            if shared.nixl_metadata:
                try:
                    agent = await asyncio.to_thread(self.nixl.connect, shared.nixl_metadata)
                except NixlError as error:
                    raise TransferError(str(error)) from None
                peer = NixlPeer(shared.cache_id, agent, same_host)
            else:
                log.warning("%s has no NIXL agent: %s", address, shared.nixl_unavailable)
        return peer

    def _start_nixl(self) -> bool:
        """Whether this side's agent runs (started on first call; why not, logged once; none
        once `close` ran)."""
        if self.closing.is_set():
            return False
        if self.nixl is None and self.why_not_nixl is None:
            try:
                self.nixl = NixlCache(self.runner.cache)
            except NixlUnavailable as error:
                self.why_not_nixl = f"no NIXL agent here: {error}"
                log.warning("KV transfer without NIXL: %s", error)
        return self.nixl is not None

    async def _release(self, transfer, kv_handle: str) -> bool:
        """End the lease; whether it was still intact."""
        try:
            await transfer.Release(pb.ReleaseRequest(kv_handle=kv_handle), timeout=TRANSFER_TIMEOUT)
            return True
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # UsageError: a closed channel
            return False

    async def _stream(self, transfer, handle, targets, num_pages: int) -> None:
        """The pages as they come, checked and written a few at a time on a worker thread (one
        batch at a time, while the next arrives); every write ends before this returns or
        raises, so the blocks are never freed under one."""
        blocks, batch, count, writing = dict(targets), [], 0, None
        call = transfer.Pull(handle, timeout=TRANSFER_TIMEOUT)
        try:
            async for message in call:
                if message.index != count or message.kv_handle != handle.kv_handle:
                    raise ValueError(f"page {message.index} of {message.kv_handle!r} out of order")
                count += 1
                batch.append(message)
                if len(batch) == STREAM_WRITE_PAGES:
                    await self._written(writing)
                    writing = asyncio.ensure_future(asyncio.to_thread(self._write, batch, blocks))
                    batch = []
            if count != num_pages:
                raise ValueError(f"{count} pages came, {num_pages} were prefilled")
            await self._written(writing)
            writing = None
            await asyncio.to_thread(self._write, batch, blocks)
        finally:
            call.cancel()  # a bad page ends the pull here, not when the call is collected
            await self._written(writing, quiet=True)

    @staticmethod
    async def _written(writing, quiet: bool = False) -> None:
        """Wait for a batch's write (None: no batch)."""
        if writing is not None:
            try:
                await asyncio.shield(writing)
            except Exception:
                if not quiet:
                    raise

    def _write(self, messages: list[pb.KvPage], blocks: dict[int, int]) -> None:
        """Check each page and write those that have a block."""
        cache = self.runner.cache
        for message in messages:
            if len(message.data) != cache.page_bytes:
                raise ValueError(
                    f"page {message.index} holds {len(message.data)} bytes, not this "
                    f"instance's {cache.page_contents}"
                )
            page = page_tensor(message, (cache.page_bytes,))
            if message.index in blocks:
                self.runner.write_page(blocks[message.index], page)
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()

    async def _copy_mapped(self, link: _Link, handle, targets, num_pages) -> int | None:
        mapped = self.mapped.get(link.address)
        if self.runner.device.type != "cuda" or (mapped is None and link.address in self.mapped):
            return None  # this side, or that instance's cache found before, is not shareable
        located = await link.transfer.Locate(handle, timeout=TRANSFER_TIMEOUT)
        if mapped is None or mapped[0] != located.cache_id:  # first use, or a restarted instance
            mapped = await self._map(link.transfer)
            if self._current(link):
                self.mapped[link.address] = mapped
            if mapped is None or mapped[0] != located.cache_id:
                return None
        if len(located.blocks) != num_pages:
            raise ValueError(f"{len(located.blocks)} pages held, {num_pages} were prefilled")
        source = [located.blocks[index] for index, _ in targets]
        await asyncio.to_thread(self._copy_blocks, mapped[1], source, [b for _, b in targets])
        return CUDA_IPC

    def _copy_blocks(self, mapped: list[torch.Tensor], source: list[int], target: list[int]):
        """Blocks `source` of the prefill cache's page tensors into blocks `target` of ours."""
        cache = self.runner.cache
        check_page_tensors(cache, [t[0].nbytes for t in mapped])
        src = torch.tensor(source, device=mapped[0].device)
        dst = torch.tensor(target, device=cache.device)
        for theirs, ours in zip(mapped, cache.page_tensors, strict=True):
            ours.index_copy_(0, dst, theirs.index_select(0, src).to(cache.device))
        for device in {mapped[0].device, cache.device}:  # done before the lease is checked
            torch.cuda.current_stream(device).synchronize()

    async def _map(self, transfer) -> tuple[str, list[torch.Tensor]] | None:
        shared = await transfer.ShareCache(pb.ShareCacheRequest(), timeout=TRANSFER_TIMEOUT)
        if not shared.layers or shared.host_id != host_id():
            return None
        try:
            return shared.cache_id, [_open(layer) for layer in shared.layers]
        except RuntimeError:  # e.g. a device this process cannot see
            return None
