"""`SpeculativeSteps` on the CPU: speculative decoding's verify and draft steps in their fixed
shapes against the model's eager steps over the same tokens, the engine through graphs stood in
for by eager replays against the engine without them, and no data-dependent shape nor host
read in what a graph captures (fake tensors). Replayed from CUDA graphs:
test_speculative_gpu.py."""

from __future__ import annotations

import dataclasses
from itertools import chain

import pytest
import torch

import ref_server.model as M
import ref_server.model.speculative as S
from overlap_sched.split import Split, split_decode
from ref_server.engine import Engine, SchedulerConfig
from ref_server.model import SamplingParams, StepBatch, speculative_graphs
from ref_server.model.layers import MLP
from ref_server.model.speculative_graphs import SpeculativeSteps, StaticSampling

PAGE = 16
BLOCKS = 12


def random_cache(args, g: torch.Generator) -> M.PagedKVCache:
    """A cache whose every row holds random values (positive scales for FP8 index keys)."""
    cache = M.PagedKVCache(args, BLOCKS, PAGE)
    for tensor in cache.page_tensors:
        values = torch.randn(tensor.shape, generator=g)
        if tensor.dtype == torch.float32:  # index keys' scales
            values = values.abs() + 0.5
        tensor.copy_(values.to(tensor.dtype))
    return cache


def copy_of(args, cache: M.PagedKVCache) -> M.PagedKVCache:
    other = M.PagedKVCache(args, BLOCKS, PAGE)
    for mine, theirs in zip(other.page_tensors, cache.page_tensors, strict=True):
        mine.copy_(theirs)
    return other


def poison_padding_block(cache: M.PagedKVCache) -> None:
    for tensor in cache.page_tensors:
        tensor[cache.padding_block] = float("nan")


def assert_same_cache_but_padding(got: M.PagedKVCache, want: M.PagedKVCache) -> None:
    """The same rows written, within the bf16 rounding of their inputs (a step of e4m3 in FP8
    index keys), outside the padding block."""
    for mine, theirs in zip(got.page_tensors, want.page_tensors, strict=True):
        tolerance = 2**-3 if mine.dtype == torch.float8_e4m3fn else 0.02
        torch.testing.assert_close(
            mine[:-1].float(), theirs[:-1].float(), rtol=tolerance, atol=0.02
        )


def batch_of(g: torch.Generator, args, lens: list[int], first: int) -> StepBatch:
    """Sequences bringing lens random tokens after at least `first` cached ones, each in 3
    random pages with room for 3 drafts more."""
    table = torch.randperm(BLOCKS, generator=g)[: 3 * len(lens)].view(len(lens), 3).int()
    context = [int(torch.randint(first, 3 * PAGE - 8, (1,), generator=g)) + n for n in lens]
    ids = torch.randint(2, args.vocab_size, (sum(lens),), generator=g)
    return StepBatch(ids, lens, context, table)


@pytest.mark.parametrize("two_batch", [False, True])
@pytest.mark.parametrize("preset", ["tiny", "v3.2-tiny"])
def test_verify_rows_match_the_models_step_over_the_same_tokens(preset, two_batch):
    """A verify step of 0 to 3 drafts a sequence (1 to 4 rows in groups of 4) through the decode
    kernel at s_q = 4, as one batch or two overlapped microbatches split between sequences,
    against `every_row_step` over the same tokens (a prefill chunk each, attending to
    decompressed keys): logits and hidden states within bf16 rounding, the same cache rows
    written, and nothing read from the padding block, which the groups' padding rows write (it
    starts as NaN)."""
    g = torch.Generator().manual_seed(21)
    model = M.from_preset(preset, mtp=True, seed=21)
    want_cache = random_cache(model.args, g)
    got_cache = copy_of(model.args, want_cache)
    poison_padding_block(got_cache)
    batch = batch_of(g, model.args, [1, 4, 2, 3], first=5)
    want_logits, want_hidden = model.every_row_step(batch, want_cache)
    steps = SpeculativeSteps(model, got_cache, draft_tokens=3, max_batch=4, max_blocks=3)
    split = split_decode(batch.context_lens) if two_batch else None
    logits, hidden = steps.verify(batch, split)
    assert logits.shape == (16, model.args.vocab_size)
    rows = torch.tensor(
        [r for i, n in enumerate(batch.query_lens) for r in range(4 * i + 4 - n, 4 * i + 4)]
    )
    for got, want in ((logits[rows], want_logits), (hidden[rows], want_hidden)):
        assert not got.isnan().any()
        assert (got - want).abs().amax() < 0.02 * want.abs().max()
    assert_same_cache_but_padding(got_cache, want_cache)


@pytest.mark.parametrize("preset", ["tiny", "v3.2-tiny"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafts_match_the_eager_drafts(preset, temperature):
    """After a verify step that kept 1 to 4 rows a sequence, drafting 3, 0, 1 and 2 tokens:
    the first step over groups of 4 rows, the later ones over a row of every sequence (padding
    for those done drafting), against `speculative.draft` (the kept rows as a prefill chunk,
    then the drafting sequences only): the same drafts, the same q within bf16 rounding, the
    same module's rows written in the cache, nothing read from the padding block."""
    g = torch.Generator().manual_seed(22)
    model = M.from_preset(preset, mtp=True, seed=22)
    want_cache = random_cache(model.args, g)
    got_cache = copy_of(model.args, want_cache)
    poison_padding_block(got_cache)
    batch = batch_of(g, model.args, [1, 4, 2, 3], first=5)
    hidden = torch.randn(batch.num_tokens, model.args.hidden_size, generator=g)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    counts = [3, 0, 1, 2]
    want, want_q = S.draft(model, want_cache, batch, hidden, params, counts)
    steps = SpeculativeSteps(model, got_cache, draft_tokens=3, max_batch=4, max_blocks=3)
    got, got_q = steps.draft(batch, hidden, params, counts)
    assert got == want
    assert [len(d) for d in got] == counts
    for q, reference in zip(chain(*got_q), chain(*want_q), strict=True):
        if temperature:
            torch.testing.assert_close(q, reference, rtol=0.02, atol=1e-3)
        else:
            assert q is reference is None
    assert_same_cache_but_padding(got_cache, want_cache)


class ReplayedEagerly:
    """A CUDA graph's stand-in on the CPU: a replay runs the captured function again, over the
    static inputs as they are then, and writes its outputs over those of the capture, where a
    graph's replay writes them."""

    def __init__(self, run) -> None:
        self.run, self.replays = run, 0
        self.output = run()

    def replay(self) -> None:
        self.replays += 1
        fresh = self.run()
        if isinstance(fresh, torch.Tensor):  # the draft's tokens; the verify's logits and hidden
            self.output.copy_(fresh)
        else:
            for mine, new in zip(self.output, fresh, strict=True):
                mine.copy_(new)

    def pool(self) -> None:
        return None


def capture_eagerly(run, device, pool=None):
    graph = ReplayedEagerly(run)
    return graph, graph.output


SAMPLED = [  # the five sequences', the shortest first: top-k and top-p end first
    dict(temperature=0.7, top_k=20, seed=6),
    dict(temperature=1.1, top_p=0.9, seed=7),
    dict(temperature=0.0),
    dict(temperature=0.8, seed=5),
    dict(temperature=0.9, seed=8),
]


@pytest.mark.parametrize(
    ("draft_tokens", "sampled"), [(1, False), (2, False), (3, False), (2, True), (3, True)]
)
def test_the_engine_through_graphs_gives_the_eager_engines_tokens(
    draft_tokens, sampled, monkeypatch
):
    """The engine with its speculative steps captured (each graph stood in for by an eager
    replay: the bucket's shapes, the static inputs, the drafting on the device) against the
    engine without graphs: the same tokens, with the module's drafts and with drafts accepted
    half the time whatever they are (so that the drafts' tokens reach the text). Five
    sequences decode in the bucket of 8, then fewer in smaller ones, some wanting fewer
    drafts. Greedy, or sampled (drafting in the sampling graphs: a greedy row among sampled
    ones, with top-k / top-p while those sequences run, without once they have ended)."""
    monkeypatch.setattr(speculative_graphs, "capture", capture_eagerly)
    model = M.from_preset("tiny", mtp=True, seed=23)
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 40, 70, 1, 17)]
    config = SchedulerConfig(num_blocks=40, block_size=PAGE, max_num_seqs=8, max_model_len=256)
    for forced in (None, 0.5):
        engines = [
            Engine(model, config, draft_tokens=draft_tokens, forced_acceptance=forced)
            for _ in range(2)
        ]
        runner = engines[1].runner
        runner.speculative = SpeculativeSteps(
            model, runner.cache, draft_tokens, max_batch=8, max_blocks=16, capture_graphs=True,
            sampled_graphs=sampled,
        )  # fmt: skip
        assert runner.speculative.buckets == [1, 2, 4, 8]
        params = [
            SamplingParams(max_tokens=6 + 3 * i, **(SAMPLED[i] if sampled else {}))
            for i in range(len(prompts))
        ]
        tokens = []
        for engine in engines:
            seqs = [engine.add(p, q) for p, q in zip(prompts, params, strict=True)]
            while engine.has_work():
                engine.step()
            tokens.append([seq.completion for seq in seqs])
        assert tokens[1] == tokens[0]
        replays = {key: graph.replays for key, graph in runner.speculative.graphs.items()}
        # five sequences in 8 (two with top-k / top-p); the last, alone, without
        first, last = ("draft-filtered", "draft-sampled") if sampled else ("draft", "draft")
        assert replays["verify", 8] and replays[first, 8]
        assert any(replays["verify", b] and replays[last, b] for b in (1, 2, 4))
        if forced:
            assert engines[1].speculative_stats.accepted > 0


@pytest.mark.parametrize("kind", ["verify", "draft", "draft-filtered"])
def test_speculative_steps_have_no_data_dependent_shape_nor_host_read(kind):
    """A V3.2 model's verify and draft steps as their graphs run them (the draft greedy, or
    sampling with top-k and top-p), under fake tensors: a shape that depends on a value, or
    reading one on the host, raises. Every layer dense, the
    module's too (the experts' CPU path selects rows by their count; their CUDA path, which
    graphs capture, does not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = dataclasses.replace(
        M.PRESETS["v3.2-tiny"], first_k_dense_replace=3, num_nextn_predict_layers=1
    )
    model = M.from_args(args, seed=24, dtype=torch.bfloat16)
    model.mtp.mlp = MLP(args.hidden_size, args.intermediate_size).bfloat16()
    g = torch.Generator().manual_seed(24)
    steps = SpeculativeSteps(model, random_cache(args, g), draft_tokens=3, max_batch=4)
    batch = batch_of(g, args, [1, 4, 2], first=5)
    if kind == "verify":
        steps.verify(batch)  # fills the static inputs
    else:
        hidden = torch.randn(batch.num_tokens, args.hidden_size, generator=g).bfloat16()
        steps.draft(batch, hidden, [SamplingParams()] * 3, [3, 1, 2])
    sampling = StaticSampling(4, 3, args.vocab_size, "cpu")
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=s) for s in range(3)]
    sampling.fill(params, batch.context_lens)
    choose = sampling.choose(filtered=True) if kind == "draft-filtered" else None
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        if kind == "verify":
            logits, hidden = steps.run_verify(4)
            assert logits.shape == (16, args.vocab_size) and hidden.shape == (16, args.hidden_size)
        else:
            assert steps.run_draft(4, choose).shape == (3, 4)


def test_speculative_steps_refuse_what_they_cannot_run():
    model = M.from_preset("tiny", mtp=True, seed=25)
    cache = M.PagedKVCache(model.args, BLOCKS, PAGE)
    with pytest.raises(ValueError, match="CUDA graphs need the cache on a CUDA device, not cpu"):
        SpeculativeSteps(model, cache, 2, max_batch=2, capture_graphs=True)
    with pytest.raises(ValueError, match="needs a model with an MTP module"):
        SpeculativeSteps(M.from_preset("tiny"), cache, 2)
    with pytest.raises(ValueError, match="draft_tokens must be 1 to 3"):
        SpeculativeSteps(model, cache, 4)
    steps = SpeculativeSteps(model, cache, 2, max_batch=2, max_blocks=3)
    g = torch.Generator().manual_seed(25)
    with pytest.raises(ValueError, match="3 sequences and 3 blocks exceeds the 2 sequences"):
        steps.verify(batch_of(g, model.args, [1, 1, 1], first=5))
    with pytest.raises(
        ValueError, match=r"brings 4 tokens; .* at most 3 \(its newest and 2 drafts\)"
    ):
        steps.verify(batch_of(g, model.args, [4, 1], first=5))
    inside = Split(tokens=(range(2), range(2, 4)), seqs=(range(2), range(1, 2)), cut=1)
    with pytest.raises(ValueError, match="splits between sequences, not inside one's drafts"):
        steps.verify(batch_of(g, model.args, [3, 1], first=5), inside)


def test_the_switch_is_checked_and_captures_nothing_on_the_cpu(monkeypatch):
    model = M.from_preset("tiny", mtp=True, seed=26)
    config = SchedulerConfig(num_blocks=8, block_size=PAGE, max_model_len=64)
    monkeypatch.setenv("REF_SERVER_MTP_GRAPHS", "yes")
    with pytest.raises(ValueError, match="REF_SERVER_MTP_GRAPHS must be auto, 1 or 0, got 'yes'"):
        Engine(model, config, draft_tokens=1)
    monkeypatch.delenv("REF_SERVER_MTP_GRAPHS")  # auto: eager where the graphs cannot be
    monkeypatch.setenv("REF_SERVER_MTP_SAMPLED_GRAPHS", "on")
    with pytest.raises(ValueError, match="REF_SERVER_MTP_SAMPLED_GRAPHS must be 1 or 0, got 'on'"):
        Engine(model, config, draft_tokens=1)
    monkeypatch.setenv("REF_SERVER_MTP_SAMPLED_GRAPHS", "1")
    assert Engine(model, config, draft_tokens=1).runner.speculative.sampling is None  # on the CPU
    Engine(model, config, draft_tokens=1, two_batch="on")
    monkeypatch.setenv("REF_SERVER_MTP_GRAPHS", "1")
    runner = Engine(model, config, draft_tokens=1).runner
    assert runner.speculative.width == 2 and not runner.speculative.captured
    with pytest.raises(
        ValueError, match="captures one rank's speculative steps as one batch: not with expert"
    ):
        Engine(model, config, draft_tokens=1, two_batch="on")
