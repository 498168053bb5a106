"""The block-scaled FP8 GEMM operator (`ref_server::fp8_block_gemm`): argument checks, shapes
from its fake implementation and opcheck on the CPU; its Triton kernel on the CPU through
Triton's interpreter (where triton is installed); on the GPU (`gpu` marker), every layout
through every backend (Triton, CUTLASS, cuBLASLt for the dense one) against float64 on the
dequantized operands, CUDA graph replays with new values, torch.compile and opcheck."""

from __future__ import annotations

import pytest
import torch

from ref_server.kernels import cutlass_gemm, fp8_gemm
from ref_server.kernels.fp8_cast import (
    dequantize_activations,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)
from ref_server.kernels.fp8_gemm import block_gemm, scaled_mm_takes, triton_block_gemm
from ref_server.model.fp8 import fp8_block_gemm

gpu = pytest.mark.gpu


def spread(t: torch.Tensor, g: torch.Generator, rows: int) -> torch.Tensor:
    """t `[..., r, c]` with each `rows` x 128 block scaled by its own power of two in
    [2^-4, 2^4], so that a scale applied to the wrong block shows."""
    r, c = t.shape[-2:]
    shape = (*t.shape[:-2], -(-r // rows), -(-c // 128))
    factors = torch.exp2(torch.randint(-4, 5, shape, generator=g).float())
    factors = factors.repeat_interleave(rows, -2).repeat_interleave(128, -1)
    return t * factors[..., :r, :c]


def operands(x_shape, w_shape, seed: int, device="cpu"):
    """Quantized (x, x_scales) and (w, w_scales) of random values with spread block scales."""
    g = torch.Generator().manual_seed(seed)
    x = spread(torch.randn(x_shape, generator=g), g, 1)
    w = spread(torch.randn(w_shape, generator=g), g, 128)
    return (
        tuple(t.to(device) for t in quantize_activations(x)),
        tuple(t.to(device) for t in quantize_blocks(w)),
    )


def expected(x, w) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w^T in float64 on the dequantized operands, and the sum of the terms' magnitudes
    (on the operands' device)."""
    a = dequantize_activations(*x).double()
    b = dequantize_blocks(*w).double().transpose(-2, -1)
    return a @ b, a.abs() @ b.abs()


def close_in(got, want, magnitude, out_dtype):
    """got (out_dtype) within 2^-9 of the terms' magnitudes (the tensor cores add e4m3
    products keeping about 14 bits; the kernel rescales into fp32 every 128 channels) plus
    out_dtype's rounding of want."""
    rounding = torch.finfo(out_dtype).eps
    assert got.dtype == out_dtype and got.shape == want.shape
    if got.numel() == 0:
        return
    error = (got.double() - want).abs()
    bound = 2**-9 * magnitude + rounding * want.abs()
    worst = (error / bound.clamp(min=1e-300)).max().item()
    assert worst <= 1, f"error up to {worst:.3g} x the bound"


# Dense: x `[*lead, m, k]` against w `[n, k]`. Up to 128 rows in all use 64-row tiles, more
# 128-row ones; k = 200 loads through pointers (not a multiple of 16), the rest through TMA
# (m = 1: too few rows for one TMA box); 576 = kv_a_proj's width; k >= 1024 is split into
# ranges (few tiles on an H200); torch._scaled_mm takes k in multiples of 512 at rows in
# multiples of 4.
DENSE = [
    ((), 1, 512, 576),
    ((), 77, 384, 200),
    ((2,), 130, 1024, 576),
    ((), 300, 336, 256),
    ((), 100, 200, 130),
    ((), 512, 2048, 1536),
    ((), 512, 7168, 576),  # with ((), 512, 2048, 1536): through scaled_mm (>= 512 rows)
]
BATCHED = [(4, 1, 256, 192), (6, 70, 512, 576), (3, 130, 384, 256)]  # e, m, k, n
# rows, k, n, offsets: an expert without rows, rows past offsets[-1], groups under and over 128
GROUPED = [
    (1, 256, 192, [0, 1, 1]),
    (300, 512, 576, [100, 100, 229, 290]),
    (1100, 384, 256, [300, 600, 600, 1090]),
]


def counts_for(e: int, m: int) -> list[int]:
    """0, all, 3, m - 1, more than m (all), -1 (none), in turn over the experts."""
    return [(0, m, 3, m - 1, m + 5, -1)[i % 6] for i in range(e)]


def poison(out_dtype, numel: int) -> None:
    """Leave NaN in the caching allocator's next block of this size, which the operator's
    output then most likely gets: rows it should have written and did not show."""
    torch.full((numel,), float("nan"), dtype=out_dtype, device="cuda")


@gpu
@pytest.mark.parametrize("backend", fp8_gemm.BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead, m, k, n", DENSE)
def test_dense_layout_against_float64(lead, m, k, n, out_dtype, backend):
    x, w = operands((*lead, m, k), (n, k), seed=m + k + n, device="cuda")
    want, magnitude = expected(x, w)
    poison(out_dtype, want.numel())
    got = block_gemm(*x, *w, None, None, out_dtype, backend)
    close_in(got, want, magnitude, out_dtype)


# What each backend is tested in: CUTLASS writes bf16 only (other dtypes take Triton).
EXPERT_BACKENDS = [
    ("triton", torch.bfloat16),
    ("triton", torch.float32),
    ("cutlass", torch.bfloat16),
    ("auto", torch.bfloat16),
]


@gpu
@pytest.mark.parametrize("with_counts", [False, True])
@pytest.mark.parametrize("backend, out_dtype", EXPERT_BACKENDS)
@pytest.mark.parametrize("e, m, k, n", BATCHED)
def test_batched_layout_against_float64(e, m, k, n, out_dtype, backend, with_counts):
    x, w = operands((e, m, k), (e, n, k), seed=e + m + k + n, device="cuda")
    want, magnitude = expected(x, w)
    counts = counts_for(e, m) if with_counts else [m] * e
    poison(out_dtype, want.numel())
    sizes = torch.tensor(counts, dtype=torch.int32, device="cuda") if with_counts else None
    got = block_gemm(*x, *w, None, sizes, out_dtype, backend)
    for g, count in enumerate(counts):
        rows = slice(0, min(max(count, 0), m))
        close_in(got[g, rows], want[g, rows], magnitude[g, rows], out_dtype)


@gpu
@pytest.mark.parametrize("backend, out_dtype", EXPERT_BACKENDS)
@pytest.mark.parametrize("rows, k, n, ends", GROUPED)
def test_grouped_layout_against_float64(rows, k, n, ends, out_dtype, backend):
    e = len(ends)
    x, w = operands((rows, k), (e, n, k), seed=rows + k + n, device="cuda")
    offsets = torch.tensor(ends, dtype=torch.int32, device="cuda")
    poison(out_dtype, rows * n)
    got = block_gemm(*x, *w, offsets, None, out_dtype, backend)
    assert got.shape == (rows, n)
    for g, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
        x_g = tuple(t[start:end] for t in x)
        want, magnitude = expected(x_g, tuple(t[g] for t in w))
        close_in(got[start:end], want, magnitude, out_dtype)


@gpu
@pytest.mark.parametrize("split_k", [1, 5])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("config", [fp8_gemm.FEW_ROWS, fp8_gemm.DECODE, fp8_gemm.PREFILL])
def test_load_paths_configs_and_k_splits_on_the_grouped_layout(config, tma, split_k):
    x, w = operands((700, 640), (3, 320, 640), seed=3, device="cuda")
    offsets = torch.tensor([200, 450, 690], dtype=torch.int32, device="cuda")
    got = triton_block_gemm(
        *x, *w, offsets, out_dtype=torch.float32, config=config, tma=tma, split_k=split_k
    )
    for g, (start, end) in enumerate([(0, 200), (200, 450), (450, 690)]):
        want, magnitude = expected(tuple(t[start:end] for t in x), tuple(t[g] for t in w))
        close_in(got[start:end], want, magnitude, torch.float32)


@gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_cutlass_on_groups_of_every_size(seed):
    """Fresh random group sizes (empty groups, groups of one row, groups spanning many tiles,
    rows past the last group) at V2-Lite's gate+up width (1408 = 11 x 128)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 300, (9,), generator=g)
    sizes[torch.randperm(9, generator=g)[:3]] = torch.tensor([0, 1, 0])
    ends = sizes.cumsum(0).tolist()
    rows, k, n = ends[-1] + 7, 2048, 1408
    x, w = operands((rows, k), (9, n, k), seed=seed, device="cuda")
    poison(torch.bfloat16, rows * n)
    offsets = torch.tensor(ends, dtype=torch.int32, device="cuda")
    got = block_gemm(*x, *w, offsets, None, torch.bfloat16, "cutlass")
    for e, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
        want, magnitude = expected(tuple(t[start:end] for t in x), tuple(t[e] for t in w))
        close_in(got[start:end], want, magnitude, torch.bfloat16)


@gpu
def test_cutlass_runs_on_hopper_and_checks_its_arguments():
    """The CUTLASS kernel builds on an H200 (a failure here says why "cutlass" is Triton), and
    its op refuses what it cannot run with a message naming it. Only checks whose messages are
    text: one with numbers in it (a k that does not match) crashed the process on the GPU
    machine instead (docs/model.md, FP8 weights); fp8_block_gemm checks in Python first."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUTLASS kernel is built for sm90a only")
    assert cutlass_gemm.built() is None
    assert cutlass_gemm.takes(576, 7168, torch.bfloat16, torch.device("cuda"))
    assert not cutlass_gemm.takes(576, 7168, torch.float32, torch.device("cuda"))
    assert not cutlass_gemm.takes(130, 7168, torch.bfloat16, torch.device("cuda"))
    x, w = operands((64, 256), (2, 128, 256), seed=4, device="cuda")
    op = torch.ops.ref_server_cuda.fp8_grouped_gemm
    offsets = torch.tensor([10, 64], dtype=torch.int32, device="cuda")
    bad = [
        ((x[0].cpu(), x[1], *w, offsets, None, 32), "x must be a CUDA tensor"),
        ((*x, *w, offsets.long(), None, 32), "offsets must be Int"),
        ((*x, *w, offsets, offsets, 32), "not both"),
        ((x[0].t(), x[1], *w, offsets, None, 32), "x must be contiguous"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            op(*args)


@gpu
def test_scaled_mm_takes_deepseek_v3_projections_on_hopper():
    """torch._scaled_mm's blockwise scaling is there for V3's linear layers (at whole
    4-row batches): a failure here says this torch lacks it, and "scaled_mm" is Triton."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("blockwise torch._scaled_mm is sm90 only")
    assert fp8_gemm.SCALED_MM_BLOCKWISE, (torch.__version__, torch.version.cuda)
    for k, n in [(7168, 1536), (1536, 24576), (7168, 576), (512, 32768), (16384, 7168)]:
        assert scaled_mm_takes(4096, n, k, torch.bfloat16, "cuda"), (k, n)


def graph_case(layout: str, seed: int):
    """Arguments of one call in `layout`, and which rows of its output are specified (dense:
    few enough tiles that k is split on an H200)."""
    if layout == "dense":
        x, w = operands((200, 2048), (576, 2048), seed, "cuda")
        return (*x, *w, None, None), [slice(0, 200)]
    if layout == "batched":
        x, w = operands((4, 96, 512), (4, 256, 512), seed, "cuda")
        counts = torch.randint(0, 97, (4,), generator=torch.Generator().manual_seed(seed))
        rows = [slice(0, c) for c in counts.tolist()]
        return (*x, *w, None, counts.to(torch.int32).cuda()), rows
    x, w = operands((400, 512), (4, 256, 512), seed, "cuda")
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(0, 401, (4,), generator=g).sort().values.tolist()
    offsets = torch.tensor(ends, dtype=torch.int32, device="cuda")
    return (*x, *w, offsets, None), [slice(a, b) for a, b in zip([0, *ends], ends, strict=False)]


def graph_expected(args, rows):
    x, x_scales, w, w_scales, offsets, counts = args
    outputs = []
    for g, r in enumerate(rows):
        if offsets is not None or counts is not None:
            xg = (x[r], x_scales[r]) if offsets is not None else (x[g, r], x_scales[g, r])
            outputs.append(expected(xg, (w[g], w_scales[g])))
        else:
            outputs.append(expected((x[r], x_scales[r]), (w, w_scales)))
    return outputs


@gpu
@pytest.mark.parametrize(
    "layout, backend",
    [("dense", "triton"), ("dense", "scaled_mm"), ("batched", "triton"), ("grouped", "triton")]
    + [(layout, "cutlass") for layout in ("dense", "batched", "grouped")],
)
def test_captured_in_a_cuda_graph_and_replayed_with_new_values(layout, backend):
    args, _ = graph_case(layout, seed=1)
    block_gemm(*args, torch.bfloat16, backend)  # compiles the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_gemm(*args, torch.bfloat16, backend)
    new, rows = graph_case(layout, seed=2)
    for static, value in zip(args, new, strict=True):
        if static is not None:
            static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    for g, (r, (want, magnitude)) in enumerate(zip(rows, graph_expected(new, rows), strict=True)):
        got = out[r] if layout != "batched" else out[g, r]
        close_in(got, want, magnitude, torch.bfloat16)


@gpu
def test_torch_compile_calls_the_operator():
    args, rows = graph_case("grouped", seed=3)
    compiled = torch.compile(fp8_block_gemm, fullgraph=True)
    got = compiled(*args[:4], args[4], torch.bfloat16)
    want = fp8_block_gemm(*args[:4], args[4], torch.bfloat16)
    for r in rows:
        assert torch.equal(got[r], want[r])


def opcheck(args, out_dtype):
    """torch.library.opcheck but its test_schema (which compares inputs with torch.allclose,
    that has no float8 kernels): that the inputs come back unchanged is checked here."""
    before = [t.clone() for t in args if t is not None]
    torch.library.opcheck(
        block_gemm,
        (*args, out_dtype, "triton"),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    after = [t for t in args if t is not None]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@gpu
@pytest.mark.parametrize("layout", ["dense", "batched", "grouped"])
def test_opcheck_on_cuda(layout):
    opcheck(small_case(layout, "cuda"), torch.bfloat16)


# ---- CPU ----


def small_case(layout: str, device="cpu"):
    """Small arguments in `layout` whose output is specified everywhere (opcheck compares
    outputs across calls): counts of all rows, groups covering every row, one of them empty."""
    if layout == "dense":
        x, w = operands((2, 5, 200), (130, 200), seed=0, device=device)
        return (*x, *w, None, None)
    if layout == "batched":
        x, w = operands((3, 4, 256), (3, 64, 256), seed=1, device=device)
        return (*x, *w, None, torch.tensor([4, 4, 4], dtype=torch.int32, device=device))
    x, w = operands((9, 256), (3, 64, 256), seed=2, device=device)
    return (*x, *w, torch.tensor([3, 3, 9], dtype=torch.int32, device=device), None)


@pytest.mark.parametrize("layout", ["dense", "batched", "grouped"])
def test_opcheck_on_cpu(layout):
    opcheck(small_case(layout), torch.float32)


@pytest.mark.parametrize(
    "layout, shape", [("dense", (2, 5, 130)), ("batched", (3, 4, 64)), ("grouped", (9, 64))]
)
def test_the_fake_implementation_gives_the_output_shape(layout, shape):
    args = [None if t is None else t.to("meta") for t in small_case(layout)]
    out = block_gemm(*args, torch.bfloat16, "triton")
    assert out.device.type == "meta" and out.shape == shape and out.dtype == torch.bfloat16


def test_torch_compile_traces_the_operator_whole():
    args = small_case("grouped")
    compiled = torch.compile(fp8_block_gemm, fullgraph=True, backend="aot_eager")
    want = fp8_block_gemm(*args[:5], torch.float32)
    assert torch.equal(compiled(*args[:5], torch.float32), want)


def replace(args, **changes):
    names = ("x", "x_scales", "w", "w_scales", "offsets", "counts", "out_dtype", "backend")
    values = dict(zip(names, args, strict=False)) | changes
    return [values.get(name) for name in names]


def bad_inputs():
    dense = (*small_case("dense"), torch.bfloat16, "triton")
    grouped = (*small_case("grouped"), torch.bfloat16, "triton")
    batched = (*small_case("batched"), torch.bfloat16, "triton")
    x, x_scales, w, w_scales = dense[:4]
    int32 = dict(dtype=torch.int32)
    return [
        (replace(dense, x=x.float()), "x must be torch.float8_e4m3fn, got torch.float32"),
        (replace(dense, w=w.to(torch.float8_e5m2)), "w must be torch.float8_e4m3fn"),
        (replace(dense, x_scales=x_scales.double()), "x_scales must be torch.float32"),
        (replace(dense, w=w[:, :128], w_scales=w_scales[:, :1]), "x has k = 200 .* k = 128"),
        (replace(dense, x_scales=x_scales[..., :1]), r"x_scales must be \(2, 5, 2\)"),
        (replace(dense, w_scales=w_scales[:1]), r"w_scales must be \(2, 2\)"),
        (replace(dense, out_dtype=torch.int32), "out_dtype must be one of"),
        (replace(dense, backend="cublas"), "backend must be one of"),
        (replace(dense, w=w[0]), r"w must be \[n, k\] or \[e, n, k\]"),
        (replace(dense, counts=torch.ones(1, **int32)), "counts is for experts' weights"),
        (replace(dense, offsets=torch.ones(1, **int32)), "offsets is for experts' weights"),
        (replace(grouped, offsets=grouped[4].long()), r"offsets must be \[3\] int32"),
        (replace(grouped, offsets=grouped[4][:2]), r"offsets must be \[3\] int32 .* \(2,\)"),
        (replace(grouped, counts=torch.ones(3, **int32)), "pass offsets .* or counts .* not both"),
        (replace(grouped, x=grouped[0][None], x_scales=grouped[1][None]), "with offsets, x must"),
        (replace(batched, counts=torch.ones(2, **int32)), r"counts must be \[3\] int32"),
        (replace(batched, x=batched[0][:2], x_scales=batched[1][:2]), "with e = 3 experts"),
        (replace(dense, w=w.to("meta"), w_scales=w_scales.to("meta")), "one device"),
    ]


@pytest.mark.parametrize("args, message", bad_inputs())
def test_bad_arguments_are_a_value_error_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        block_gemm(*args)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def interpreted_checks():
    """Each layout at sizes with partial tiles in m, n and k (k = 336: TMA reads zeros past
    it), an expert without rows, rows past the groups, through both load paths, k whole or
    split; then one row and k = 200 (pointer loads only), and PREFILL's 128-row tiles."""
    for tma in (False, True):
        x, w = operands((2, 70, 336), (200, 336), seed=5)
        want, magnitude = expected(x, w)
        for split_k in (1, 3):
            got = triton_block_gemm(*x, *w, out_dtype=torch.float32, tma=tma, split_k=split_k)
            close_in(got, want, magnitude, torch.float32)

        x, w = operands((3, 70, 256), (3, 192, 256), seed=6)
        counts = [0, 70, 5]
        sizes = torch.tensor(counts, dtype=torch.int32)
        got = triton_block_gemm(*x, *w, counts=sizes, out_dtype=torch.bfloat16, tma=tma)
        want, magnitude = expected(x, w)
        for g, count in enumerate(counts):
            close_in(got[g, :count], want[g, :count], magnitude[g, :count], torch.bfloat16)

        rows, _ = operands((150, 256), (1, 256), seed=7)
        ends = [64, 64, 140]
        offsets = torch.tensor(ends, dtype=torch.int32)
        got = triton_block_gemm(*rows, *w, offsets, tma=tma, split_k=2)
        for g, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
            want, magnitude = expected(tuple(t[start:end] for t in rows), tuple(t[g] for t in w))
            close_in(got[start:end], want, magnitude, torch.bfloat16)

    x, w = operands((1, 200), (130, 200), seed=8)
    want, magnitude = expected(x, w)
    close_in(triton_block_gemm(*x, *w, out_dtype=torch.float32), want, magnitude, torch.float32)
    with pytest.raises(ValueError, match="tma needs"):
        triton_block_gemm(*x, *w, tma=True)

    x, w = operands((300, 256), (2, 128, 256), seed=9)
    ends = torch.tensor([290, 300], dtype=torch.int32)
    got = triton_block_gemm(*x, *w, ends, out_dtype=torch.float32, config=fp8_gemm.PREFILL)
    for g, (start, end) in enumerate([(0, 290), (290, 300)]):
        want, magnitude = expected(tuple(t[start:end] for t in x), tuple(t[g] for t in w))
        close_in(got[start:end], want, magnitude, torch.float32)


if __name__ == "__main__":
    interpreted_checks()
