"""The sparse Triton kernels compiled for a CUDA GPU against the torch reference (float32 on
the same GPU), at DeepSeek-V3.2's shapes (h_q 64 and 128, topk 2048) and at small ones."""

import pytest
import torch

import mla_kernels
from mla_kernels import reference
from mla_kernels.kv_cache import write_kv_cache
from mla_kernels.testing import NAN_BYTE, poison_cuda_allocator, sparse_decode_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "triton")


def decode(q, k_cache, indices, is_fp8_kvcache):
    return mla_kernels.flash_mla_with_kvcache(
        q, k_cache, None, None, 512, None, None, is_fp8_kvcache=is_fp8_kvcache, indices=indices
    )


def decode_and_reference(case):
    """The kernel's (out, lse) into poisoned memory, and the reference's, shaped alike."""
    paged = case.paged
    b, s_q, h_q, _ = paged.q.shape
    rows = b * s_q
    partials = [(rows, splits, h_q, *tail) for splits in range(2, 9) for tail in ((512,), ())]
    poison_cuda_allocator(
        [(rows, h_q, 512), (rows, h_q), *partials], (torch.float32, torch.bfloat16)
    )
    out, lse = decode(paged.q, paged.k_cache, case.indices, paged.is_fp8_kvcache)
    width = paged.k_cache.shape[-1]
    ref_out, _, ref_lse = reference.sparse_attention(
        paged.q.view(rows, h_q, 576), paged.k_cache.view(-1, width),
        case.indices.view(rows, -1), 576**-0.5, paged.is_fp8_kvcache,
    )  # fmt: skip
    return (out, lse), (ref_out.view(b, s_q, h_q, 512), ref_lse.view(b, s_q, h_q).transpose(1, 2))


def assert_close(actual, expected):
    (out, lse), (ref_out, ref_lse) = actual, expected
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN in out (an element left unwritten, or a NaN slot read)"
    assert not lse.isnan().any(), "NaN in lse"
    assert torch.equal(lse.isposinf(), ref_lse.isposinf())
    seen = ref_lse.isfinite()
    assert (lse[seen] - ref_lse[seen]).abs().max().item() < 1e-3
    error = (out.double() - ref_out.double()).norm() / ref_out.double().norm().clamp(min=1e-12)
    assert error.item() < 1e-2, f"relative error {error.item():.2e}"


@pytest.mark.parametrize("is_fp8_kvcache", [True, False])
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
def test_deepseek_v32_shapes(s_q, h_q, is_fp8_kvcache, cuda_generator):
    case = sparse_decode_case([4096] * 64, s_q, h_q, 2048, is_fp8_kvcache=is_fp8_kvcache,
                              invalid=0.02, device="cuda", generator=cuda_generator)  # fmt: skip
    case.indices[3, 0] = -1  # a query that attends nothing
    assert_close(*decode_and_reference(case))


@pytest.mark.parametrize(
    ("seqlens", "s_q", "h_q", "topk", "page_size"),
    [
        ([70, 300, 5], 4, 16, 64, 16),
        ([1000] * 6, 3, 32, 192, 32),
        ([500, 2500], 1, 128, 1024, 128),
        ([200] * 9, 2, 7, 100, 64),
    ],
)
@pytest.mark.parametrize("is_fp8_kvcache", [True, False])
def test_small_shapes(seqlens, s_q, h_q, topk, page_size, is_fp8_kvcache, cuda_generator):
    case = sparse_decode_case(seqlens, s_q, h_q, topk, page_size, is_fp8_kvcache, invalid=0.2,
                              device="cuda", generator=cuda_generator)  # fmt: skip
    num_slots = case.paged.k_cache.shape[0] * page_size
    case.indices[0, 0, ::2] = num_slots + 3  # past the cache: not attended, never read
    assert_close(*decode_and_reference(case))


def test_slots_past_two_gigabytes(cuda_generator):
    """Byte offsets beyond 2^31 (3.4M FP8 tokens): the kernel's addresses are 64-bit."""
    num_slots = 3_400_000
    k_cache = torch.empty(num_slots // 64, 64, 1, 656, dtype=torch.float8_e4m3fn, device="cuda")
    k_cache.view(torch.uint8).fill_(NAN_BYTE)
    slots = torch.randperm(100_000, device="cuda", generator=cuda_generator)[:4096] + 3_290_000
    tokens = torch.randn(4096, 1, 576, device="cuda", generator=cuda_generator)
    write_kv_cache(k_cache, tokens[..., :512], tokens[..., 512:], slots, True)
    indices = slots.to(torch.int32).view(2, 1, 2048)
    q = torch.randn(2, 1, 64, 576, device="cuda", generator=cuda_generator).to(torch.bfloat16)
    out, lse = decode(q, k_cache, indices, True)
    ref_out, _, ref_lse = reference.sparse_attention(
        q.view(2, 64, 576), k_cache.view(-1, 656), indices.view(2, 2048), 576**-0.5, True
    )
    assert_close((out, lse), (ref_out.view(2, 1, 64, 512), ref_lse.view(2, 1, 64).transpose(1, 2)))


@pytest.mark.parametrize("h_q", [64, 128])
def test_prefill(h_q, cuda_generator):
    s_q, s_kv, topk = 512, 8192, 2048
    like = {"device": "cuda", "generator": cuda_generator}
    q = torch.randn(s_q, h_q, 576, **like).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, **like).to(torch.bfloat16)
    indices = torch.rand(s_q, s_kv, **like).argsort(dim=-1)[:, :topk].to(torch.int32)
    indices[torch.rand(s_q, topk, **like) < 0.05] = -1
    indices[1] = s_kv  # past the end: nothing attended
    indices = indices.view(s_q, 1, topk)
    poison_cuda_allocator([(s_q, h_q, 512), (s_q, h_q)], (torch.float32, torch.bfloat16))
    out, max_logits, lse = mla_kernels.flash_mla_sparse_fwd(q, kv, indices, 0.05)
    expected = reference.sparse_attention(q, kv.view(s_kv, 576), indices.view(s_q, topk), 0.05,
                                          False)  # fmt: skip
    assert torch.equal(max_logits.isneginf(), expected[1].isneginf())
    seen = expected[2].isfinite()
    assert (max_logits[seen] - expected[1][seen]).abs().max().item() < 1e-3
    assert_close((out, lse), (expected[0], expected[2]))


@pytest.mark.parametrize("is_fp8_kvcache", [True, False])
def test_cuda_graph_replay_matches_eager(is_fp8_kvcache, cuda_generator):
    case = sparse_decode_case([3000] * 16, 2, 64, 2048, is_fp8_kvcache=is_fp8_kvcache,
                              device="cuda", generator=cuda_generator)  # fmt: skip
    q, k_cache = case.paged.q.clone(), case.paged.k_cache
    indices = case.indices.clone()
    decode(q, k_cache, indices, is_fp8_kvcache)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = decode(q, k_cache, indices, is_fp8_kvcache)
    for _ in range(2):  # new queries and indices, as each decode step brings
        q.copy_(torch.randn(q.shape, device="cuda", generator=cuda_generator))
        indices.copy_(indices[:, :, torch.randperm(2048, device="cuda", generator=cuda_generator)])
        indices[0, 0, :100] = -1
        graph.replay()
        out, lse = decode(q, k_cache, indices, is_fp8_kvcache)
        assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)


def test_opcheck_cuda(cuda_generator):
    case = sparse_decode_case([300, 90], 2, 16, 128, is_fp8_kvcache=True, device="cuda",
                              generator=cuda_generator)  # fmt: skip
    tokens = case.paged.k_cache.view(torch.uint8).view(-1, 656)
    args = (case.paged.q.view(4, 16, 576), tokens, case.indices.view(4, 128), 0.04, True)
    torch.library.opcheck(torch.ops.mla_kernels.sparse_mla.default, args)
