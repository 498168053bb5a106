"""Scheduler, block manager (no torch) and the engine against one-process generation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ref_server.model as M
from ref_server.engine import (
    BlockManager,
    Engine,
    FinishReason,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    Sequence,
    Status,
    prefix_hashes,
)
from ref_server.model import SamplingParams


def seq(tokens, max_tokens=4) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=max_tokens))


def test_prefix_pages_are_shared_and_counted():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first = seq(range(10))  # pages [0-3] [4-7] [8-9]
    blocks.allocate(first)
    assert len(first.block_table) == 3 and first.num_cached == 0 and blocks.num_free == 5
    first.num_computed = 10
    blocks.register_computed(first)  # the two full pages become findable
    second = seq([*range(8), 42, 43, 44])
    blocks.allocate(second)
    assert second.block_table[:2] == first.block_table[:2] and second.num_cached == 8
    assert second.num_computed == 8 and blocks.num_free == 4
    assert blocks.ref_count[first.block_table[0]] == 2
    # a prompt entirely in the cache still computes its last token: the last page is not reused
    third = seq(range(8))
    blocks.allocate(third)
    assert third.num_cached == 4 and third.block_table[0] == first.block_table[0]
    assert third.block_table[1] != first.block_table[1]


def test_freed_pages_stay_cached_until_reused_least_recent_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    blocks.allocate(a)
    a.num_computed = 5
    blocks.register_computed(a)
    blocks.deallocate(a)
    assert blocks.num_free == 4 and blocks.usage == 0
    again = seq([1, 2, 3, 4, 9])
    blocks.allocate(again)
    assert again.num_cached == 4  # both full pages found after the free
    pages = again.block_table
    blocks.deallocate(again)
    # free pages are reused least recently freed first, and a freed prefix's tail goes before
    # its head: the cached pages [1, 2] and [3, 4] outlive two other pages...
    blocks.allocate(seq([7, 7, 7]))
    assert blocks.cached_prefix([1, 2, 3, 4, 5]) == pages[:2]
    # ...then [3, 4] goes, [1, 2] stays
    blocks.allocate(seq([8]))
    assert blocks.cached_prefix([1, 2, 3, 4, 5]) == pages[:1]


def test_page_exhaustion_is_an_error_not_a_hang():
    blocks = BlockManager(num_blocks=2, block_size=4)
    big = seq(range(9))
    assert not blocks.can_allocate(big)
    with pytest.raises(MemoryError, match="not enough free pages"):
        blocks.allocate(big)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(0, 3)), max_size=40))
def test_page_accounting_holds_under_any_sequence_of_operations(operations):
    blocks = BlockManager(num_blocks=12, block_size=3)
    live: list[Sequence] = []
    for op, length, vocab in operations:
        if op == 0:
            s = seq([vocab] * length)
            if blocks.can_allocate(s):
                blocks.allocate(s)
                s.num_computed = len(s) - 1
                blocks.register_computed(s)
                live.append(s)
        elif op == 1 and live:
            s = live[length % len(live)]
            s.tokens.append(vocab)
            if blocks.can_append(s):
                blocks.append(s)
        elif live:
            blocks.deallocate(live.pop(length % len(live)))
        held = sum(blocks.ref_count)
        assert held == sum(len(s.block_table) for s in live)
        assert blocks.num_free == sum(1 for c in blocks.ref_count if c == 0)
        assert all(c >= 0 for c in blocks.ref_count)


def test_chunked_prefill_keeps_to_the_token_budget():
    config = SchedulerConfig(
        num_blocks=32, block_size=4, max_num_batched_tokens=10, max_model_len=128
    )
    scheduler = Scheduler(config)
    long, short = seq(range(2, 25)), seq(range(2, 6))
    scheduler.add(long)
    scheduler.add(short)
    step = scheduler.schedule()
    assert step.is_prefill and step.seqs == [long] and step.chunks == [10]
    scheduler.advance(step, [None])
    step = scheduler.schedule()
    assert step.chunks == [10] and step.seqs == [long]
    scheduler.advance(step, [None])
    step = scheduler.schedule()  # the rest of long, then short fills the budget
    assert step.seqs == [long, short] and step.chunks == [3, 4]


def test_admission_limits_and_abort():
    config = SchedulerConfig(
        num_blocks=8, block_size=4, max_num_seqs=1, max_model_len=32, max_waiting=2
    )
    scheduler = Scheduler(config)
    with pytest.raises(ValueError, match="exceeds the context limit of 32"):
        scheduler.add(seq(range(30), max_tokens=3))
    a, b = seq(range(5)), seq(range(6))
    scheduler.add(a)
    scheduler.add(b)
    with pytest.raises(QueueFull):
        scheduler.add(seq(range(3)))
    step = scheduler.schedule()
    assert step.seqs == [a]  # max_num_seqs 1
    free_before = scheduler.blocks.num_free
    assert scheduler.abort(a.request_id) is a
    assert a.status is Status.FINISHED and a.finish_reason is FinishReason.ABORT
    assert scheduler.blocks.num_free == free_before + 2
    assert scheduler.abort("nobody") is None
    with pytest.raises(ValueError, match="max_model_len 64 exceeds the cache"):
        SchedulerConfig(num_blocks=2, block_size=16, max_model_len=64)


@pytest.fixture(scope="module", params=["tiny", "v3.2-tiny"])
def tiny(request):
    """V3's tiny model, and V3.2's, whose pages hold the indexer's keys too."""
    return M.from_preset(request.param, seed=3)


PROMPTS = [[5, 6, 7, 8], [9, 10], list(range(2, 150)), [4] * 70]


def test_engine_equals_one_process_generation(tiny):
    params = SamplingParams(max_tokens=12)
    want = tiny.generate(PROMPTS, params)
    config = SchedulerConfig(
        num_blocks=32, block_size=16, max_num_batched_tokens=48, max_model_len=256
    )
    assert Engine(tiny, config).generate(PROMPTS, params) == want


def test_a_shared_prefix_is_reported_cached_and_skipped(tiny):
    params = SamplingParams(max_tokens=6)
    prefix = list(range(10, 74))  # four 16-token pages
    prompts = [[*prefix, 3, 4], [*prefix, 5]]
    want = tiny.generate(prompts, params)
    engine = Engine(tiny, SchedulerConfig(num_blocks=32, block_size=16, max_model_len=256))
    first = engine.add(prompts[0], params)
    while engine.has_work():
        engine.step()
    second = engine.add(prompts[1], params)
    step = engine.scheduler.schedule()  # admits it: 64 prompt tokens found, 1 to compute
    assert second.num_cached == 64 and step.seqs == [second] and step.chunks == [1]
    engine.scheduler.advance(step, engine.runner.run(step))
    while engine.has_work():
        engine.step()
    assert [first.completion, second.completion] == want
    assert engine.scheduler.blocks.cache_hits == 64


def test_preemption_recomputes_and_still_matches(tiny):
    params = SamplingParams(max_tokens=40)
    prompts = [list(range(2, 30)), list(range(40, 70)), list(range(80, 100))]
    want = tiny.generate(prompts, params)
    # 8 pages of 16 tokens: the three cannot all keep their ~70-token contexts
    config = SchedulerConfig(num_blocks=8, block_size=16, max_model_len=128)
    engine = Engine(tiny, config)
    assert engine.generate(prompts, params) == want
    assert engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_reproducible(tiny):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seed=5)
    config = SchedulerConfig(num_blocks=32, block_size=16, max_model_len=256)
    first = Engine(tiny, config).generate(PROMPTS[:2], params)
    assert first == Engine(tiny, config).generate(PROMPTS[:2], params)
    assert first == [tiny.generate([p], params)[0] for p in PROMPTS[:2]]


def test_queued_prefill_flops_follow_the_prompts_still_to_compute(tiny):
    args = tiny.args
    config = SchedulerConfig(
        num_blocks=32, block_size=16, max_num_batched_tokens=100, max_model_len=256
    )
    engine = Engine(tiny, config)
    for prompt in PROMPTS[2:]:  # 148 and 70 tokens
        engine.add(prompt, SamplingParams(max_tokens=2))
    assert engine.queued_prefill_flops() == args.prefill_flops(148) + args.prefill_flops(70)
    engine.step()  # the first 100 tokens of the first prompt
    assert engine.queued_prefill_flops() == args.prefill_flops(48, 100) + args.prefill_flops(70)
    while engine.has_work():
        engine.step()
    assert engine.queued_prefill_flops() == 0


def test_prefix_hashes_chain():
    a, b = prefix_hashes([1, 2, 3, 4], 2), prefix_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same page, different prefix
