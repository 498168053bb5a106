"""The MoE's weighted sum (`moe_weighted_sum`: the torch reference on the CPU, the Triton kernel
of `ref_server.kernels.moe` on CUDA) against float64, and the router's GEMM; `gpu`-marked tests need CUDA.

Slots of experts on another rank (-1) point at rows the experts never wrote: the tests fill
those rows, and the slots' weights, with NaN, which must not reach any sum."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import ref_server.model as M
from ref_server.kernels.moe import moe_weighted_sum
from ref_server.model.moe import Gate


def problem(n: int, k: int, hidden: int, dtype=torch.bfloat16, device="cpu", seed=0):
    """(y, rows, weights) as `RoutedExperts.grouped` hands them over: n x k rows of y in a
    random order, about a third of the slots -1 with their rows and weights NaN, the first
    token (if any) with every slot -1."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n * k, hidden, generator=g).to(dtype)
    rows = torch.randperm(n * k, generator=g).view(n, k)
    weights = torch.rand(n, k, generator=g)
    skipped = torch.rand(n, k, generator=g) < 0.3
    skipped[:1] = True
    y[rows[skipped]] = float("nan")
    weights[skipped] = float("nan")
    rows[skipped] = -1
    return y.to(device), rows.to(device), weights.to(device)


def naive(y, rows, weights) -> torch.Tensor:
    """The sums in float64, every slot gathered and the skipped ones masked out."""
    gathered = y.double()[rows.clamp(min=0)]
    terms = gathered * weights.double()[..., None]
    return torch.where((rows >= 0)[..., None], terms, 0.0).sum(dim=1)


def check(got, y, rows, weights) -> None:
    """Within one rounding to y's dtype of float64 (plus fp32 sums' error); NaN-free; tokens
    with no slot of this rank exactly zero."""
    assert got.shape == (rows.shape[0], y.shape[1]) and got.dtype == y.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), naive(y, rows, weights), rtol=2**-7, atol=1e-4)
    assert (got[(rows < 0).all(dim=1)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "hidden"), [(0, 2, 64), (1, 1, 64), (37, 2, 64), (50, 8, 300)])
def test_the_reference_weighted_sum_matches_float64(n, k, hidden, dtype):
    y, rows, weights = problem(n, k, hidden, dtype)
    check(moe_weighted_sum(y, rows, weights), y, rows, weights)


def test_opcheck_the_reference():
    torch.library.opcheck(moe_weighted_sum, problem(20, 3, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 1, 1000])
@pytest.mark.parametrize("hidden", [128, 2048, 7168])
@pytest.mark.parametrize("k", [1, 6, 8])
def test_the_kernel_matches_float64(k, hidden, n):
    y, rows, weights = problem(n, k, hidden, device="cuda")
    got = moe_weighted_sum(y, rows, weights)
    check(got, y, rows, weights)
    assert torch.equal(moe_weighted_sum(y, rows, weights), got)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_in_other_dtypes(dtype):
    y, rows, weights = problem(300, 6, 1000, dtype, "cuda")  # 1000: a partial column block
    check(moe_weighted_sum(y, rows, weights), y, rows, weights)


@pytest.mark.gpu
def test_opcheck_the_kernel():
    torch.library.opcheck(moe_weighted_sum, problem(64, 6, 256, device="cuda"))


@pytest.mark.gpu
def test_the_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on new values in the same tensors: no host synchronization."""
    y, rows, weights = problem(256, 8, 2048, device="cuda")
    moe_weighted_sum(y, rows, weights)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_weighted_sum(y, rows, weights)
    for fresh in (
        problem(256, 8, 2048, device="cuda", seed=1),
        problem(256, 8, 2048, device="cuda", seed=2),
    ):
        for static, value in zip((y, rows, weights), fresh, strict=True):
            static.copy_(value)
        graph.replay()
        check(out, y, rows, weights)


@pytest.mark.gpu
def test_grouped_experts_on_the_gpu_match_the_expert_loop():
    """The whole grouped path on CUDA (grouped GEMMs, the kernel) against the loop: some rows
    route to another rank (-1), whose unwritten rows must not leak in."""
    experts = (
        M.from_preset("tiny", seed=2, dtype=torch.bfloat16, device="cuda").layers[1].mlp.experts
    )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 64, generator=g).to(torch.bfloat16).cuda()
    ids = torch.randint(-1, 6, (300, 2), generator=g).cuda()
    weights = torch.rand(300, 2, generator=g).cuda()
    grouped = experts(x, ids, weights)
    assert torch.isfinite(grouped).all()
    torch.testing.assert_close(grouped, experts.looped(x, ids, weights), rtol=2e-2, atol=2e-2)
    assert experts(x[:0], ids[:0], weights[:0]).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_the_router_gemm_in_bf16_keeps_fp32_scores(hidden):
    """bf16 operands through a GEMM with fp32 output: the scores of the fp32 GEMM up to the
    order of the sums (both against float64)."""
    args = dataclasses.replace(M.PRESETS["v3"], hidden_size=hidden)
    gate = Gate(args).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    gate.weight.data.copy_(torch.randn(gate.weight.shape, generator=g) * 0.02)
    x = torch.randn(1000, hidden, generator=g).to("cuda", torch.bfloat16)
    scores = gate.logits(x).sigmoid()
    assert scores.dtype == torch.float32
    want = F.linear(x.double(), gate.weight.double()).sigmoid()
    fp32 = F.linear(x.float(), gate.weight.float()).sigmoid()
    torch.testing.assert_close(scores.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(fp32.double(), want, rtol=0, atol=1e-5)
    assert gate.logits(x[:0]).shape == (0, args.n_routed_experts)
