"""KV pages read through NIXL: one-sided reads from a prefill instance's registered cache into
the pages a decode instance reserved, over NIXL's UCX backend (RDMA where the NICs have it,
shared memory or TCP where they do not). gRPC stays the control plane: it is to carry each
side's agent metadata once per instance pair and, per request, the leased pages' descriptors.

`kv_transfer` chooses it (method "nixl", or "auto" across hosts) beside CUDA IPC and the gRPC
stream. nixl 1.5.1 cannot share a process with grpc_tools' protoc compiler (their bundled C++
libraries abort on load, in either order); grpcio is fine. Descriptors cross as `Pages`: the
memory kind and packed int64 rows (address, bytes, device), never as NIXL's pickled lists,
which would run a peer's pickle.

    source = NixlCache(prefill_cache)                   # the prefill instance
    pages = source.pages([3, 1, 5])                     # its leased blocks, every page tensor
    reader = NixlCache(decode_cache)                    # the decode instance
    peer = reader.connect(source.metadata())            # once per pair
    reader.read(peer, pages, [0, 2, 4], timeout=60.0)   # blocks reserved here, same order
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np

from ref_server.model import PagedKVCache

log = logging.getLogger(__name__)

BACKEND = "UCX"
MEMORY_KINDS = ("DRAM", "VRAM")


class NixlError(RuntimeError):
    """A NIXL read or connection that failed (kv_transfer makes it the request's TransferError)."""


class NixlUnavailable(RuntimeError):
    """No NIXL agent here, and why (nixl not installed, its UCX backend did not start)."""


def _agent(name: str):
    # nixl logs INFO lines to stdout, into an instance's output; ours says what matters
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as error:
        raise NixlUnavailable(f"nixl is not installed ({error}): pip install nixl") from None
    try:
        return nixl_agent(name, nixl_agent_config(backends=[BACKEND]))
    except Exception as error:  # nixl raises plain exceptions from its bindings
        raise NixlUnavailable(
            f"a NIXL agent with the {BACKEND} backend did not start: {error}"
        ) from None


@dataclass(frozen=True)
class Pages:
    """Pages of one cache, as a peer reads them: kind "DRAM" (host) or "VRAM" (a GPU) and rows
    `[n, 3]` int64 (address, bytes, device id), page tensor by page tensor
    (`PagedKVCache.page_tensors`), each one's blocks in order."""

    kind: str
    rows: bytes

    def descriptors(self) -> np.ndarray:
        """The rows as NIXL takes them, checked: ValueError naming what is wrong."""
        if self.kind not in MEMORY_KINDS:
            raise ValueError(f"page memory kind must be one of {MEMORY_KINDS}, got {self.kind!r}")
        if not self.rows or len(self.rows) % 24:
            raise ValueError(
                "page rows must be whole (address, bytes, device) triples of int64, got "
                f"{len(self.rows)} bytes"
            )
        rows = np.frombuffer(self.rows, dtype="<i8").reshape(-1, 3)
        if (rows < 0).any() or (rows[:, 1] == 0).any():
            raise ValueError("page rows need non-negative addresses and devices and non-zero sizes")
        return rows.astype(np.uint64)


def cache_pages(cache: PagedKVCache, blocks: list[int]) -> Pages:
    """`blocks`' pages in every page tensor of `cache`, tensor by tensor, as a peer reads them."""
    if not blocks or any(not 0 <= b < cache.num_blocks for b in blocks):
        raise ValueError(
            f"blocks must be a non-empty list in [0, {cache.num_blocks}), got {blocks}"
        )
    kind = "VRAM" if cache.device.type == "cuda" else "DRAM"
    device = (cache.device.index or 0) if kind == "VRAM" else 0
    rows = [(t[b].data_ptr(), t[b].nbytes, device) for t in cache.page_tensors for b in blocks]
    return Pages(kind, np.asarray(rows, dtype="<i8").tobytes())


class NixlCache:
    """An instance's paged cache registered with an agent of its own (either side)."""

    def __init__(self, cache: PagedKVCache, name: str | None = None) -> None:
        self.cache = cache
        self.name = name or f"ref-server-{uuid.uuid4().hex}"
        self.agent = _agent(self.name)
        self.kind = "VRAM" if cache.device.type == "cuda" else "DRAM"
        self._registration = self.agent.register_memory(cache.page_tensors)
        self._peers: dict[bytes, str] = {}  # a peer's metadata -> its agent's name
        size = sum(t.nbytes for t in cache.page_tensors)
        log.info(
            "NIXL agent %s holds the KV cache: %d page tensors, %.1f MiB of %s",
            self.name, len(cache.page_tensors), size / 2**20, self.kind,
        )  # fmt: skip

    def metadata(self) -> bytes:
        """This agent's metadata: what a peer needs to reach it (sent once per pair)."""
        return self.agent.get_agent_metadata()

    def pages(self, blocks: list[int]) -> Pages:
        """The descriptors of `blocks` in every page tensor (the prefill side's leased pages)."""
        return cache_pages(self.cache, blocks)

    def connect(self, metadata: bytes) -> str:
        """The peer's agent name, added on first sight only; NixlError when this agent
        cannot reach it."""
        if metadata not in self._peers:
            try:
                self._peers[metadata] = self.agent.add_remote_agent(metadata)
            except Exception as error:  # nixl's bindings raise their own exception types
                raise NixlError(f"no NIXL connection to the peer: {error}") from None
        return self._peers[metadata]

    def read(self, peer: str, pages: Pages, blocks: list[int], timeout: float) -> int:
        """The peer's `pages` into this cache's `blocks` (the same order, every page tensor); waits
        for completion and returns the bytes read. NixlError when the sizes disagree, the
        transfer fails or outlasts `timeout` seconds; the transfer's handle is released (an
        unfinished transfer cancelled) either way."""
        if peer not in self._peers.values():
            raise NixlError(f"no NIXL connection to {peer!r}: connect() its metadata first")
        try:
            remote = pages.descriptors()
        except ValueError as error:
            raise NixlError(f"the peer's pages: {error}") from None
        local = np.frombuffer(self.pages(blocks).rows, dtype="<i8").reshape(-1, 3)
        if remote.shape != local.shape or (remote[:, 1] != local[:, 1].astype(np.uint64)).any():
            raise NixlError(
                f"the peer offers {len(remote)} pages, {len(blocks)} blocks x "
                f"{len(self.cache.page_tensors)} page tensors of this cache's sizes were asked for"
            )
        what = f"the NIXL read of {len(remote)} pages from {peer!r}"
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local.astype(np.uint64), self.kind),
                self.agent.get_xfer_descs(remote, pages.kind),
                peer,
            )
        except Exception as error:  # nixl's bindings raise their own exception types
            raise NixlError(f"{what} could not start: {error}") from None
        try:
            self._finish(handle, what, timeout)
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as error:
                log.warning("%s: its handle was not released: %s", what, error)
        return int(local[:, 1].sum())

    def _finish(self, handle, what: str, timeout: float) -> None:
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise NixlError(f"{what} outlasted {timeout:g} s")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
        except NixlError:
            raise
        except Exception as error:
            raise NixlError(f"{what} failed: {error}") from None
        if state != "DONE":
            raise NixlError(f"{what} failed")

    def close(self) -> None:
        """Forget the peers and deregister the cache."""
        for name in self._peers.values():
            self.agent.remove_remote_agent(name)
        self._peers.clear()
        self.agent.deregister_memory(self._registration)
