"""Speculative decoding's verify and draft steps replayed from CUDA graphs (`gpu` marker):
`SpeculativeSteps` captured against the same steps run eagerly, through the engine token for
token and step by step with padding. Their logic on the CPU: test_speculative_graphs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.model import SamplingParams, StepBatch
from ref_server.model.speculative_graphs import SpeculativeSteps

pytestmark = pytest.mark.gpu

PRESETS = ["v2-lite", "v3.2-lite"]


def small_lite(preset: str) -> M.ModelArgs:
    """A GPU preset cut to 3 layers and 4,096 tokens (V3.2's indexer picking 128 of up to 256),
    with the MTP module."""
    sparse = dict(index_topk=128) if preset == "v3.2-lite" else {}
    return dataclasses.replace(
        M.PRESETS[preset], num_hidden_layers=3, vocab_size=4096, num_nextn_predict_layers=1,
        **sparse,
    )  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("draft_tokens", [1, 2, 3])
def test_the_engine_through_graphs_gives_the_eager_engines_tokens(preset, draft_tokens):
    """An engine whose verify and draft steps replay CUDA graphs captured for every batch size
    up to 4 (so a graph and an eager step run the same kernels on the same shapes) against the
    engine running them eagerly: the same greedy tokens, with the module's drafts and with
    drafts accepted half the time whatever they are (so that the drafted tokens reach the
    text)."""
    args = small_lite(preset)
    model = M.from_args(args, seed=3, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 4096, (n,), generator=g).tolist() for n in (70, 9, 130, 33)]
    config = SchedulerConfig(num_blocks=32, block_size=64, max_num_seqs=4, max_model_len=512)
    params = SamplingParams(max_tokens=24)
    for forced in (None, 0.5):
        eager = Engine(model, config, draft_tokens=draft_tokens, forced_acceptance=forced)
        graphs = Engine(model, config, draft_tokens=draft_tokens, forced_acceptance=forced)
        runner = graphs.runner
        runner.speculative = SpeculativeSteps(
            model, runner.cache, draft_tokens, max_blocks=8, batch_sizes=[1, 2, 3, 4],
            capture_graphs=True,
        )  # fmt: skip
        assert not eager.runner.speculative.captured
        assert graphs.generate(prompts, params) == eager.generate(prompts, params)
        if forced:
            assert graphs.speculative_stats.accepted > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_sampled_requests_draft_in_graphs_as_eagerly(preset):
    """Sampled requests (top-k, top-p, plain, a greedy one among them) through draft graphs
    that sample (`sampled_graphs`) against the engine drafting eagerly: the same tokens, with
    the module's drafts and with drafts accepted half the time."""
    args = small_lite(preset)
    model = M.from_args(args, seed=5, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 4096, (n,), generator=g).tolist() for n in (70, 9, 130, 33)]
    config = SchedulerConfig(num_blocks=32, block_size=64, max_num_seqs=4, max_model_len=512)
    kinds = [dict(top_k=20), dict(top_p=0.9), dict(temperature=0.0), {}]
    params = [
        SamplingParams(max_tokens=12 + 4 * i, temperature=0.8, seed=i, **kind)
        for i, kind in enumerate(kinds)
    ]
    for forced in (None, 0.5):
        tokens = []
        for sampled_graphs in (False, True):
            engine = Engine(model, config, draft_tokens=2, forced_acceptance=forced)
            engine.runner.speculative = SpeculativeSteps(
                model, engine.runner.cache, 2, max_blocks=8, batch_sizes=[1, 2, 3, 4],
                capture_graphs=sampled_graphs, sampled_graphs=sampled_graphs,
            )  # fmt: skip
            seqs = [engine.add(p, q) for p, q in zip(prompts, params, strict=True)]
            while engine.has_work():
                engine.step()
            tokens.append([seq.completion for seq in seqs])
        assert tokens[1] == tokens[0]


def test_the_switch_captures_the_runners_steps(monkeypatch):
    """REF_SERVER_MTP_GRAPHS=1: the runner captures its speculative steps in the buckets of
    max_num_seqs (2: buckets 1 and 2, every batch size) and no decode graphs; greedy tokens
    as without."""
    args = small_lite("v2-lite")
    model = M.from_args(args, seed=4, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 4096, (n,), generator=g).tolist() for n in (40, 100)]
    config = SchedulerConfig(num_blocks=16, block_size=64, max_num_seqs=2, max_model_len=256)
    params = SamplingParams(max_tokens=20)
    want = Engine(model, config, draft_tokens=2).generate(prompts, params)
    monkeypatch.setenv("REF_SERVER_MTP_GRAPHS", "1")
    engine = Engine(model, config, draft_tokens=2)
    runner = engine.runner
    assert runner.speculative.captured and runner.speculative.buckets == [1, 2]
    assert runner.decode_graphs is None and runner.prefill_graphs is None
    assert engine.generate(prompts, params) == want


def random_cache(args, g: torch.Generator) -> M.PagedKVCache:
    cache = M.PagedKVCache(args, 16, 64, device="cuda")
    for tensor in cache.page_tensors:
        values = torch.randn(tensor.shape, generator=g)
        if tensor.dtype == torch.float32:  # index keys' scales
            values = values.abs() + 0.5
        tensor.copy_(values.to(tensor.dtype))
    return cache


@pytest.mark.parametrize("preset", PRESETS)
def test_padding_rows_stay_in_the_padding_block(preset):
    """Three sequences (0, 3 and 1 drafts) verified in the bucket of 4, then drafting 1, 0 and 1
    tokens (the later steps all padding), against the same steps run eagerly at 3 sequences on a
    copy of the cache, the captured one's padding block NaN: the verify step's logits of the
    sequences' tokens within bf16 rounding (the padded GEMMs may round differently) and no NaN
    among them, and the same cache outside the padding block (the rows the padding writes stay
    there)."""
    args = small_lite(preset)
    model = M.from_args(args, seed=5, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(5)
    eager_cache, graph_cache = random_cache(args, g), M.PagedKVCache(args, 16, 64, device="cuda")
    for mine, theirs in zip(graph_cache.page_tensors, eager_cache.page_tensors, strict=True):
        mine.copy_(theirs)
        mine[graph_cache.padding_block] = float("nan")
    eager = SpeculativeSteps(model, eager_cache, 3, max_batch=4, max_blocks=4)
    graphs = SpeculativeSteps(model, graph_cache, 3, max_batch=4, max_blocks=4, capture_graphs=True)
    assert graphs.buckets == [1, 2, 4]
    lens = [1, 4, 2]
    table = torch.randperm(16, generator=g)[:12].view(3, 4).int()
    context = [150 + 30 * i for i in range(3)]
    ids = torch.randint(2, 4096, (sum(lens),), generator=g)
    batch = StepBatch(ids, lens, context, table)
    want, _ = eager.verify(batch)
    got, _ = graphs.verify(batch)
    assert got.shape[0] == 16 and want.shape[0] == 12
    rows = [r for i, n in enumerate(lens) for r in range(4 * i + 4 - n, 4 * i + 4)]
    assert not got[rows].isnan().any()
    assert (got[rows] - want[rows]).abs().amax() < 0.02 * want[rows].abs().max()
    # the verify step kept the first 1, 2 and 2 rows: the module reads them
    kept = [1, 2, 2]
    computed = [c - n + k for c, n, k in zip(context, lens, kept, strict=True)]
    after = torch.randint(2, 4096, (sum(kept),), generator=g)
    hidden = torch.randn(sum(kept), args.hidden_size, generator=g).to("cuda", torch.bfloat16)
    for steps in (eager, graphs):
        steps.draft(
            StepBatch(after, kept, computed, table), hidden, [SamplingParams()] * 3, [1, 0, 1]
        )
    for mine, theirs in zip(graph_cache.page_tensors, eager_cache.page_tensors, strict=True):
        torch.testing.assert_close(mine[:-1].float(), theirs[:-1].float(), rtol=0.13, atol=0.05)
