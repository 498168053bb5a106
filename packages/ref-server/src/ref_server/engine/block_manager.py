"""Pages of the KV cache: allocation, reference counts and the prefix cache. No torch.

A full page is known by the hash of its tokens chained with its predecessor's hash, so equal
hashes mean equal prefixes. The chain starts from the sequence's cache salt: requests of
different salts (tenants) never share pages. Pages whose reference count drops to zero keep
their contents and stay findable by hash until they are reused, least recently freed first
(LRU). A page freed while a step queued on the device may still write it (`step_launched`)
is reused only once that step is done (`step_done`).
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
        self.steps_launched = self.steps_done = 0  # steps queued on the device, steps finished
        # freed pages that a step in flight may still write, each with the steps launched then
        self.freed_in_flight: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1 - self.num_free / self.num_blocks

    def _take(self, block: int) -> None:
        self.free.pop(block, None)
        self.freed_in_flight.pop(block, None)  # it holds cached tokens, which no step rewrites
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] > 0:
            return
        if self.steps_done < self.steps_launched:
            self.freed_in_flight[block] = self.steps_launched
        else:
            self.free[block] = None

    def step_launched(self) -> None:
        """A step is queued on the device: pages freed from now on may still be written by it."""
        self.steps_launched += 1

    def step_done(self) -> None:
        """The oldest step in flight has finished: pages freed before any later one was
        launched are free."""
        self.steps_done += 1
        while self.freed_in_flight:
            block, launched = next(iter(self.freed_in_flight.items()))
            if launched > self.steps_done:
                return
            del self.freed_in_flight[block]
            self.free[block] = None

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

    def _cached_pages(self, seq: Sequence, shareable: int | None) -> list[int]:
        """The cached pages among those of seq's first `shareable` tokens (None: all but its
        newest)."""
        return self.lookup(self._page_hashes(seq, len(seq) - 1 if shareable is None else shareable))

    def can_allocate(self, seq: Sequence, shareable: int | None = None) -> bool:
        cached = self._cached_pages(seq, shareable)
        reusable_free = sum(1 for b in cached if b in self.free)
        return seq.num_blocks(self.block_size) - len(cached) + reusable_free <= self.num_free

    def allocate(self, seq: Sequence, shareable: int | None = None) -> None:
        """Pages for all of seq's tokens, sharing cached prefix pages among those of its first
        `shareable` tokens (None: all but its newest); sets num_cached."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id} already has pages")
        if not self.can_allocate(seq, shareable):
            raise MemoryError(f"not enough free pages for {seq.request_id}")
        cached = self._cached_pages(seq, shareable)
        for block in cached:
            self._take(block)
        seq.block_table = cached + [
            self._fresh() for _ in range(seq.num_blocks(self.block_size) - len(cached))
        ]
        seq.num_cached = seq.num_computed = len(cached) * self.block_size
        seq.num_registered = len(cached)
        self.cache_hits += seq.num_cached

    def needs_page(self, seq: Sequence) -> bool:
        """Whether seq's newest token is past its pages."""
        return len(seq) > len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_page(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        """Room for seq's newest token."""
        if self.needs_page(seq):
            if not self.free:
                raise MemoryError(f"no free page for {seq.request_id}")
            seq.block_table.append(self._fresh())

    def resize(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for exactly seq's first num_tokens tokens: those past them released, or free
        ones added; False, and nothing added, when too few are free."""
        missing = -(-num_tokens // self.block_size) - len(seq.block_table)
        if missing > self.num_free:
            return False
        seq.block_table += [self._fresh() for _ in range(missing)]
        self.trim(seq, num_tokens)
        return True

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

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's pages past those of its first num_tokens tokens."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):  # a prefix's tail is evicted before its head
            self._release(block)
        seq.block_table = seq.block_table[:keep]

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's pages (cached contents stay findable until reused)."""
        self.trim(seq, 0)
        seq.num_computed = seq.num_registered = 0
