"""The sparse Triton kernels in Triton's interpreter (CPU tensors) against the torch reference,
and compiled for sm_90a (no GPU needed).

Triton chooses between interpreter and compiler when it is imported, so the interpreter's
tests run in a child pytest of this file with TRITON_INTERPRET=1
(`test_the_kernels_in_the_interpreter`); in this process they are skipped.
"""

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("triton")
import triton

import mla_kernels
from mla_kernels import reference, sparse_triton
from mla_kernels.testing import sparse_decode_case

INTERPRETING = triton.knobs.runtime.interpret
in_the_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="runs in the child that test_the_kernels_in_the_interpreter starts"
)
compiling = pytest.mark.skipif(INTERPRETING, reason="Triton was imported as its interpreter")


def flat(case):
    b, s_q, h_q, _ = case.paged.q.shape
    cache = case.paged.k_cache
    return (
        case.paged.q.view(b * s_q, h_q, 576),
        cache.view(-1, cache.shape[-1]),
        case.indices.view(b * s_q, -1),
    )


def poison_empty(monkeypatch):
    """Outputs the kernels allocate start as NaN, so an element they leave unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)


def assert_close(actual, expected):
    (out, max_logits, lse), (ref_out, ref_max, ref_lse) = actual, expected
    assert out.dtype == torch.bfloat16 and lse.dtype == max_logits.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any() and not max_logits.isnan().any()
    assert torch.equal(lse.isposinf(), ref_lse.isposinf())
    assert torch.equal(max_logits.isneginf(), ref_max.isneginf())
    seen = ref_lse.isfinite()
    assert (lse[seen] - ref_lse[seen]).abs().max() < 1e-4
    assert (max_logits[seen] - ref_max[seen]).abs().max() < 1e-4
    # The kernel rounds the probabilities to bf16 before the second product.
    error = (out.double() - ref_out.double()).norm() / ref_out.double().norm()
    assert error.item() < 5e-3
    assert (out[~seen] == 0).all()


@in_the_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("is_fp8_kvcache", [False, True])
@pytest.mark.parametrize(
    ("seqlens", "s_q", "h_q", "topk", "page_size"),
    [
        ([200, 90], 2, 16, 128, 64),
        ([300], 2, 5, 192, 16),  # heads padded to the tile, three tiles of indices
        ([130, 20], 1, 128, 64, 32),  # two head blocks; the second sequence pads with -1
    ],
)
def test_kernel_matches_the_reference(
    seqlens, s_q, h_q, topk, page_size, is_fp8_kvcache, num_splits, generator, monkeypatch
):
    case = sparse_decode_case(seqlens, s_q, h_q, topk, page_size, is_fp8_kvcache, invalid=0.2,
                              generator=generator)  # fmt: skip
    case.indices[0, 0] = -1  # a query row that attends nothing
    q, tokens, indices = flat(case)
    expected = reference.sparse_attention(q, tokens, indices, 0.06, is_fp8_kvcache)
    poison_empty(monkeypatch)
    actual = sparse_triton.sparse_attention(q, tokens, indices, 0.06, is_fp8_kvcache, num_splits)
    assert_close(actual, expected)


@in_the_interpreter
def test_more_splits_than_tiles_and_uneven_splits(generator):
    case = sparse_decode_case([400], 1, 16, 200, generator=generator)
    q, tokens, indices = flat(case)
    expected = reference.sparse_attention(q, tokens, indices, 0.06, False)
    for num_splits in (2, 4, 9):  # 2 uneven splits (128 + 72), 4 of one tile each, 9 → 4
        assert_close(sparse_triton.sparse_attention(q, tokens, indices, 0.06, False, num_splits),
                     expected)  # fmt: skip


def test_default_splits_fill_one_wave():
    assert sparse_triton.default_num_splits(64, 64, 2048, 132) == 2  # 128 programs
    assert sparse_triton.default_num_splits(32, 64, 2048, 132) == 4
    assert sparse_triton.default_num_splits(64, 128, 2048, 132) == 1
    assert sparse_triton.default_num_splits(200, 128, 2048, 132) == 1
    assert sparse_triton.default_num_splits(1, 16, 128, 132) == 4  # at most one split per tile


@in_the_interpreter
def test_public_calls_run_the_kernel(generator, monkeypatch, sparse_oracle):
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "triton")
    case = sparse_decode_case([150, 80], 2, 8, 64, is_fp8_kvcache=True, generator=generator)
    out, lse = mla_kernels.flash_mla_with_kvcache(
        case.paged.q, case.paged.k_cache, None, None, 512, None, None,
        is_fp8_kvcache=True, indices=case.indices,
    )  # fmt: skip
    expected_out, _, expected_lse = sparse_oracle(*flat(case), 576**-0.5, True)
    assert (out.double() - expected_out.view(2, 2, 8, 512)).norm() / expected_out.norm() < 5e-3
    assert (lse - expected_lse.view(2, 2, 8).transpose(1, 2)).abs().max() < 1e-4

    q = torch.randn(3, 16, 576, generator=generator).to(torch.bfloat16)
    kv = torch.randn(100, 1, 576, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 110, (3, 1, 128), generator=generator, dtype=torch.int32)
    out, max_logits, lse = mla_kernels.flash_mla_sparse_fwd(q, kv, indices, 0.05)
    expected = sparse_oracle(q, kv.view(100, 576), indices.view(3, 128), 0.05, False)
    assert (out.double() - expected[0]).norm() / expected[0].norm() < 5e-3
    assert (max_logits - expected[1]).abs().max() < 1e-4
    assert (lse - expected[2]).abs().max() < 1e-4


@compiling
def test_the_kernels_in_the_interpreter():
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed and int(passed.group(1)) >= 15, child.stdout[-3000:]


def ptxas_report(kernel) -> str:
    """ptxas's register and spill report of a compiled kernel's PTX, for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)  # fmt: skip
    return done.stderr


@compiling
@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas is a Linux program")
@pytest.mark.parametrize(
    ("is_fp8_kvcache", "split", "heads"), [(True, False, 64), (False, True, 64), (True, True, 16)]
)
def test_the_kernels_compile_for_sm90a_within_shared_memory_and_few_spills(
    is_fp8_kvcache, split, heads
):
    """The interpreter runs what the compiler may refuse (a module-level int read inside a
    kernel, say): compile for Hopper here."""
    from triton.backends.compiler import GPUTarget

    cache = "*u8" if is_fp8_kvcache else "*bf16"
    pointers = ["*bf16", cache, "*fp32" if is_fp8_kvcache else "*bf16", "*bf16", "*i32",
                "*fp32" if split else "*bf16", "*fp32", "*fp32"]  # fmt: skip
    types = [*pointers, "i32", "i32", "i32", "fp32", "i32", "i32", "i32"]
    signature = dict(zip(sparse_triton._attend_kernel.arg_names[: len(types)], types, strict=True))
    constants = {"TOKENS_PER_SPLIT": 1024, "BLOCK_N": sparse_triton.BLOCK_N,
                 "IS_FP8": is_fp8_kvcache, "SPLIT": split, "BLOCK_H": heads, "INTERPRETED": False}  # fmt: skip
    signature |= dict.fromkeys(constants, "constexpr")
    source = triton.compiler.ASTSource(sparse_triton._attend_kernel, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8, "num_stages": 2})  # fmt: skip
    assert kernel.metadata.shared <= 227 * 1024
    spills = int(re.search(r"(\d+) bytes spill stores", ptxas_report(kernel)).group(1))
    # ptxas, 2026-12: 360 bytes at 64 heads on the FP8 cache, none at 16.
    assert spills <= 512


@compiling
@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas is a Linux program")
def test_the_combine_kernel_compiles_for_sm90a_without_spills():
    from triton.backends.compiler import GPUTarget

    names = sparse_triton._combine_kernel.arg_names
    types = ["*fp32", "*fp32", "*fp32", "*bf16", "*fp32", "*fp32", "i32"]
    constants = {"NUM_SPLITS": 4, "BLOCK_H": sparse_triton.COMBINE_BLOCK_H, "INTERPRETED": False}
    signature = dict(zip(names[: len(types)], types, strict=True))
    signature |= dict.fromkeys(constants, "constexpr")
    source = triton.compiler.ASTSource(sparse_triton._combine_kernel, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "0 bytes spill stores" in ptxas_report(kernel)
