"""Linear layers (`ref_server::linear`, `layers.Linear`): the torch reference, fake shapes,
opcheck and argument checks on the CPU; on the GPU (`gpu` marker), the Triton kernel that takes
a decode step's few rows against float64 (NaN-poisoned outputs, strided inputs), cuBLAS above
them, the weight prefetch changing no bit, a CUDA graph whose input comes from the kernel
before (what the prefetch overlaps) replayed with new values, and opcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ref_server.model.fp8 import quantize_activations, quantize_blocks
from ref_server.model.fp8_gemm import triton_block_gemm
from ref_server.model.layers import Linear
from ref_server.model.linear import TILES, TRITON_MAX_ROWS, linear
from ref_server.model.norm_kernels import rms_norm

gpu = pytest.mark.gpu


def operands(rows, n, k, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(device, dtype), w.to(device, dtype)


def check(got, x, w) -> None:
    """got within one rounding to x's dtype of float64, plus fp32 sums' error."""
    want = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    assert got.dtype == x.dtype and got.shape == want.shape
    bound = 2**-16 * magnitude + torch.finfo(x.dtype).eps * want.abs()
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"error up to {(error / bound.clamp(min=1e-300)).max():.3g}"


# ---- CPU: the reference, fake, opcheck, bad arguments, the module ----


def test_the_reference_matches_float64():
    x, w = operands(5, 40, 64, torch.float32)
    check(linear(x, w), x, w)


def test_the_fake_implementation_gives_the_output_shape():
    x, w = operands(6, 40, 64)
    out = linear(x.view(2, 3, 64).to("meta"), w.to("meta"))
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16 and out.device.type == "meta"


def test_opcheck_on_cpu():
    torch.library.opcheck(linear, operands(5, 40, 64, torch.float32))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(w=torch.zeros(3, 40, 64, dtype=torch.bfloat16)), r"linear layer's weight \[n, k\]"),
        (dict(w=torch.zeros(40, 64)), "x and w must be one of"),
        (dict(x=torch.zeros(9, 32, dtype=torch.bfloat16)), "x has k = 32 .* k = 64"),
        (dict(x=torch.tensor(1.0, dtype=torch.bfloat16)), "got a scalar"),
    ],
)
def test_bad_arguments_are_a_value_error_naming_the_problem(change, message):
    x, w = operands(9, 40, 64)
    with pytest.raises(ValueError, match=message):
        linear(**(dict(x=x, w=w) | change))


def test_the_module_is_a_linear_layer_without_bias():
    layer = Linear(64, 40)
    assert layer.bias is None and layer.weight.shape == (40, 64)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0, atol=0)


# ---- the CUDA implementation ----


def poison(numel: int, dtype) -> None:
    """NaN in the caching allocator's next block of this size (the output's, most likely)."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


# V2-Lite's q + kv_a (2048 -> 3648), shared down (2816 -> 2048); V3's q_a + kv_a (7168 -> 2112)
SHAPES = [(3648, 2048), (2048, 2816), (2112, 7168)]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, TRITON_MAX_ROWS])
@pytest.mark.parametrize("n, k", SHAPES)
def test_few_rows_against_float64(n, k, rows, dtype):
    x, w = operands(rows, n, k, dtype, "cuda", seed=rows + n)
    poison(rows * n, dtype)
    check(linear(x, w), x, w)
    wide = torch.randn(rows, 2 * k, device="cuda", dtype=dtype)  # rows of x 2k apart
    wide[:, :k] = x
    poison(rows * n, dtype)
    check(linear(wide[:, :k].unsqueeze(0), w)[0], x, w)


@gpu
def test_few_rows_take_the_triton_kernel_and_more_rows_cublas():
    x, w = operands(TRITON_MAX_ROWS + 1, *SHAPES[0], device="cuda")
    few = x[:TRITON_MAX_ROWS]
    assert torch.equal(linear(few, w), triton_block_gemm(few, None, w, None, config=TILES))
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert linear(x[:0], w).shape == (0, SHAPES[0][0])


@gpu
@pytest.mark.parametrize("scaled", [False, True])
def test_the_weight_prefetch_changes_no_bit(scaled):
    """bf16 and FP8 operands (the FP8 decode projections take the same path), k split and not."""
    n, k = SHAPES[1]
    x, w = operands(4, n, k, device="cuda", seed=5)
    args = (*quantize_activations(x), *quantize_blocks(w)) if scaled else (x, None, w, None)
    for split_k in (1, 11):
        outs = [triton_block_gemm(*args, split_k=split_k, prefetch=p) for p in (False, True)]
        assert torch.equal(*outs)


@gpu
def test_captured_after_the_kernel_that_writes_its_input_and_replayed_with_new_values():
    """x comes from the RMS norm before it in the graph: the prefetch runs before the norm
    ends, the product must still read the norm's output."""
    n, k = SHAPES[0]
    h, w = operands(2, n, k, device="cuda", seed=1)
    norm = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    linear(rms_norm(h, norm, 1e-6), w)  # compiles the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(rms_norm(h, norm, 1e-6), w)
    for seed in (2, 3):
        new_h, new_w = operands(2, n, k, device="cuda", seed=seed)
        h.copy_(new_h)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        check(out, rms_norm(h, norm, 1e-6), w)


@gpu
def test_opcheck_on_cuda():
    torch.library.opcheck(linear, operands(3, 256, 128, device="cuda"))
