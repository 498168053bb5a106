"""The router's guess of which prompt pages each prefill instance has cached.

A page is known by its chained hash (`ref_server.engine.prefix_hashes`): the hash of its
tokens and of every page before it, so one hash stands for a whole prefix. The pages a request
finds cached are therefore the leading hashes of its prompt that the instance holds, and a set
of hashes per instance is already the prefix tree a radix tree would store: no tree is needed.
Each instance's set is an OrderedDict in least-recently-used order, bounded like the
instance's own cache, which also evicts least recently used pages first.

The guess is the router's alone: it learns what it sent where (`insert`, after a prefill), it
does not see other routers' requests, and it learns of an eviction only when a request finds
fewer pages cached than it predicted (`evicted`). An instance that goes down or registers
again has lost its cache (`drop`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_PAGES_PER_INSTANCE = 1 << 17  # ~23 MB of hashes; 8 Mi tokens of 64-token pages


class PrefixIndex:
    def __init__(self, pages_per_instance: int = DEFAULT_PAGES_PER_INSTANCE) -> None:
        if pages_per_instance < 1:
            raise ValueError(f"pages_per_instance must be >= 1, got {pages_per_instance}")
        self.pages_per_instance = pages_per_instance
        self._pages: dict[str, OrderedDict[bytes, None]] = {}

    def pages(self, instance: str) -> int:
        """How many page hashes the index holds for `instance`."""
        return len(self._pages.get(instance, ()))

    def match(self, instance: str, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` the instance is thought to cache. Only a read: the
        router asks every candidate, and only the chosen one will use its pages."""
        pages = self._pages.get(instance)
        if not pages:
            return 0
        matched = 0
        for page_hash in hashes:
            if page_hash not in pages:
                break
            matched += 1
        return matched

    def insert(self, instance: str, hashes: Sequence[bytes]) -> None:
        """The instance caches the pages of `hashes` (one prompt's, first page first): they
        become its most recently used, the first page last, so that a prompt's tail is
        evicted before its head (as the instance evicts, and a tail without its head matches
        nothing); beyond the bound the least recently used go."""
        pages = self._pages.setdefault(instance, OrderedDict())
        for page_hash in reversed(hashes):
            pages[page_hash] = None
            pages.move_to_end(page_hash)
        while len(pages) > self.pages_per_instance:
            pages.popitem(last=False)

    def evicted(self, instance: str, page_hash: bytes) -> None:
        """The instance no longer caches `page_hash` though the index said so: that entry
        goes, and with it every entry used less recently, which the instance's LRU cache
        evicted before it (so far as this router's requests are all it serves)."""
        pages = self._pages.get(instance)
        if not pages or page_hash not in pages:
            return
        while pages.popitem(last=False)[0] != page_hash:
            pass

    def drop(self, instance: str) -> None:
        """Forget everything of `instance` (it went down, or came back with an empty cache)."""
        self._pages.pop(instance, None)
