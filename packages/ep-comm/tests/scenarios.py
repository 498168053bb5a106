"""What each rank runs in the multi-process tests (loaded by path in spawned processes).

Every rank builds the same global problem from one seed, so each can compute exactly what it
should receive and what combine should return, without communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from ep_comm import Buffer, Config, EPCommError, torch_backend
from ep_comm.layout import aligned
from ep_comm.testing import out_of_memory_once, per_token_cast_to_fp8, random_routing

HIDDEN = 256
# 2 channels, rings of 8 tokens filled 3 at a time: the cuda backend's rings wrap many times
SMALL_RINGS = Config(
    num_sms=4, num_max_nvl_chunked_send_tokens=3, num_max_nvl_chunked_recv_tokens=8
)


@dataclass
class Problem:
    x: list[torch.Tensor]  # per rank [num_tokens_r, HIDDEN] bf16
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor]
    num_experts: int


def make_problem(
    world: int, seed: int, experts_per_rank: int = 3, num_topk: int = 4, idle_rank: bool = False
) -> Problem:
    """The last rank has no tokens when world > 2; with idle_rank, also no token chooses its
    experts, so it neither sends nor receives a row."""
    g = torch.Generator().manual_seed(seed)
    num_experts = experts_per_rank * world
    routable = num_experts - experts_per_rank if idle_rank else num_experts
    xs, idx, weights = [], [], []
    for rank in range(world):
        empty = rank == world - 1 and (world > 2 or idle_rank)
        num_tokens = 0 if empty else 29 + 17 * rank
        xs.append(torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16))
        i, w = random_routing(num_tokens, routable, min(num_topk, routable), g, skew=1.5)
        idx.append(i)
        weights.append(w)
    return Problem(xs, idx, weights, num_experts)


def expert(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Expert e's output for rows x (float64): distinct per expert, elementwise."""
    e = e.to(torch.float64).unsqueeze(1)
    return torch.tanh(x.to(torch.float64) * (1 + e / 8)) + e / 16


def expected_receive(p: Problem, rank: int, world: int):
    """Rows rank receives, in order (by source rank, then token), with global expert ids."""
    per_rank = p.num_experts // world
    rows, idx, weights, counts = [], [], [], []
    for src in range(world):
        here = (p.topk_idx[src] // per_rank == rank) & (p.topk_idx[src] >= 0)
        chosen = here.any(dim=1)
        rows.append(p.x[src][chosen])
        local = torch.where(here, p.topk_idx[src] - rank * per_rank, -1)[chosen]
        idx.append(local)
        weights.append(torch.where(here, p.topk_weights[src], 0.0)[chosen])
        counts.append(int(chosen.sum()))
    return torch.cat(rows), torch.cat(idx), torch.cat(weights), counts


def expected_combine(p: Problem, rank: int, world: int, biases=()) -> torch.Tensor:
    """What combine returns for rank's tokens, bit for bit: every rank it went to returns
    bf16(its local experts' weighted outputs, summed in float64 in top-k order), and these are
    added in float32, in rank order, to the sum of the biases."""
    per_rank = p.num_experts // world
    idx, weights = p.topk_idx[rank], p.topk_weights[rank]
    out = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.float32)
    for bias in biases:
        out += bias.float()
    for dst in range(world):
        here = (idx >= 0) & (idx // per_rank == dst)
        partial = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.float64)
        for k in range(idx.shape[1]):
            valid = here[:, k]
            partial[valid] += weights[valid, k, None].double() * expert(
                idx[valid, k], p.x[rank][valid]
            )
        went = here.any(dim=1)
        out[went] += partial[went].to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def make_buffer(group, world: int, backend: str, timeout: float = 60) -> Buffer:
    nvl_bytes = Config().get_nvl_buffer_size_hint(HIDDEN * 2, world) if backend == "cuda" else 0
    buffer = Buffer(group, nvl_bytes, backend=backend, timeout=timedelta(seconds=timeout))
    assert buffer.backend == backend
    return buffer


def roundtrip(
    rank: int, world: int, group, device: str, seed: int, backend: str = "torch", idle_rank=False
):
    p = make_problem(world, seed, idle_rank=idle_rank)
    x = p.x[rank].to(device)
    topk_idx, topk_weights = p.topk_idx[rank].to(device), p.topk_weights[rank].to(device)
    buffer = make_buffer(group, world, backend)

    per_rank, rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    assert rdma is None
    want_rows, want_idx, want_weights, want_counts = expected_receive(p, rank, world)
    alignment = 4
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    layout |= dict(num_tokens_per_expert=per_expert, config=SMALL_RINGS)
    recv_x, recv_idx, recv_w, per_expert_list, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=alignment, **layout
    )
    event.current_stream_wait()
    assert torch.equal(recv_x.cpu(), want_rows)
    assert torch.equal(recv_idx.cpu(), want_idx)
    assert torch.equal(recv_w.cpu(), want_weights)
    prefix = handle[0].cpu()
    assert prefix[:, rank].tolist() == torch.tensor(want_counts).cumsum(0).tolist()
    per_local = [int((want_idx == e).sum()) for e in range(p.num_experts // world)]
    assert per_expert_list == [aligned(c, alignment) for c in per_local]

    # Each received row: the weighted sum of its local experts' outputs; combine adds the ranks.
    y = torch.zeros(recv_x.shape[0], x.shape[1], dtype=torch.float64)
    for k in range(recv_idx.shape[1]):
        valid = want_idx[:, k] >= 0
        e = want_idx[valid, k] + rank * (p.num_experts // world)
        y[valid] += want_weights[valid, k, None].double() * expert(e, want_rows[valid])
    y = y.to(torch.bfloat16).to(device)
    combined, combined_w, _ = buffer.combine(y, handle, recv_w, config=SMALL_RINGS)
    assert combined.dtype == torch.bfloat16 and combined.shape == x.shape
    assert torch.equal(combined.cpu(), expected_combine(p, rank, world))
    reference = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for k in range(topk_idx.shape[1]):
        valid = p.topk_idx[rank][:, k] >= 0
        w = p.topk_weights[rank][valid, k, None].double()
        reference[valid] += w * expert(p.topk_idx[rank][valid, k], p.x[rank][valid])
    torch.testing.assert_close(combined.cpu().double(), reference, rtol=2e-2, atol=2e-2)
    g = torch.Generator().manual_seed(rank)
    biases = [torch.randn(x.shape, generator=g).to(torch.bfloat16) for _ in range(2)]
    on_device = tuple(b.to(device) for b in biases)
    with_bias, _, _ = buffer.combine(y, handle, bias=on_device, config=SMALL_RINGS)
    assert torch.equal(with_bias.cpu(), expected_combine(p, rank, world, biases))
    want_combined_w = torch.where(p.topk_idx[rank] >= 0, p.topk_weights[rank], 0.0)
    assert torch.equal(combined_w.cpu(), want_combined_w)

    # Cached layout: the same rows again; FP8 values and scales arrive bit for bit.
    again, none_idx, none_w, none_list, none_handle, _ = buffer.dispatch(
        x, handle=handle, config=SMALL_RINGS
    )
    assert torch.equal(again, recv_x) and none_idx is none_w is none_list is none_handle is None
    values, scales = per_token_cast_to_fp8(x)
    (recv_values, recv_scales), *_ = buffer.dispatch((values, scales), **layout)
    want_values, want_scales = per_token_cast_to_fp8(want_rows.to(device))  # cast where x was
    assert torch.equal(recv_values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(recv_scales, want_scales)
    (cached_values, cached_scales), *_ = buffer.dispatch((values, scales), handle=handle)
    assert torch.equal(cached_values.view(torch.uint8), recv_values.view(torch.uint8))
    assert torch.equal(cached_scales, recv_scales)

    # num_worst_tokens: fixed shapes, padding past the received rows, list empty.
    worst = max(len(expected_receive(p, r, world)[0]) for r in range(world)) + 3
    out = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst, **layout
    )
    padded_x, padded_idx, padded_w, padded_list, padded_handle, _ = out
    n = want_rows.shape[0]
    assert padded_x.shape[0] == worst and padded_list == []
    assert int(padded_handle.actual_num_recv_tokens) == n
    assert torch.equal(padded_x[:n].cpu(), want_rows) and not padded_x[n:].any()
    assert (padded_idx[n:] == -1).all() and not padded_w[n:].any()
    padded_y = torch.zeros(worst, x.shape[1], dtype=torch.float64)
    padded_y[:n] = y
    combined_padded, _, _ = buffer.combine(padded_y.to(torch.bfloat16).to(device), padded_handle)
    assert torch.equal(combined_padded, combined)
    assert int(buffer.dispatch(x, handle=padded_handle)[0][n:].abs().sum()) == 0


def rejected_everywhere(rank: int, world: int, group, case: str) -> None:
    """One rank (or all) passes a bad argument; every rank must raise ValueError saying what."""
    p = make_problem(world, seed=7)
    buffer = Buffer(group, timeout=timedelta(seconds=30))
    x, topk_idx, topk_weights = p.x[rank], p.topk_idx[rank], p.topk_weights[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    layout |= dict(num_tokens_per_expert=per_expert)
    args = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)
    bad_rank = rank == 1
    if case == "expert id out of range":
        bad = topk_idx.clone()
        if bad_rank and bad.numel():
            bad[0, 0] = p.num_experts + 5
        args["topk_idx"], match = bad, f"expert id {p.num_experts + 5}"
    elif case == "hidden differs":
        if bad_rank:
            args["x"] = torch.zeros(x.shape[0], HIDDEN + 8, dtype=torch.bfloat16)
        match = "disagree on hidden"
    elif case == "wrong dtype":
        if bad_rank:
            args["x"] = x.float()
        match = "x must be torch.bfloat16"
    elif case == "weights shape":
        if bad_rank:
            args["topk_weights"] = topk_weights[:, :1].contiguous()
        match = "topk_weights must have shape"
    elif case == "num_worst_tokens too small":
        args["num_worst_tokens"], match = 1, "more than num_worst_tokens=1"
    elif case == "combine rows":
        _, _, _, _, handle, _ = buffer.dispatch(**args)
        rows = handle.recv_src_idx.shape[0] + (1 if bad_rank else 0)
        with pytest.raises(ValueError, match="x must have shape"):
            buffer.combine(torch.zeros(rows, HIDDEN, dtype=torch.bfloat16), handle)
        return
    else:
        raise AssertionError(case)
    with pytest.raises(ValueError, match=match):
        buffer.dispatch(**args)
    # the group is still usable afterwards
    buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **layout)


def absent_peer(rank: int, world: int, group) -> None:
    """Rank 1 never calls dispatch: the others raise EPCommError within the timeout."""
    p = make_problem(world, seed=3)
    buffer = Buffer(group, timeout=timedelta(seconds=3))
    if rank == 1:
        time.sleep(8)
        return
    x, topk_idx = p.x[rank], p.topk_idx[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    start = time.monotonic()
    with pytest.raises(EPCommError, match=rf"rank {rank}/{world}: dispatch: check arguments"):
        buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
    assert time.monotonic() - start < 6


def late_from_the_device(rank: int, world: int, group) -> None:
    """Rank 1 reaches raise_if_failed 1.5 timeouts after rank 0 (its kernels waited on a peer
    for a whole timeout, say): the host waits for it, and neither raises."""
    timeout = 2
    buffer = Buffer(group, timeout=timedelta(seconds=timeout))
    if rank == 1:
        time.sleep(1.5 * timeout)
    start = time.monotonic()
    buffer.raise_if_failed()
    assert rank == 1 or time.monotonic() - start > timeout


def async_paths(rank: int, world: int, group, backend: str) -> None:
    """async_finish, previous_event and allocate_on_comm_stream give what the plain call gives."""
    p = make_problem(world, seed=11)
    x = p.x[rank].cuda()
    topk_idx, topk_weights = p.topk_idx[rank].cuda(), p.topk_weights[rank].cuda()
    buffer = make_buffer(group, world, backend)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    layout |= dict(num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    plain = buffer.dispatch(x, **layout)
    flags = dict(async_finish=True, allocate_on_comm_stream=True)
    overlapped = buffer.dispatch(x, previous_event=buffer.capture(), **flags, **layout)
    event = overlapped[-1]
    assert event.event is not None
    event.current_stream_wait()
    for a, b in zip(plain[:3], overlapped[:3], strict=True):
        assert torch.equal(a, b)
    assert plain[3] == overlapped[3]
    combined = buffer.combine(plain[0], plain[4], plain[2])
    later = buffer.combine(
        plain[0], plain[4], plain[2], previous_event=buffer.capture(), async_finish=True
    )
    with later[-1]:  # leaving the block makes the current stream wait
        pass
    assert torch.equal(combined[0], later[0]) and torch.equal(combined[1], later[1])


def absent_peer_on_gpu(rank: int, world: int, group) -> None:
    """Rank 1 never launches notify: rank 0's kernel gives up at the barrier after the timeout
    instead of spinning, and the next call raises EPCommError naming the step and the rank."""
    p = make_problem(world, seed=5)
    buffer = make_buffer(group, world, "cuda", timeout=2)
    topk_idx = p.topk_idx[rank].cuda()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    if rank == 1:
        time.sleep(8)
        return
    counts = [
        torch.empty(*shape, dtype=torch.int32, device="cuda") for shape in ((2, 2), (2, 10), (3,))
    ]
    start = time.monotonic()
    buffer._impl.state.notify(in_rank, per_expert, *counts)  # as dispatch would, alone
    torch.cuda.synchronize()
    assert time.monotonic() - start < 5
    match = (
        r"rank 0/2: the barrier starting a call timed out after 2 s waiting for rank 1 "
        r".* rebuild the buffer \(Buffer.reset\(\) on every rank\)"
    )
    with pytest.raises(EPCommError, match=match):
        buffer.dispatch(
            p.x[rank].cuda(),
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )


def buffer_too_small(rank: int, world: int, group) -> None:
    """A config whose rings do not fit num_nvl_bytes: ValueError on every rank, naming sizes."""
    p = make_problem(world, seed=4)
    small = Config(num_sms=4, num_max_nvl_chunked_recv_tokens=32).get_nvl_buffer_size_hint(
        HIDDEN * 2, world
    )
    buffer = Buffer(group, small, backend="cuda", timeout=timedelta(seconds=30))
    x, topk_idx = p.x[rank].cuda(), p.topk_idx[rank].cuda()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    layout |= dict(num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match=rf"rings need \d+ bytes .* num_nvl_bytes={small}"):
        buffer.dispatch(x, **layout)  # the default config: 10 channels of 256 tokens
    fits = Config(num_sms=4, num_max_nvl_chunked_recv_tokens=32)
    recv_x, *_ = buffer.dispatch(x, config=fits, **layout)
    assert torch.equal(recv_x.cpu(), expected_receive(p, rank, world)[0])


def overflow_on_gpu(rank: int, world: int, group) -> None:
    """num_worst_tokens too small on the cuda backend: the rows past it are dropped without a
    host synchronization, and the next call raises on every rank, naming the rank."""
    p = make_problem(world, seed=9)
    buffer = make_buffer(group, world, "cuda")
    x, topk_idx = p.x[rank].cuda(), p.topk_idx[rank].cuda()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    layout |= dict(num_tokens_per_expert=per_expert)
    recv_x, *_ = buffer.dispatch(x, num_worst_tokens=2, **layout)
    assert recv_x.shape[0] == 2
    received = len(expected_receive(p, 0, world)[0])
    match = rf"rank 0/{world}: an earlier dispatch received {received} rows, more than its"
    with pytest.raises(EPCommError, match=match):
        buffer.dispatch(x, **layout)
    # poisoned until rebuilt
    assert int(buffer.error_flag) == (2 if len(expected_receive(p, rank, world)[0]) > 2 else 0)
    buffer.reset()
    recv_x, *_ = buffer.dispatch(x, **layout)
    assert torch.equal(recv_x.cpu(), expected_receive(p, rank, world)[0])
    assert int(buffer.error_flag) == 0


def overflow_returns_nan_rows(rank: int, world: int, group) -> None:
    """With EP_COMM_OVERFLOW_RETURNS_ROWS=1, rank 0 alone overflows num_worst_tokens: the
    combine after it ends on every rank well within the timeout, its tokens' sums NaN where
    rank 0 took part (all of rank 0's), the others right; then every rank raises."""
    p = make_problem(world, seed=31)
    received = [len(expected_receive(p, r, world)[0]) for r in range(world)]
    worst = max(received[1:])
    assert received[0] > worst
    timeout = 20
    buffer = make_buffer(group, world, "cuda", timeout=timeout)
    x, topk_idx = p.x[rank].cuda(), p.topk_idx[rank].cuda()
    start = time.monotonic()
    _, combined = _dispatch_and_combine(buffer, x, topk_idx, p.num_experts, worst)
    torch.cuda.synchronize()
    assert time.monotonic() - start < timeout / 2
    combined = combined.cpu()
    via_rank_0 = (p.topk_idx[rank] >= 0) & (p.topk_idx[rank] // (p.num_experts // world) == 0)
    poisoned = via_rank_0.any(dim=1) if rank else torch.ones(len(combined), dtype=torch.bool)
    assert combined[poisoned].isnan().all(dim=1).all()
    want = _sums_of_copies(p, rank, world)
    assert torch.equal(combined[~poisoned], want[~poisoned])
    match = rf"rank 0/{world}: an earlier dispatch received {received[0]} rows"
    with pytest.raises(EPCommError, match=match):
        buffer.raise_if_failed()


def _dispatch_and_combine(buffer, x, topk_idx, num_experts: int, num_worst_tokens: int = 0):
    """One dispatch of CUDA x and topk_idx, the identity as experts, one combine: (received
    rows, combined)."""
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        num_worst_tokens=num_worst_tokens,
    )
    combined, _, _ = buffer.combine(recv_x, handle)
    return recv_x, combined


def _sums_of_copies(p: Problem, rank: int, world: int) -> torch.Tensor:
    """What combine returns when every rank returns the rows it received unchanged."""
    per_rank = p.num_experts // world
    idx = p.topk_idx[rank]
    ranks = [((idx >= 0) & (idx // per_rank == r)).any(dim=1) for r in range(world)]
    copies = torch.stack(ranks).sum(dim=0, dtype=torch.float32)
    return (p.x[rank].float() * copies.unsqueeze(1)).to(torch.bfloat16)


def sleeping_peer(rank: int, world: int, group, graph: bool) -> None:
    """Rank 1 sleeps past the timeout before launching a combine's kernels (eager; its own
    kernels then wait for rank 0 in vain) or instead of a replay of a captured dispatch +
    combine (graph). Rank 0's call returns without raising, with NaN outputs and error_flag 1,
    and so does every later call; raise_if_failed then raises on every rank, and reset() gives
    a working buffer without restarting anything."""
    p = make_problem(world, seed=17)
    timeout = 3
    buffer = make_buffer(group, world, "cuda", timeout=timeout)
    worst = max(len(expected_receive(p, r, world)[0]) for r in range(world))
    x, topk_idx = p.x[rank].cuda(), p.topk_idx[rank].cuda()
    if graph:
        _dispatch_and_combine(buffer, x, topk_idx, p.num_experts, worst)  # warm-up
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            recv_x, combined = _dispatch_and_combine(buffer, x, topk_idx, p.num_experts, worst)
        cuda_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(combined.cpu(), _sums_of_copies(p, rank, world))
        if rank == 1:
            time.sleep(timeout + 1)  # skips the replay
        else:
            cuda_graph.replay()
    else:
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        if rank == 1:  # past the arguments' check, stuck before its kernels (the host, say)
            launch = buffer._impl.combine

            def late(*args):
                time.sleep(timeout + 1)
                return launch(*args)

            buffer._impl.combine = late
        combined, _, _ = buffer.combine(recv_x, handle)
    if rank == 0:
        torch.cuda.synchronize()
        assert combined.isnan().all() and int(buffer.error_flag) == 1
        if graph:  # stays poisoned, and gives up at once instead of waiting out the timeout
            start = time.monotonic()
            cuda_graph.replay()
            torch.cuda.synchronize()
            assert time.monotonic() - start < 1
            assert recv_x.isnan().all() and combined.isnan().all()
    match = (
        "combine .* timed out after 3 s waiting for rank 1|the barrier starting a call timed out"
    )
    with pytest.raises(EPCommError, match=match):
        buffer.raise_if_failed()
    if rank == 1 and not graph:
        torch.cuda.synchronize()
        assert combined.isnan().all() and int(buffer.error_flag) == 1
    buffer.reset()
    assert int(buffer.error_flag) == 0
    _, combined = _dispatch_and_combine(buffer, x, topk_idx, p.num_experts)
    assert torch.equal(combined.cpu(), _sums_of_copies(p, rank, world))


def allocation_fails_between_kernels(rank: int, world: int, group) -> None:
    """Rank 1 cannot allocate its received rows after notify (an OOM, say): every rank raises
    from that dispatch before any rows move; the buffer stays failed until reset()."""
    p = make_problem(world, seed=19)
    buffer = make_buffer(group, world, "cuda", timeout=10)
    x, topk_idx = p.x[rank].cuda(), p.topk_idx[rank].cuda()
    if rank == 1:
        real = buffer._impl._outputs

        def out_of_memory(sources, rows, padded):
            if rows:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(sources, rows, padded)

        buffer._impl._outputs = out_of_memory
    with pytest.raises(EPCommError, match=r"rank 1/2: dispatch could not allocate its outputs"):
        _dispatch_and_combine(buffer, x, topk_idx, p.num_experts)
    if rank == 1:
        buffer._impl._outputs = real
    with pytest.raises(EPCommError, match=r"rank 1/2: .*rebuild the buffer"):
        buffer.raise_if_failed()
    buffer.reset()
    _, combined = _dispatch_and_combine(buffer, x, topk_idx, p.num_experts)
    assert torch.equal(combined.cpu(), _sums_of_copies(p, rank, world))


def allocation_fails_on_one_rank(rank: int, world: int, group) -> None:
    """Rank 1 runs out of memory allocating a combine's outputs, then those of a dispatch padded
    to num_worst_tokens: every rank raises the same EPCommError from that call, before anything
    moved, and the buffer, reset, returns the right sums again."""
    p = make_problem(world, seed=29)
    buffer = make_buffer(group, world, "torch", timeout=20)
    x, topk_idx = p.x[rank], p.topk_idx[rank]
    worst = max(len(expected_receive(p, r, world)[0]) for r in range(world))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    layout = dict(
        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
    )
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    calls = [
        ("zeros", "combine", lambda: buffer.combine(recv_x, handle)),
        ("full", "dispatch", lambda: buffer.dispatch(x, num_worst_tokens=worst, **layout)),
    ]
    for allocator, step, call in calls:
        with out_of_memory_once(torch_backend, allocator) as failing:
            failing.failed = rank != 1  # the others allocate
            match = rf"rank 1/{world}: {step} could not allocate its outputs .*simulated"
            with pytest.raises(EPCommError, match=match):
                call()
        assert failing.failed
        buffer.reset()
        _, combined = _dispatch_and_combine(buffer, x, topk_idx, p.num_experts, worst)
        assert torch.equal(combined, _sums_of_copies(p, rank, world))


def wrong_device(rank: int, world: int, group) -> None:
    """A CPU tensor given to the cuda backend: ValueError on every rank, naming the devices."""
    p = make_problem(world, seed=23)
    buffer = make_buffer(group, world, "cuda")
    device = "cpu" if rank == 1 else "cuda"  # all of rank 1's tensors
    topk_idx = p.topk_idx[rank].to(device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, p.num_experts)
    x = p.x[rank].to(device)
    match = "x is on cpu; this cuda-backend Buffer moves tensors on cuda:0"
    with pytest.raises(ValueError, match=match):
        buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )


def cuda_graph(rank: int, world: int, group) -> None:
    """get_dispatch_layout, dispatch with num_worst_tokens and combine captured in one CUDA
    graph on every rank; replays with new inputs give the eager results."""
    p = make_problem(world, seed=13)
    buffer = make_buffer(group, world, "cuda")
    worst = max(len(expected_receive(p, r, world)[0]) for r in range(world)) + 5
    static_x = p.x[rank].cuda()
    static_idx, static_w = p.topk_idx[rank].cuda(), p.topk_weights[rank].cuda()

    def step():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(static_idx, p.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            static_x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=static_idx,
            topk_weights=static_w,
            num_worst_tokens=worst,
        )
        combined, combined_w, _ = buffer.combine(recv_x, handle, recv_w)
        return recv_x, recv_idx, recv_w, handle.actual_num_recv_tokens, combined, combined_w

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()  # also warms up: the extension, the communication stream
    torch.cuda.current_stream().wait_stream(side)
    eager = [t.clone() for t in eager]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for scale, shift in ((2.0, 0), (0.5, 1), (1.0, 0)):
        static_x.copy_(p.x[rank].cuda() * scale)
        static_idx.copy_(p.topk_idx[rank].roll(shift, dims=1).cuda())
        graph.replay()
        torch.cuda.synchronize()
        recv_x, recv_idx, _, actual, combined, _ = captured
        n = int(eager[3])
        assert int(actual) == n
        assert torch.equal(recv_x[:n], eager[0][:n] * scale) and not recv_x[n:].any()
        # rolling every token's experts changes which weight goes with which id, not the set
        assert torch.equal(recv_idx.sort(dim=1).values, eager[1].sort(dim=1).values)
        assert torch.equal(combined, eager[4] * scale)
    assert buffer._impl.failure() is None
