"""What each rank runs in the expert-parallel model tests (loaded by path in spawned processes)."""

from __future__ import annotations

import torch

import ref_server.model as M
from ref_server.model import StepBatch


def expert_parallel_matches_one_process(
    rank: int, world: int, group, path: str, device: str = "cpu"
) -> None:
    """Each rank holds 1/world of the routed experts and runs its own tokens (data-parallel
    attention); its logits equal one process holding every expert, within bf16 rounding (the
    two sum expert outputs in different orders). On CUDA, ep_comm's cuda backend moves them."""
    ep = M.from_pretrained(path, dtype=torch.bfloat16, device=device, group=group)
    one = M.from_pretrained(path, dtype=torch.bfloat16, device=device)
    if device == "cuda":
        assert ep.layers[1].mlp.expert_parallel.buffer.backend == "cuda"
    moe = ep.layers[1].mlp
    assert moe.experts.gate_up_proj.shape[0] == 8 // world and moe.first_expert == rank * 8 // world
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(2, 300, (2, 11 + rank), generator=g).to(device)  # shapes differ by rank
    torch.testing.assert_close(ep(ids), one(ids), rtol=3e-2, atol=3e-2)

    # a cached prefill and one decode step, all ranks in step
    prompt = ids[0].tolist()
    caches = [M.PagedKVCache(m.args, 1, 64, device=device) for m in (ep, one)]
    table = torch.zeros(1, 1, dtype=torch.int32)
    steps = [
        StepBatch(torch.tensor(prompt, device=device), [len(prompt)], [len(prompt)], table),
        StepBatch(torch.tensor([7], device=device), [1], [len(prompt) + 1], table),
    ]
    for batch in steps:
        got, want = (m.forward_step(batch, c) for m, c in zip((ep, one), caches, strict=True))
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def an_idle_rank_serves_its_experts(rank: int, world: int, group, path: str, device: str = "cpu"):
    """Rank 0 runs a prompt while the others run idle steps: rank 0's logits equal one process
    holding every expert (the idle ranks computed their experts' share)."""
    ep = M.from_pretrained(path, dtype=torch.bfloat16, device=device, group=group)
    prompt = list(range(5, 20))
    cache = M.PagedKVCache(ep.args, 1, 64, device=device)
    batch = StepBatch(
        torch.tensor(prompt, device=device), [15], [15], torch.zeros(1, 1, dtype=torch.int32)
    )
    with torch.no_grad():
        if rank == 0:
            got = ep.forward_step(batch, cache)
            one = M.from_pretrained(path, dtype=torch.bfloat16, device=device)
            want = one.forward_step(batch, M.PagedKVCache(one.args, 1, 64, device=device))
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        else:
            ep.idle_step(cache)


def two_batches_match_one(rank: int, world: int, group, path: str, device: str = "cpu") -> None:
    """Over ranks of an expert-parallel model, two microbatches overlapped give exactly the
    logits of the same microbatches run one after the other, and those of one batch within
    rounding, in prefill and decode; a rank without tokens runs the same schedule; ranks that
    disagree run one batch."""
    from overlap_sched.split import split_decode, split_prefill

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ep = M.from_pretrained(path, dtype=dtype, device=device, group=group)
    g = torch.Generator().manual_seed(40 + rank)
    lengths = [int(n) for n in torch.randint(1, 90, (3 + rank,), generator=g)]
    table = torch.arange(2 * len(lengths), dtype=torch.int32).view(-1, 2)
    ids = torch.randint(2, 300, (sum(lengths),), generator=g)
    prompt = StepBatch(ids.to(device), lengths, lengths, table)
    decode = StepBatch(
        torch.randint(2, 300, (len(lengths),), generator=g).to(device),
        [1] * len(lengths),
        [n + 1 for n in lengths],
        table,
    )
    splits = {
        id(prompt): split_prefill(prompt.query_lens, prompt.context_lens),
        id(decode): split_decode(decode.context_lens),
    }
    logits = {}
    for how in ("one", "two", "in turn"):
        cache = M.PagedKVCache(ep.args, 2 * len(lengths), 64, device=device)
        got = []
        for batch in (prompt, decode):
            split = splits[id(batch)]
            if how == "one":
                got.append(ep.forward_step(batch, cache))
            elif how == "two":
                got.append(ep.forward_step(batch, cache, split))
            else:  # each microbatch as a batch of its own, A then B
                a, b = (ep.forward_step(p, cache) for p in batch.split(split))
                got.append(torch.cat([a[:-1] if split.cut else a, b]))
        logits[how] = got
    for one, two, in_turn in zip(logits["one"], logits["two"], logits["in turn"], strict=True):
        assert torch.equal(two, in_turn)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(two, one, rtol=tolerance, atol=tolerance)

    # rank 0 runs a prompt in two microbatches while the others have nothing to run
    cache = M.PagedKVCache(ep.args, 2 * len(lengths), 64, device=device)
    if rank == 0:
        two = ep.forward_step(prompt, cache, splits[id(prompt)])
        assert torch.equal(two, logits["two"][0])
    else:
        ep.idle_step(cache, "prefill")

    # runners: rank 0 wants two batches and rank 1 is below the threshold, so both run one
    from overlap_sched.gating import Thresholds, agree, wants_overlap

    thresholds = Thresholds(decode=2, prefill=2 if rank == 0 else 10_000)
    wants = wants_overlap(prompt.num_tokens, "prefill", thresholds)
    assert agree(wants, "prefill", group) is None
    assert agree(True, "decode" if rank == 0 else None, group) == "decode"


def two_batch_graphs_match_eager(rank: int, world: int, group, path: str) -> None:
    """An expert-parallel model's decode graphs, two microbatches from 2 sequences up: rank r
    decodes r + 2 sequences and the last rank none; all replay the bucket of the largest, the
    last with padding rows only. Each rank's logits equal the same step run eagerly (the graph's
    static inputs through `run_step`, with its fixed dispatch rows)."""
    ep = M.from_pretrained(path, dtype=torch.bfloat16, device="cuda", group=group)
    assert ep.expert_parallel.capturable
    cache = M.PagedKVCache(ep.args, 16, 64, device="cuda")
    g = torch.Generator().manual_seed(70 + rank)
    for layer in cache.layers:
        layer[:-1].copy_(torch.randn(layer[:-1].shape, generator=g).to(layer.dtype))
    graphs = M.DecodeGraphs(ep, cache, max_batch=8, max_blocks=2, two_batch_from=2)
    counts = [r + 2 for r in range(world - 1)] + [0]
    bucket = graphs.bucket(max(counts))
    assert graphs.two_batch[bucket]
    b = counts[rank]
    got = None
    for _ in range(2):  # a second replay reads what the first left in the cache
        if b:
            tables = torch.randperm(16, generator=g)[: b * 2].view(b, 2).int()
            context = torch.randint(1, 128, (b,), generator=g).tolist()
            ids = torch.randint(2, 300, (b,), generator=g).cuda()
            got = graphs(StepBatch(ids, [1] * b, context, tables), bucket).clone()
        else:
            graphs.idle(bucket)
        eager = ep.run_step(
            graphs.step_inputs(bucket), cache, "decode", graphs.num_worst_tokens[bucket]
        )
        if b:
            assert torch.equal(got, eager[:b])
            assert torch.isfinite(got).all()
