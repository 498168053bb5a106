"""The RMS norm operators (`ref_server::rms_norm`, `ref_server::add_rms_norm`): on the CPU, bit
for bit the torch formula `RMSNorm` ran before them (after torch's add), with opcheck, fake
shapes, torch.compile and argument checks; their Triton kernel on the CPU through Triton's
interpreter (where triton is installed); on the GPU (`gpu` marker), the kernel against float64
(the sum: torch's add, exactly), in CUDA graphs, and in a model step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ref_server.model as M
from ref_server.kernels.norm import (
    add_rms_norm,
    rms_norm,
    triton_add_rms_norm,
    triton_rms_norm,
)
from ref_server.model import StepBatch
from ref_server.model.layers import RMSNorm

gpu = pytest.mark.gpu
EPS = 1e-6
# dims of DeepSeek's norms (64: a small one; 1000: no power of two, nor a multiple of 16)
DIMS = [64, 512, 1536, 7168, 1000]
# (x, weight) dtypes the kernel takes
DTYPES = [
    (x, w)
    for x in (torch.float32, torch.bfloat16, torch.float16)
    for w in (torch.bfloat16, torch.float32)
]
# What the fp32 arithmetic may cost, relative: the mean's sum in another order, rsqrt, the
# products' roundings (about 2^-22 measured).
FP32_MATH = 2**-20


def torch_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` before the operator."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def problem(shape, dtype=torch.float32, weight_dtype=None, device="cpu", seed=0):
    """(x `shape` N(0, 1) times a power of two per row, so that rows differ in scale, weight
    `[shape[-1]]` around 1)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-8, 9, (*shape[:-1], 1), generator=g))
    x = torch.randn(shape, generator=g) * scales
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=g)
    return x.to(device, dtype), weight.to(device, weight_dtype or dtype)


def roundoff(dtype: torch.dtype, truncated: bool) -> float:
    """The relative error of one rounding to dtype: half its eps to nearest, a whole eps where
    the interpreter truncates (fp32 to bf16)."""
    eps = torch.finfo(dtype).eps
    return eps if truncated and dtype == torch.bfloat16 else eps / 2


def check(got, x, weight, eps=EPS, interpreted=False) -> None:
    """got against float64: x * rsqrt(mean(x^2) + eps) * weight within one rounding to x's
    dtype (the normalized values), one to the output's and the fp32 arithmetic's FP32_MATH
    (plus 2^-24 * |weight| for fp16's subnormals). Where x is half precision and the roundings
    are to nearest, exactly the float64 values rounded as the kernel rounds (to x's dtype,
    then the product to the output's), but for values so near a rounding boundary of x's
    dtype that the fp32 arithmetic may put them on either side."""
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    assert got.dtype == out_dtype and got.shape == x.shape and got.is_contiguous()
    x64, w64 = x.double(), weight.double()
    normalized = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    want = normalized * w64
    tolerance = roundoff(x.dtype, interpreted) + roundoff(out_dtype, interpreted) + FP32_MATH
    bound = tolerance * want.abs() + 2**-24 * w64.abs()
    error = (got.double() - want).abs()
    worst = (error / bound).max().item() if got.numel() else 0.0
    assert worst <= 1, f"error up to {worst:.3g} x the bound"
    nearest = not (interpreted and torch.bfloat16 in (x.dtype, out_dtype))
    if x.dtype != torch.float32 and nearest:
        rounded = (normalized.to(x.dtype).double() * w64).to(out_dtype)
        low, high = ((normalized * (1 + d)).to(x.dtype) for d in (-FP32_MATH, FP32_MATH))
        certain = low == high
        assert torch.equal(got[certain], rounded[certain])


# ---- CPU ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 1536), (1, 1000), (0, 512), (4, 0)])
def test_the_operator_on_the_cpu_is_the_torch_formula_bit_for_bit(shape, dtype):
    x, weight = problem(shape, dtype)
    assert torch.equal(rms_norm(x, weight, EPS), torch_formula(x, weight, EPS))
    norm = RMSNorm(shape[-1], EPS).to(dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(norm(x), torch_formula(x, weight, EPS))


def test_the_operator_takes_strided_rows_and_mixed_dtypes_bit_for_bit():
    """A slice of wider rows (the latent of kv_a_proj's output), permuted leading dims (the
    result comes out contiguous), bf16 x with an fp32 weight (fp32 out) and the reverse."""
    wide, weight = problem((6, 576), torch.bfloat16)
    x = wide[:, :512]
    assert torch.equal(rms_norm(x, weight[:512], EPS), torch_formula(x, weight[:512], EPS))
    x = problem((3, 5, 64), torch.bfloat16)[0].transpose(0, 1)
    got = rms_norm(x, weight[:64], EPS)
    assert got.is_contiguous() and torch.equal(got, torch_formula(x, weight[:64], EPS))
    for x_dtype, w_dtype in [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]:
        x, weight = problem((5, 64), x_dtype, w_dtype)
        got = rms_norm(x, weight, EPS)
        assert got.dtype == torch.float32 and torch.equal(got, torch_formula(x, weight, EPS))


@pytest.mark.parametrize(
    "x, weight",
    [
        problem((9, 64)),
        problem((2, 3, 100), torch.bfloat16, torch.float32),
        (problem((4, 3, 64))[0].transpose(0, 1), problem((4, 3, 64))[1]),
    ],
)
def test_opcheck_on_cpu(x, weight):
    torch.library.opcheck(rms_norm, (x, weight, EPS))


@pytest.mark.parametrize(
    "x_dtype, w_dtype, out_dtype",
    [
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float16, torch.bfloat16, torch.float32),
    ],
)
def test_the_fake_implementation_gives_the_output(x_dtype, w_dtype, out_dtype):
    x, weight = problem((2, 5, 64), x_dtype, w_dtype, device="meta")
    out = rms_norm(x, weight, EPS)
    assert out.device.type == "meta" and out.shape == (2, 5, 64) and out.dtype == out_dtype


def test_a_norm_built_on_the_meta_device_runs_once_loaded():
    """As `M.from_args` builds models: on the meta device (where the operator's fake runs),
    then given memory and weights."""
    with torch.device("meta"):
        norm = RMSNorm(64, EPS).to(torch.bfloat16)
        assert norm(torch.empty(3, 64, dtype=torch.bfloat16)).device.type == "meta"
    norm = norm.to_empty(device="cpu")
    x, weight = problem((3, 64), torch.bfloat16)
    norm.load_state_dict({"weight": weight})
    with torch.no_grad():
        assert torch.equal(norm(x), torch_formula(x, weight, EPS))


def test_gradients_are_not_supported_but_the_forward_runs():
    """Outside no_grad, with the weight a parameter that requires grad: the forward is the
    formula's; a backward raises (the operator has no autograd formula)."""
    norm = RMSNorm(64, EPS)
    x, weight = problem((3, 64))
    norm.weight.data.copy_(weight)
    out = norm(x)
    assert torch.equal(out.detach(), torch_formula(x, weight, EPS))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        assert not norm(x).requires_grad


def test_torch_compile_traces_the_operator_whole():
    norm = RMSNorm(1000, EPS).to(torch.bfloat16)
    x, weight = problem((2, 7, 1000), torch.bfloat16)
    norm.weight.data.copy_(weight)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), torch_formula(x, weight, EPS))


def bad_inputs():
    x, weight = problem((3, 64))
    return [
        ((x, weight[:63]), r"weight must be \[64\] \(one per channel of x\), got \(63,\)"),
        ((x, weight.view(8, 8)), r"weight must be \[64\] .* got \(8, 8\)"),
        ((x.int(), weight), "x must be a floating-point tensor, got torch.int32"),
        ((x, weight.long()), "weight must be a floating-point tensor, got torch.int64"),
        ((x[0, 0], weight[:1]), r"x must be \[\.\.\., dim\], got a scalar"),
        ((x, weight.to("meta")), "x and weight must be on one device"),
    ]


@pytest.mark.parametrize("args, message", bad_inputs())
def test_bad_arguments_are_a_value_error_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        rms_norm(*args, EPS)


def test_the_kernel_refuses_what_it_does_not_take():
    """Before any launch (so without triton): float64, rows wider than MAX_BLOCK."""
    x, weight = problem((3, 64), torch.float64)
    with pytest.raises(ValueError, match="the kernel takes x in"):
        triton_rms_norm(x, weight.float(), EPS)
    x, weight = problem((1, 16385))
    with pytest.raises(ValueError, match="rows of at most 16384 values"):
        triton_rms_norm(x, weight, EPS)


# ---- the residual add and the norm ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 1536), (0, 512)])
def test_add_rms_norm_on_the_cpu_is_torch_s_add_then_the_norm_bit_for_bit(shape, dtype):
    x, weight = problem(shape, dtype, seed=1)
    residual = problem(shape, dtype, seed=2)[0]
    total, normed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, torch_formula(x + residual, weight, EPS))


def sum_of_three(x, residual, residual2):
    """x + residual + residual2 in float64, rounded once to x's dtype (in float64 the three
    sums of values of at most 24 significant bits are exact where they are in fp32: the
    kernel's fp32 sum is exact only when no bit is lost, so compare with `roundoff`)."""
    return (x.double() + residual.double() + residual2.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_add_rms_norm_with_two_updates_sums_once_then_norms(dtype):
    x, weight = problem((9, 512), dtype, seed=1)
    residual, residual2 = (problem((9, 512), dtype, seed=s)[0] for s in (2, 3))
    total, normed = add_rms_norm(x, residual, weight, EPS, residual2)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (x.to(wide) + residual.to(wide) + residual2.to(wide)).to(dtype)
    assert torch.equal(total, expected)
    assert torch.equal(normed, torch_formula(expected, weight, EPS))
    if dtype == torch.bfloat16:  # one rounding, not two: closer to the exact sum than torch's
        exact = x.double() + residual.double() + residual2.double()
        error = (total.double() - exact).abs().sum()
        assert error <= ((x + residual + residual2).double() - exact).abs().sum()
    torch.library.opcheck(add_rms_norm, (x, residual, weight, EPS, residual2))
    with pytest.raises(ValueError, match="residual2 must be x's shape and dtype"):
        add_rms_norm(x, residual, weight, EPS, residual2[:3])


def test_add_rms_norm_opcheck_fake_and_bad_arguments():
    x, weight = problem((2, 5, 64), torch.bfloat16)
    residual = problem((2, 5, 64), torch.bfloat16, seed=3)[0]
    torch.library.opcheck(add_rms_norm, (x, residual, weight, EPS))
    total, normed = add_rms_norm(x.to("meta"), residual.to("meta"), weight.float().to("meta"), EPS)
    assert (total.shape, total.dtype) == (x.shape, torch.bfloat16)
    assert (normed.shape, normed.dtype) == (x.shape, torch.float32)
    with pytest.raises(ValueError, match="residual must be x's shape and dtype"):
        add_rms_norm(x, residual[:1], weight, EPS)
    with pytest.raises(ValueError, match="residual must be x's shape and dtype"):
        add_rms_norm(x, residual.float(), weight, EPS)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """Every dim and dtype pair on 1 and 5 rows, 300 rows at two dims; a slice of wider rows,
    permuted leading dims, no rows. The interpreter truncates fp32 to bf16 (`check`)."""
    for dim in DIMS:
        for x_dtype, w_dtype in DTYPES:
            for rows in (1, 5):
                x, weight = problem((rows, dim), x_dtype, w_dtype, seed=dim + rows)
                check(triton_rms_norm(x, weight, EPS), x, weight, interpreted=True)
    for dim in (1000, 1536):
        x, weight = problem((300, dim), torch.bfloat16, seed=dim)
        check(triton_rms_norm(x, weight, EPS), x, weight, interpreted=True)
        x, weight = problem((300, dim), torch.float16, torch.float32, seed=dim)
        check(triton_rms_norm(x, weight, EPS), x, weight, interpreted=True)
    wide, weight = problem((2, 4, 576), torch.float16, torch.float32)
    x = wide[..., :512]
    check(triton_rms_norm(x, weight[:512], EPS), x, weight[:512], interpreted=True)
    x, weight = problem((4, 3, 64), torch.float32)
    x = x.transpose(0, 1)
    check(triton_rms_norm(x, weight, EPS), x, weight, interpreted=True)
    x, weight = problem((0, 3, 64), torch.bfloat16)
    assert triton_rms_norm(x, weight, EPS).shape == (0, 3, 64)
    for dtype in (torch.float32, torch.float16):  # bf16: the interpreter truncates the sum
        wide, weight = problem((5, 576), dtype, seed=4)
        x, residual = wide[:, :512], problem((5, 512), dtype, seed=5)[0]
        total, normed = triton_add_rms_norm(x, residual, weight[:512], EPS)
        assert torch.equal(total, x + residual)
        assert torch.equal(normed, triton_rms_norm(total, weight[:512], EPS))
    x, weight = problem((0, 64), torch.bfloat16)
    assert [t.shape for t in triton_add_rms_norm(x, x, weight, EPS)] == [(0, 64), (0, 64)]
    for dtype in (torch.float32, torch.float16):  # two updates, one of strided rows
        x, weight = problem((6, 1000), dtype, seed=6)
        residual = problem((6, 1000), dtype, seed=7)[0]
        residual2 = problem((6, 1064), dtype, seed=8)[0][:, :1000]
        total, normed = triton_add_rms_norm(x, residual, weight, EPS, residual2)
        expected, _ = add_rms_norm(x, residual, weight, EPS, residual2)  # the reference, on CPU
        assert torch.equal(total, expected)
        assert torch.equal(normed, triton_rms_norm(total, weight, EPS))


# ---- GPU ----


@gpu
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("dim", DIMS)
def test_the_kernel_matches_float64(dim, rows, x_dtype, w_dtype):
    x, weight = problem((rows, dim), x_dtype, w_dtype, device="cuda", seed=dim + rows)
    got = rms_norm(x, weight, EPS)
    check(got, x, weight)
    assert torch.equal(rms_norm(x, weight, EPS), got)  # deterministic


@gpu
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dim", [2048, 7168, 1000])
def test_add_rms_norm_on_the_gpu_is_torch_s_add_then_the_kernel(dim, rows, x_dtype, w_dtype):
    """The sum bit for bit torch's add; the normalized rows bit for bit the norm kernel's of
    that sum, which the float64 check covers; a residual of strided rows read in place."""
    x, weight = problem((rows, dim), x_dtype, w_dtype, device="cuda", seed=dim + rows)
    wide = problem((rows, dim + 64), x_dtype, device="cuda", seed=dim)[0]
    residual = wide[:, :dim]
    total, normed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, rms_norm(x + residual, weight, EPS))
    check(normed, x + residual, weight)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_with_two_updates_on_the_gpu_is_the_reference_bit_for_bit(dtype):
    """The three summed in fp32 and rounded once, as the CPU reference does; the normalized
    rows the norm kernel's of that sum; poisoned outputs are overwritten."""
    x, weight = problem((300, 2048), dtype, torch.float32, device="cuda", seed=3)
    residual, residual2 = (problem((300, 2048), dtype, device="cuda", seed=s)[0] for s in (4, 5))
    total, normed = add_rms_norm(x, residual, weight, EPS, residual2)
    expected, _ = add_rms_norm(*(t.cpu() for t in (x, residual, weight)), EPS, residual2.cpu())
    assert torch.equal(total.cpu(), expected)
    assert torch.equal(normed, rms_norm(total, weight, EPS))
    assert not torch.equal(total, x + residual + residual2) or dtype == torch.float32


@gpu
def test_the_kernel_on_strided_and_empty_inputs():
    """Rows of a slice of wider rows (read in place), permuted leading dims, no rows; float64
    (which the kernel does not take) through the torch formula."""
    wide, weight = problem((3, 40, 576), torch.bfloat16, device="cuda")
    check(rms_norm(wide[..., :512], weight[:512], EPS), wide[..., :512], weight[:512])
    x = wide[..., :64].transpose(0, 1)
    check(rms_norm(x, weight[:64], EPS), x, weight[:64])
    assert rms_norm(wide[:0], weight, EPS).shape == (0, 40, 576)
    x, weight = problem((5, 64), torch.float64, device="cuda")
    assert torch.equal(rms_norm(x, weight, EPS), torch_formula(x, weight, EPS))


@gpu
def test_the_kernel_does_not_wait_for_the_device():
    x, weight = problem((64, 7168), torch.bfloat16, device="cuda")
    rms_norm(x, weight, EPS)  # compiles first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rms_norm(x, weight, EPS)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_the_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on new values in the same tensors."""
    x, weight = problem((16, 7168), torch.bfloat16, device="cuda")
    rms_norm(x, weight, EPS)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm(x, weight, EPS)
    for seed in (1, 2):
        for static, value in zip(
            (x, weight), problem((16, 7168), torch.bfloat16, device="cuda", seed=seed), strict=True
        ):
            static.copy_(value)
        graph.replay()
        check(out, x, weight)


@gpu
def test_opcheck_on_cuda():
    torch.library.opcheck(rms_norm, (*problem((9, 1536), torch.bfloat16, device="cuda"), EPS))


@gpu
def test_torch_compile_calls_the_kernel():
    norm = RMSNorm(7168, EPS).to("cuda", torch.bfloat16)
    x, weight = problem((2, 7, 7168), torch.bfloat16, device="cuda")
    norm.weight.data.copy_(weight)
    compiled = torch.compile(norm, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), rms_norm(x, weight, EPS))


@gpu
def test_a_model_step_matches_the_torch_formula(monkeypatch):
    """Three V2-Lite-sized layers (bf16) through a prefill and a decode step: the kernel's
    logits against those of the same model normalizing with the torch formula."""
    args = dataclasses.replace(M.PRESETS["v2-lite"], num_hidden_layers=3, vocab_size=4096)
    model = M.from_args(args, seed=3, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):  # norms other than ones
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=g))
    ids = torch.randint(2, args.vocab_size, (2, 40), generator=g)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    steps = [
        StepBatch(ids.flatten().cuda(), [40, 40], [40, 40], table),
        StepBatch(torch.tensor([11, 17]).cuda(), [1, 1], [41, 41], table),
    ]

    def run():
        cache = M.PagedKVCache(args, 4, 64, device="cuda")
        return [model.forward_step(batch, cache) for batch in steps]

    got = run()
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: torch_formula(x, self.weight, self.eps))
    want = run()
    for kernel, formula in zip(got, want, strict=True):
        assert ((kernel - formula).abs().amax(dim=-1) < 0.02 * formula.abs().max()).all()


if __name__ == "__main__":
    interpreted_checks()
