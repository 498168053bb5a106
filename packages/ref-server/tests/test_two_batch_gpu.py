"""Two-batch overlap on the GPU (`gpu` marker): overlapped microbatches against the same
microbatches run one after the other (bit-identical: the same kernels on the same shapes), and
against one batch within bf16 rounding; from CUDA graphs against the eager step; and over
expert-parallel processes sharing the GPU through ep_comm's cuda backend."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ref_server.model as M
from ep_comm.testing import run_ranks
from overlap_sched import Split, split_prefill
from ref_server.model import StepBatch

pytestmark = pytest.mark.gpu
SCENARIOS = str(Path(__file__).with_name("model_scenarios.py"))


def small_v2_lite():
    return dataclasses.replace(M.PRESETS["v2-lite"], num_hidden_layers=3, vocab_size=4096)


def halves(b: int) -> Split:
    return Split((range(0, b // 2), range(b // 2, b)), (range(0, b // 2), range(b // 2, b)), 0)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got - want).abs().amax(dim=-1) < 0.02 * want.abs().max()).all())


def test_two_prefill_microbatches_on_the_gpu():
    """A batch cut inside its second prompt: overlapped equals A then B exactly, and one batch
    within bf16 rounding."""
    args = small_v2_lite()
    model = M.from_args(args, seed=3, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(3)
    lengths = [200, 700, 90]
    table = torch.arange(3 * 12, dtype=torch.int32).view(3, 12)
    ids = torch.randint(2, args.vocab_size, (sum(lengths),), generator=g).cuda()
    batch = StepBatch(ids, lengths, lengths, table)
    split = split_prefill(lengths, lengths)
    assert split.cut > 0  # the balanced split is inside the 700-token prompt
    caches = [M.PagedKVCache(args, 40, 64, device="cuda") for _ in range(3)]
    two = model.forward_step(batch, caches[0], split)
    a, b = (model.forward_step(part, caches[1]) for part in batch.split(split))
    one = model.forward_step(batch, caches[2])
    assert torch.equal(two, torch.cat([a[:-1], b]))
    assert close(two, one)


def test_two_batch_decode_graphs_match_the_eager_two_batch_step():
    """Buckets from 4 sequences up are captured as two microbatches of half the bucket: at a
    bucket's size the graph and the eager two-batch step run the same kernels, bit-identical;
    against one batch, within bf16 rounding."""
    args = small_v2_lite()
    model = M.from_args(args, seed=4, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(4)
    eager, captured = (M.PagedKVCache(args, 64, 64, device="cuda") for _ in range(2))
    for mine, other in zip(eager.layers, captured.layers, strict=True):
        mine.copy_(torch.randn(mine.shape, generator=g).to(mine.dtype))
        other.copy_(mine)
    graphs = M.DecodeGraphs(model, captured, max_batch=16, max_blocks=4, two_batch_from=4)
    assert graphs.two_batch == {1: False, 2: False, 4: True, 8: True, 16: True}
    for b in (4, 16, 2, 8):
        tables = torch.randperm(64, generator=g)[: b * 4].view(b, 4).int()
        context = torch.randint(1, 4 * 64, (b,), generator=g).tolist()
        ids = torch.randint(2, args.vocab_size, (b,), generator=g)
        batch = StepBatch(ids.cuda(), [1] * b, context, tables)
        got = graphs(batch).clone()
        want = model.forward_step(batch, eager, halves(b) if graphs.two_batch[b] else None)
        assert torch.equal(got, want)
        assert close(got, model.forward_step(batch, eager))


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_two_batches_on_the_cuda_backend(world, checkpoints, tmp_path):
    """Eager, with dispatch and combine on ep_comm's communication stream (async_finish)."""
    checkpoints.write(tmp_path, seed=13)
    run_ranks(world, SCENARIOS, "two_batches_match_one", str(tmp_path), "cuda", limit=600)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_two_batch_graphs_match_the_eager_step(world, checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=14)
    run_ranks(world, SCENARIOS, "two_batch_graphs_match_eager", str(tmp_path), limit=600)
