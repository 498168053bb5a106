"""What each rank runs in the low-latency GPU tests (loaded by path in spawned processes).

Every rank builds the same global problem from one seed, so each knows exactly what it should
receive from every rank and what combine must return, bit for bit. The calls go through
`Buffer`, as a user's would, except in `late_rank` (see there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from ep_comm import Buffer
from ep_comm.collectives import Collectives, EPCommError
from ep_comm.fp8 import per_token_cast_to_fp8
from ep_comm.low_latency import LowLatencyMode
from ep_comm.low_latency_backend import rdma_size_hint
from ep_comm.streams import CommStream
from ep_comm.testing import random_routing

HIDDEN = 512  # the smallest hidden size UE8M0 allows
TOKENS = 24  # num_max_dispatch_tokens_per_rank
EXPERTS_PER_RANK = 3
NUM_TOPK = 4
FLAVOURS = {  # use_fp8, round_scale, use_ue8m0
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "fp8-round": (True, True, False),
    "ue8m0": (True, True, True),
}


@dataclass
class Problem:
    x: list[torch.Tensor]  # per rank [n_r, HIDDEN] bf16
    topk_idx: list[torch.Tensor]  # per rank [n_r, NUM_TOPK] int64
    topk_weights: list[torch.Tensor]
    num_experts: int


def make_problem(world: int, seed: int, sizes: list[int] | None = None) -> Problem:
    """Rank r has sizes[r] tokens (default: the last rank none, the others up to TOKENS)."""
    g = torch.Generator().manual_seed(seed)
    num_experts = EXPERTS_PER_RANK * world
    sizes = sizes or [0 if r == world - 1 else TOKENS - 5 * (r % 3) for r in range(world)]
    xs, idx, weights = [], [], []
    for n in sizes:
        xs.append((torch.randn(n, HIDDEN, generator=g) * 3).to(torch.bfloat16))
        i, w = random_routing(n, num_experts, NUM_TOPK, g, skew=1.0, drop=0.15)
        idx.append(i)
        weights.append(w)
    return Problem(xs, idx, weights, num_experts)


def make_buffer(group, backend: str) -> Buffer:
    world = group.size()
    rdma = rdma_size_hint(TOKENS, HIDDEN, world, EXPERTS_PER_RANK * world)
    buffer = Buffer(
        group, 0, rdma, low_latency_mode=True, backend=backend, timeout=timedelta(seconds=120)
    )
    assert buffer.low_latency_backend == backend
    return buffer


def make_mode(group, backend: str, ll_timeout: float = 60.0) -> LowLatencyMode:
    comm = Collectives(group, timedelta(seconds=120))
    world = group.size()
    num_experts = EXPERTS_PER_RANK * world
    rdma = rdma_size_hint(TOKENS, HIDDEN, world, num_experts) if backend == "cuda" else 0
    return LowLatencyMode(comm, backend, rdma, timedelta(seconds=ll_timeout), CommStream())


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., G/4] -> the fp32 powers of two [..., G] they encode."""
    exponents = packed.contiguous().reshape(-1).view(torch.uint8).to(torch.int32)
    return (exponents << 23).view(torch.float32).view(*packed.shape[:-1], -1)


def sent_rows(p: Problem, flavour: str, source: int):
    """What `source` sends: values as bytes [n, ...] uint8 and fp32 scales [n, G] (or None)."""
    use_fp8, round_scale, _ = FLAVOURS[flavour]
    x = p.x[source]
    if not use_fp8:
        return x.view(torch.uint8), None
    values, scale_inv = per_token_cast_to_fp8(x, round_scale)
    return values.view(torch.uint8), scale_inv


def expected_blocks(p: Problem, flavour: str, rank: int, world: int) -> dict:
    """(local expert, source) -> (source tokens ascending, value bytes, fp32 scales or None)."""
    blocks = {}
    for source in range(world):
        values, scales = sent_rows(p, flavour, source)
        for local in range(EXPERTS_PER_RANK):
            e = rank * EXPERTS_PER_RANK + local
            tokens = (p.topk_idx[source] == e).any(dim=1).nonzero().flatten()
            blocks[local, source] = (
                tokens.to(torch.int32),
                values[tokens],
                None if scales is None else scales[tokens],
            )
    return blocks


def received_blocks(recv_x, count, handle, flavour: str, world: int) -> dict:
    """The same, read from a dispatch's outputs (rows of a block sorted by source token)."""
    use_fp8, _, use_ue8m0 = FLAVOURS[flavour]
    values, scales = recv_x if use_fp8 else (recv_x, None)
    values = values.cpu().view(torch.uint8)
    if scales is not None:
        scales = scales.cpu()
        scales = unpack_ue8m0(scales) if use_ue8m0 else scales
    src_info, layout = handle.src_info.cpu(), handle.layout_range.cpu()
    count = count.cpu()
    blocks, total = {}, [0] * EXPERTS_PER_RANK
    for local in range(EXPERTS_PER_RANK):
        for source in range(world):
            begin, n = int(layout[local, source]) >> 32, int(layout[local, source]) & 0xFFFFFFFF
            rows = torch.arange(begin, begin + n)
            order = src_info[local, rows].argsort()
            rows = rows[order]
            blocks[local, source] = (
                src_info[local, rows],
                values[local, rows],
                None if scales is None else scales[local, rows],
            )
            total[local] += n
    assert count.tolist() == total, (count.tolist(), total)
    return blocks


def assert_blocks_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, (tokens, values, scales) in want.items():
        g_tokens, g_values, g_scales = got[key]
        assert torch.equal(g_tokens, tokens), (key, g_tokens, tokens)
        assert torch.equal(g_values, values), key
        if scales is not None:
            assert torch.equal(g_scales, scales), key


def expert_output(recv_x, rank: int, flavour: str) -> torch.Tensor:
    """A fake expert on the device: local expert le multiplies its rows by 1 + e / 8 (e global),
    after dequantizing FP8."""
    use_fp8, _, use_ue8m0 = FLAVOURS[flavour]
    if use_fp8:
        values, scales = recv_x
        scales = unpack_ue8m0(scales) if use_ue8m0 else scales
        shape = (*values.shape[:2], HIDDEN // 128, 128)
        v = (values.float().view(shape) * scales.unsqueeze(3)).view(values.shape)
    else:
        v = recv_x.float()
    factor = 1 + (rank * EXPERTS_PER_RANK + torch.arange(v.shape[0], device=v.device)) / 8
    return (v * factor.view(-1, 1, 1).float()).to(torch.bfloat16)


def expected_combine(p: Problem, rank: int, flavour: str) -> torch.Tensor:
    """out[t] = bf16(sum over k in order of w * expert row), fp32, no fused multiply-add."""
    values, scales = sent_rows(p, flavour, rank)
    n = p.x[rank].shape[0]
    if scales is None:
        v = p.x[rank].float()
    else:
        fp8 = values.view(torch.float8_e4m3fn).float().view(n, HIDDEN // 128, 128)
        v = (fp8 * scales.unsqueeze(2)).view(n, HIDDEN)
    out = torch.zeros(n, HIDDEN, dtype=torch.float32)
    for k in range(NUM_TOPK):
        e = p.topk_idx[rank][:, k]
        valid = e >= 0
        factor = (1 + e[valid].float() / 8).unsqueeze(1)
        row = (v[valid] * factor).to(torch.bfloat16).float()
        out[valid] = out[valid] + p.topk_weights[rank][valid, k, None] * row
    return out.to(torch.bfloat16)


def _inputs(p: Problem, rank: int, device):
    return p.x[rank].to(device), p.topk_idx[rank].to(device), p.topk_weights[rank].to(device)


def roundtrip(rank: int, world: int, group, device: str, backends: list[str], seed: int):
    """Every flavour, plain calls then hooks, on each backend: exactly the expected rows, counts
    and scales per (local expert, source), stats, and combine bit for bit; the backends' results
    are then equal to each other too."""
    p = make_problem(world, seed)
    x, topk_idx, topk_weights = _inputs(p, rank, device)
    E = p.num_experts
    for backend in backends:
        buffer = make_buffer(group, backend)
        for flavour, (use_fp8, round_scale, use_ue8m0) in FLAVOURS.items():
            want = expected_blocks(p, flavour, rank, world)
            stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32, device=device)
            cost = torch.zeros(world, dtype=torch.int64, device=device)
            for hook in (False, True):
                recv_x, count, handle, _, receive = buffer.low_latency_dispatch(
                    x,
                    topk_idx,
                    TOKENS,
                    E,
                    cumulative_local_expert_recv_stats=stats,
                    dispatch_wait_recv_cost_stats=cost,
                    use_fp8=use_fp8,
                    round_scale=round_scale,
                    use_ue8m0=use_ue8m0,
                    return_recv_hook=hook,
                )
                if hook:
                    receive()
                got = received_blocks(recv_x, count, handle, flavour, world)
                assert_blocks_equal(got, want)
                y = expert_output(recv_x, rank, flavour)
                out, _, receive = buffer.low_latency_combine(
                    y, topk_idx, topk_weights, handle, return_recv_hook=hook
                )
                if hook:
                    receive()
                assert torch.equal(out.cpu(), expected_combine(p, rank, flavour)), (
                    backend,
                    flavour,
                )
            per_expert = [
                sum(len(want[le, s][0]) for s in range(world)) for le in range(EXPERTS_PER_RANK)
            ]
            assert stats.cpu().tolist() == [2 * c for c in per_expert]
            assert bool((cost >= 0).all())
        zero_copy_and_two_in_flight(buffer, p, rank, world, device)
        buffer.destroy()


def zero_copy_and_two_in_flight(buffer, p: Problem, rank: int, world: int, device) -> None:
    """Two dispatches in flight (both slots), their hooks in order, then their combines, one
    with zero_copy."""
    q = make_problem(world, 1000 + world)  # a second problem, the same on every rank
    first, second = _inputs(p, rank, device), _inputs(q, rank, device)
    E = p.num_experts
    calls = []
    for x, topk_idx, _ in (first, second):
        recv_x, count, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, TOKENS, E, use_fp8=False, return_recv_hook=True
        )
        calls.append((recv_x, count, handle, hook))
    for *_, hook in calls:
        hook()
    for problem, (recv_x, count, handle, _) in zip((p, q), calls, strict=True):
        assert_blocks_equal(
            received_blocks(recv_x, count, handle, "bf16", world),
            expected_blocks(problem, "bf16", rank, world),
        )
    combines = []
    for zero_copy, (problem, inputs, (recv_x, _, handle, _)) in enumerate(
        zip((p, q), (first, second), calls, strict=True)
    ):
        y = expert_output(recv_x, rank, "bf16")
        if zero_copy:
            staged = buffer.get_next_low_latency_combine_buffer(handle)
            staged.copy_(y)
            y = staged
        out, _, hook = buffer.low_latency_combine(
            y, inputs[1], inputs[2], handle, zero_copy=bool(zero_copy), return_recv_hook=True
        )
        combines.append((problem, out, hook))
    for problem, out, hook in combines:
        hook()
        assert torch.equal(out.cpu(), expected_combine(problem, rank, "bf16"))


def _capture(buffer, x, topk_idx, topk_weights, hooks: bool):
    """A CUDA graph of dispatch -> a fake expert (x 2) -> combine; returns (graph, out)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, _, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, TOKENS, EXPERTS_PER_RANK * buffer.group_size, use_fp8=False,
            return_recv_hook=hooks,
        )  # fmt: skip
        if hooks:
            hook()
        y = recv_x * 2
        out, _, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=hooks
        )
        if hooks:
            hook()
    return graph, out


def _times_two(p: Problem, rank: int) -> torch.Tensor:
    """expected_combine for the x 2 expert."""
    n = p.x[rank].shape[0]
    out = torch.zeros(n, HIDDEN, dtype=torch.float32)
    row = (p.x[rank].float() * 2).to(torch.bfloat16).float()
    for k in range(NUM_TOPK):
        valid = p.topk_idx[rank][:, k] >= 0
        out[valid] = out[valid] + p.topk_weights[rank][valid, k, None] * row[valid]
    return out.to(torch.bfloat16)


def cuda_graph(rank: int, world: int, group, hooks: bool):
    """One graph per real token count (T fixed, one buffer), replayed in mixed order with new
    inputs each time; eager calls in between keep working."""
    buffer = make_buffer(group, "cuda")
    sizes = {n: [max(n - r, 0) for r in range(world)] for n in (TOKENS, 7, 1)}
    graphs = {}
    for n, per_rank in sizes.items():
        p = make_problem(world, 50 + n, per_rank)
        x, topk_idx, topk_weights = (t.clone() for t in _inputs(p, rank, "cuda"))
        graphs[n] = (x, topk_idx, topk_weights, *_capture(buffer, x, topk_idx, topk_weights, hooks))
    for step, n in enumerate([TOKENS, 1, 7, TOKENS, 7, 1, 1, TOKENS]):
        p = make_problem(world, 100 + step, sizes[n])
        x, topk_idx, topk_weights, graph, out = graphs[n]
        for static, new in zip((x, topk_idx, topk_weights), _inputs(p, rank, "cuda"), strict=True):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), _times_two(p, rank)), (step, n)
        if step == 3:  # an eager roundtrip between replays
            ex, eidx, ew = _inputs(p, rank, "cuda")
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
                ex, eidx, TOKENS, p.num_experts, use_fp8=False
            )
            eout, _, _ = buffer.low_latency_combine(recv_x * 2, eidx, ew, handle)
            assert torch.equal(eout.cpu(), _times_two(p, rank))
    assert int(buffer.low_latency_error_flag.item()) == 0
    buffer.destroy()


def _poisoned(out: torch.Tensor) -> bool:
    return out.numel() == 0 or bool(out.float().isnan().all())


def late_rank(rank: int, world: int, group, graph: bool):
    """(Through `LowLatencyMode`, whose kernel timeout can be shorter than its host
    collectives', so that the late rank's peers time out on the GPU, not in gloo.)
    The last rank is 5 s late for a call whose kernels time out after 3 s: every rank sees
    NaN outputs and error_flag set, or a failure; the next call raises EPCommError on every
    rank. Then clean_low_latency_buffer, and destroy + a new mode, both work again."""
    late = world - 1
    mode = make_mode(group, "cuda", ll_timeout=3.0)
    p = make_problem(world, 7, [TOKENS] * world)
    x, topk_idx, topk_weights = _inputs(p, rank, "cuda")
    E = p.num_experts

    def roundtrip_once():
        recv_x, _, handle, _, hook = mode.dispatch(
            x, topk_idx, TOKENS, E, use_fp8=False, return_recv_hook=True
        )
        hook()
        out, _, hook = mode.combine(
            recv_x * 2, topk_idx, topk_weights, handle, return_recv_hook=True
        )
        hook()
        return out

    assert torch.equal(roundtrip_once().cpu(), _times_two(p, rank))
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = roundtrip_once()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), _times_two(p, rank))
        mode.comm.all_gather("test: replay together", torch.zeros(1))
        if rank == late:
            time.sleep(5)
        g.replay()
    else:
        # Calls agree on the host first, so a late host would hold everyone there: this rank
        # is late between agreeing and launching, as one stuck in its send would be.
        if rank == late:
            send = mode.impl.dispatch_send
            mode.impl.dispatch_send = lambda *args: (time.sleep(5), send(*args))[1]
        try:
            out = roundtrip_once()
        except EPCommError as error:  # the combine's agreement saw the failure already
            assert "timed out" in str(error)
            out = None
        finally:
            if rank == late:
                del mode.impl.dispatch_send
    torch.cuda.synchronize()
    raised = out is None
    poisoned = raised or (_poisoned(out) and int(mode.impl.error_flag.item()) != 0)
    failure = mode.impl.failure()
    assert poisoned or failure is not None, (rank, out, failure)
    failures = mode.comm.all_gather("test: failures", torch.tensor([int(failure is not None)]))
    assert bool(failures.any())
    with pytest.raises(EPCommError, match="timed out"):
        mode.dispatch(x, topk_idx, TOKENS, E, use_fp8=False)

    mode.clean(TOKENS, HIDDEN, E)
    assert mode.impl.failure() is None and int(mode.impl.error_flag.item()) == 0
    assert torch.equal(roundtrip_once().cpu(), _times_two(p, rank))
    if graph:
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), _times_two(p, rank))
    mode.destroy()
    mode = make_mode(group, "cuda", ll_timeout=3.0)
    assert torch.equal(roundtrip_once().cpu(), _times_two(p, rank))
    mode.destroy()


def too_small(rank: int, world: int, group):
    """A (T, H, E) larger than num_rdma_bytes allows is refused, on every rank."""
    buffer = make_buffer(group, "cuda")
    p = make_problem(world, 3)
    x, topk_idx, _ = _inputs(p, rank, "cuda")
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        buffer.low_latency_dispatch(x, topk_idx, TOKENS * 4, p.num_experts, use_fp8=False)
    buffer.destroy()
