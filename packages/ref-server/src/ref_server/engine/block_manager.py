"""Pages of the KV cache: allocation, reference counts and the prefix cache. No torch.

A full page is known by the hash of its tokens chained with its predecessor's hash, so equal
hashes mean equal prefixes. The chain starts from the sequence's cache salt: requests of
different salts (tenants) never share pages. Pages whose reference count drops to zero keep
their contents and stay findable by hash until they are reused, least recently freed first
(LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from ref_server.engine.sequence import Sequence


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Stable across processes (the router's prefix affinity compares them)."""
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def prefix_hashes(tokens: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hash of every full page of `tokens`, the chain seeded by `salt`."""
    hashes, parent = [], salt
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 64) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cache_hits = 0  # prompt tokens served from the cache, in total

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1 - self.num_free / self.num_blocks

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def _fresh(self) -> int:
        block, _ = self.free.popitem(last=False)  # the least recently freed
        if block in self.hash_of:
            del self.block_of[self.hash_of.pop(block)]
        self.ref_count[block] = 1
        return block

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the leading `hashes`."""
        blocks = []
        for h in hashes:
            if h not in self.block_of:
                break
            blocks.append(self.block_of[h])
        return blocks

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """The pages already holding a prefix of `tokens` (full pages, never the whole prompt:
        its last token must be computed for its logits)."""
        return self.lookup(prefix_hashes(tokens[:-1], self.block_size))

    def _page_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The chained hashes of seq's full pages among its first `num_tokens` tokens. Kept on
        the sequence and extended as it grows: each page is hashed once."""
        size, hashes = self.block_size, seq.page_hashes
        while (len(hashes) + 1) * size <= num_tokens:
            start = len(hashes) * size
            hashes.append(
                block_hash(
                    hashes[-1] if hashes else seq.cache_salt, seq.tokens[start : start + size]
                )
            )
        return hashes[: num_tokens // size]

    def _cached_pages(self, seq: Sequence) -> list[int]:
        return self.lookup(self._page_hashes(seq, len(seq) - 1))

    def can_allocate(self, seq: Sequence) -> bool:
        cached = self._cached_pages(seq)
        reusable_free = sum(1 for b in cached if self.ref_count[b] == 0)
        return seq.num_blocks(self.block_size) - len(cached) + reusable_free <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Pages for all of seq's tokens, sharing cached prefix pages; sets num_cached."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id} already has pages")
        if not self.can_allocate(seq):
            raise MemoryError(f"not enough free pages for {seq.request_id}")
        cached = self._cached_pages(seq)
        for block in cached:
            self._take(block)
        seq.block_table = cached + [
            self._fresh() for _ in range(seq.num_blocks(self.block_size) - len(cached))
        ]
        seq.num_cached = seq.num_computed = len(cached) * self.block_size
        seq.num_registered = len(cached)
        self.cache_hits += seq.num_cached

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        """Room for seq's newest token."""
        if len(seq) > len(seq.block_table) * self.block_size:
            if not self.free:
                raise MemoryError(f"no free page for {seq.request_id}")
            seq.block_table.append(self._fresh())

    def register_computed(self, seq: Sequence) -> None:
        """Make seq's computed full pages findable by hash (those not registered yet)."""
        if seq.num_computed // self.block_size <= seq.num_registered:
            return  # no page filled since the last call: most decode steps
        hashes = self._page_hashes(seq, seq.num_computed)
        for i in range(seq.num_registered, len(hashes)):
            block, h = seq.block_table[i], hashes[i]
            if block not in self.hash_of and h not in self.block_of:
                self.hash_of[block], self.block_of[h] = h, block
        seq.num_registered = max(seq.num_registered, len(hashes))

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's pages (cached contents stay findable until reused)."""
        for block in reversed(seq.block_table):  # a prefix's tail is evicted before its head
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_computed = seq.num_registered = 0
