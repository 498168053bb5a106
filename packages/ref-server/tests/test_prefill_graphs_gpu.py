"""Prefill steps replayed piecewise from CUDA graphs (`PrefillGraphs`) against eager steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.kernels.fp8_gemm import SCALED_MM_MIN_ROWS
from ref_server.model import SamplingParams, StepBatch

pytestmark = pytest.mark.gpu


def small_v2_lite():
    return dataclasses.replace(M.PRESETS["v2-lite"], num_hidden_layers=3, vocab_size=4096)


def caches(args, blocks: int, g: torch.Generator):
    """Two caches of the same random rows; the second's padding block NaN (graphs write and
    read it, and nothing of it may reach a real row)."""
    eager, captured = (M.PagedKVCache(args, blocks, 64, device="cuda") for _ in range(2))
    for mine, other in zip(eager.layers, captured.layers, strict=True):
        mine.copy_(torch.randn(mine.shape, generator=g).to(mine.dtype))
        other.copy_(mine)
        other[captured.padding_block] = float("nan")
    return eager, captured


@pytest.mark.parametrize("weight_dtype", [None, "fp8"])
def test_prefill_graphs_match_the_eager_step(weight_dtype):
    """Batches of several sequences, each new tokens after a cached prefix (context > query),
    over scattered pages. Padding rows go to no expert, so the experts' GEMMs see what an eager
    step gives them, and the dense GEMMs compute each row alike at these sizes: bit-identical
    logits, except for FP8 steps padded past 512 rows, where cuBLASLt's block-scaled GEMM
    picks its kernel by the row count and rounds unlike the eager step's (FP8 casts, and then
    the router's choice among close scores, amplify that). The cache rows written are the
    eager step's, bit for bit where the logits are, and no NaN from the padding block leaks."""
    args = small_v2_lite()
    model = M.from_args(
        args, seed=3, dtype=torch.bfloat16, device="cuda", weight_dtype=weight_dtype
    )
    g = torch.Generator().manual_seed(3)
    eager, captured = caches(args, 96, g)
    graphs = M.PrefillGraphs(model, captured, max_tokens=1024)
    assert graphs.buckets == [256, 512, 1024]
    for queries, prefixes in (
        ([200, 56], [0, 30]),  # 256 tokens: a bucket
        ([512], [700]),  # 512: a bucket, after 700 cached tokens
        ([3, 100, 37], [0, 64, 5]),  # 140 tokens, padded to 256
        ([600, 1, 290], [10, 300, 0]),  # 891 tokens, padded to 1024
    ):
        b = len(queries)
        context = [q + p for q, p in zip(queries, prefixes, strict=True)]
        tables = torch.randperm(96, generator=g)[: b * 20].view(b, 20).int()
        ids = torch.randint(2, args.vocab_size, (sum(queries),), generator=g).cuda()
        batch = StepBatch(ids, queries, context, tables)
        want = model.forward_step(batch, eager)
        # it rewrites the step's cache rows with the same values
        assert torch.equal(model.forward_step(batch, eager), want), "eager steps differ"
        got = graphs(batch)
        assert got.shape == want.shape == (b, args.vocab_size)
        assert torch.isfinite(got).all()
        exact = weight_dtype is None or sum(queries) < SCALED_MM_MIN_ROWS
        if exact or sum(queries) in graphs.buckets:
            assert torch.equal(got, want)
            for mine, other in zip(eager.layers, captured.layers, strict=True):
                assert torch.equal(other[:-1], mine[:-1])
        else:  # the last case
            assert (F.cosine_similarity(got, want, dim=-1) > 0.97).all()
            for mine, other in zip(eager.layers, captured.layers, strict=True):
                close = torch.isclose(other[:-1], mine[:-1], rtol=0.1, atol=0.1)
                assert torch.isfinite(other[:-1]).all() and close.float().mean() > 0.99
    too_many = StepBatch(torch.zeros(1025, dtype=torch.long).cuda(), [1025], [1025], tables[:1])
    with pytest.raises(ValueError, match="1025 tokens exceed the captured 1024"):
        graphs(too_many)
    with pytest.raises(ValueError, match="runs prefill steps"):
        graphs(StepBatch(ids[:2], [1, 1], [5, 9], tables[:2]))


def test_the_engine_prefills_from_graphs_and_generates_as_one_process(monkeypatch):
    """The engine (prefill piecewise from graphs, decode from graphs) against `generate`
    (eager, pages in order): four prompts prefill in one step of 256 tokens, a bucket's size,
    so greedy tokens agree; the prefill graphs are what ran it."""
    model = M.from_args(small_v2_lite(), seed=2, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 4096, (n,), generator=g).tolist() for n in (70, 9, 130, 47)]
    params = SamplingParams(max_tokens=12)
    config = SchedulerConfig(num_blocks=32, block_size=64, max_num_seqs=8, max_model_len=512)
    engine = Engine(model, config)
    assert engine.runner.prefill_graphs.max_tokens == 8192
    steps = []
    replay = M.PrefillGraphs.__call__
    monkeypatch.setattr(
        M.PrefillGraphs,
        "__call__",
        lambda self, batch: steps.append(batch.num_tokens) or replay(self, batch),
    )
    assert engine.generate(prompts, params) == model.generate(prompts, params)
    assert steps == [256]
