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
            ep.idle_step()
