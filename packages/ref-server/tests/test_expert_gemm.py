"""The routed experts' half-precision GEMMs (`ref_server::expert_gemm`): the torch reference,
fake shapes, opcheck and argument checks on the CPU; fp8_gemm's Triton kernel on unscaled
operands through Triton's interpreter (where triton is installed); on the GPU (`gpu` marker),
the CUDA implementation against float64 at decode and prefill sizes, NaN-poisoned outputs, in
a CUDA graph replayed with new values, and opcheck."""

from __future__ import annotations

import pytest
import torch

from ref_server.kernels.expert_gemm import expert_gemm
from ref_server.kernels.fp8_gemm import triton_block_gemm

gpu = pytest.mark.gpu


def operands(x_shape, w_shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g)
    w = torch.randn(w_shape, generator=g) / w_shape[-1] ** 0.5
    return x.to(device, dtype), w.to(device, dtype)


def check(got, x, w, dtype, sums=2**-16) -> None:
    """got (x @ w^T of one expert) within one rounding to dtype of float64, plus the sums'
    error: `sums` of the terms' magnitudes (fp32 sums by default)."""
    want = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    assert got.dtype == dtype and got.shape == want.shape
    bound = sums * magnitude + torch.finfo(dtype).eps * want.abs()
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"error up to {(error / bound.clamp(min=1e-300)).max():.3g}"


def check_grouped(got, x, w, ends, sums=2**-16) -> None:
    for g, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
        check(got[start:end], x[start:end], w[g], x.dtype, sums)


def check_batched(got, x, w, counts, sums=2**-16) -> None:
    for g, count in enumerate(counts):
        rows = slice(0, min(max(count, 0), x.shape[1]))
        check(got[g, rows], x[g, rows], w[g], x.dtype, sums)


def ends_for(rows: int, experts: int, seed: int) -> list[int]:
    """Cumulative ends of `experts` random groups over at most `rows` rows (some empty)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows + 1, (experts,), generator=g).sort().values.tolist()


# ---- CPU: the reference, fake, opcheck, bad arguments ----


def test_the_reference_matches_float64_in_both_layouts():
    x, w = operands((50, 64), (3, 40, 64), torch.float32)
    ends = [10, 10, 45]
    check_grouped(expert_gemm(x, w, torch.tensor(ends, dtype=torch.int32)), x, w, ends)
    x, w = operands((3, 7, 64), (3, 40, 64), torch.float32)
    check_batched(expert_gemm(x, w), x, w, [7, 7, 7])


def test_the_fake_implementation_gives_the_output_shape():
    x, w = operands((9, 64), (3, 40, 64))
    offsets = torch.tensor([3, 3, 9], dtype=torch.int32)
    out = expert_gemm(x.to("meta"), w.to("meta"), offsets.to("meta"))
    assert out.shape == (9, 40) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    x, w = operands((3, 5, 64), (3, 40, 64))
    assert expert_gemm(x.to("meta"), w.to("meta")).shape == (3, 5, 40)


def test_opcheck_on_cpu():
    x, w = operands((9, 64), (3, 40, 64), torch.float32)
    torch.library.opcheck(expert_gemm, (x, w, torch.tensor([3, 3, 9], dtype=torch.int32)))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(w=torch.zeros(40, 64, dtype=torch.bfloat16)), r"w must be the experts' weights"),
        (dict(w=torch.zeros(3, 40, 64)), "x and w must be one of"),
        (dict(x=torch.zeros(9, 32, dtype=torch.bfloat16)), "x has k = 32 .* k = 64"),
        (dict(offsets=torch.tensor([3, 9])), r"offsets must be \[3\] int32"),
        (dict(counts=torch.ones(3, dtype=torch.int32)), "pass offsets .* or counts .* not both"),
    ],
)
def test_bad_arguments_are_a_value_error_naming_the_problem(change, message):
    x, w = operands((9, 64), (3, 40, 64))
    args = dict(x=x, w=w, offsets=torch.tensor([3, 3, 9], dtype=torch.int32), counts=None)
    with pytest.raises(ValueError, match=message):
        expert_gemm(**(args | change))


# ---- the Triton kernel on unscaled operands, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


INTERPRETED_SUMS = 2**-9


def interpreted_checks():
    """Both layouts and load paths, k whole and split, k = 200 (a partial step of 64). In fp16:
    Triton 3.6's interpreter multiplies bf16 tiles as integers (numpy has no bf16; the GPU tests
    cover bf16), and it rounds each step's fp16 product to fp16 before the fp32 sum, hence
    INTERPRETED_SUMS."""
    for tma in (False, True):
        x, w = operands((150, 192), (3, 192, 192), torch.float16, seed=1)
        ends = [64, 64, 140]
        offsets = torch.tensor(ends, dtype=torch.int32)
        for split_k in (1, 3):
            got = triton_block_gemm(
                x, None, w, None, offsets, None, x.dtype, tma=tma, split_k=split_k
            )
            check_grouped(got, x, w, ends, INTERPRETED_SUMS)
        x, w = operands((3, 70, 128), (3, 130, 128), torch.float16, seed=2)
        counts = [0, 70, 5]
        sizes = torch.tensor(counts, dtype=torch.int32)
        got = triton_block_gemm(x, None, w, None, None, sizes, x.dtype, tma=tma)
        check_batched(got, x, w, counts, INTERPRETED_SUMS)
    x, w = operands((5, 200), (2, 64, 200), torch.float16, seed=3)
    got = triton_block_gemm(
        x, None, w, None, torch.tensor([1, 5], dtype=torch.int32), None, x.dtype
    )
    check_grouped(got, x, w, [1, 5], INTERPRETED_SUMS)
    # a decode step's shape: far more experts than rows, so a tile row for each row, not group
    x, w = operands((3, 64), (8, 64, 64), torch.float16, seed=4)
    ends = [0, 1, 1, 1, 2, 2, 3, 3]
    got = triton_block_gemm(x, None, w, None, torch.tensor(ends, dtype=torch.int32), None, x.dtype)
    check_grouped(got, x, w, ends, INTERPRETED_SUMS)


# ---- the CUDA implementation ----


def poison(numel: int, dtype=torch.bfloat16) -> None:
    """NaN in the caching allocator's next block of this size (the output's, most likely)."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


# V2-Lite's experts (64, hidden 2048, inter 1408) and V3's at EP 8 (32 local, 7168 / 2048):
# gate+up, then down
SHAPES = [(64, 2816, 2048), (64, 2048, 1408), (32, 4096, 7168), (32, 7168, 2048)]


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 256, 2048])
@pytest.mark.parametrize("experts, n, k", SHAPES)
def test_the_grouped_layout_against_float64(experts, n, k, tokens):
    """Rows of `tokens` tokens with 6 experts each: decode sizes through Triton, 2048 tokens
    (192 rows an expert on V2-Lite, over TRITON_MAX_GROUP_ROWS) through torch._grouped_mm."""
    rows = 6 * tokens
    x, w = operands((rows + 5, k), (experts, n, k), device="cuda", seed=tokens)
    ends = ends_for(rows, experts, seed=n + tokens)
    poison((rows + 5) * n)
    got = expert_gemm(x, w, torch.tensor(ends, dtype=torch.int32, device="cuda"))
    check_grouped(got, x, w, ends)


@gpu
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("experts, n, k", SHAPES[:2])
def test_the_batched_layout_against_float64(experts, n, k, counted):
    x, w = operands((experts, 24, k), (experts, n, k), device="cuda", seed=k)
    counts = [(0, 24, 3, 23, 30, -1)[g % 6] for g in range(experts)] if counted else None
    sizes = torch.tensor(counts, dtype=torch.int32, device="cuda") if counted else None
    poison(experts * 24 * n)
    check_batched(expert_gemm(x, w, counts=sizes), x, w, counts or [24] * experts)


@gpu
def test_captured_in_a_cuda_graph_and_replayed_with_new_values():
    experts, n, k = SHAPES[1]
    x, w = operands((48, k), (experts, n, k), device="cuda", seed=1)
    offsets = torch.tensor(ends_for(48, experts, 1), dtype=torch.int32, device="cuda")
    expert_gemm(x, w, offsets)  # compiles the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_gemm(x, w, offsets)
    new_x, new_w = operands((48, k), (experts, n, k), device="cuda", seed=2)
    ends = ends_for(48, experts, 2)
    for static, value in ((x, new_x), (w, new_w), (offsets, torch.tensor(ends).int().cuda())):
        static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    check_grouped(out, x, w, ends)


@gpu
def test_opcheck_on_cuda():
    x, w = operands((9, 256), (3, 128, 256), device="cuda")
    offsets = torch.tensor([3, 3, 9], dtype=torch.int32, device="cuda")
    torch.library.opcheck(expert_gemm, (x, w, offsets))


if __name__ == "__main__":
    interpreted_checks()
