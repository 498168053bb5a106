"""The router's choice of instances (`ref_server.balance.instances`) and its prefix index
(`ref_server.balance.prefix_index`), as pure functions: SGLang's cache_aware rule for prefill
with specific loads, the decode rule, bad thresholds, and the index's matches and evictions
(hypothesis: against the longest common prefix of what was inserted); the router's settings
of them."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_server.balance import (
    InstanceLoad,
    PrefillPolicy,
    PrefixIndex,
    imbalanced,
    pick_decode,
    pick_prefill,
)
from ref_server.balance.instances import LOAD, PREFIX
from ref_server.balance.prefix_index import DEFAULT_PAGES_PER_INSTANCE
from ref_server.engine import prefix_hashes
from ref_server.services.config import ServeConfig

POLICY = PrefillPolicy()  # 0.3 of the pages, 64 tokens and 1.5 times


def queued(*tokens: int) -> list[InstanceLoad]:
    return [InstanceLoad(f"prefill-{i}", queued_tokens=t) for i, t in enumerate(tokens)]


def test_balanced_queues_send_a_request_to_its_longest_cached_prefix_above_the_threshold():
    candidates = queued(0, 40, 30)  # 40 tokens apart: balanced
    assert pick_prefill(candidates, [0, 2, 4], 10, POLICY) == (2, PREFIX)
    assert pick_prefill(candidates, [0, 4, 2], 10, POLICY) == (1, PREFIX)  # not the least queued


def test_a_prefix_at_or_below_the_threshold_goes_to_the_least_queued():
    candidates = queued(50, 10, 30)
    assert pick_prefill(candidates, [3, 0, 0], 10, POLICY) == (1, LOAD)  # 0.3 is not above it
    assert pick_prefill(candidates, [4, 0, 0], 10, POLICY) == (0, PREFIX)
    assert pick_prefill(candidates, [0, 0, 0], 0, POLICY) == (1, LOAD)  # no full page


def test_queues_uneven_by_both_thresholds_go_to_the_least_queued_despite_a_cached_prefix():
    candidates = queued(200, 100)  # 100 tokens apart and twice as long
    assert imbalanced(candidates, POLICY)
    assert pick_prefill(candidates, [10, 0], 10, POLICY) == (1, LOAD)


@pytest.mark.parametrize(
    "tokens",
    [
        (1000, 700),  # 300 tokens apart but only 1.43 times: the relative one fails
        (60, 0),  # infinitely many times but only 60 tokens apart: the absolute one fails
        (96, 64),  # 32 apart and exactly 1.5 times: neither exceeds
    ],
)
def test_queues_uneven_by_one_threshold_only_are_balanced(tokens):
    candidates = queued(*tokens)
    assert not imbalanced(candidates, POLICY)
    assert pick_prefill(candidates, [10, 0], 10, POLICY) == (0, PREFIX)


def test_thresholds_are_the_policys():
    candidates = queued(60, 0)
    strict = PrefillPolicy(cache_threshold=0.9, balance_abs_threshold=50)
    assert imbalanced(candidates, strict)
    assert pick_prefill(candidates, [10, 0], 10, strict) == (1, LOAD)
    assert pick_prefill(queued(0, 0), [8, 9], 10, strict) == (0, LOAD)  # 0.9 not exceeded
    assert pick_prefill(queued(0, 0), [8, 10], 10, strict) == (1, PREFIX)


def test_ties_go_to_less_work_then_fewer_assigned_then_fewer_running_then_the_name():
    def pick(*loads: InstanceLoad) -> str:
        index, rule = pick_prefill(loads, [0] * len(loads), 4, POLICY)
        assert rule == LOAD
        return loads[index].name

    def load(name: str, flops=0.0, assigned=0, running=0) -> InstanceLoad:
        return InstanceLoad(name, 10, flops, running, assigned=assigned)

    assert pick(load("a", flops=2.0), load("b", flops=1.0, assigned=5, running=5)) == "b"
    assert pick(load("a", assigned=2), load("b", assigned=1, running=9)) == "b"
    assert pick(load("a", running=3), load("b", running=2)) == "b"
    assert pick(load("b"), load("a")) == "a"
    # among equal prefixes too
    matched = [5, 5, 5]
    loads = [load("c", flops=1.0), load("b", assigned=1), load("a", assigned=1)]
    assert pick_prefill(loads, matched, 10, POLICY) == (2, PREFIX)


def test_pick_prefill_needs_one_match_per_candidate():
    with pytest.raises(ValueError, match="needs a candidate"):
        pick_prefill([], [], 4, POLICY)
    with pytest.raises(ValueError, match="one matched_pages per candidate, got 1 for 2"):
        pick_prefill(queued(0, 0), [1], 4, POLICY)


def test_decode_goes_to_room_then_the_lowest_kv_use_then_fewer_assigned_then_running():
    def decode(name, kv=0.0, assigned=0, running=0, capacity=4) -> InstanceLoad:
        return InstanceLoad(
            name, kv_usage=kv, assigned=assigned, running=running, capacity=capacity
        )

    full = decode("a", kv=0.1, assigned=4)
    assert pick_decode([full, decode("b", kv=0.9, assigned=3)]) == 1
    assert pick_decode([decode("a", kv=0.5), decode("b", kv=0.2, assigned=3)]) == 1
    assert pick_decode([decode("a", assigned=2), decode("b", assigned=1, running=7)]) == 1
    assert pick_decode([decode("a", running=2), decode("b", running=1)]) == 1
    assert pick_decode([decode("b"), decode("a")]) == 1
    assert pick_decode([full, decode("b", capacity=0)]) is None  # not registered: no room
    assert pick_decode([]) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cache_threshold=-0.1), r"cache_threshold must be in \[0, 1\], got -0.1"),
        (dict(cache_threshold=1.5), r"cache_threshold must be in \[0, 1\], got 1.5"),
        (dict(cache_threshold=float("nan")), r"cache_threshold must be in \[0, 1\], got nan"),
        (dict(balance_abs_threshold=-1), "balance_abs_threshold must be >= 0 tokens, got -1"),
        (dict(balance_rel_threshold=0.5), "balance_rel_threshold must be >= 1, got 0.5"),
        (dict(balance_rel_threshold=float("nan")), "balance_rel_threshold must be >= 1, got nan"),
    ],
)
def test_bad_thresholds_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        PrefillPolicy(**fields)


# ---------------------------------------------------------------- the prefix index


def pages(*tokens: int, page_size: int = 2) -> list[bytes]:
    return prefix_hashes(list(tokens), page_size)


def test_a_match_is_the_leading_pages_the_instance_was_given():
    index = PrefixIndex()
    index.insert("p0", pages(1, 2, 3, 4, 5, 6))
    assert index.match("p0", pages(1, 2, 3, 4, 9, 9, 7, 7)) == 2
    assert index.match("p0", pages(1, 2, 3, 4, 5, 6, 7, 8)) == 3
    assert index.match("p0", pages(9, 9, 3, 4)) == 0  # the same page after another prefix
    assert index.match("p1", pages(1, 2)) == 0
    assert index.match("p0", []) == 0


def test_the_least_recently_inserted_pages_go_at_the_bound_a_prompts_tail_first():
    index = PrefixIndex(pages_per_instance=4)
    first, second = pages(1, 1, 2, 2, 3, 3), pages(4, 4, 5, 5)
    index.insert("p0", first)
    index.insert("p0", second)  # 5 pages: first's tail goes
    assert index.pages("p0") == 4
    assert index.match("p0", first) == 2
    assert index.match("p0", second) == 2
    index.insert("p0", first[:1])  # used again: now the most recent
    index.insert("p0", pages(6, 6, 7, 7))  # 6 pages: first[1] and then second's tail go
    assert index.match("p0", first) == 1
    assert index.match("p0", second) == 1
    assert index.match("p0", pages(6, 6, 7, 7)) == 2
    index.insert("p1", pages(8, 8))  # the bound is per instance
    assert index.pages("p0") == 4 and index.pages("p1") == 1


def test_an_eviction_drops_the_page_and_everything_used_less_recently():
    index = PrefixIndex()
    old, newer, newest = pages(1, 1, 2, 2), pages(3, 3, 4, 4), pages(5, 5, 6, 6)
    for prompt in (old, newer, newest):
        index.insert("p0", prompt)
    index.insert("p1", old)
    index.evicted("p0", newer[0])  # newer's head was the last of it inserted
    assert [index.match("p0", p) for p in (old, newer, newest)] == [0, 0, 2]
    assert index.match("p1", old) == 2  # another instance's entries stay
    index.evicted("p0", newer[0])  # not there any more: nothing changes
    index.evicted("p2", newer[0])
    assert index.pages("p0") == 2


def test_dropping_an_instance_forgets_it_alone():
    index = PrefixIndex()
    index.insert("p0", pages(1, 1, 2, 2))
    index.insert("p1", pages(1, 1, 2, 2))
    index.drop("p0")
    index.drop("p9")
    assert index.match("p0", pages(1, 1, 2, 2)) == 0
    assert index.match("p1", pages(1, 1, 2, 2)) == 2
    assert index.pages("p0") == 0


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="pages_per_instance must be >= 1, got 0"):
        PrefixIndex(0)


def common_pages(a: list[int], b: list[int], page_size: int) -> int:
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same // page_size


prompts = st.lists(st.integers(0, 2), max_size=12)  # few tokens: prefixes are shared often
steps = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "drop"]), st.sampled_from(["p0", "p1"]), prompts),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps=steps, bound=st.integers(1, 8))
def test_a_match_is_the_longest_common_prefix_with_what_was_inserted(steps, bound):
    """Unbounded, the match is the longest whole-page common prefix with any prompt inserted
    since the instance was last dropped; bounded, it never exceeds that, the index never holds
    more than the bound, and right after an insert the prompt's first pages, up to the bound,
    are matched."""
    unbounded, bounded = PrefixIndex(), PrefixIndex(bound)
    inserted: dict[str, list[list[int]]] = {"p0": [], "p1": []}
    for action, instance, prompt in steps:
        hashes = pages(*prompt)
        if action == "insert":
            unbounded.insert(instance, hashes)
            bounded.insert(instance, hashes)
            inserted[instance].append(prompt)
            assert bounded.match(instance, hashes) == min(len(hashes), bound)  # its head stays
        elif action == "drop":
            unbounded.drop(instance)
            bounded.drop(instance)
            inserted[instance] = []
        want = max((common_pages(prompt, p, 2) for p in inserted[instance]), default=0)
        assert unbounded.match(instance, hashes) == want
        assert bounded.match(instance, hashes) <= want
        assert bounded.pages(instance) <= bound


# ---------------------------------------------------------------- the router's settings


def test_the_serve_settings_default_to_the_policys_and_the_indexs_defaults():
    """config.py keeps its own copies (importing ref_server.balance would load numpy into
    `serve --help`)."""
    config = ServeConfig()
    policy = PrefillPolicy()
    assert config.cache_threshold == policy.cache_threshold
    assert config.balance_abs_threshold == policy.balance_abs_threshold
    assert config.balance_rel_threshold == policy.balance_rel_threshold
    assert config.prefix_index_pages == DEFAULT_PAGES_PER_INSTANCE


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cache_threshold=1.01), r"cache_threshold must be in \[0, 1\], got 1.01"),
        (dict(balance_abs_threshold=-5), "balance_abs_threshold must be >= 0, got -5"),
        (dict(balance_rel_threshold=0.9), "balance_rel_threshold must be >= 1, got 0.9"),
        (dict(prefix_index_pages=0), "prefix_index_pages must be > 0, got 0"),
        (dict(balance_abs_threshold=1.5), "balance_abs_threshold must be int, got 1.5"),
    ],
)
def test_bad_router_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**fields)


def test_an_instance_serving_with_fewer_ranks_counts_for_as_much_less():
    """The workers of an elastic instance serving with 3 of its 4 ranks: each has room for 3/4
    of its sequences, and its prefill queue counts 4/3 as long. So a decode request goes to a
    whole instance's worker once the degraded one holds 6 of 8 (its lower KV use
    notwithstanding), and a prefill to the whole one when their queues are equal."""
    import asyncio

    from ref_server.services.workers import Worker
    from ref_server.v1 import serving_pb2 as pb

    async def snapshots() -> list[InstanceLoad]:
        workers = [Worker(f"w-{i}", "decode", "127.0.0.1:1", "secret") for i in range(2)]
        for worker, ranks, kv in zip(workers, (4, 3), (0.5, 0.1), strict=True):
            worker.info = pb.InstanceInfo(max_running=8, ranks=4)
            worker.load = pb.WorkerLoad(
                ranks=ranks, configured_ranks=4, queued_tokens=300, kv_usage=kv
            )
            worker.assigned = 6
        await asyncio.gather(*(w.channel.close() for w in workers))
        return [w.snapshot() for w in workers]

    whole, degraded = asyncio.run(snapshots())
    assert (whole.capacity, degraded.capacity) == (8, 6)
    assert (whole.queued_tokens, degraded.queued_tokens) == (300, 400)
    assert pick_decode([degraded, whole]) == 1
    assert pick_decode([dataclasses.replace(degraded, assigned=5), whole]) == 0
    assert pick_prefill([degraded, whole], [0, 0], 4, POLICY) == (1, LOAD)
