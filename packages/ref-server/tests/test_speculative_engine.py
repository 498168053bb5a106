"""Speculative decoding with the MTP module through the engine (CPU): the same greedy tokens
as the plain engine, the same sampled tokens as the one-process path, stops and max_tokens
exact inside accepted runs, rejected drafts' pages given back."""

from __future__ import annotations

import pytest
import torch

import ref_server.model as M
import ref_server.model.speculative as S
from ref_server.engine import Engine, FinishReason, Scheduler, SchedulerConfig, Sequence
from ref_server.model import SamplingParams

BLOCK = 16  # the smallest page the cache takes: runs and rollbacks cross pages


@pytest.fixture(scope="module")
def model():
    return M.from_preset("tiny", mtp=True, seed=11)


def config(**overrides) -> SchedulerConfig:
    options = dict(num_blocks=24, block_size=BLOCK, max_model_len=256)
    return SchedulerConfig(**{**options, **overrides})


def run(engine: Engine, prompts, params: SamplingParams):
    """Every sequence to its end; after each step, each running sequence holds the pages of
    its tokens and its drafts, no more."""
    free = engine.scheduler.blocks.num_free
    seqs = [engine.add(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= -(-(len(seq) + len(seq.drafts)) // BLOCK)
    assert engine.scheduler.blocks.num_free == free
    return seqs


def test_draft_room_takes_pages_for_drafts_and_gives_back_those_of_rejected_ones():
    scheduler = Scheduler(SchedulerConfig(num_blocks=5, block_size=4, max_model_len=20))
    seq = Sequence(list(range(7)), SamplingParams(max_tokens=6))
    scheduler.blocks.allocate(seq)  # 7 tokens: 2 pages
    assert scheduler.draft_room(seq, 3) == 3 and len(seq.block_table) == 3  # 10 tokens
    seq.tokens.append(9)  # a round kept no draft: 8 tokens
    assert scheduler.draft_room(seq, 0) == 0 and len(seq.block_table) == 2
    assert scheduler.blocks.num_free == 3
    seq.tokens += [9, 9, 9]  # 11 tokens, 4 generated: max_tokens leaves room for one draft
    assert scheduler.draft_room(seq, 3) == 1 and len(seq.block_table) == 3
    other = Sequence(list(range(8)), SamplingParams(max_tokens=9))
    scheduler.blocks.allocate(other)  # the last 2 free pages
    assert scheduler.draft_room(other, 3) == 0 and len(other.block_table) == 2
    assert scheduler.blocks.num_free == 0


def prompts_of(seed: int, lengths=(5, 40, 70)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("draft_tokens", [1, 2, 3])
def test_greedy_tokens_equal_the_plain_engine(model, draft_tokens, monkeypatch, oracle):
    prompts = prompts_of(draft_tokens)
    params = SamplingParams(max_tokens=20)
    want = Engine(model, config()).generate(prompts, params)
    # drafts of the plain engine's tokens but at every fifth position: accepted runs, each
    # ended by a rejection (continuations at positions 5-24, 40-59, 70-89: no overlap)
    positions = {len(p) + i: t for p, w in zip(prompts, want, strict=True) for i, t in enumerate(w)}
    monkeypatch.setattr(S, "propose", oracle(positions, wrong_every=5))
    # prefill in chunks: the module reads the prompts' hidden states chunk by chunk too
    engine = Engine(model, config(max_num_batched_tokens=32), draft_tokens=draft_tokens)
    got = [seq.completion for seq in run(engine, prompts, params)]
    assert got == want
    stats = engine.speculative_stats
    assert 0.3 < stats.acceptance_rate < 1
    assert stats.accepted_length > 1.3


def test_sampled_tokens_equal_the_one_process_path(model):
    prompts = prompts_of(5)
    params = SamplingParams(temperature=0.8, seed=123, max_tokens=12)
    want = S.generate_speculative(model, prompts, params, draft_tokens=2, page_size=BLOCK)
    engine = Engine(model, config(), draft_tokens=2)
    got = [seq.completion for seq in run(engine, prompts, params)]
    assert got == want
    assert engine.speculative_stats.drafted > 0


def test_stops_and_max_tokens_end_accepted_runs_exactly(model):
    prompts = prompts_of(7, lengths=(9, 30))
    every = Engine(model, config(), draft_tokens=3, forced_acceptance=1.0)
    seqs = run(every, prompts, SamplingParams(max_tokens=24))
    full = [seq.completion for seq in seqs]
    assert every.speculative_stats.accepted == every.speculative_stats.drafted  # runs of 4
    for max_tokens in (1, 2, 6, 11):
        engine = Engine(model, config(), draft_tokens=3, forced_acceptance=1.0)
        seqs = run(engine, prompts, SamplingParams(max_tokens=max_tokens))
        assert [len(seq.completion) for seq in seqs] == [max_tokens] * 2
        assert {seq.finish_reason for seq in seqs} == {FinishReason.LENGTH}
    # a stop id or eos inside a run of four (the second or third of a round, a round's first
    # token being at 1, 5, 9, ...): the text up to it, which the last step gave in part
    for at, eos in ((6, False), (11, False), (11, True)):
        stop = full[0][at]
        engine = Engine(model, config(), draft_tokens=3, forced_acceptance=1.0)
        if eos:
            engine.eos_ids = frozenset({stop})
        params = SamplingParams(max_tokens=24, stop_token_ids=[] if eos else [stop])
        got = run(engine, prompts, params)
        for seq, text in zip(got, full, strict=True):
            if stop not in text:
                assert (seq.completion, seq.finish_reason) == (text, FinishReason.LENGTH)
                continue
            end = text.index(stop)
            assert (seq.completion, seq.finish_reason) == (text[: end + 1], FinishReason.STOP)
            assert seq.num_new == (end - 1) % 4 + 1 if end else 1


def test_the_engine_refuses_what_it_cannot_speculate_with(model):
    with pytest.raises(ValueError, match="no MTP module"):
        Engine(M.from_preset("tiny"), config(), draft_tokens=1)
    with pytest.raises(ValueError, match="draft_tokens must be 1 to 3"):
        Engine(model, config(), draft_tokens=4)
    with pytest.raises(ValueError, match="not with overlapped steps"):
        Engine(model, config(), draft_tokens=1, overlap_steps="on")
