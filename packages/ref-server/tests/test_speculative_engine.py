"""Speculative decoding with the MTP module through the engine (CPU): the same greedy tokens
as the plain engine, the same sampled tokens as the one-process path, stops and max_tokens
exact inside accepted runs, rejected drafts' pages given back; a prompt prefilled in one engine
drafts in the other from the hidden state its pages bring."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ref_server.model as M
import ref_server.model.speculative as S
from ep_comm.testing import run_ranks
from ref_server.engine import Engine, FinishReason, Scheduler, SchedulerConfig, Sequence
from ref_server.model import SamplingParams

SCENARIOS = str(Path(__file__).with_name("model_scenarios.py"))
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


def hand_over(prefill: Engine, decode: Engine, prompt: list[int], params, request_id: str):
    """A prompt prefilled in one engine and started in the other, as a prefill instance and a
    decode instance do it: the pages move as bytes (what the gRPC stream carries)."""
    first = dataclasses.replace(params, max_tokens=1)
    held = prefill.add(prompt, first, request_id, hold_pages=True)
    while prefill.has_work():
        prefill.step()
    targets = decode.reserve(prompt, held.completion[0], params, request_id)
    pages = prefill.pages(request_id)
    for index, block in targets:
        decode.runner.write_page(block, pages[index])
    assert prefill.release(request_id)
    return decode.start(request_id), targets


def module_rows(engine: Engine, seq: Sequence, count: int) -> torch.Tensor:
    """The MTP module's cache rows of seq's first `count` positions `[count, width]`."""
    page = engine.scheduler.config.block_size
    rows = [seq.block_table[p // page] * page + p % page for p in range(count)]
    return engine.runner.cache.layers[-1].flatten(0, 2)[rows]


def test_a_decode_engine_drafts_from_the_hidden_state_the_prefill_engine_handed_over(model):
    """Prompts prefilled in chunks by one engine (one of them a page long), their pages copied
    into another: before verifying anything, the second engine's module drafts what one engine
    drafts after its prefill, over the same module rows; then both give the same tokens and
    drafting stats. The drafts are the random module's own: they depend on the hidden state
    handed over and on the module's rows."""
    prompts = prompts_of(13, lengths=(5, 16, 40, 70))
    params = SamplingParams(max_tokens=12)
    one = Engine(model, config(num_blocks=48), draft_tokens=3)
    want = [one.add(prompt, params) for prompt in prompts]
    one.step()  # every prompt prefilled and drafted for
    prefill = Engine(model, config(num_blocks=48, max_num_batched_tokens=32), draft_tokens=3)
    decode = Engine(model, config(num_blocks=48), draft_tokens=3)
    got = [hand_over(prefill, decode, p, params, f"r{i}")[0] for i, p in enumerate(prompts)]
    assert not any(seq.drafts for seq in got)
    assert decode.step() == []  # their first drafts, nothing verified
    for seq, mine, prompt in zip(got, want, prompts, strict=True):
        assert len(seq.drafts) == 3
        assert (seq.drafts, seq.tokens) == (mine.drafts, mine.tokens)
        assert len(seq.block_table) == len(mine.block_table)  # pages for the drafts
        rows = module_rows(decode, seq, len(prompt))
        assert rows.abs().sum(-1).min() > 0  # every row written
        torch.testing.assert_close(rows, module_rows(one, mine, len(prompt)), rtol=0, atol=1e-2)
    while one.has_work() or decode.has_work():
        one.step()
        decode.step()
    assert [seq.completion for seq in got] == [seq.completion for seq in want]
    assert decode.speculative_stats == one.speculative_stats
    assert decode.speculative_stats.drafted > 0


def test_the_page_of_a_handed_over_prompt_s_last_token_always_comes_with_it(model):
    """A decode engine that has a page-aligned prompt's pages cached still takes the page of
    its last token from the transfer (it brings the hidden state of the first draft, whose
    module row must not land in a page other sequences share); a plain one shares it."""
    prompt = prompts_of(17, lengths=(32,))[0]
    params = SamplingParams(max_tokens=3)
    for draft_tokens, again in ((3, [1]), (0, [])):
        prefill = Engine(model, config(), draft_tokens=draft_tokens)
        decode = Engine(model, config(), draft_tokens=draft_tokens)
        first, targets = hand_over(prefill, decode, prompt, params, "a")
        assert [index for index, _ in targets] == [0, 1]
        blocks = list(first.block_table)
        while decode.has_work():
            decode.step()
        second, targets = hand_over(prefill, decode, prompt, params, "b")
        assert targets == [(index, second.block_table[index]) for index in again]
        assert second.block_table[0] == blocks[0]  # the first page is shared
        assert (second.block_table[1] == blocks[1]) == (not again)


def test_the_engine_refuses_what_it_cannot_speculate_with(model):
    with pytest.raises(ValueError, match="no MTP module"):
        Engine(M.from_preset("tiny"), config(), draft_tokens=1)
    with pytest.raises(ValueError, match="draft_tokens must be 1 to 3"):
        Engine(model, config(), draft_tokens=4)
    with pytest.raises(ValueError, match="not with overlapped steps"):
        Engine(model, config(), draft_tokens=1, overlap_steps="on")


def test_expert_parallel_engines_draft_the_plain_tokens_over_two_gloo_ranks():
    run_ranks(2, SCENARIOS, "speculative_engines_match_plain_ones", limit=300)
