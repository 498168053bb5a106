import math

import pytest
import torch

import mla_kernels
from mla_kernels.testing import decode_case, dequantized, long_tail_seqlens, repage

CASES = [
    # seqlens, s_q, h_q, h_kv, page_size, causal
    ([37], 1, 16, 1, 64, False),
    ([1, 140, 64, 65], 1, 8, 1, 16, False),
    ([20, 140], 2, 4, 2, 32, True),
    ([0, 77, 3], 4, 6, 3, 16, True),
    ([130, 129, 256], 3, 16, 8, 128, True),
    ([2, 9], 4, 2, 1, 64, True),  # seqlen < s_q: the first queries see nothing
]


def relative_error(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("seqlens", "s_q", "h_q", "h_kv", "page_size", "causal"), CASES)
def test_reference_matches_float64_math(
    seqlens, s_q, h_q, h_kv, page_size, causal, dtype, is_fp8_kvcache, generator, oracle
):
    case = decode_case(
        seqlens, s_q, h_q, h_kv, page_size, dtype, is_fp8_kvcache, generator=generator
    )
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = mla_kernels.flash_mla_with_kvcache(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
        causal=causal, is_fp8_kvcache=is_fp8_kvcache,
    )  # fmt: skip
    expected_out, expected_lse = oracle(case, 576**-0.5, causal)

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert relative_error(out, expected_out) < 4e-3  # the bf16/fp16 rounding of out
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isinf(), ~seen)
    assert (lse[seen].double() - expected_lse[seen]).abs().max() < 1e-4
    assert (out.double()[~seen.permute(0, 2, 1)] == 0).all()


def test_softmax_scale_and_a_hand_computed_case():
    # One sequence of two tokens, one query: attention weights are a softmax of two scores.
    q = torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k_cache = torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16)
    k_cache[0, 0, 0, 0], k_cache[0, 1, 0, 0] = 2.0, 4.0  # scores 2 and 4 before scaling
    k_cache[0, 0, 0, 1], k_cache[0, 1, 0, 1] = 1.0, 3.0  # V column 1 holds 1 and 3
    k_cache[0, 2:] = float("nan")
    seqlens = torch.tensor([2], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    metadata, splits = mla_kernels.get_mla_metadata(seqlens, 1, 1)
    out, lse = mla_kernels.flash_mla_with_kvcache(
        q, k_cache, table, seqlens, 512, metadata, splits, softmax_scale=0.5
    )
    w = torch.softmax(torch.tensor([1.0, 2.0], dtype=torch.float64), 0)
    assert lse.item() == pytest.approx(math.log(math.exp(1.0) + math.exp(2.0)), abs=1e-6)
    assert out[0, 0, 0, 1].item() == pytest.approx(float(w[0] * 1 + w[1] * 3), rel=4e-3)
    assert out[0, 0, 0, 0].item() == pytest.approx(float(w[0] * 2 + w[1] * 4), rel=4e-3)


def test_empty_sequence_gives_zero_and_infinite_lse(generator):
    case = decode_case([0, 5], 2, 4, generator=generator)
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 8, 1)
    out, lse = mla_kernels.flash_mla_with_kvcache(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits
    )
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()
    assert lse[1].isfinite().all()


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
def test_tokens_without_a_cache_block_are_not_attended(
    is_fp8_kvcache, missing_blocks_case, generator, oracle
):
    case = missing_blocks_case(2, 8, is_fp8_kvcache, "cpu", generator)
    args = (case.q, case.k_cache, case.block_table, case.cache_seqlens, 512)
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 16, 1)
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 360 is outside"):
        mla_kernels.flash_mla_with_kvcache(*args, metadata, splits, causal=True,
                                           is_fp8_kvcache=is_fp8_kvcache, check_values=True)  # fmt: skip
    out, lse = mla_kernels.flash_mla_with_kvcache(  # unchecked, the default
        *args, metadata, splits, causal=True, is_fp8_kvcache=is_fp8_kvcache
    )
    expected_out, expected_lse = oracle(case, 576**-0.5, True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert relative_error(out, expected_out) < 4e-3
    assert (out[3] == 0).all() and torch.isposinf(lse[3]).all()  # no token left to attend
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isinf(), ~seen)
    assert (lse[seen].double() - expected_lse[seen]).abs().max() < 1e-4


def attend(case, causal=True):
    s_q, h_q = case.q.shape[1:3]
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, s_q * h_q, 1)
    return mla_kernels.flash_mla_with_kvcache(
        case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, metadata, splits,
        causal=causal, is_fp8_kvcache=case.is_fp8_kvcache,
    )  # fmt: skip


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
def test_repaged_cases_hold_the_same_tokens(is_fp8_kvcache, generator):
    case = decode_case([70, 1, 200, 129], 2, 4, page_size=64, is_fp8_kvcache=is_fp8_kvcache,
                       generator=generator)  # fmt: skip
    out, lse = attend(case)
    for page_size in (16, 32, 128):
        moved = repage(case, page_size, generator)
        assert moved.k_cache.shape[1] == page_size and moved.k_cache.dtype == case.k_cache.dtype
        assert moved.block_table.shape[1] == -(-200 // page_size)
        moved_out, moved_lse = attend(moved)
        # The reference sums over the padded block table, so the order of float32 sums moves.
        assert relative_error(moved_out, out.double()) < 2e-3
        seen = lse.isfinite()
        assert torch.equal(moved_lse.isfinite(), seen) and not seen.all()
        assert (moved_lse[seen] - lse[seen]).abs().max() < 1e-5


def test_the_dequantized_case_is_what_the_fp8_cache_computes(generator, oracle):
    case = decode_case([90, 300], 1, 8, is_fp8_kvcache=True, generator=generator)
    twin = dequantized(case)
    assert twin.k_cache.dtype == case.q.dtype and not twin.is_fp8_kvcache
    out, lse = attend(case)
    twin_out, twin_lse = attend(twin)
    assert torch.equal(out, twin_out) and torch.equal(lse, twin_lse)
    expected_out, _ = oracle(twin, 576**-0.5, True)
    assert relative_error(twin_out, expected_out) < 4e-3


def test_long_tail_lengths(generator):
    lengths = long_tail_seqlens(128, generator)
    assert len(lengths) == 128 and min(lengths) >= 512 and max(lengths) <= 65536
    assert sum(n <= 2048 for n in lengths) >= 64
    assert sum(n >= 32768 for n in lengths) == 8
    assert lengths != sorted(lengths)
    assert long_tail_seqlens(4, generator) != long_tail_seqlens(4, generator)
