"""The low-latency mode: its FP8 cast and buffer size in this process, and dispatch / combine
across gloo process groups of 2, 3 and 4 spawned processes (tests/ll_scenarios.py)."""

import importlib.util
import operator
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ep_comm import Buffer, EPCommError, nvshmem
from ep_comm.fp8 import ceil_to_power_of_two, pack_ue8m0, per_token_cast_to_fp8
from ep_comm.low_latency_backend import LowLatencyHandle, rdma_size_hint
from ep_comm.testing import run_ranks

SCENARIOS = str(Path(__file__).with_name("ll_scenarios.py"))


def _inputs(seed: int) -> torch.Tensor:
    """[48, 512] bf16 rows of very different magnitudes, a zero group and a tiny one."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.randint(-6, 6, (48, 1), generator=g)
    x = (torch.randn(48, 512, generator=g) * magnitude).to(torch.bfloat16)
    x[0, :128] = 0
    x[1, 128:256] = 1e-7
    return x


def _reference_cast(x: torch.Tensor, round_scale: bool):
    """The cast rule in float64, each step rounded to fp32 (exact for these IEEE operations)."""
    groups = x.double().reshape(x.shape[0], -1, 128)
    floor = torch.tensor(1e-4, dtype=torch.float32).double()
    amax = groups.abs().amax(dim=2).clamp(min=floor)
    scale_inv = (amax / 448).float().double()
    if round_scale:
        mantissa, exponent = torch.frexp(scale_inv)
        scale_inv = torch.ldexp(torch.ones_like(scale_inv), exponent - (mantissa == 0.5).long())
    reciprocal = (1 / scale_inv).float().double()
    values = (groups * reciprocal.unsqueeze(2)).float().clamp(-448, 448)
    return values.to(torch.float8_e4m3fn).reshape(x.shape), scale_inv.float()


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_is_the_rule_bit_for_bit(round_scale):
    x = _inputs(1)
    values, scale_inv = per_token_cast_to_fp8(x, round_scale)
    want_values, want_scale_inv = _reference_cast(x, round_scale)
    assert values.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale_inv, want_scale_inv)


def test_fp8_cast_saturates_floors_and_rounds_scales_up():
    x = _inputs(2)
    values, scale_inv = per_token_cast_to_fp8(x)
    magnitudes = values.float().abs().reshape(48, 4, 128)
    assert not values.float().isnan().any()
    nonzero = x.float().abs().reshape(48, 4, 128).amax(dim=2) >= 1e-4
    assert (magnitudes.amax(dim=2)[nonzero] == 448).all()  # each group's amax saturates
    floor = torch.tensor(1e-4) / torch.tensor(448.0)
    assert scale_inv[0, 0] == floor and scale_inv[1, 1] == floor
    assert not values[0, :128].float().any()

    rounded_values, rounded = per_token_cast_to_fp8(x, round_scale=True)
    mantissa, _ = torch.frexp(rounded)
    assert (mantissa == 0.5).all()  # powers of two
    assert (rounded >= scale_inv).all() and (rounded < 2 * scale_inv).all()
    assert rounded_values.float().abs().amax() <= 448
    back = rounded_values.float().reshape(48, 4, 128) * rounded.unsqueeze(2)
    error = (back - x.float().reshape(48, 4, 128)).abs()
    assert (error <= x.float().abs().reshape(48, 4, 128) / 8 + rounded.unsqueeze(2)).all()


def test_power_of_two_rounding_is_exact():
    x = torch.tensor([1.0, 1.5, 2.0, 2.0000002, 0.75, 3e-7, 1e30, 2.0**-126])
    want = torch.tensor([1.0, 2.0, 2.0, 4.0, 1.0, 2.0**-21, 2.0**100, 2.0**-126])
    assert torch.equal(ceil_to_power_of_two(x), want)


def test_ue8m0_packs_exponent_bytes_little_endian():
    exponents = torch.tensor([[-5, 0, 3, -20, 1, 2, 7, -1]])
    scale_inv = torch.ldexp(torch.ones(1, 8), exponents)
    packed = pack_ue8m0(scale_inv)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    biased = (exponents + 127).tolist()[0]
    for i in range(2):
        word = sum(b << (8 * j) for j, b in enumerate(biased[4 * i : 4 * i + 4]))
        assert int(packed[0, i]) & 0xFFFFFFFF == word


@pytest.mark.parametrize(
    ("tokens", "hidden", "experts", "gigabytes"),
    [
        (128, 7168, 256, 1.91),
        (128, 7168, 288, 2.15),
        (256, 7168, 288, 4.29),
        (128, 2048, 64, 0.136),
    ],
)
def test_rdma_size_hint_matches_deepeps_layout(tokens, hidden, experts, gigabytes):
    size = Buffer.get_low_latency_rdma_size_hint(tokens, hidden, 8, experts)
    assert size % 128 == 0 and size == rdma_size_hint(tokens, hidden, 16, experts)
    assert abs(size / 1e9 - gigabytes) < 0.005 * max(1, gigabytes)


def test_rdma_size_hint_formula_for_a_small_case():
    tokens, hidden, experts = 16, 512, 6
    dispatch = 16 + max(2 * hidden, hidden + 4 * hidden // 128)  # 1040
    combine = 4 * hidden // 128 + 2 * hidden  # 1040
    signals = 128  # 16 bytes for each of 6 experts, 128-aligned
    send = max(tokens * dispatch, experts * tokens * combine)
    receive = experts * tokens * max(dispatch, combine)
    assert rdma_size_hint(tokens, hidden, 2, experts) == 2 * (signals + send + receive)


def test_handle_is_deepeps_five_tuple():
    src_info, layout_range = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 2)
    handle = LowLatencyHandle(src_info, layout_range, 4, 256, 4)
    a, b, tokens, hidden, experts = handle
    assert a is src_info and b is layout_range and (tokens, hidden, experts) == (4, 256, 4)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_and_combine_roundtrip(world):
    """Rows as sets per (expert, source), FP8 bytes and scales exact, counts and stats, combine
    bit for bit; 3 and 4 ranks include a rank with no tokens, 2 and 4 one whose choices are -1."""
    run_ranks(world, SCENARIOS, "roundtrip", 100 + world, limit=120)


def test_hook_protocol_and_fixed_layout():
    run_ranks(2, SCENARIOS, "hook_protocol", limit=120)


def test_bad_arguments_raise_on_every_rank():
    run_ranks(3, SCENARIOS, "rejected_everywhere", limit=120)


def test_an_allocation_failure_on_one_rank_raises_on_every_rank():
    run_ranks(2, SCENARIOS, "allocation_fails", limit=120)


def test_without_any_nvidia_wheel_nvshmem_says_what_to_install(monkeypatch):
    def no_nvidia_package(name, package=None):
        raise ModuleNotFoundError("No module named 'nvidia'", name="nvidia")

    monkeypatch.delenv("NVSHMEM_DIR", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", no_nvidia_package)
    with pytest.raises(
        nvshmem.NvshmemUnavailable, match=r"install nvidia-nvshmem-cu\d+ or set NVSHMEM_DIR"
    ):
        nvshmem.nvshmem_dir()


def test_an_nvshmem_collective_that_never_returns_raises_and_so_does_every_later_one(
    monkeypatch,
):
    monkeypatch.setenv("EP_COMM_NVSHMEM_WATCHDOG", "1")
    monkeypatch.setattr(nvshmem, "_blocked", [])
    comm = SimpleNamespace(rank=1, size=2, device_timeout=timedelta(seconds=0.5))
    assert nvshmem.collective(comm, "add", operator.add, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        nvshmem.collective(comm, "divide", operator.truediv, 1, 0)
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(EPCommError, match=r"rank 1/2: nvshmem_free did not return within 0.5 s"):
        nvshmem.collective(comm, "nvshmem_free", never.wait)
    assert 0.5 <= time.monotonic() - start < 3
    with pytest.raises(EPCommError, match="unusable in this process since nvshmem_free never"):
        nvshmem.collective(comm, "nvshmem_malloc", operator.add, 1, 1)
    never.set()


def test_ranks_share_nvshmem_only_in_one_world():
    """Each rank's vote (can it run NVSHMEM, the world it runs in): every rank fresh, or all in
    one world, share it; a rank that replaced a lost one (no world) beside its peers' does not."""
    from ep_comm.buffer import shared_nvshmem_problem

    assert shared_nvshmem_problem(torch.tensor([[1, 0], [1, 0], [1, 0]])) is None
    assert shared_nvshmem_problem(torch.tensor([[1, 77], [1, 77]])) is None
    assert shared_nvshmem_problem(torch.tensor([[1, 77], [0, 0]])) == "another rank cannot run it"
    assert "a rank was replaced" in shared_nvshmem_problem(torch.tensor([[1, 77], [1, 0]]))
    assert "a rank was replaced" in shared_nvshmem_problem(torch.tensor([[1, 77], [1, 78]]))


def test_nvshmem_started_for_one_group_says_why_another_cannot_start(monkeypatch):
    """NVSHMEM starts once per process: after an instance lost a rank, a Buffer over the ranks
    left can no longer run on it (the low-latency backend choice reads this reason), the same
    ranks still can."""
    monkeypatch.setattr(nvshmem, "_started", {})
    assert nvshmem.why_not_start((0, 1, 2)) is None and nvshmem.world() == 0
    monkeypatch.setattr(nvshmem, "_started", {"members": (0, 1, 2, 3)})
    assert nvshmem.why_not_start((0, 1, 2, 3)) is None
    assert nvshmem.why_not_start((0, 1, 2)) == (
        "NVSHMEM already runs in this process for the group of global ranks [0, 1, 2, 3], "
        "not [0, 1, 2] (it starts once per process)"
    )
