import pytest
import torch

import mla_kernels
from mla_kernels.extension import fp8_in_registers
from mla_kernels.testing import decode_case


def call(case, **overrides):
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 8, 1)
    args = {
        "q": case.q,
        "k_cache": case.k_cache,
        "block_table": case.block_table,
        "cache_seqlens": case.cache_seqlens,
        "head_dim_v": 512,
        "tile_scheduler_metadata": metadata,
        "num_splits": splits,
        "is_fp8_kvcache": case.is_fp8_kvcache,
    }
    return mla_kernels.flash_mla_with_kvcache(**(args | overrides))


@pytest.fixture
def case(generator):
    return decode_case([70, 3], s_q=2, h_q=4, page_size=32, generator=generator)


@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
def test_opcheck_mla_decode(generator, is_fp8_kvcache):
    case = decode_case([40, 0, 9], 2, 4, 2, 16, is_fp8_kvcache=is_fp8_kvcache, generator=generator)
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 4, 2)
    # opcheck compares inputs arithmetically, which float8 tensors do not support on the CPU.
    cache = case.k_cache.view(torch.uint8) if is_fp8_kvcache else case.k_cache
    args = (case.q, cache, case.block_table, case.cache_seqlens, metadata, splits)
    torch.library.opcheck(
        torch.ops.mla_kernels.mla_decode.default, (*args, 0.04, True, is_fp8_kvcache)
    )


def test_opcheck_write_kv_cache(generator):
    cache = torch.zeros(2, 16, 1, 576, dtype=torch.bfloat16)
    latent, rope = torch.randn(3, 1, 512), torch.randn(3, 1, 64)
    args = (cache, latent, rope, torch.tensor([0, 5, 31]), False)
    torch.library.opcheck(torch.ops.mla_kernels.write_kv_cache.default, args)


def test_compiles_without_graph_breaks(case):
    metadata, splits = mla_kernels.get_mla_metadata(case.cache_seqlens, 8, 1)

    def attend(q):
        return torch.ops.mla_kernels.mla_decode(
            q,
            case.k_cache,
            case.block_table,
            case.cache_seqlens,
            metadata,
            splits,
            0.04,
            True,
            False,
        )

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    for got, expected in zip(compiled(case.q), attend(case.q), strict=True):
        torch.testing.assert_close(got, expected)


def test_backend_is_reference_on_cpu(monkeypatch):
    assert mla_kernels.backend("cpu") == "reference"
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="MLA_KERNELS_BACKEND=cuda but the tensors are on cpu"):
        mla_kernels.backend("cpu")
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "fast")
    with pytest.raises(ValueError, match="MLA_KERNELS_BACKEND='fast'"):
        mla_kernels.backend("cpu")


def test_the_experimental_fp8_kernel_is_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv("MLA_KERNELS_FP8_IN_REGISTERS", raising=False)
    assert fp8_in_registers() is False
    monkeypatch.setenv("MLA_KERNELS_FP8_IN_REGISTERS", "1")
    assert fp8_in_registers() is True
    monkeypatch.setenv("MLA_KERNELS_FP8_IN_REGISTERS", "yes")
    with pytest.raises(ValueError, match="MLA_KERNELS_FP8_IN_REGISTERS='yes'; expected 0 or 1"):
        fp8_in_registers()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda c: {"q": c.q.float()}, "q must be bfloat16 or float16, got torch.float32"),
        (lambda c: {"q": c.q[..., :512].contiguous()}, "q must be \\[b, s_q, h_q, 576\\]"),
        (lambda c: {"q": c.q.transpose(1, 2)}, "q must be contiguous"),
        (lambda c: {"q": c.q.repeat(1, 3, 1, 1)}, "s_q must be in 1..4, got 6"),
        (lambda c: {"q": c.q.repeat(1, 1, 40, 1)}, "h_q must be a multiple of h_kv=1 and at most 128"),
        (lambda c: {"head_dim_v": 576}, "head_dim_v must be 512, got 576"),
        (lambda c: {"softmax_scale": 0.0}, "softmax_scale must be a positive finite number, got 0.0"),
        (lambda c: {"k_cache": c.k_cache.half()}, "k_cache dtype torch.float16 differs from q dtype"),
        (lambda c: {"k_cache": c.k_cache[..., :512].contiguous()}, "k_cache must be \\[num_blocks"),
        (lambda c: {"is_fp8_kvcache": True}, "k_cache must be \\[num_blocks, page_size, h_kv, 656\\]"),
        (lambda c: {"k_cache": c.k_cache.view(-1, 8, 1, 576)}, "page_size must be one of"),
        (lambda c: {"block_table": c.block_table.long()}, "block_table must be int32"),
        (lambda c: {"block_table": c.block_table[:1]}, "block_table must be int32 \\[b=2"),
        (lambda c: {"cache_seqlens": c.cache_seqlens.long()}, "cache_seqlens must be a non-empty 1-D int32"),
        (lambda c: {"q": torch.zeros(2, 2, 4, 576, dtype=torch.bfloat16, device="meta")}, "is on cpu but q is on meta"),
        (lambda c: {"num_splits": torch.zeros(5, dtype=torch.int32)}, "num_splits must have b \\+ 1 = 3"),
        (lambda c: {"tile_scheduler_metadata": torch.zeros(3, 8, dtype=torch.int32)}, "tile_scheduler_metadata must be"),
        # values, checked only when asked (a device-to-host synchronization)
        (lambda c: {"block_table": c.block_table.clone().fill_(-1), "check_values": True}, "block_table\\[0, 0\\] = -1 is outside"),
        (lambda c: {"block_table": c.block_table + 100, "check_values": True}, "is outside the cache's 9 blocks"),
        (lambda c: {"cache_seqlens": torch.tensor([70, 97], dtype=torch.int32), "check_values": True}, "cache_seqlens\\[1\\] = 97 is outside 0..max_blocks"),
        (lambda c: {"cache_seqlens": torch.tensor([-1, 3], dtype=torch.int32), "check_values": True}, "cache_seqlens\\[0\\] = -1"),
    ],
)  # fmt: skip
def test_bad_input_names_the_problem(case, make, message):
    with pytest.raises(ValueError, match=message):
        call(case, **make(case))


def test_block_table_entries_past_the_sequence_are_not_checked(case):
    table = case.block_table.clone()
    table[1, 1:] = 10_000  # sequence 1 has 3 tokens: only its first page is read
    out, _ = call(case, block_table=table, check_values=True)
    assert out.isfinite().all()


def test_metadata_errors():
    with pytest.raises(ValueError, match="num_heads_k must be a positive int"):
        mla_kernels.get_mla_metadata(torch.tensor([1], dtype=torch.int32), 8, 0)
    with pytest.raises(ValueError, match="cache_seqlens must be a non-empty 1-D int32"):
        mla_kernels.get_mla_metadata(torch.tensor([1.0]), 8, 1)
