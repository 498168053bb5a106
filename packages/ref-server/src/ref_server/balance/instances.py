"""Which instance the router sends a request to: pure functions over load snapshots.

The router polls every instance's load once per health interval, so what it knows lags; the
snapshots add what it has itself sent there since (`InstanceLoad.queued_tokens`, `assigned`).

Prefill follows SGLang's cache_aware policy. While the queues are balanced, a request goes
where the longest prefix of its prompt is cached, if that covers more than `cache_threshold`
of its pages: reusing cached pages saves their whole prefill. Otherwise, and always once the
queues are imbalanced, it goes to the least loaded instance: a cache hit behind a long queue
costs more time than it saves, and following hits alone would pile every request of one
system prompt onto one instance.

Decode has no cache to aim at: a request goes to an instance with room, the lowest KV use
first (pages are what a decode instance runs out of).

Ties go to the least prefill work queued (prefill only), then the fewest of this router's
requests in flight, then the fewest running, then the name: the same loads always give the
same choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PREFIX, LOAD = "prefix", "load"  # which rule of pick_prefill chose


@dataclass(frozen=True)
class InstanceLoad:
    """An instance as a balancer sees it."""

    name: str
    queued_tokens: int = 0  # prompt tokens waiting there, polled, plus those sent there since
    queued_flops: float = 0.0  # prefill work waiting there, polled
    running: int = 0  # sequences running there, polled
    kv_usage: float = 0.0  # share of its KV pages in use, polled
    assigned: int = 0  # this router's requests in flight there
    capacity: int = 0  # sequences it runs at once


@dataclass(frozen=True)
class PrefillPolicy:
    """cache_threshold: the share of a request's pages a cached prefix must exceed to decide
    where it goes; the queues are imbalanced when the longest exceeds the shortest by more
    than balance_abs_threshold tokens and by more than balance_rel_threshold times. SGLang's
    defaults."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.cache_threshold <= 1:
            problems.append(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            problems.append(
                f"balance_abs_threshold must be >= 0 tokens, got {self.balance_abs_threshold}"
            )
        if not self.balance_rel_threshold >= 1:  # the longest queue is never below the shortest
            problems.append(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if problems:
            raise ValueError("; ".join(problems))


def imbalanced(candidates: Sequence[InstanceLoad], policy: PrefillPolicy) -> bool:
    """Whether the queued prompt tokens differ by both thresholds (one alone is normal noise:
    a few tokens over an empty queue, or a small relative gap between long queues)."""
    queued = [c.queued_tokens for c in candidates]
    longest, shortest = max(queued), min(queued)
    return (
        longest - shortest > policy.balance_abs_threshold
        and longest > policy.balance_rel_threshold * shortest
    )


def pick_prefill(
    candidates: Sequence[InstanceLoad],
    matched_pages: Sequence[int],
    request_pages: int,
    policy: PrefillPolicy,
) -> tuple[int, str]:
    """(the index of the chosen candidate, PREFIX or LOAD: the rule that chose it).
    matched_pages[i]: how many leading pages of the request candidate i caches;
    request_pages: the request's pages that a cache could hold."""
    if not candidates:
        raise ValueError("pick_prefill needs a candidate")
    if len(matched_pages) != len(candidates):
        raise ValueError(
            f"need one matched_pages per candidate, got {len(matched_pages)} for "
            f"{len(candidates)} candidates"
        )
    order = range(len(candidates))
    least = min(order, key=lambda i: (candidates[i].queued_tokens, *_ties(candidates[i])))
    if request_pages and not imbalanced(candidates, policy):
        best = min(order, key=lambda i: (-matched_pages[i], *_ties(candidates[i])))
        if matched_pages[best] / request_pages > policy.cache_threshold:
            return best, PREFIX
    return least, LOAD


def pick_decode(candidates: Sequence[InstanceLoad]) -> int | None:
    """The index of the candidate with room (fewer of this router's requests than it runs at
    once) and the lowest KV use; None when none has room."""
    roomy = [i for i, c in enumerate(candidates) if c.assigned < c.capacity]
    if not roomy:
        return None
    c = candidates
    return min(roomy, key=lambda i: (c[i].kv_usage, c[i].assigned, c[i].running, c[i].name))


def _ties(instance: InstanceLoad) -> tuple:
    """How equal prefill choices are ordered."""
    return (instance.queued_flops, instance.assigned, instance.running, instance.name)
