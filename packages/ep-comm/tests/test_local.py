"""Single-process tests: the layout math, configs, FP8 casts, and local argument errors."""

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ep_comm import Buffer, Config
from ep_comm.layout import dispatch_layout, rank_prefix_matrix, to_local_experts
from ep_comm.testing import per_token_cast_back, per_token_cast_to_fp8, random_routing
from ep_comm.torch_backend import _pack, _unpack


@pytest.fixture
def generator():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def solo_group():
    """A one-rank gloo group in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_layout_matches_a_token_by_token_count(generator, num_ranks):
    num_experts = 8 * num_ranks
    topk_idx, _ = random_routing(300, num_experts, 6, generator, skew=1.2, drop=0.2)
    per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, num_ranks)
    want_in_rank = torch.zeros(300, num_ranks, dtype=torch.bool)
    want_expert = torch.zeros(num_experts, dtype=torch.int32)
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                want_in_rank[t, e // 8] = True
                want_expert[e] += 1
    assert torch.equal(in_rank, want_in_rank)
    assert torch.equal(per_expert, want_expert)
    assert torch.equal(per_rank, want_in_rank.sum(0, dtype=torch.int32))
    assert per_rank.dtype == per_expert.dtype == torch.int32


def test_routing_has_distinct_experts_drops_and_skew(generator):
    topk_idx, weights = random_routing(4000, 64, 8, generator, skew=1.5, drop=0.1)
    for row in topk_idx.tolist():
        chosen = [e for e in row if e >= 0]
        assert len(chosen) == len(set(chosen))
    assert 0.05 < (topk_idx == -1).float().mean() < 0.15
    load = torch.bincount(topk_idx[topk_idx >= 0], minlength=64)
    assert load.max() > 4 * load.min().clamp(min=1)  # skewed
    assert weights.dtype == torch.float32


def test_local_experts_and_prefix_matrix():
    idx = torch.tensor([[0, 5, -1], [7, 4, 3]])
    w = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 3.0]])
    local, local_w = to_local_experts(idx, w, rank=1, per_rank=4)
    assert local.tolist() == [[-1, 1, -1], [3, 0, -1]]
    assert local_w.tolist() == [[0.0, 0.25, 0.0], [1.0, 2.0, 0.0]]
    counts = torch.tensor([[1, 2], [3, 4]])
    assert rank_prefix_matrix(counts).tolist() == [[1, 2], [4, 6]]


def test_fp8_cast_error_is_within_e4m3_rounding(generator):
    x = (torch.randn(64, 512, generator=generator) * 3).to(torch.bfloat16)
    values, scales = per_token_cast_to_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (64, 4)
    back = per_token_cast_back(values, scales).float()
    bound = x.float().abs() * 2**-3 + scales.repeat_interleave(128, dim=1) * 2**-9
    assert ((back - x.float()).abs() <= bound * 1.01).all()


def test_config_checks_and_size_hint():
    with pytest.raises(ValueError, match="positive even"):
        Config(num_sms=7)
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens"):
        Config(20, 300, 256)
    config = Config(24, 6, 256)
    small = config.get_nvl_buffer_size_hint(7168 * 2, 4)
    assert small % 128 == 0
    assert config.get_nvl_buffer_size_hint(7168 * 2, 8) > small
    assert Config(48, 6, 256).get_nvl_buffer_size_hint(7168 * 2, 4) > small
    assert Buffer.get_dispatch_config(8).num_max_nvl_chunked_send_tokens == 6
    assert Buffer.get_combine_config(2).num_max_nvl_chunked_send_tokens == 10


def test_buffer_rejects_modes_it_does_not_have(solo_group):
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        Buffer(solo_group, num_rdma_bytes=1 << 20)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend 'cuda' was requested but CUDA is not"):
            Buffer(solo_group, 1 << 20, backend="cuda")
    assert Buffer(solo_group, 1 << 20).backend == ("cuda" if torch.cuda.is_available() else "torch")
    with pytest.raises(ValueError, match="unknown ep_comm backend"):
        Buffer(solo_group, backend="nvshmem")
    with pytest.raises(ValueError, match="even"):
        Buffer.set_num_sms(5)


def test_layout_rejects_bad_expert_counts_and_ids(solo_group):
    buffer = Buffer(solo_group)
    topk_idx = torch.tensor([[0, 1], [2, -1]])
    with pytest.raises(ValueError, match="positive multiple"):
        buffer.get_dispatch_layout(topk_idx, 0)
    with pytest.raises(ValueError, match="expert id 9"):
        buffer.get_dispatch_layout(torch.tensor([[9, 1]]), 4)
    with pytest.raises(ValueError, match=r"topk_idx must be torch\.int64"):
        buffer.get_dispatch_layout(topk_idx.int(), 4)


def test_one_rank_roundtrip_and_argument_errors(solo_group, generator):
    buffer = Buffer(solo_group)
    x = torch.randn(50, 128, generator=generator).to(torch.bfloat16)
    topk_idx, topk_w = random_routing(50, 4, 2, generator)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 4)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    layout |= dict(num_tokens_per_expert=per_expert)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    assert torch.equal(recv_x, x[in_rank[:, 0]])
    combined, weights, _ = buffer.combine(recv_x, handle)
    assert weights is None
    assert torch.equal(combined[in_rank[:, 0]], x[in_rank[:, 0]])
    assert not combined[~in_rank[:, 0]].any()
    bias = torch.ones_like(x)
    with_bias, _, _ = buffer.combine(recv_x, handle, bias=(bias, bias))
    assert torch.equal(with_bias, (combined.float() + 2).to(torch.bfloat16))

    with pytest.raises(ValueError, match="needs num_tokens_per_rank"):
        buffer.dispatch(x)
    with pytest.raises(ValueError, match="give both or neither"):
        buffer.dispatch(x, topk_idx=topk_idx, **layout)
    with pytest.raises(ValueError, match="column sums"):
        buffer.dispatch(x, **{**layout, "num_tokens_per_rank": per_rank + 1})
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buffer.dispatch(x, handle=handle, topk_idx=topk_idx, topk_weights=topk_w)
    with pytest.raises(ValueError, match="multiple of 128"):
        buffer.dispatch(
            (x[:, :100].contiguous().to(torch.float8_e4m3fn), torch.ones(50, 1)), **layout
        )
    values, _ = per_token_cast_to_fp8(x)
    with pytest.raises(ValueError, match="x scales must have shape"):
        buffer.dispatch((values, torch.ones(50, 2)), **layout)
    with pytest.raises(ValueError, match="must be contiguous"):
        buffer.dispatch(x.t().contiguous().t(), **layout)
    with pytest.raises(ValueError, match="expert_alignment"):
        buffer.dispatch(x, expert_alignment=0, **layout)
    with pytest.raises(ValueError, match=r"handle must come from Buffer\.dispatch"):
        buffer.combine(recv_x, tuple(handle))
    with pytest.raises(ValueError, match="at most two"):
        buffer.combine(recv_x, handle, bias=(bias, bias, bias))


def test_non_tensor_arguments_get_value_errors(solo_group):
    buffer = Buffer(solo_group)
    with pytest.raises(ValueError, match="topk_idx must be a tensor"):
        buffer.get_dispatch_layout([[0, 1]], 4)
    with pytest.raises(ValueError, match="x must be a"):
        buffer.dispatch(None)


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_packed_rows_unpack_whatever_their_count(rows, generator):
    """The torch backend's byte rows (156 bytes here: not a multiple of 8) come back as the
    tensors they were made of, for one row and none too."""
    pieces = [
        torch.randn(rows, 64, generator=generator).to(torch.bfloat16),
        torch.randint(-1, 8, (rows, 3), generator=generator),
        torch.randint(0, 9, (rows, 1), generator=generator).to(torch.int32),
    ]
    packed = _pack(pieces)
    assert packed.shape == (rows, 156)
    for got, want in zip(_unpack(packed, pieces), pieces, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
