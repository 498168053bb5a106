"""The new latent rows into the cache (`ref_server::cache_latent`): on the CPU, bit for bit what
`rms_norm`, `rope` and `mla_kernels.write_kv_cache` wrote before it, with opcheck and argument
checks; its Triton kernel through Triton's interpreter (where triton is installed); on the GPU
(`gpu` marker), the kernel bit for bit the three operators' kernels, in a CUDA graph, opcheck."""

from __future__ import annotations

import pytest
import torch

import mla_kernels
import ref_server.model as M
from ref_server.model.latent_kernels import cache_latent, triton_cache_latent
from ref_server.model.layers import Rope
from ref_server.model.norm_kernels import rms_norm
from ref_server.model.rope_kernels import rope

gpu = pytest.mark.gpu
EPS = 1e-6
BLOCKS, PAGE = 6, 16
# (kv, kv_a_layernorm's weight) dtypes: the GPU model's, the CPU model's, mixed ones
DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
]


def problem(n, dtype, weight_dtype, device="cpu", cache_dtype=torch.bfloat16, seed=0):
    """(kv `[n, 576]`, the kv_a columns of a wider fused projection output, N(0, 1) times a
    power of two per token; weight `[512]` around 1; cos and sin `[n, 1, 32]` at random
    positions; a NaN-filled cache `[6, 16, 1, 576]`; n distinct random slots)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-6, 7, (n, 1), generator=g))
    wide = torch.randn(n, 3072 + 576, generator=g) * scales
    kv = wide.to(device, dtype)[:, 3072:]
    weight = (1 + 0.5 * torch.randn(512, generator=g)).to(device, weight_dtype)
    positions = torch.randint(0, 163840, (n,), generator=g)
    cos, sin = Rope(M.PRESETS["v2-lite"])(positions.to(device), dtype)
    cache = torch.full((BLOCKS, PAGE, 1, 576), float("nan"), dtype=cache_dtype, device=device)
    slots = torch.randperm(BLOCKS * PAGE, generator=g)[:n].to(device)
    return kv, weight, cos, sin, cache, slots


def written_before(kv, weight, cos, sin, interleave, cache, slots) -> torch.Tensor:
    """The cache as the three operators left it (a copy of cache)."""
    want = cache.clone()
    latent = rms_norm(kv[:, :512], weight, EPS)
    key = rope(kv[:, None, 512:], cos, sin, interleave)[:, 0]
    mla_kernels.write_kv_cache(want, latent, key, slots, check_values=False)
    return want


def check(call, kv, weight, cos, sin, cache, slots, interleave, exact=True):
    """call writes what the operators wrote, and nothing else (the other slots stay NaN)."""
    want = written_before(kv, weight, cos, sin, interleave, cache, slots)
    call(kv, weight, EPS, cos, sin, interleave, cache, slots)
    rows, want_rows = cache.view(-1, 576), want.view(-1, 576)
    others = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    others[slots] = False
    assert rows[others].isnan().all()
    if exact:
        assert torch.equal(rows[slots], want_rows[slots])
    else:  # the interpreter: the mean's sum in another order, then a rounding to fp16
        got, expected = rows[slots].float(), want_rows[slots].float()
        assert torch.equal(got[:, 512:], expected[:, 512:])
        assert torch.allclose(got[:, :512], expected[:, :512], rtol=2**-10, atol=0)


# ---- CPU ----


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_the_operator_writes_what_the_three_operators_wrote(dtype, weight_dtype, interleave):
    check(cache_latent, *problem(11, dtype, weight_dtype, seed=3), interleave)


def test_int32_slots_and_no_tokens():
    kv, weight, cos, sin, cache, slots = problem(5, torch.float32, torch.float32, seed=1)
    check(cache_latent, kv, weight, cos, sin, cache, slots.int(), True)
    empty = problem(0, torch.float32, torch.float32)
    cache_latent(empty[0], empty[1], EPS, *empty[2:4], True, *empty[4:])
    assert empty[4].isnan().all()


def test_opcheck_on_cpu():
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16)
    cache.zero_()  # opcheck compares outputs, and NaN is not equal to itself
    torch.library.opcheck(cache_latent, (kv, weight, EPS, cos, sin, True, cache, slots))


def bad_arguments():
    kv, weight, cos, sin, cache, slots = problem(4, torch.float32, torch.float32)
    return [
        ((kv[:3], weight, EPS, cos, sin, True, cache, slots), r"kv must be \[n, 576\] with n = "),
        ((kv[:, :512], weight, EPS, cos, sin, True, cache, slots), r"got \(4, 512\)"),
        ((kv, weight[:64], EPS, cos, sin, True, cache, slots), r"weight must be \[512\]"),
        ((kv, weight, EPS, cos[:3], sin, True, cache, slots), r"cos must be \[n, 1, rope / 2\]"),
        ((kv, weight, EPS, cos, sin, True, cache[..., :512], slots), "cache must be a contig"),
        ((kv, weight, EPS, cos, sin, True, cache.float(), slots), "bfloat16 or float16"),
        ((kv, weight, EPS, cos, sin, True, cache, slots.float()), "int32 or int64, got"),
        (
            (kv, weight.to("meta"), EPS, cos, sin, True, cache, slots),
            "must share a device",
        ),
    ]


@pytest.mark.parametrize(("args", "message"), bad_arguments())
def test_bad_arguments_are_value_errors_naming_the_problem(args, message):
    for call in (cache_latent, triton_cache_latent):
        with pytest.raises(ValueError, match=message):
            call(*args)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """fp32 and fp16 rows into an fp16 cache (the interpreter rounds to fp16 as torch does; to
    bf16 it truncates), both rope layouts, int64 and int32 slots."""
    for dtype in (torch.float32, torch.float16):
        for interleave in (True, False):
            kv, weight, cos, sin, cache, slots = problem(
                9, dtype, dtype, cache_dtype=torch.float16, seed=int(interleave)
            )
            check(triton_cache_latent, kv, weight, cos, sin, cache, slots, interleave, False)
    kv, weight, cos, sin, cache, slots = problem(3, torch.float32, torch.float32, seed=5)
    check(triton_cache_latent, kv, weight, cos, sin, cache.half(), slots.int(), True, False)


# ---- GPU ----


@gpu
@pytest.mark.parametrize("n", [1, 7, 96])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_the_kernel_writes_what_the_three_kernels_wrote(dtype, weight_dtype, interleave, n):
    check(cache_latent, *problem(n, dtype, weight_dtype, "cuda", seed=n), interleave)


@gpu
def test_the_kernel_replays_in_a_cuda_graph():
    kv, weight, cos, sin, cache, slots = problem(8, torch.bfloat16, torch.bfloat16, "cuda")
    args = (kv, weight, EPS, cos, sin, True, cache, slots)
    cache_latent(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache_latent(*args)
    for seed in (1, 2):
        new = problem(8, torch.bfloat16, torch.bfloat16, "cuda", seed=seed)
        for mine, fresh in zip((kv, cos, sin, cache, slots), (new[0], *new[2:]), strict=True):
            mine.copy_(fresh)
        want = written_before(kv, weight, cos, sin, True, cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.view(-1, 576)[slots], want.view(-1, 576)[slots])


@gpu
def test_opcheck_on_cuda():
    kv, weight, cos, sin, cache, slots = problem(7, torch.bfloat16, torch.bfloat16, "cuda")
    cache.zero_()
    torch.library.opcheck(cache_latent, (kv, weight, EPS, cos, sin, False, cache, slots))


if __name__ == "__main__":
    interpreted_checks()
