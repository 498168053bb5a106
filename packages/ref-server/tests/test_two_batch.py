"""Two-batch overlap in the model: DeepSeek's schedules in SGLang's order; two microbatches run
overlapped give exactly the logits of the same two microbatches run one after the other, and
the logits of one batch within float32 rounding (CPU GEMMs are not batch-invariant: the router's
8-wide GEMM differs by 6e-8 between 80 rows and 30 + 50), alone and over two gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ref_server.model as M
import ref_server.model.speculative as S
from ep_comm.testing import run_ranks
from overlap_sched import Recorder
from overlap_sched.gating import Thresholds
from overlap_sched.split import Split, split_decode, split_prefill
from ref_server.engine import Engine, SchedulerConfig
from ref_server.model import PagedKVCache, SamplingParams, StepBatch


@pytest.fixture(scope="module", params=["tiny", "v3.2-tiny"])
def model(request):
    """V3's tiny model, and V3.2's, whose index keys a cut sequence's second part reads too."""
    return M.from_preset(request.param, seed=3)


def contiguous_table(lengths: list[int], page: int = 64) -> torch.Tensor:
    pages = [-(-n // page) for n in lengths]
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    start = 0
    for row, n in enumerate(pages):
        table[row, :n] = torch.arange(start, start + n)
        start += n
    return table


def step_logits(model, steps, split_of=None, in_turn=False):
    """Logits of each step in turn on a fresh cache; split_of(batch): its Split, or None;
    in_turn: run a split batch's microbatches as batches of their own, A then B."""
    cache = PagedKVCache(model.args, 16, 64)
    out = []
    for batch in steps:
        split = split_of(batch) if split_of else None
        if in_turn and split is not None:
            a, b = (model.forward_step(p, cache) for p in batch.split(split))
            out.append(torch.cat([a[:-1] if split.cut else a, b]))  # a cut sequence ends in B
        else:
            out.append(model.forward_step(batch, cache, split))
    return out


def assert_same(model, two: torch.Tensor, in_turn: torch.Tensor, one: torch.Tensor) -> None:
    """Two microbatches against one: float32 GEMMs over fewer rows round differently (MKL picks
    its kernels by shape and thread count; 1.9e-4 measured on a 2-core machine, 2026-12-03).
    V3.2's prefill rounds its absorbed queries to the cache's bf16, as its kernels take them,
    which can turn such a difference into a bf16 step (5.3e-4 measured, 2026-12-05)."""
    assert torch.equal(two, in_turn)
    torch.testing.assert_close(two, one, rtol=0, atol=1e-3 if model.args.is_sparse else 5e-4)
    assert torch.equal(two.argmax(-1), one.argmax(-1))


def prefill(lengths, seed=0, cached=None):
    """A prefill batch of prompts of these lengths; cached: tokens of each already in the cache
    (the step computes the rest)."""
    g = torch.Generator().manual_seed(seed)
    cached = cached or [0] * len(lengths)
    ids = torch.randint(
        2, 500, (sum(n - c for n, c in zip(lengths, cached, strict=True)),), generator=g
    )
    query = [n - c for n, c in zip(lengths, cached, strict=True)]
    return StepBatch(ids, query, list(lengths), contiguous_table(lengths))


def test_decode_runs_five_stages_per_moe_layer_in_sglangs_order(model):
    """R-2.1: with delta 2, B's attention runs while A's dispatch and combine are in flight:
    SHARED(A) ATTN-0(B) | MLP(A) | ATTN-1(B) | combine-recv(A) | SHARED(B) ATTN-0(A) | ..."""
    lengths = [5, 9, 30, 12]
    cache = PagedKVCache(model.args, 16, 64)
    model.forward_step(prefill(lengths), cache)
    decode = StepBatch(
        torch.tensor([3, 4, 5, 6]), [1] * 4, [n + 1 for n in lengths], contiguous_table(lengths)
    )
    recorder = Recorder(cuda=False)
    model.run_step(
        [(p.input_ids, p.metadata(cache)) for p in decode.split(split_decode(decode.context_lens))],
        cache,
        "decode",
        recorder=recorder,
    )
    stages = [
        (0, "embed L0.comm_prepare_attn L0.attn.prepare L0.attn.core L0.comm_prepare_mlp L0.mlp "
            "L0.postprocess L1.comm_prepare_attn L1.attn.prepare"),
        (0, "L1.attn.core L1.comm_prepare_mlp L1.gate L1.select_experts"),
        (0, "L1.dispatch_a L1.shared_experts"),  # SHARED(A)
        (1, "embed L0.comm_prepare_attn L0.attn.prepare L0.attn.core L0.comm_prepare_mlp L0.mlp "
            "L0.postprocess L1.comm_prepare_attn L1.attn.prepare"),  # ATTN-0(B)
        (0, "L1.dispatch_b L1.experts L1.combine_a"),  # MLP(A)
        (1, "L1.attn.core L1.comm_prepare_mlp L1.gate L1.select_experts"),  # ATTN-1(B)
        (0, "L1.combine_b"),  # combine-recv(A)
        (1, "L1.dispatch_a L1.shared_experts"),  # SHARED(B)
        (0, "L1.output L1.postprocess L2.comm_prepare_attn L2.attn.prepare"),  # ATTN-0(A)
        (1, "L1.dispatch_b L1.experts L1.combine_a"),  # MLP(B)
        (0, "L2.attn.core L2.comm_prepare_mlp L2.gate L2.select_experts"),  # ATTN-1(A)
        (1, "L1.combine_b"),  # combine-recv(B)
        (0, "L2.dispatch_a L2.shared_experts"),
        (1, "L1.output L1.postprocess L2.comm_prepare_attn L2.attn.prepare"),
        (0, "L2.dispatch_b L2.experts L2.combine_a"),
        (1, "L2.attn.core L2.comm_prepare_mlp L2.gate L2.select_experts"),
        (0, "L2.combine_b"),
        (1, "L2.dispatch_a L2.shared_experts"),
        (0, "L2.output L2.postprocess head"),
        (1, "L2.dispatch_b L2.experts L2.combine_a"),
        (1, "L2.combine_b"),
        (1, "L2.output L2.postprocess head"),
    ]  # fmt: skip
    expected = [(m, name) for m, names in stages for name in names.split()]
    assert [(s.microbatch, s.name) for s in recorder.spans] == expected


def test_prefill_runs_two_stages_per_moe_layer_side_by_side(model):
    """R-2.1 for prefill (delta 0): A[attention .. dispatch_a] B[same] A[dispatch_b, experts,
    combine_a] B[same] A[shared, combine_b, output, next attention .. dispatch_a] ..."""
    batch = prefill([40, 24])
    recorder = Recorder(cuda=False)
    cache = PagedKVCache(model.args, 16, 64)
    halves = batch.split(split_prefill(batch.query_lens, batch.context_lens))
    model.run_step(
        [(p.input_ids, p.metadata(cache)) for p in halves], cache, "prefill", recorder=recorder
    )
    attention = "comm_prepare_attn attn.prepare attn.core comm_prepare_mlp"
    first = f"embed {' '.join('L0.' + n for n in attention.split())} L0.mlp L0.postprocess"
    moe_a = "gate select_experts dispatch_a"
    stages = [
        f"{first} {' '.join('L1.' + n for n in (attention + ' ' + moe_a).split())}",
        "L1.dispatch_b L1.experts L1.combine_a",
        "L1.shared_experts L1.combine_b L1.output L1.postprocess "
        + " ".join("L2." + n for n in (attention + " " + moe_a).split()),
        "L2.dispatch_b L2.experts L2.combine_a",
        "L2.shared_experts L2.combine_b L2.output L2.postprocess head",
    ]
    expected = [(m, name) for names in stages for m in (0, 1) for name in names.split()]
    assert [(s.microbatch, s.name) for s in recorder.spans] == expected


def cut(batch: StepBatch, seq: int, tokens_to_a: int) -> Split:
    """A split that gives A sequences [0, seq) and the first tokens_to_a new tokens of seq."""
    row = sum(batch.query_lens[:seq]) + tokens_to_a
    return Split(
        tokens=(range(0, row), range(row, batch.num_tokens)),
        seqs=(range(0, seq + (tokens_to_a > 0)), range(seq, len(batch.query_lens))),
        cut=tokens_to_a,
    )


@pytest.mark.parametrize(
    ("lengths", "cached", "where"),
    [
        ([30, 50, 7], None, (1, 0)),  # at a sequence boundary
        ([120], None, (0, 70)),  # one prompt cut in two across a page boundary
        ([33, 90, 5], None, (1, 17)),  # inside a sequence among others
        ([100, 40], [64, 0], (0, 20)),  # a cached prefix, then a cut inside the new part
        ([3, 2], None, (0, 1)),  # one token on A's side of the cut
    ],
)
def test_two_prefill_microbatches_give_the_logits_of_one(model, lengths, cached, where):
    batch = prefill(lengths, seed=len(lengths), cached=cached)
    steps = [batch]
    if cached:  # the cached prefix, computed in an earlier step
        head = prefill(cached[:1], seed=9)
        steps = [StepBatch(head.input_ids, [cached[0]], [cached[0]], batch.block_table[:1]), batch]
    split_of = lambda b: cut(b, *where) if b is batch else None  # noqa: E731
    one = step_logits(model, steps)
    two = step_logits(model, steps, split_of)
    assert_same(model, two[-1], step_logits(model, steps, split_of, in_turn=True)[-1], one[-1])


def test_two_decode_microbatches_give_the_logits_of_one(model):
    lengths = [3, 70, 20, 1, 130]
    first = prefill(lengths, seed=4)
    decode = StepBatch(
        torch.tensor([7, 8, 9, 10, 11]),
        [1] * 5,
        [n + 1 for n in lengths],
        contiguous_table([n + 1 for n in lengths]),
    )
    first.block_table = decode.block_table
    split = split_decode(decode.context_lens)
    assert split.seqs == (range(0, 4), range(4, 5))  # balanced by context: 130 against 98
    split_of = lambda b: split if b is decode else None  # noqa: E731
    one = step_logits(model, [first, decode])
    two = step_logits(model, [first, decode], split_of)
    assert_same(
        model, two[1], step_logits(model, [first, decode], split_of, in_turn=True)[1], one[1]
    )


def test_the_engine_generates_the_same_tokens_with_two_batches(model, monkeypatch):
    import ref_server.model.transformer as transformer

    overlapped = []
    original = transformer.run_overlapped
    monkeypatch.setattr(
        transformer, "run_overlapped", lambda *a, **k: overlapped.append(1) or original(*a, **k)
    )
    config = SchedulerConfig(num_blocks=32, max_num_batched_tokens=100, max_model_len=512)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 90, 17, 64, 1)]
    results = {}
    for two_batch in ("off", "on"):
        engine = Engine(
            model, config, two_batch=two_batch, thresholds=Thresholds(decode=2, prefill=2)
        )
        greedy = engine.generate(prompts, SamplingParams(max_tokens=9))
        sampled = engine.generate(
            prompts[:3], SamplingParams(max_tokens=6, temperature=0.8, seed=5)
        )
        results[two_batch] = (greedy, sampled)
        if two_batch == "off":
            assert overlapped == []
    assert results["on"] == results["off"]
    assert len(overlapped) > 10  # chunked prefills and decode steps both ran in two batches


def test_the_runner_runs_one_batch_below_the_thresholds(model, monkeypatch):
    import ref_server.model.transformer as transformer

    overlapped = []
    monkeypatch.setattr(transformer, "run_overlapped", lambda *a, **k: overlapped.append(a))
    engine = Engine(
        model, SchedulerConfig(num_blocks=16, max_model_len=512), two_batch="on"
    )  # 64 / 512 tokens
    engine.generate([list(range(2, 40))] * 3, SamplingParams(max_tokens=3))
    assert overlapped == []
    with pytest.raises(ValueError, match="two_batch must be one of"):
        Engine(model, SchedulerConfig(num_blocks=16, max_model_len=512), two_batch="yes")


def test_expert_parallel_two_batches_match_one_over_two_gloo_ranks(checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=12)
    scenarios = str(Path(__file__).with_name("model_scenarios.py"))
    run_ranks(2, scenarios, "two_batches_match_one", str(tmp_path), limit=300)


@pytest.mark.parametrize("drafter", ["module", "oracle"])
def test_drafts_verified_in_two_batches_give_the_plain_engine_s_tokens(
    monkeypatch, oracle, drafter
):
    """SGLang's users report two-batch overlap and MTP breaking each other. Here every verify
    step of two sequences or more (each sequence's newest token and its drafts, through the
    decode kernel) runs as two overlapped microbatches split between sequences, and the greedy
    tokens are the plain engine's, drafting by the random module (drafts rejected) or by an
    oracle (runs of them accepted)."""
    from ref_server.engine.model_runner import ModelRunner

    plain, mtp = (M.from_preset("tiny", seed=3, mtp=with_module) for with_module in (False, True))
    config = SchedulerConfig(
        num_blocks=48, block_size=16, max_num_batched_tokens=100, max_model_len=512
    )
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 90, 17)]
    params = SamplingParams(max_tokens=12)
    want = Engine(plain, config).generate(prompts, params)
    if drafter == "oracle":  # the continuations' positions do not overlap
        drafts = {
            len(p) + i: t for p, w in zip(prompts, want, strict=True) for i, t in enumerate(w)
        }
        monkeypatch.setattr(S, "propose", oracle(drafts, wrong_every=5))
    verifies = []  # the splits of decode steps, whose sequences verify drafts
    split = ModelRunner._split

    def recorded(self, batch, between_sequences=False):
        result = split(self, batch, between_sequences)
        if between_sequences:
            verifies.append(result)
        return result

    monkeypatch.setattr(ModelRunner, "_split", recorded)
    engine = Engine(
        mtp, config, two_batch="on", thresholds=Thresholds(decode=2, prefill=2), draft_tokens=3
    )
    assert engine.generate(prompts, params) == want
    assert engine.speculative_stats.drafted > 0
    assert len(verifies) >= 3 and not any(s.cut for s in verifies)
