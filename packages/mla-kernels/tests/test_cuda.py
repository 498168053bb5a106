"""The sm_90a kernel against the torch reference (fp32 math on the same GPU)."""

import itertools
import random

import pytest
import torch

import mla_kernels
from mla_kernels import reference, scheduler
from mla_kernels.testing import decode_case, poison_cuda_allocator, varlen_seqlens

pytestmark = pytest.mark.gpu

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the sm_90a kernel needs a Hopper GPU",
)


@pytest.fixture(params=["bf16", "fp8", "fp8-in-registers"])
def is_fp8_kvcache(request, monkeypatch):
    """The cache: 16-bit, or FP8 with either narrow kernel (MLA_KERNELS_FP8_IN_REGISTERS 0 or 1;
    above 16 query rows per KV head both run the same wide kernel)."""
    in_registers = request.param == "fp8-in-registers"
    monkeypatch.setenv("MLA_KERNELS_FP8_IN_REGISTERS", "1" if in_registers else "0")
    return request.param != "bf16"


def poison_allocator(case):
    """Hand the op's output allocations memory full of NaN, so unwritten elements show."""
    b, s_q, h_q, _ = case.q.shape
    rows = (b + 256) * s_q * h_q
    shapes = ((b, s_q, h_q, 512), (b, h_q, s_q), (rows, 512), (rows,))
    poison_cuda_allocator(shapes, (torch.float32, case.q.dtype))


def run_both(case, causal):
    _, s_q, h_q, _ = case.q.shape
    h_kv = case.k_cache.shape[2]
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, s_q * h_q // h_kv, h_kv)
    poison_allocator(case)
    out, lse = mla_kernels.flash_mla_with_kvcache(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
        causal=causal, is_fp8_kvcache=case.is_fp8_kvcache,
    )  # fmt: skip
    expected = reference.mla_decode(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 576**-0.5, causal,
        case.is_fp8_kvcache,
    )  # fmt: skip
    return (out, lse), expected


def assert_close(actual, expected):
    (out, lse), (ref_out, ref_lse) = actual, expected
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out (an element left unwritten, or NaN slots read)"
    assert not lse.isnan().any(), "NaN in lse"
    assert torch.equal(lse.isposinf(), ref_lse.isposinf())
    finite = ref_lse.isfinite()
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    error = (out.double() - ref_out.double()).norm() / ref_out.double().norm().clamp(min=1e-12)
    assert error.item() < 1e-2, f"relative error {error.item():.2e}"
    assert (out.float() - ref_out.float()).abs().max().item() < 5e-2


def grid_cases():
    """FlashMLA's correctness grid, thinned: each value of each axis appears several times."""
    rng = random.Random(0)
    cases = []
    for b, s_q, s_k, h_q in itertools.product(
        [1, 2, 6, 64], [1, 2, 4], [20, 140, 4096], [1, 9, 64, 128]
    ):
        if b * s_k * h_q > 64 * 4096 * 64:
            continue
        cases.append((b, s_q, s_k, h_q, 1, rng.random() < 0.5, rng.random() < 0.5))
    for h_kv, h_q in [(2, 2), (2, 126), (3, 3), (3, 63), (3, 9), (8, 8), (8, 64), (8, 128)]:
        for s_q in (1, 2):
            cases.append((6, s_q, 140, h_q, h_kv, True, s_q > 1))
    return cases


@needs_hopper
@pytest.mark.parametrize(("b", "s_q", "s_k", "h_q", "h_kv", "varlen", "causal"), grid_cases())
def test_grid(b, s_q, s_k, h_q, h_kv, varlen, causal, is_fp8_kvcache, cuda_generator):
    assert mla_kernels.backend("cuda") == "cuda"
    seqlens = varlen_seqlens(b, s_k, s_q, cuda_generator) if varlen else [s_k] * b
    case = decode_case(
        seqlens,
        s_q,
        h_q,
        h_kv,
        is_fp8_kvcache=is_fp8_kvcache,
        device="cuda",
        generator=cuda_generator,
    )
    assert_close(*run_both(case, causal))


@needs_hopper
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q", [8, 16, 48])  # 16, 32 and 96 query rows per KV head
def test_page_sizes_dtypes_and_fp8(page_size, dtype, is_fp8_kvcache, h_q, cuda_generator):
    seqlens = [*varlen_seqlens(6, 1000, 2, cuda_generator), 1, 63, 64, 65]
    case = decode_case(seqlens, 2, h_q, 1, page_size, dtype, is_fp8_kvcache, "cuda", cuda_generator)
    assert_close(*run_both(case, causal=True))


@needs_hopper
@pytest.mark.parametrize("h_q", [4, 32])  # 16 and 128 query rows per KV head
def test_empty_and_short_sequences(h_q, is_fp8_kvcache, cuda_generator):
    seqlens = [0, 3, 0, 1, 200, 0, 64, 2]
    case = decode_case(
        seqlens, 4, h_q, is_fp8_kvcache=is_fp8_kvcache, device="cuda", generator=cuda_generator
    )
    (out, lse), expected = run_both(case, causal=True)
    assert_close((out, lse), expected)
    assert (out[0] == 0).all() and lse[0].isposinf().all()
    assert lse[1, :, 0].isposinf().all()  # 3 tokens, 4 causal queries: the first sees none


@needs_hopper
def test_long_sequence(is_fp8_kvcache, cuda_generator):
    case = decode_case(
        [131072, 5000],
        1,
        16,
        is_fp8_kvcache=is_fp8_kvcache,
        device="cuda",
        generator=cuda_generator,
    )
    assert_close(*run_both(case, causal=False))


@needs_hopper
@pytest.mark.parametrize("h_q", [8, 16, 64])  # 16, 32 and 128 query rows per KV head
def test_cuda_graph_replay_matches_eager(h_q, is_fp8_kvcache, cuda_generator):
    case = decode_case(
        varlen_seqlens(16, 2000, 2, cuda_generator), 2, h_q, is_fp8_kvcache=is_fp8_kvcache,
        device="cuda", generator=cuda_generator,
    )  # fmt: skip
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 2 * h_q, 1)

    def attend():
        return mla_kernels.flash_mla_with_kvcache(
            case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
            causal=True, is_fp8_kvcache=is_fp8_kvcache,
        )  # fmt: skip

    attend()  # build and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = attend()
    for _ in range(2):
        case.q.copy_(torch.randn(case.q.shape, generator=cuda_generator, device="cuda"))
        graph.replay()
        out, lse = attend()
        assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)


@needs_hopper
def test_opcheck_cuda(cuda_generator):
    case = decode_case([100, 7, 0], 2, 16, device="cuda", generator=cuda_generator)
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 32, 1)
    args = (case.q, case.k_cache, case.block_table, case.cache_seqlens, metadata, splits)
    torch.library.opcheck(torch.ops.mla_kernels.mla_decode.default, (*args, 0.04, True, False))


@needs_hopper
@pytest.mark.parametrize(("s_q", "h_q"), [(1, 16), (2, 64)])  # FP8: the narrow and wide kernels
def test_tokens_without_a_cache_block_are_not_attended(
    s_q, h_q, is_fp8_kvcache, missing_blocks_case, cuda_generator, oracle
):
    """Review finding 7: a page past the block table, or a -1 entry, read block 0 into the
    softmax (here NaN) or zeros with score 0; unchecked, the kernel attends neither."""
    case = missing_blocks_case(s_q, h_q, is_fp8_kvcache, "cuda", cuda_generator)
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, s_q * h_q, 1)
    poison_allocator(case)
    out, lse = mla_kernels.flash_mla_with_kvcache(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
        causal=True, is_fp8_kvcache=is_fp8_kvcache, check_values=False,
    )  # fmt: skip
    expected = reference.mla_decode(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 576**-0.5, True,
        is_fp8_kvcache,
    )  # fmt: skip
    assert_close((out, lse), expected)
    assert (out[3] == 0).all() and torch.isposinf(lse[3]).all()
    oracle_out, oracle_lse = oracle(case, 576**-0.5, True)
    assert_close((out.cpu(), lse.cpu()), (oracle_out.to(out.dtype), oracle_lse.float()))


@needs_hopper
def test_out_of_range_pages_do_not_fault_inside_a_graph(cuda_generator):
    # Value checks are skipped during capture; the kernel attends no token of such a page.
    case = decode_case([300, 300], 1, 16, device="cuda", generator=cuda_generator)
    case.block_table[1, 2] = 1 << 20
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 16, 1)
    graph = torch.cuda.CUDAGraph()
    mla_kernels.flash_mla_with_kvcache(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
        check_values=False,
    )  # fmt: skip
    with torch.cuda.graph(graph):
        out, _ = mla_kernels.flash_mla_with_kvcache(
            case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits
        )
    graph.replay()
    torch.cuda.synchronize()
    assert out.isfinite().all()


def poison_small_blocks():
    """Empty the allocator's cache, then fill a whole 2 MiB segment of its pool for small
    tensors with -7 and free it: the small tensors allocated next (an op's outputs and
    workspace) come from there, so what the op leaves unwritten shows."""
    torch.cuda.empty_cache()
    filled = [torch.full((1 << 18,), -7, dtype=torch.int32, device="cuda") for _ in range(2)]
    del filled


@needs_hopper
def test_the_schedule_kernel_equals_the_reference_schedule():
    """The one-block schedule kernel against `schedule_reference` on the CPU, bit for bit:
    random batches (empty, short and long sequences, up to 5,000 of them: several elements per
    thread in its scans) at every partition count from 1 to 140, written into poisoned
    memory."""
    rng = random.Random(0)
    cases = [[0], [1], [64], [65], [0, 0, 0], [131072, 5000], [1] * 5000, [4096] * 1024]
    for _ in range(60):
        b = rng.choice([1, 2, 7, 64, 131, 1000, 1025, 4999])
        cases.append([rng.choice([0, rng.randint(1, 64), rng.randint(1, 20000)]) for _ in range(b)])
    for seqlens, num_parts in zip(cases, itertools.cycle(range(1, 141)), strict=False):
        for parts in {num_parts, 1, 132}:
            lengths = torch.tensor(seqlens, dtype=torch.int32)
            lengths_on_gpu = lengths.cuda()
            poison_small_blocks()
            got = scheduler.schedule(lengths_on_gpu, parts)
            want = scheduler.schedule_reference(lengths, parts)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g.cpu(), w), (seqlens[:8], len(seqlens), parts)


@needs_hopper
def test_the_schedule_kernel_is_one_kernel_and_replays_from_a_cuda_graph():
    lengths = torch.tensor([100, 0, 7000, 64], dtype=torch.int32, device="cuda")
    mla_kernels.get_mla_metadata(lengths, 32, 1)  # build and load outside the capture
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        mla_kernels.get_mla_metadata(lengths, 32, 1)
        torch.cuda.synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert [e.name for e in kernels if "schedule" in e.name] and len(kernels) == 1, kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        metadata, splits = mla_kernels.get_mla_metadata(lengths, 32, 1)
    lengths.copy_(torch.tensor([5, 3000, 0, 129], dtype=torch.int32))
    graph.replay()
    want = scheduler.schedule_reference(lengths.cpu(), metadata.shape[0])
    assert torch.equal(metadata.cpu(), want[0]) and torch.equal(splits.cpu(), want[1])
