"""What each rank runs in the low-latency tests (loaded by path in spawned processes).

Every rank builds the same global problem from one seed, so each can compute what it should
receive, as a set of rows per (local expert, source rank), and what combine should return, bit
for bit, without communication. The checks do not depend on the order of rows inside an
expert, so the cuda backend meets them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from ep_comm import Buffer, Config, EPCommError, low_latency
from ep_comm.fp8 import pack_ue8m0, per_token_cast_to_fp8
from ep_comm.low_latency_backend import LowLatencyHandle
from ep_comm.testing import out_of_memory_once, random_routing

HIDDEN = 512  # UE8M0 packs four 128-channel scales per int32
TOKENS = 16  # T, num_max_dispatch_tokens_per_rank
EXPERTS_PER_RANK = 3
NUM_TOPK = 4


@dataclass
class Problem:
    x: list[torch.Tensor]  # per rank [num_tokens_r, HIDDEN] bf16
    topk_idx: list[torch.Tensor]  # per rank [num_tokens_r, NUM_TOPK] int64
    topk_weights: list[torch.Tensor]  # per rank [num_tokens_r, NUM_TOPK] fp32
    num_experts: int


def make_problem(world: int, seed: int) -> Problem:
    """Rank r has TOKENS - 3r tokens. With 3 or more ranks the last has none; with an even
    number of ranks, every choice of rank world / 2 is -1 (it sends nothing, still receives)."""
    g = torch.Generator().manual_seed(seed)
    num_experts = EXPERTS_PER_RANK * world
    xs, idx, weights = [], [], []
    for rank in range(world):
        num_tokens = 0 if world >= 3 and rank == world - 1 else TOKENS - 3 * rank
        xs.append(torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16))
        i, w = random_routing(num_tokens, num_experts, NUM_TOPK, g, skew=1.0)
        if world % 2 == 0 and rank == world // 2:
            i.fill_(-1)
        idx.append(i)
        weights.append(w)
    return Problem(xs, idx, weights, num_experts)


def expert_output(expert: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert `expert`'s bf16 output for bf16 rows: exact float64 arithmetic, then bf16."""
    return (rows.double() * (1 + expert / 8) + expert / 16).to(torch.bfloat16)


def expected_tokens(p: Problem, rank: int, world: int, local_expert: int, src: int):
    """Source `src`'s tokens that chose local expert `local_expert` of `rank`, in order."""
    expert = rank * (p.num_experts // world) + local_expert
    return (p.topk_idx[src] == expert).any(dim=1).nonzero().squeeze(1)


def unchanged(expert: int, rows: torch.Tensor) -> torch.Tensor:
    return rows


def expected_combine(p: Problem, rank: int, weights=None, expert_output=expert_output):
    """sum_k w[t, k] * expert_output(topk_idx[t, k], x[t]): each product rounded to fp32, added
    in k order, -1 skipped, rounded to bf16 once."""
    idx, x = p.topk_idx[rank], p.x[rank]
    weights = p.topk_weights[rank] if weights is None else weights
    total = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            expert = int(idx[t, k])
            if expert >= 0:
                total[t] = total[t] + weights[t, k] * expert_output(expert, x[t]).float()
    return total.to(torch.bfloat16)


def combine_input(p: Problem, rank: int, world: int, recv_x, count, expert_output=expert_output):
    """Each valid received row through its expert; the rows past the counts NaN (never read)."""
    y = torch.full(recv_x.shape, float("nan"), dtype=torch.bfloat16)
    for e in range(recv_x.shape[0]):
        n = int(count[e])
        y[e, :n] = expert_output(rank * (p.num_experts // world) + e, recv_x[e, :n].cpu())
    return y.to(recv_x.device)


def check_received(
    p: Problem, rank: int, world: int, dispatched, backend: str, fp8=None, round_scale=False
) -> None:
    """dispatched: low_latency_dispatch's result. fp8: None (BF16), "scales" or "ue8m0"."""
    recv_x, count, handle, _, _ = dispatched
    values, scales = recv_x if fp8 else (recv_x, None)
    local_experts = p.num_experts // world
    assert isinstance(handle, LowLatencyHandle) and len(handle) == 5
    assert tuple(handle[2:]) == (TOKENS, HIDDEN, p.num_experts)
    assert values.shape == (local_experts, world * TOKENS, HIDDEN)
    assert values.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    if fp8:
        groups = HIDDEN // (512 if fp8 == "ue8m0" else 128)
        assert scales.shape == (local_experts, world * TOKENS, groups)
        assert scales.dtype == (torch.int32 if fp8 == "ue8m0" else torch.float32)
        assert scales.stride(1) == 1  # column-major per expert, as TMA loads it
    layout = handle.layout_range.cpu()
    begin, num = layout >> 32, layout & 0xFFFFFFFF
    src_info, count = handle.src_info.cpu(), count.cpu()
    for e in range(local_experts):
        blocks = sorted(zip(begin[e].tolist(), num[e].tolist(), strict=True))
        assert [b for b, _ in blocks] == [sum(n for _, n in blocks[:i]) for i in range(world)]
        assert int(count[e]) == sum(n for _, n in blocks)
        if backend == "torch":  # its documented order: by source rank
            assert begin[e].tolist() == [int(num[e, :r].sum()) for r in range(world)]
        for src in range(world):
            rows = slice(int(begin[e, src]), int(begin[e, src] + num[e, src]))
            tokens, order = src_info[e, rows].sort()
            want = expected_tokens(p, rank, world, e, src)
            assert tokens.tolist() == want.tolist()
            got = values[e, rows].cpu()[order]
            if not fp8:
                assert torch.equal(got, p.x[src][want])
                continue
            want_values, want_scales = per_token_cast_to_fp8(p.x[src][want], round_scale)
            if fp8 == "ue8m0":
                want_scales = pack_ue8m0(want_scales)
            assert torch.equal(got.view(torch.uint8), want_values.view(torch.uint8))
            assert torch.equal(scales[e, rows].cpu()[order], want_scales)


def make_buffer(group, world: int, backend: str, timeout: float = 60) -> Buffer:
    num_nvl_bytes = num_rdma_bytes = 0
    if backend == "cuda":  # room for normal-mode calls too
        num_nvl_bytes = Config().get_nvl_buffer_size_hint(HIDDEN * 2, world)
        experts = EXPERTS_PER_RANK * world
        num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, world, experts)
    buffer = Buffer(
        group,
        num_nvl_bytes,
        num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=EXPERTS_PER_RANK,
        backend=backend,
        timeout=timedelta(seconds=timeout),
    )
    assert buffer.backend == backend
    return buffer


def roundtrip(rank: int, world: int, group, seed: int, backend="torch", device="cpu") -> None:
    """BF16 and the three FP8 forms, stats over four calls; combine plain, into `out`, async
    and zero-copy; two dispatches in flight with hooks called out of order; a normal-mode call
    on the same buffer, then clean and LL again."""
    p = make_problem(world, seed)
    buffer = make_buffer(group, world, backend)
    x, topk_idx = p.x[rank].to(device), p.topk_idx[rank].to(device)
    topk_weights = p.topk_weights[rank].to(device)
    num_experts, local_experts = p.num_experts, p.num_experts // world
    cumulative = torch.zeros(local_experts, dtype=torch.int32, device=device)
    waited = torch.zeros(world, dtype=torch.int64, device=device)
    stats = dict(
        cumulative_local_expert_recv_stats=cumulative, dispatch_wait_recv_cost_stats=waited
    )

    plain = buffer.low_latency_dispatch(x, topk_idx, TOKENS, num_experts, use_fp8=False, **stats)
    assert plain[4] is None
    check_received(p, rank, world, plain, backend)
    for fp8, round_scale in (("scales", False), ("scales", True), ("ue8m0", True)):
        flags = dict(use_fp8=True, round_scale=round_scale, use_ue8m0=fp8 == "ue8m0")
        cast = buffer.low_latency_dispatch(x, topk_idx, TOKENS, num_experts, **flags, **stats)
        check_received(p, rank, world, cast, backend, fp8, round_scale)
    assert torch.equal(cumulative, 4 * plain[1])
    assert (waited >= 0).all() and (backend != "torch" or bool((waited > 0).all()))

    _, count, handle, _, _ = plain
    y = combine_input(p, rank, world, plain[0], count)
    want = expected_combine(p, rank)
    combined, _, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
    assert hook is None and torch.equal(combined.cpu(), want)
    out = torch.empty_like(x)
    combine_waited = torch.zeros(world, dtype=torch.int64, device=device)
    into, _, _ = buffer.low_latency_combine(
        y, topk_idx, topk_weights, handle, out=out, combine_wait_recv_cost_stats=combine_waited
    )
    assert into is out and torch.equal(out.cpu(), want)
    assert backend != "torch" or bool((combine_waited > 0).all())
    later, event, _ = buffer.low_latency_combine(
        y, topk_idx, topk_weights, handle, async_finish=True
    )
    if device == "cuda":
        assert event.event is not None and any(t is later for t in event.extra_tensors)
    event.current_stream_wait()
    assert torch.equal(later.cpu(), want)
    buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    nan = torch.full_like(y, float("nan"))
    zero_copy, _, _ = buffer.low_latency_combine(
        nan, topk_idx, topk_weights, handle, zero_copy=True
    )
    assert torch.equal(zero_copy.cpu(), want)
    buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    buffer.low_latency_combine(y, topk_idx, topk_weights, handle)  # moves to the other buffer
    with pytest.raises(ValueError, match="another low-latency op ran in between"):
        buffer.low_latency_combine(nan, topk_idx, topk_weights, handle, zero_copy=True)
    # fp32 absorbs x next to 2**24 x: only the k order gives these sums
    absorbing = torch.tensor([2.0**24, 1.0, -(2.0**24), 0.5]).expand(x.shape[0], -1).contiguous()
    y = combine_input(p, rank, world, plain[0], count, unchanged)
    combined, _, _ = buffer.low_latency_combine(y, topk_idx, absorbing.to(device), handle)
    assert torch.equal(combined.cpu(), expected_combine(p, rank, absorbing, unchanged))

    # Two ops in flight: the second's hook first. Nothing has arrived before a hook runs.
    q = make_problem(world, seed + 1)
    first = buffer.low_latency_dispatch(
        x, topk_idx, TOKENS, num_experts, use_fp8=False, return_recv_hook=True
    )
    assert first[3].event is None and callable(first[4])
    second = buffer.low_latency_dispatch(
        q.x[rank].to(device),
        q.topk_idx[rank].to(device),
        TOKENS,
        num_experts,
        return_recv_hook=True,
    )
    if backend == "torch":
        assert not first[1].any() and not second[1].any()
    second[4]()
    first[4]()
    check_received(q, rank, world, second, backend, "scales")
    check_received(p, rank, world, first, backend)
    y = combine_input(p, rank, world, first[0], first[1])
    combined, _, hook = buffer.low_latency_combine(
        y, topk_idx, topk_weights, first[2], return_recv_hook=True
    )
    hook()
    assert torch.equal(combined.cpu(), want)

    # The normal mode on the same buffer, then clean before the low-latency mode again.
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
    )
    buffer.clean_low_latency_buffer(TOKENS, HIDDEN, num_experts)
    again = buffer.low_latency_dispatch(x, topk_idx, TOKENS, num_experts, use_fp8=False)
    check_received(p, rank, world, again, backend)


def hook_protocol(rank: int, world: int, group) -> None:
    """Hooks run once; a third op while the op two calls back waits for its hook raises on
    every rank; (T, H, E) change only through clean, which also expires pending hooks."""
    p = make_problem(world, seed=21)
    x, topk_idx, num_experts = p.x[rank], p.topk_idx[rank], p.num_experts
    with pytest.raises(ValueError, match="without low_latency_mode=True"):
        Buffer(group).low_latency_dispatch(x, topk_idx, TOKENS, num_experts)
    buffer = make_buffer(group, world, "torch")

    def dispatch(tokens=TOKENS, **flags):
        args = (x[:tokens], topk_idx[:tokens], tokens, num_experts)
        return buffer.low_latency_dispatch(*args, use_fp8=False, **flags)

    first = dispatch(return_recv_hook=True)
    first[4]()
    with pytest.raises(ValueError, match="was already called"):
        first[4]()
    check_received(p, rank, world, first, "torch")

    pending = dispatch(return_recv_hook=True)  # slot s
    y = combine_input(p, rank, world, first[0], first[1])
    buffer.low_latency_combine(y, topk_idx, p.topk_weights[rank], first[2])  # slot 1 - s
    if rank == 1:
        pending[4]()
    match = "the low_latency_dispatch two calls back .* has not had its receive hook called"
    with pytest.raises(ValueError, match=match if rank == 0 else f"rank 0 rejected.*{match}"):
        dispatch()  # slot s again
    if rank == 0:
        pending[4]()
    check_received(p, rank, world, pending, "torch")
    dispatch()

    with pytest.raises(ValueError, match=r"differs from \(16, 512, 6\).*clean_low_latency_buffer"):
        dispatch(tokens=8)
    expired = dispatch(return_recv_hook=True)
    buffer.clean_low_latency_buffer(8, HIDDEN, num_experts)
    with pytest.raises(ValueError, match="expired"):
        expired[4]()
    smaller = dispatch(tokens=8)
    assert smaller[0].shape == (EXPERTS_PER_RANK, world * 8, HIDDEN)
    with pytest.raises(ValueError, match=r"differs from \(8, 512, 6\)"):
        dispatch()


def rejected_everywhere(rank: int, world: int, group) -> None:
    """Rank 1 (or every rank) passes one bad argument at a time: every rank raises ValueError
    saying what, and the buffer stays usable."""
    p = make_problem(world, seed=5)
    buffer = make_buffer(group, world, "torch")
    x, topk_idx, weights = p.x[rank], p.topk_idx[rank], p.topk_weights[rank]
    num_experts, local_experts = p.num_experts, p.num_experts // world
    good = dict(x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=TOKENS)
    good |= dict(num_experts=num_experts, use_fp8=False)
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(**good)
    y = combine_input(p, rank, world, recv_x, count)
    combine_args = dict(x=y, topk_idx=topk_idx, topk_weights=weights, handle=handle)
    bad = rank == 1
    too_many = torch.zeros(TOKENS + 1, HIDDEN, dtype=torch.bfloat16)
    twice, out_of_range = topk_idx.clone(), topk_idx.clone()
    if bad:  # it has tokens
        twice[0, :2] = 0
        out_of_range[0, 0] = num_experts + 5
    dispatch_cases = [
        ("x must be torch.bfloat16", dict(x=x.float())),
        (
            "17 tokens, more than num_max_dispatch_tokens_per_rank=16",
            dict(x=too_many, topk_idx=torch.full((TOKENS + 1, NUM_TOPK), -1)),
        ),
        (f"expert id {num_experts + 5}", dict(topk_idx=out_of_range)),
        ("names an expert twice", dict(topk_idx=twice)),
        ("num_topk must be in 1..11", dict(topk_idx=torch.full((x.shape[0], 12), -1))),
        ("topk_idx must be torch.int64", dict(topk_idx=topk_idx.int())),
        ("use_ue8m0 needs use_fp8=True and round_scale=True", dict(use_fp8=True, use_ue8m0=True)),
        ("cannot both be set", dict(async_finish=True, return_recv_hook=True)),
        (
            "cumulative_local_expert_recv_stats must be torch.int32",
            dict(cumulative_local_expert_recv_stats=torch.zeros(local_experts, dtype=torch.int64)),
        ),
        (
            r"dispatch_wait_recv_cost_stats must have shape \[3\]",
            dict(dispatch_wait_recv_cost_stats=torch.zeros(world, world, dtype=torch.int64)),
        ),
        ("num_experts .* must be a multiple of the group size", dict(num_experts=num_experts + 1)),
        ("call clean_low_latency_buffer", dict(num_max_dispatch_tokens_per_rank=20)),
    ]
    for match, change in dispatch_cases:
        with pytest.raises(ValueError, match=match):
            buffer.low_latency_dispatch(**(good | change if bad else good))
    for match, change in [
        (r"multiple of 4", dict(num_max_dispatch_tokens_per_rank=5)),
        ("hidden .* must be a multiple of 128", dict(x=torch.zeros(1, 200, dtype=torch.bfloat16))),
    ]:
        if "x" in change:
            change["topk_idx"] = torch.full((1, NUM_TOPK), -1)
        with pytest.raises(ValueError, match=match):
            buffer.low_latency_dispatch(**(good | change))

    nan_out = torch.empty(x.shape[0] + 1, HIDDEN, dtype=torch.bfloat16)
    combine_cases = [
        (r"x must have shape \[3, 48, 512\]", dict(x=y[:, :-1])),
        ("topk_weights must be torch.float32", dict(topk_weights=weights.double())),
        ("handle must be the LowLatencyHandle", dict(handle=tuple(handle))),
        ("out must have shape", dict(out=nan_out)),
        ("cannot both be set", dict(async_finish=True, return_recv_hook=True)),
    ]
    for match, change in combine_cases:
        with pytest.raises(ValueError, match=match):
            buffer.low_latency_combine(**(combine_args | change if bad else combine_args))
    with pytest.raises(ValueError, match="use_logfmt=True is not supported in this version"):
        buffer.low_latency_combine(**combine_args, use_logfmt=True)

    combined, _, _ = buffer.low_latency_combine(**combine_args)
    assert torch.equal(combined, expected_combine(p, rank))


def allocation_fails(rank: int, world: int, group) -> None:
    """Rank 1 runs out of memory allocating a dispatch's outputs, then a combine's: every rank
    raises the same EPCommError from that call; the buffer, reset, dispatches and combines
    the right rows again."""
    p = make_problem(world, seed=23)
    buffer = make_buffer(group, world, "torch", timeout=20)
    x, topk_idx, weights = p.x[rank], p.topk_idx[rank], p.topk_weights[rank]
    args = (x, topk_idx, TOKENS, p.num_experts)

    def on_rank_1(call, match: str):
        with out_of_memory_once(low_latency, "empty") as failing:
            if rank != 1:
                failing.failed = True  # the other ranks allocate
            with pytest.raises(EPCommError, match=match):
                call()
        assert failing.failed

    match = r"rank 1/\d: low_latency_dispatch could not allocate its outputs .*simulated"
    on_rank_1(lambda: buffer.low_latency_dispatch(*args, use_fp8=False), match)
    buffer.reset()
    dispatched = buffer.low_latency_dispatch(*args, use_fp8=False)
    check_received(p, rank, world, dispatched, "torch")
    recv_x, count, handle, _, _ = dispatched
    y = combine_input(p, rank, world, recv_x, count)
    match = r"rank 1/\d: low_latency_combine could not allocate its outputs .*simulated"
    on_rank_1(lambda: buffer.low_latency_combine(y, topk_idx, weights, handle), match)
    combined, _, _ = buffer.low_latency_combine(y, topk_idx, weights, handle)
    assert torch.equal(combined, expected_combine(p, rank))
