"""Sparse MLA (decode and prefill) through the public calls, on the torch reference."""

import importlib.util
import math

import pytest
import torch

import mla_kernels
from mla_kernels import reference
from mla_kernels.fp8_layout import quantize_fp8
from mla_kernels.testing import (
    DecodeCase,
    dequantized,
    repage,
    slots_of,
    sparse_decode_case,
)


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "reference")


def decode(case, **overrides):
    paged = case.paged
    args = {
        "q": paged.q,
        "k_cache": paged.k_cache,
        "block_table": None,
        "cache_seqlens": None,
        "head_dim_v": 512,
        "tile_scheduler_metadata": None,
        "num_splits": None,
        "is_fp8_kvcache": paged.is_fp8_kvcache,
        "indices": case.indices,
    }
    return mla_kernels.flash_mla_with_kvcache(**(args | overrides))


def flat_oracle(case, oracle, softmax_scale=576**-0.5):
    """The float64 oracle over the decode case's query rows, shaped as decode returns them."""
    b, s_q, h_q, _ = case.paged.q.shape
    cache = case.paged.k_cache
    out, _, lse = oracle(
        case.paged.q.view(b * s_q, h_q, 576), cache.view(-1, cache.shape[-1]),
        case.indices.view(b * s_q, -1), softmax_scale, case.paged.is_fp8_kvcache,
    )  # fmt: skip
    return out.view(b, s_q, h_q, 512), lse.view(b, s_q, h_q).transpose(1, 2)


def relative_error(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def assert_matches(out, lse, expected_out, expected_lse, out_error=4e-3):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert relative_error(out, expected_out) < out_error  # the bf16 rounding of out
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isposinf(), ~seen)
    assert (lse[seen].double() - expected_lse[seen]).abs().max() < 1e-4


DECODE_CASES = [
    # seqlens, s_q, h_q, topk, page_size
    ([300, 70], 1, 16, 64, 64),
    ([100, 500, 3], 2, 8, 128, 16),  # the third sequence has fewer tokens than topk
    ([257], 4, 3, 64, 128),
    ([90, 40], 3, 64, 100, 32),  # topk not a multiple of 64
]


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
@pytest.mark.parametrize(("seqlens", "s_q", "h_q", "topk", "page_size"), DECODE_CASES)
def test_sparse_decode_matches_float64_math(
    seqlens, s_q, h_q, topk, page_size, is_fp8_kvcache, generator, sparse_oracle
):
    case = sparse_decode_case(
        seqlens, s_q, h_q, topk, page_size, is_fp8_kvcache, generator=generator
    )
    out, lse = decode(case)
    b = len(seqlens)
    assert out.shape == (b, s_q, h_q, 512) and lse.shape == (b, h_q, s_q)
    assert_matches(out, lse, *flat_oracle(case, sparse_oracle))


def prefill_case(s_q, s_kv, h_q, topk, generator):
    """Queries, a kv of s_kv rows, and topk distinct rows per query of which some are -1 and
    some point past the end of kv (both invalid)."""
    q = torch.randn(s_q, h_q, 576, generator=generator).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, generator=generator).to(torch.bfloat16)
    pool = max(s_kv + 8, topk)  # entries from s_kv up are past the end
    indices = torch.rand(s_q, pool, generator=generator).argsort(dim=-1)[:, :topk]
    dropped = torch.rand(s_q, topk, generator=generator) < 0.1
    indices = indices.masked_fill(dropped, -1).to(torch.int32).view(s_q, 1, topk)
    return q, kv, indices


@pytest.mark.parametrize(("s_q", "s_kv", "h_q", "topk"), [(5, 300, 16, 64), (3, 70, 4, 128)])
def test_sparse_prefill_matches_float64_math(s_q, s_kv, h_q, topk, generator, sparse_oracle):
    q, kv, indices = prefill_case(s_q, s_kv, h_q, topk, generator)
    assert (indices >= s_kv).any() and (indices == -1).any()
    out, max_logits, lse = mla_kernels.flash_mla_sparse_fwd(q, kv, indices, 0.07)
    expected_out, expected_max, expected_lse = sparse_oracle(
        q, kv.view(s_kv, 576), indices.view(s_q, topk), 0.07, False
    )
    assert out.shape == (s_q, h_q, 512) and max_logits.shape == lse.shape == (s_q, h_q)
    assert max_logits.dtype == torch.float32
    assert_matches(out, lse, expected_out, expected_lse)
    assert (max_logits.double() - expected_max).abs().max() < 1e-4


def test_the_reference_in_chunks_of_rows_gives_the_same_result(monkeypatch, generator):
    q, kv, indices = prefill_case(7, 300, 4, 64, generator)
    args = (q, kv.view(300, 576), indices.view(7, 64), 0.1, False)
    whole = reference.sparse_attention(*args)
    monkeypatch.setattr(reference, "SPARSE_CHUNK_FLOATS", 3 * 64 * 576)  # 3 rows a chunk
    for chunked, expected in zip(reference.sparse_attention(*args), whole, strict=True):
        assert torch.equal(chunked, expected)
    empty = reference.sparse_attention(
        q[:0], kv.view(300, 576), indices.view(7, 64)[:0], 0.1, False
    )
    assert [tuple(t.shape) for t in empty] == [(0, 4, 512), (0, 4), (0, 4)]


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
def test_the_reference_in_float64_matches_the_oracle_to_rounding(
    is_fp8_kvcache, generator, sparse_oracle
):
    case = sparse_decode_case(
        [200, 90], 2, 8, 64, is_fp8_kvcache=is_fp8_kvcache, generator=generator
    )
    q, cache = case.paged.q.double().view(4, 8, 576), case.paged.k_cache
    tokens = cache.view(-1, cache.shape[-1]) if is_fp8_kvcache else cache.double().view(-1, 576)
    args = (q, tokens, case.indices.view(4, 64), 0.05, is_fp8_kvcache)
    for got, expected in zip(reference.sparse_attention(*args), sparse_oracle(*args), strict=True):
        assert got.dtype == torch.float64
        finite = expected.isfinite()
        assert torch.equal(got.isfinite(), finite)
        assert (got[finite] - expected[finite]).abs().max() < 1e-12


def test_a_hand_computed_case():
    """One query attends slots 17 and 5 (scores 2 and 4 before the scale 0.5, V column 1
    holding 1 and 3) past a -1 and an entry beyond the cache; every other slot is NaN."""
    cache = torch.full((2, 16, 1, 576), float("nan"), dtype=torch.bfloat16)
    flat = cache.view(32, 576)
    flat[17], flat[5] = 0.0, 0.0
    flat[17, 0], flat[5, 0] = 2.0, 4.0
    flat[17, 1], flat[5, 1] = 1.0, 3.0
    q = torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    indices = torch.tensor([[[17, -1, 5, 32]]], dtype=torch.int32)

    out, lse = mla_kernels.flash_mla_with_kvcache(
        q, cache, None, None, 512, None, None, softmax_scale=0.5, indices=indices
    )
    w = torch.softmax(torch.tensor([1.0, 2.0], dtype=torch.float64), 0)
    assert lse.item() == pytest.approx(math.log(math.exp(1.0) + math.exp(2.0)), abs=1e-6)
    assert out[0, 0, 0, 1].item() == pytest.approx(float(w[0] * 1 + w[1] * 3), rel=4e-3)
    assert out[0, 0, 0, 0].item() == pytest.approx(float(w[0] * 2 + w[1] * 4), rel=4e-3)
    assert (out[0, 0, 0, 2:] == 0).all()

    out, max_logits, lse = mla_kernels.flash_mla_sparse_fwd(
        q.view(1, 1, 576), flat.view(32, 1, 576), indices.view(1, 1, 4), 0.5
    )
    assert max_logits.item() == 2.0
    assert lse.item() == pytest.approx(math.log(math.exp(1.0) + math.exp(2.0)), abs=1e-6)


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
def test_a_query_without_valid_indices_gets_zero_and_infinite_lse(is_fp8_kvcache, generator):
    case = sparse_decode_case([80, 80], 2, 4, 64, is_fp8_kvcache=is_fp8_kvcache,
                              generator=generator)  # fmt: skip
    num_slots = case.paged.k_cache.shape[0] * 64
    case.indices[0, 1] = -1
    case.indices[1, 0, ::2] = -1
    case.indices[1, 0, 1::2] = num_slots + 5
    out, lse = decode(case)
    assert (out[0, 1] == 0).all() and (out[1, 0] == 0).all()
    assert torch.isposinf(lse[0, :, 1]).all() and torch.isposinf(lse[1, :, 0]).all()
    assert lse[0, :, 0].isfinite().all() and lse[1, :, 1].isfinite().all()

    q, kv, indices = prefill_case(3, 50, 4, 64, generator)
    indices[1] = -1
    out, max_logits, lse = mla_kernels.flash_mla_sparse_fwd(q, kv, indices, 0.1)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    assert torch.isneginf(max_logits[1]).all() and max_logits[0].isfinite().all()


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
def test_any_page_size_gives_the_same_result(is_fp8_kvcache, generator):
    case = sparse_decode_case([200, 70], 2, 8, 64, page_size=64, is_fp8_kvcache=is_fp8_kvcache,
                              generator=generator)  # fmt: skip
    out, lse = decode(case)
    for page_size in (1, 16, 128, 256):
        moved = repage(case.paged, page_size, generator)
        indices = slots_of(case.positions, moved.block_table, page_size)
        moved_out, moved_lse = decode(case, k_cache=moved.k_cache, indices=indices)
        assert torch.equal(moved_out, out) and torch.equal(moved_lse, lse)


def test_the_fp8_cache_computes_its_dequantized_twin_within_fp8_error(generator):
    case = sparse_decode_case([300, 200], 2, 16, 128, generator=generator)
    paged = case.paged
    cache = paged.k_cache
    fp8 = DecodeCase(paged.q, quantize_fp8(cache[..., :512], cache[..., 512:]),
                     paged.block_table, paged.cache_seqlens, True)  # fmt: skip
    fp8_out, fp8_lse = decode(case, k_cache=fp8.k_cache, is_fp8_kvcache=True)
    twin_out, twin_lse = decode(case, k_cache=dequantized(fp8).k_cache, is_fp8_kvcache=False)
    assert torch.equal(fp8_out, twin_out) and torch.equal(fp8_lse, twin_lse)

    out, lse = decode(case)  # the bf16 cache the FP8 one was quantized from
    seen = lse.isfinite()
    # e4m3 keeps 3 mantissa bits: about 3.4 % of out's norm on these random tokens.
    assert 0.01 < relative_error(fp8_out, out.double()) < 0.05
    assert (fp8_lse[seen] - lse[seen]).abs().max() < 0.05


def test_opcheck_sparse_mla(generator):
    for is_fp8_kvcache in (False, True):
        case = sparse_decode_case([70, 9], 2, 4, 64, page_size=16, is_fp8_kvcache=is_fp8_kvcache,
                                  generator=generator)  # fmt: skip
        cache = case.paged.k_cache
        # opcheck compares inputs arithmetically, which float8 tensors do not support on the CPU.
        tokens = cache.view(torch.uint8) if is_fp8_kvcache else cache
        args = (case.paged.q.view(4, 4, 576), tokens.view(-1, cache.shape[-1]),
                case.indices.view(4, 64), 0.04, is_fp8_kvcache)  # fmt: skip
        torch.library.opcheck(torch.ops.mla_kernels.sparse_mla.default, args)


def test_compiles_without_graph_breaks(generator):
    case = sparse_decode_case([70, 9], 1, 4, 64, generator=generator)

    def attend(q):
        return decode(case, q=q)

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    for got, expected in zip(compiled(case.paged.q), attend(case.paged.q), strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("installed", [True, False])
def test_sparse_backend_choice(monkeypatch, installed):
    monkeypatch.delenv("MLA_KERNELS_SPARSE_BACKEND")  # the default
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: (object() if installed else None) if name == "triton" else find_spec(name),
    )
    assert mla_kernels.sparse_backend("cpu") == "reference"
    assert mla_kernels.sparse_backend("meta") == "reference"
    assert mla_kernels.sparse_backend("cuda") == ("triton" if installed else "reference")
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "reference")
    assert mla_kernels.sparse_backend("cuda") == "reference"
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "triton")
    if installed:
        assert mla_kernels.sparse_backend("cpu") == "triton"
    else:
        with pytest.raises(RuntimeError, match="Triton is not installed"):
            mla_kernels.sparse_backend("cpu")
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "fast")
    with pytest.raises(ValueError, match="MLA_KERNELS_SPARSE_BACKEND='fast'"):
        mla_kernels.sparse_backend("cpu")


@pytest.fixture
def bad_input_case(generator):
    return sparse_decode_case([70, 3], 2, 4, 64, page_size=32, generator=generator)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda c: {"q": c.paged.q.float()}, "q must be bfloat16, got torch.float32"),
        (lambda c: {"q": c.paged.q[0]}, "q must be \\[b, s_q, h_q, 576\\]"),
        (lambda c: {"q": c.paged.q[..., :512].contiguous()}, "q must be \\[b, s_q, h_q, 576\\], got \\(2, 2, 4, 512\\)"),
        (lambda c: {"q": c.paged.q.transpose(1, 2)}, "q must be contiguous"),
        (lambda c: {"q": c.paged.q.repeat(1, 1, 40, 1)}, "q must have 1..128 heads, got 160"),
        (lambda c: {"head_dim_v": 576}, "value head dimension must be 512, got 576"),
        (lambda c: {"softmax_scale": -1.0}, "softmax_scale must be a positive finite number"),
        (lambda c: {"causal": True}, "causal must be False with indices"),
        (lambda c: {"k_cache": c.paged.k_cache.half()}, "k_cache dtype torch.float16 differs"),
        (lambda c: {"k_cache": c.paged.k_cache.repeat(1, 1, 2, 1)}, "k_cache must be \\[num_blocks, page_size, 1, 576\\]"),
        (lambda c: {"is_fp8_kvcache": True}, "k_cache must be \\[num_blocks, page_size, 1, 656\\]"),
        (lambda c: {"k_cache": c.paged.k_cache[:0]}, "k_cache holds no tokens"),
        (lambda c: {"indices": c.indices.long()}, "indices must be int32"),
        (lambda c: {"indices": c.indices[:, :, :0]}, "indices must be int32 with topk >= 1"),
        (lambda c: {"indices": c.indices[:1]}, "indices must be \\[b=2, s_q=2, topk\\]"),
        (lambda c: {"indices": c.indices.transpose(0, 1)}, "indices must be contiguous"),
        (lambda c: {"indices": c.indices.to("meta")}, "indices is on meta but q is on cpu"),
    ],
)  # fmt: skip
def test_bad_decode_input_names_the_problem(bad_input_case, make, message):
    with pytest.raises(ValueError, match=message):
        decode(bad_input_case, **make(bad_input_case))


def test_bad_prefill_input_names_the_problem(generator):
    q, kv, indices = prefill_case(3, 50, 4, 64, generator)
    for args, message in [
        ((q, kv.view(50, 576), indices), "kv must be \\[s_kv, 1, 576\\]"),
        ((q, kv, indices.view(3, 64)), "indices must be \\[s_q=3, 1, topk\\]"),
        ((q, kv.float(), indices), "kv dtype torch.float32 differs from q dtype"),
        ((q.view(1, 3, 4, 576), kv, indices), "q must be \\[s_q, h_q, 576\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            mla_kernels.flash_mla_sparse_fwd(*args, 0.1)
    with pytest.raises(ValueError, match="value head dimension must be 512, got 256"):
        mla_kernels.flash_mla_sparse_fwd(q, kv, indices, 0.1, d_v=256)
    with pytest.raises(TypeError, match="indices must be a tensor, got list"):
        mla_kernels.flash_mla_sparse_fwd(q, kv, [[0]], 0.1)
