"""DeepSeek's libraries against ours on the GPU (`gpu` marker): FlashMLA's decode attention,
DeepGEMM's FP8 GEMMs in their three layouts, a V2-Lite-sized slice through both kernel sets
(prefill, decode, decode graphs), and DeepEP's exchange against ep_comm's over two GPUs. Each
test skips unless the libraries it needs import; they are built outside this repository
(packages/ref-server/NOTES.md)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

import ref_server.model as M
from ep_comm.testing import run_ranks
from ref_server import kernel_choice
from ref_server.kernels.fp8_cast import quantize_activations, quantize_blocks
from ref_server.model import kernel_set
from ref_server.model.attention import MLA_KERNELS
from ref_server.model.fp8 import fp8_block_gemm
from ref_server.model.step import StepBatch

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent


def imported(*names: str) -> None:
    """Skip unless every library imports."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:
            pytest.skip(f"{name} does not import ({type(error).__name__}: {error})")


def deepseek(spec: str, fp8: bool = True) -> kernel_set.KernelSet:
    return kernel_set.resolve(
        spec, device="cuda", dtype=torch.bfloat16, fp8=fp8, expert_parallel=False
    )


def close(got: torch.Tensor, want: torch.Tensor, share: float = 0.01) -> None:
    """Every element within `share` of want's largest magnitude (bf16 rounding of sums
    accumulated in different orders)."""
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= share * want.abs().max()


@pytest.mark.parametrize("heads", [16, 128])
def test_flash_mla_decode_matches_mla_kernels(heads):
    """V3's and V2-Lite's head counts, 48 sequences of 1-4,096 cached tokens on scattered
    pages of 64."""
    imported("flash_mla")
    flash = deepseek("deepseek:attention", fp8=False).decode_attention
    g = torch.Generator().manual_seed(heads)
    b, pages = 48, 64
    seqlens = torch.randint(1, pages * 64 + 1, (b,), generator=g).int().cuda()
    table = torch.randperm(b * pages, generator=g).view(b, pages).int().cuda()
    cache = torch.randn(b * pages, 64, 1, 576, generator=g).bfloat16().cuda()
    q = torch.randn(b, 1, heads, 576, generator=g).bfloat16().cuda()
    scale = M.PRESETS["v3"].softmax_scale
    got, want = (
        decode.attend(q, cache, table, seqlens, decode.schedule(seqlens, heads), 512, scale)
        for decode in (flash, MLA_KERNELS)
    )
    close(got, want)


def operands(x_shape, w_shape, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = quantize_activations(torch.randn(x_shape, generator=g).bfloat16().cuda())
    w = quantize_blocks(torch.randn(w_shape, generator=g).cuda())
    return x, w


@pytest.mark.parametrize("m", [1, 128, 4096])
@pytest.mark.parametrize(("n", "k"), [(2112, 7168), (24576, 1536), (7168, 16384), (576, 7168)])
def test_deep_gemm_dense_layout_matches_ours_at_v3s_projections(m, n, k):
    imported("deep_gemm")
    gemm = deepseek("deepseek:gemm").fp8_gemm
    x, w = operands((m, k), (n, k), seed=m + n)
    close(gemm(*x, *w, None, torch.bfloat16), fp8_block_gemm(*x, *w, None, torch.bfloat16))


@pytest.mark.parametrize("experts", [9, 64, 256])
def test_deep_gemm_contiguous_layout_matches_ours(experts):
    """V3's gate-up shapes, uneven groups (some empty) and rows past the groups (another
    rank's), as prefill's sorted rows come."""
    imported("deep_gemm")
    gemm = deepseek("deepseek:gemm").fp8_gemm
    g = torch.Generator().manual_seed(experts)
    counts = torch.randint(0, 300, (experts,), generator=g)
    counts[::5] = 0
    offsets = counts.cumsum(0).int().cuda()
    rows = int(offsets[-1])
    x, w = operands((rows + 37, 7168), (experts, 4096, 7168), seed=experts)
    got = gemm(*x, *w, offsets, torch.bfloat16)
    want = fp8_block_gemm(*x, *w, offsets, torch.bfloat16)
    close(got[:rows], want[:rows])


@pytest.mark.parametrize(("experts", "block"), [(2, 1024), (32, 128)])
def test_deep_gemm_masked_layout_matches_ours(experts, block):
    """V3's down projection over a low-latency dispatch's blocks, counts from 0 to full."""
    imported("deep_gemm")
    gemm = deepseek("deepseek:gemm").fp8_gemm
    g = torch.Generator().manual_seed(experts)
    counts = torch.randint(0, block + 1, (experts,), generator=g).int()
    counts[0] = block
    x, w = operands((experts, block, 2048), (experts, 7168, 2048), seed=block)
    got = gemm(*x, *w, None, torch.bfloat16, counts.cuda())
    want = fp8_block_gemm(*x, *w, None, torch.bfloat16, counts.cuda())
    for e, count in enumerate(counts.tolist()):
        close(got[e, :count], want[e, :count])


@pytest.mark.parametrize("spec", ["deepseek:attention", "deepseek:gemm", "deepseek"])
def test_a_v2_lite_slice_through_deepseeks_kernels_matches_ours(spec):
    """Three layers of the V2-Lite-sized preset in FP8, the same weights through ours and
    through DeepSeek's parts (each alone, then both): a prefill of two sequences and decode
    steps give ours' logits, the deepseek model given ours' expert choices (bf16 rounding alone
    flips near-ties among 64 experts); its decode graphs (FlashMLA fills its schedule inside
    the captured step) replay what its eager steps compute."""
    parts = kernel_choice.parse(spec).parts_in(fp8=True, expert_parallel=False)
    imported(*(kernel_choice.LIBRARIES[part].module for part in parts))
    model_gpu = load(HERE / "test_model_gpu.py")
    args = dataclasses.replace(M.PRESETS["v2-lite"], num_hidden_layers=3, vocab_size=4096)
    build = dict(seed=0, dtype=torch.bfloat16, device="cuda", weight_dtype="fp8")
    ours, theirs = M.from_args(args, **build), M.from_args(args, kernels=spec, **build)
    assert theirs.kernels.deepseek == parts
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([[5, 1, 9, 3, 0], [7, 8, 10, 11, 12]], dtype=torch.int32)
    ids = torch.randint(2, args.vocab_size, (600,), generator=g).cuda()
    steps = [StepBatch(ids, [300, 300], [300, 300], table)]
    for step in range(1, 4):
        token = torch.randint(2, args.vocab_size, (2,), generator=g).cuda()
        steps.append(StepBatch(token, [1, 1], [300 + step] * 2, table))
    calls = model_gpu.routing_recorder(ours)
    cache = M.PagedKVCache(args, 16, 64, device="cuda")
    want = [ours.forward_step(batch, cache) for batch in steps]
    model_gpu.replay_routing(theirs, calls)
    cache = M.PagedKVCache(args, 16, 64, device="cuda")
    for got, reference in zip([theirs.forward_step(b, cache) for b in steps], want, strict=True):
        close(got, reference, 0.02)

    for moe in theirs.moe_layers():
        del moe.gate.select  # its own choices again
    eager, captured = (M.PagedKVCache(args, 16, 64, device="cuda") for _ in range(2))
    for cache in (eager, captured):
        theirs.forward_step(steps[0], cache)
    graphs = M.DecodeGraphs(theirs, captured, max_batch=2, max_blocks=5)
    for batch in steps[1:]:
        close(graphs(batch).clone(), theirs.forward_step(batch, eager), 0.001)


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DeepEP's ranks need a GPU each")
def test_deep_ep_exchanges_as_ep_comm_over_two_gpus(checkpoints, tmp_path):
    imported("deep_ep")
    checkpoints.write(tmp_path, seed=17, hidden_size=128)  # the low-latency mode's 128 channels
    scenarios = str(HERE / "model_scenarios.py")
    run_ranks(
        2, scenarios, "deep_ep_exchanges_as_ep_comm", str(tmp_path), gpu_per_rank=True, limit=600
    )
