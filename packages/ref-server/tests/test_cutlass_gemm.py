"""When the CUTLASS GEMM serves and when the Triton kernel does instead, on any machine (the
kernel itself is tested on the GPU in test_fp8_gemm.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ref_server.kernels import cutlass_gemm, fp8_gemm
from ref_server.kernels.fp8_cast import quantize_activations, quantize_blocks
from ref_server.model.fp8 import fp8_block_gemm


@pytest.fixture
def fresh_build(monkeypatch):
    """`built()` forgotten before and after, so that each test sees its own attempt."""
    cutlass_gemm.built.cache_clear()
    yield
    cutlass_gemm.built.cache_clear()


def test_the_sources_ship_with_the_package():
    names = {p.name for p in cutlass_gemm.CSRC.iterdir()}
    assert {"fp8_grouped_gemm.h", "fp8_grouped_gemm.cu", "api.h", "api.cpp", "binding.cpp"} <= names


def test_it_says_why_it_cannot_run(monkeypatch):
    assert (
        cutlass_gemm.unavailable(torch.device("cpu")) == "the tensors are on cpu, not a CUDA device"
    )
    monkeypatch.setenv("REF_SERVER_CUTLASS", "0")
    assert cutlass_gemm.unavailable(torch.device("cuda")) == "REF_SERVER_CUTLASS=0"
    assert not cutlass_gemm.takes(576, 7168, torch.bfloat16, torch.device("cuda"))


def test_a_failed_build_warns_once_and_names_the_cause(monkeypatch, fresh_build):
    import mla_kernels.extension

    calls = []

    def fail(name, csrc, cache, verbose):
        calls.append((name, csrc, cache))
        raise RuntimeError("nvcc: not found")

    monkeypatch.setattr(mla_kernels.extension, "load_sm90a_ops", fail)
    monkeypatch.setenv("REF_SERVER_CACHE_DIR", "/tmp/somewhere")
    with pytest.warns(UserWarning, match=r"Triton serves instead \(RuntimeError: nvcc: not found"):
        assert cutlass_gemm.built() == "RuntimeError: nvcc: not found"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cutlass_gemm.built() == "RuntimeError: nvcc: not found"
    assert calls == [("ref_server_cuda", cutlass_gemm.CSRC, Path("/tmp/somewhere"))]


def test_auto_picks_by_layout_and_group_size():
    def layout(kind, group_rows):
        return fp8_gemm.Layout(kind, 4096, 2048, 7168, 8, group_rows, (4096, 2048))

    assert fp8_gemm.pick_backend(layout("dense", 4096)) == "scaled_mm"
    small, large = fp8_gemm.CUTLASS_MIN_GROUP_ROWS - 1, fp8_gemm.CUTLASS_MIN_GROUP_ROWS
    assert fp8_gemm.pick_backend(layout("grouped", small)) == "triton"
    assert fp8_gemm.pick_backend(layout("grouped", large)) == "cutlass"
    assert fp8_gemm.pick_backend(layout("batched", 4096)) == "triton"


@pytest.mark.parametrize("backend", fp8_gemm.BACKENDS)
def test_every_backend_is_the_reference_off_cuda(backend):
    x = quantize_activations(torch.randn(5, 256))
    w = quantize_blocks(torch.randn(3, 128, 256))
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)
    want = fp8_block_gemm(*x, *w, offsets, torch.float32)
    got = fp8_gemm.block_gemm(*x, *w, offsets, None, torch.float32, backend)
    assert torch.equal(got, want)


def test_operands_reach_the_op_contiguous_and_16_byte_aligned(monkeypatch):
    """Views that start mid-row (x_scales of rows 1.., offsets[1:]) are copied; aligned,
    contiguous ones pass as they are (the op is replaced by a recorder: it needs a GPU)."""
    seen = []
    fake = type("Ops", (), {"fp8_grouped_gemm": staticmethod(lambda *a: seen.append(a))})
    monkeypatch.setattr(torch.ops, "ref_server_cuda", fake, raising=False)
    x, x_scales = quantize_activations(torch.randn(9, 256))
    w, w_scales = quantize_blocks(torch.randn(2, 128, 256))
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    cutlass_gemm.cutlass_block_gemm(
        x[1:], x_scales[1:], w, w_scales, offsets[1:], None, "grouped", 4
    )
    [(*tensors, group_rows)] = seen
    assert group_rows == 4
    for t in tensors[:5]:
        assert t.is_contiguous() and t.data_ptr() % 16 == 0
    assert tensors[2].data_ptr() == w.data_ptr()  # aligned already: not copied
    assert torch.equal(tensors[1], x_scales[1:]) and torch.equal(tensors[4], offsets[1:])
    assert tensors[5] is None
