"""Overlapped engine steps (`Engine(overlap_steps="on")`) against steps in turn: the same tokens,
the same finishes, one row more for a sequence that ends at a token, pages freed once no step
in flight can write them. On the CPU a step has run by the time it is launched, so what these
check is the bookkeeping: which tokens are pending, which rows are dropped, which pages wait.

The tests on random prompts draw fresh ones; the seed is in their failure messages."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import ref_server.model as M
from ref_server.engine import (
    BlockManager,
    Engine,
    EplbConfig,
    FinishReason,
    SchedulerConfig,
    Sequence,
    Status,
)
from ref_server.model import SamplingParams
from ref_server.services.config import ServeConfig

VOCAB = M.PRESETS["tiny"].vocab_size
OFF_ON = ("off", "on")


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset without an eos token: sequences end where their parameters say."""
    return M.from_args(dataclasses.replace(M.PRESETS["tiny"], eos_token_id=None), seed=3)


@dataclasses.dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0  # the step call it is added before
    hold_pages: bool = False


@dataclasses.dataclass
class Run:
    engine: Engine
    seqs: dict[str, Sequence]
    streamed: dict[str, list[int]]  # the tokens step() handed out for each request, in order
    rows: Counter  # the launched steps' rows of each request
    launches: list  # (prefill step, a step in flight, tokens pending from it), per launch


def drive(engine: Engine, requests: list[Request], after_step=None) -> Run:
    """Each request added before its arrival's step call, the engine stepped until it is done;
    after_step(tokens handed out) after every call."""
    run = Run(engine, {}, {}, Counter(), [])
    launch = engine.runner.launch  # run() launches too: steps in turn are counted alike

    def counted(step, previous=None, **options):
        run.rows.update(seq.request_id for seq in step.seqs)
        pending = any(seq.pending for seq in step.seqs)
        run.launches.append((step.is_prefill, previous is not None, pending))
        return launch(step, previous, **options)

    engine.runner.launch = counted
    waiting = sorted(enumerate(requests), key=lambda item: item[1].arrival)
    calls = 0
    while waiting or engine.has_work():
        while waiting and waiting[0][1].arrival <= calls:
            i, r = waiting.pop(0)
            seq = engine.add(r.prompt, r.params, f"r{i}", hold_pages=r.hold_pages)
            run.seqs[seq.request_id], run.streamed[seq.request_id] = seq, []
        handed = engine.step()
        for seq in handed:
            run.streamed[seq.request_id].append(seq.tokens[-1])
        if after_step:
            after_step(handed)
        calls += 1
    return run


def outcome(run: Run) -> dict:
    return {i: (s.completion, s.finish_reason) for i, s in run.seqs.items()}


def assert_all_pages_free(engine: Engine) -> None:
    blocks = engine.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks and not blocks.freed_in_flight


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def test_overlapped_steps_generate_what_steps_in_turn_do(tiny):
    """Random prompts (one token to several chunks), lengths, greedy and seeded sampling with
    top-k / top-p, arriving while others decode: every request gets the same tokens, streamed
    one by one, and finishes alike; decode steps took pending tokens and prefill chunks ran
    while tokens were pending."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    requests = [
        Request(
            random_prompt(rng, rng.choice([1, rng.randint(2, 40), rng.randint(60, 150)])),
            SamplingParams(
                temperature=rng.choice([0.0, 0.0, 0.8]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([0, 20]),
                max_tokens=rng.randint(1, 16),
                seed=rng.randrange(1000),
            ),
            arrival=rng.randrange(12),
        )
        for _ in range(10)
    ]
    # room for all at once: no preemption, whose recomputed prefixes round otherwise
    config = SchedulerConfig(
        num_blocks=160, block_size=16, max_num_batched_tokens=48, max_model_len=256
    )
    runs = {mode: drive(Engine(tiny, config, overlap_steps=mode), requests) for mode in OFF_ON}
    assert outcome(runs["on"]) == outcome(runs["off"]), f"seed {seed}"
    for run in runs.values():
        assert run.streamed == {i: s.completion for i, s in run.seqs.items()}, f"seed {seed}"
        assert run.engine.scheduler.num_preemptions == 0
        assert_all_pages_free(run.engine)
    assert runs["on"].rows == runs["off"].rows  # every end was known ahead: max_tokens
    launches = Counter(runs["on"].launches)
    assert launches[(False, True, True)] > 0, f"seed {seed}: {launches}"
    assert launches[(True, True, False)] > 0, f"seed {seed}: {launches}"
    assert set(runs["off"].launches) <= {(True, False, False), (False, False, False)}


def stop_after(completion: list[int], index: int) -> int | None:
    """completion[index] if it is not among the tokens before it (so it stops there)."""
    token = completion[index]
    return None if token in completion[:index] else token


def test_a_sequence_that_ends_at_a_token_is_known_a_step_late_and_loses_only_that_row(tiny):
    """An eos token and a stop token, each sampled mid-way: the step queued before they are
    read computes one more row for their sequence. It is dropped: the same tokens as steps in
    turn and as one-process generation, none streamed after the end, and its pages wait for the
    step in flight before anything reuses them."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=12)
    while True:  # prompts whose first two completions each have a token to end at, alone
        prompts = [random_prompt(rng, rng.randint(2, 40)) for _ in range(3)]
        first, second, _ = tiny.generate(prompts, params)
        eos, stop = stop_after(first, 4), stop_after(second, 6)
        ends = None not in (eos, stop) and eos not in second[:7] and stop not in first[:5]
        if ends and eos < 256:  # the byte tokenizer's 256 ids go above an eos id below 256
            break
    model = M.from_args(dataclasses.replace(tiny.args, eos_token_id=eos), seed=3)
    params = dataclasses.replace(params, stop_token_ids=(stop,))
    want = model.generate(prompts, params)
    requests = [Request(p, params) for p in prompts]
    config = SchedulerConfig(num_blocks=32, block_size=16, max_model_len=256)
    engine = Engine(model, config, overlap_steps="on")
    blocks = engine.scheduler.blocks
    tables, waiting = {}, []

    def pages_wait_for_the_step_in_flight(handed):
        for pages in waiting:  # freed one call ago: that step has been read since
            assert all(page in blocks.free for page in pages), f"seed {seed}"
        waiting.clear()
        for seq in handed:
            if seq.finish_reason is FinishReason.STOP:
                pages = tables[seq.request_id]
                assert not any(page in blocks.free for page in pages), f"seed {seed}"
                assert set(pages) <= blocks.freed_in_flight.keys(), f"seed {seed}"
                waiting.append(pages)
        tables.update((s.request_id, list(s.block_table)) for s in engine.scheduler.running)

    on = drive(engine, requests, pages_wait_for_the_step_in_flight)
    off = drive(Engine(model, config, overlap_steps="off"), requests)
    assert [on.seqs[f"r{i}"].completion for i in range(3)] == want, f"seed {seed}"
    assert outcome(on) == outcome(off), f"seed {seed}"
    assert on.streamed == {i: s.completion for i, s in on.seqs.items()}, f"seed {seed}"
    for i, seq in on.seqs.items():
        extra = seq.finish_reason is FinishReason.STOP
        assert on.rows[i] == off.rows[i] + extra, f"seed {seed}: {i}"
    assert on.seqs["r0"].completion[-1] == eos and on.seqs["r1"].completion[-1] == stop
    assert_all_pages_free(engine)


def test_preemption_under_a_tiny_cache_waits_for_the_tokens_in_flight(tiny):
    """Three sequences that cannot all keep their pages: a step that must preempt is scheduled
    only after the step in flight is read (knowing who finished, no token pending), and the
    recomputed sequences get the tokens of one-process generation. Fixed prompts: a recomputed
    prefix's logits come from a prefill, which on other prompts may round a near-tie otherwise
    than generation's decode steps (test_engine's preemption test takes the same ones)."""
    prompts = [list(range(2, 30)), list(range(40, 70)), list(range(80, 100))]
    params = SamplingParams(max_tokens=40)
    config = SchedulerConfig(num_blocks=8, block_size=16, max_model_len=128)
    engine = Engine(tiny, config, overlap_steps="on")
    scheduler, preempted = engine.scheduler, []
    preempt = scheduler._preempt

    def recorded(seq):
        preempted.append((seq.pending, engine.in_flight is None))
        preempt(seq)

    scheduler._preempt = recorded
    run = drive(engine, [Request(p, params) for p in prompts])
    assert [run.seqs[f"r{i}"].completion for i in range(3)] == tiny.generate(prompts, params)
    assert preempted and all(not pending and read for pending, read in preempted)
    assert_all_pages_free(engine)


def test_an_abort_with_a_step_in_flight_drops_its_row_and_frees_its_pages_after_it(tiny):
    """One request aborted while its decode row is in flight, one while a chunk of its prompt
    is: neither gets a token after the abort, their pages wait for that step, and the others get
    the tokens they get alone."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    prompts = [random_prompt(rng, n) for n in (rng.randint(2, 20), 100, rng.randint(2, 20))]
    params = SamplingParams(max_tokens=10)
    config = SchedulerConfig(
        num_blocks=32, block_size=16, max_num_batched_tokens=32, max_model_len=256
    )
    engine = Engine(tiny, config, overlap_steps="on")
    blocks = engine.scheduler.blocks
    seqs = [engine.add(p, params) for p in prompts]
    decoding, prefilling = seqs[0], seqs[1]
    aborted, freed = {}, []

    def abort_if(seq, in_flight_now) -> None:
        if seq.request_id not in aborted and in_flight_now(seq):
            tokens, pages = list(seq.tokens), list(seq.block_table)
            assert engine.abort(seq.request_id) is seq
            assert seq.tokens == tokens and len(seq) == len(tokens), f"seed {seed}"
            assert not any(page in blocks.free for page in pages), f"seed {seed}"
            aborted[seq.request_id] = tokens
            freed.extend(pages)

    def in_flight(seq) -> bool:
        return engine.in_flight is not None and seq in engine.in_flight.step.seqs

    handed_after_abort = []
    while engine.has_work():
        abort_if(decoding, lambda s: in_flight(s) and s.pending and s.num_generated > 2)
        abort_if(prefilling, lambda s: in_flight(s) and not s.pending and s.num_computed < 100)
        handed = engine.step()
        handed_after_abort += [s for s in handed if s.request_id in aborted]
        assert all(page in blocks.free for page in freed), f"seed {seed}"  # the step was read
        freed.clear()
    assert aborted.keys() == {decoding.request_id, prefilling.request_id}, f"seed {seed}"
    assert not handed_after_abort
    for seq in (decoding, prefilling):
        assert seq.status is Status.FINISHED and seq.finish_reason is FinishReason.ABORT
        assert seq.tokens == aborted[seq.request_id]
    assert seqs[2].completion == tiny.generate([prompts[2]], params)[0], f"seed {seed}"
    assert_all_pages_free(engine)


def test_held_pages_and_single_tokens_match_steps_in_turn(tiny):
    """A prefill instance's requests (hold_pages, max_tokens 1) beside decoding ones: no row
    more than steps in turn (their end is known ahead), the same pages held with the same
    contents. A held request that ends at a stop token on a page's first slot: the step queued
    meanwhile took a page for the next token, which it does not keep."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    block = 16
    while True:  # a prompt whose completion has a stop token where a page begins
        prompt = random_prompt(rng, 3 * block - 5)
        stop = stop_after(tiny.generate([prompt], SamplingParams(max_tokens=8))[0], 5)
        if stop is not None:
            break
    held_to_a_stop = SamplingParams(max_tokens=8, stop_token_ids=(stop,))
    requests = [Request(prompt, held_to_a_stop, hold_pages=True)]
    one_token = SamplingParams(max_tokens=1)
    requests += [
        Request(random_prompt(rng, rng.randint(2, 60)), one_token, arrival=a, hold_pages=True)
        for a in range(0, 8, 2)
    ]
    decoding = SamplingParams(max_tokens=12)
    requests += [Request(random_prompt(rng, 10), decoding, arrival=a) for a in (0, 3)]
    config = SchedulerConfig(num_blocks=48, block_size=block, max_model_len=256)
    runs = {mode: drive(Engine(tiny, config, overlap_steps=mode), requests) for mode in OFF_ON}
    on, off = runs["on"], runs["off"]
    assert outcome(on) == outcome(off), f"seed {seed}"
    assert on.seqs["r0"].finish_reason is FinishReason.STOP
    assert on.rows == off.rows + Counter(r0=1), f"seed {seed}"
    for i, request in enumerate(requests):
        if not request.hold_pages:
            continue
        held = {mode: run.engine.held_blocks(f"r{i}") for mode, run in runs.items()}
        seq = on.seqs[f"r{i}"]
        assert len(held["on"]) == len(held["off"]) == -(-seq.num_computed // block)
        assert seq.block_table == held["on"], f"seed {seed}: r{i} kept a page more"
        for mine, theirs in zip(held["on"], held["off"], strict=True):
            torch.testing.assert_close(
                on.engine.runner.read_page(mine), off.engine.runner.read_page(theirs)
            )
    for run in runs.values():
        for i in run.seqs:
            run.engine.release(i)
        assert_all_pages_free(run.engine)


def test_pages_freed_while_a_step_is_in_flight_wait_for_it():
    """Without torch: a page freed while a step is queued is reused once that step is done;
    one freed after a later step was queued waits for that one too; a cached page among them
    may be shared at once (no step writes a page of computed tokens); with no step in flight a
    freed page is free."""
    blocks = BlockManager(num_blocks=5, block_size=2)
    a = Sequence([1, 2, 3], SamplingParams())
    b = Sequence([7, 8, 9], SamplingParams())
    blocks.allocate(a)
    blocks.allocate(b)
    a.num_computed = 2
    blocks.register_computed(a)  # its first page, [1, 2], is cached
    a_pages, b_pages = list(a.block_table), list(b.block_table)
    blocks.step_launched()
    blocks.deallocate(a)
    assert blocks.num_free == 1 and set(blocks.freed_in_flight) == set(a_pages)
    again = Sequence([1, 2, 5], SamplingParams())
    blocks.allocate(again)  # a's cached page and the free one
    assert again.num_cached == 2 and again.block_table[0] == a_pages[0]
    assert blocks.num_free == 0 and set(blocks.freed_in_flight) == {a_pages[1]}
    blocks.step_launched()
    blocks.deallocate(b)
    blocks.step_done()  # the first step: a's last page is free, b's wait for the second
    assert set(blocks.free) == {a_pages[1]} and set(blocks.freed_in_flight) == set(b_pages)
    blocks.step_done()
    assert blocks.num_free == 3 and not blocks.freed_in_flight
    blocks.deallocate(again)
    assert blocks.num_free == 5 and not blocks.freed_in_flight


def test_overlapped_steps_are_refused_where_they_cannot_run_and_auto_is_off(tiny):
    config = SchedulerConfig(num_blocks=8, block_size=16, max_model_len=64)
    assert Engine(tiny, config).overlap_steps is False
    assert Engine(tiny, config, overlap_steps="on").overlap_steps is True
    with pytest.raises(ValueError, match="overlap_steps must be one of"):
        Engine(tiny, config, overlap_steps="yes")
    with pytest.raises(ValueError, match="overlap_steps on: not with expert parallelism"):
        Engine(SimpleNamespace(expert_parallel=object()), config, overlap_steps="on")
    with pytest.raises(ValueError, match="overlap_steps on: not with expert balancing"):
        Engine(tiny, config, overlap_steps="on", eplb=EplbConfig(interval=2))
    with pytest.raises(ValueError, match="overlap_steps on needs instances of one rank without"):
        ServeConfig(overlap_steps="on", ranks=2)
    with pytest.raises(ValueError, match="overlap_steps on needs instances of one rank without"):
        ServeConfig(overlap_steps="on", eplb_interval=5)
    with pytest.raises(ValueError, match="overlap_steps must be one of auto, on, off, got 'y'"):
        ServeConfig(overlap_steps="y")
