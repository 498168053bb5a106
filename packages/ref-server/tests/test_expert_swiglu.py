"""The experts' gate and up projections with SwiGLU's activation (`ref_server::expert_swiglu`):
on the CPU, the reference against float64, fake shapes, opcheck, argument checks, and the
switch (REF_SERVER_FUSED_SWIGLU), with which the experts and an FP8 model give the same
results as without; fp8_gemm's Triton kernel with the activation in its epilogue through
Triton's interpreter, bit for bit the unfused kernels and within float64's bounds; on the GPU
(`gpu` marker), the CUDA implementation bit for bit the unfused operators and within float64's
bounds at V2-Lite's and V3's expert shapes, in a CUDA graph replayed with new values, opcheck,
and V2-Lite's experts the same with the switch on and off."""

from __future__ import annotations

import pytest
import torch

import ref_server.model as M
from ref_server.kernels import fp8_gemm
from ref_server.kernels.activation import silu_mul, triton_silu_mul
from ref_server.kernels.expert_gemm import expert_gemm
from ref_server.kernels.expert_swiglu import SWITCH, expert_swiglu, fused_by_environment
from ref_server.kernels.fp8_cast import (
    dequantize_activations,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)
from ref_server.kernels.fp8_gemm import triton_block_gemm
from ref_server.model import fp8, moe
from ref_server.model.fp8 import FP8Experts, fp8_block_gemm
from ref_server.model.moe import Experts, RoutedExperts

gpu = pytest.mark.gpu
FP8 = torch.float8_e4m3fn


def up_start(inter: int, fp8: bool) -> int:
    """Where up's rows begin in an expert's stacked weights (FP8: the next 128-row block)."""
    return -(-inter // 128) * 128 if fp8 else inter


def stacked_weights(experts: int, inter: int, k: int, fp8: bool, g: torch.Generator):
    """fp32 `[experts, rows, k]`: gate's inter rows, zero padding rows (FP8), up's inter rows;
    FP8 weights with each 128 x 128 block scaled by its own power of two in [2^-4, 2^4], so
    that a scale read from the wrong block shows."""
    first_up = up_start(inter, fp8)
    w = torch.randn(experts, first_up + inter, k, generator=g) / k**0.5
    w[:, inter:first_up] = 0
    if fp8:
        blocks = (experts, -(-w.shape[1] // 128), -(-k // 128))
        factors = torch.exp2(torch.randint(-4, 5, blocks, generator=g).float())
        factors = factors.repeat_interleave(128, 1).repeat_interleave(128, 2)
        w = w * factors[:, : w.shape[1], :k]
    return w


def problem(x_shape, experts, inter, dtype, seed, device="cpu"):
    """(x, x_scales, w, w_scales) for `expert_swiglu`: dtype FP8 gives quantized operands
    (activations from the output dtype's view: bf16), else x and w in dtype, scales None."""
    g = torch.Generator().manual_seed(seed)
    fp8 = dtype == FP8
    x = torch.randn(x_shape, generator=g)
    w = stacked_weights(experts, inter, x_shape[-1], fp8, g)
    if fp8:
        return tuple(t.to(device) for t in (*quantize_activations(x), *quantize_blocks(w)))
    return x.to(device, dtype), None, w.to(device, dtype), None


def as_float64(x, x_scales, w, w_scales):
    """The operands' values in float64, dequantized where FP8."""
    if x_scales is None:
        return x.double(), w.double()
    return dequantize_activations(x, x_scales).double(), dequantize_blocks(w, w_scales).double()


def check_against_float64(got, x, w, inter: int, dtype: torch.dtype, sums: float) -> None:
    """got, one expert's silu(x @ gate^T) * (x @ up^T) `[rows, inter]` in dtype, x `[rows, k]`
    and w `[rows of w, k]` float64, within what the kernel's roundings allow: each product off
    by `sums` of its terms' magnitudes (the fp32 sums) plus its rounding to dtype, carried
    through silu (slope at most 1.1) and the product, then silu's and the product's roundings
    (one unit in the last place each, as the interpreter's truncation; 4 for silu's fp32 exp)."""
    eps = torch.finfo(dtype).eps
    gate_w, up_w = w[:inter], w[-inter:]
    gate, up = x @ gate_w.t(), x @ up_w.t()
    gate_error = sums * (x.abs() @ gate_w.abs().t()) + eps * gate.abs()
    up_error = sums * (x.abs() @ up_w.abs().t()) + eps * up.abs()
    silu = gate * torch.sigmoid(gate)
    silu_bound, up_bound = silu.abs() + 1.1 * gate_error, up.abs() + up_error
    bound = 1.1 * gate_error * up_bound + silu.abs() * up_error + 6 * eps * silu_bound * up_bound
    assert got.dtype == dtype and got.shape == silu.shape
    error = (got.double() - silu * up).abs()
    assert (error <= bound).all(), f"error up to {(error / bound.clamp(min=1e-300)).max():.3g}"


def expert_rows(layout: str, sizes: list[int], rows: int):
    """(expert, index of its valid rows in the output) for grouped ends or batched counts."""
    if layout == "grouped":
        return [(g, slice(a, b)) for g, (a, b) in enumerate(zip([0, *sizes], sizes, strict=False))]
    return [(g, (g, slice(0, min(max(c, 0), rows)))) for g, c in enumerate(sizes)]


def check_layout(got, args, inter, layout, sizes, dtype, sums) -> None:
    x, w = as_float64(*args)
    rows = x.shape[-2]
    for g, index in expert_rows(layout, sizes, rows):
        check_against_float64(got[index], x[index], w[g], inter, dtype, sums)


def assert_same_bits(got, want, layout, sizes) -> None:
    """got and want of one shape and dtype, bit for bit in every valid row."""
    assert got.dtype == want.dtype and got.shape == want.shape
    for _, index in expert_rows(layout, sizes, got.shape[-2]):
        assert torch.equal(got[index].view(torch.int16), want[index].view(torch.int16))


def sizes_tensor(sizes: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32, device=device)


def offsets_and_counts(layout: str, sizes: list[int], device):
    """The operators' (offsets, counts) arguments: grouped ends or batched counts."""
    if layout == "grouped":
        return sizes_tensor(sizes, device), None
    return None, sizes_tensor(sizes, device)


def call(op, args, inter, layout, sizes, out_dtype, device="cpu", **options):
    """op (expert_swiglu or triton_block_gemm, which takes options) in layout."""
    offsets, counts = offsets_and_counts(layout, sizes, device)
    if op is triton_block_gemm:
        return op(*args, offsets, counts, out_dtype, swiglu_inter=inter, **options)
    x, x_scales, w, w_scales = args
    return op(x, x_scales, w, w_scales, inter, offsets, counts, out_dtype)


def unfused(args, inter, layout, sizes, out_dtype, device="cpu", **options):
    """What the experts computed before: the gate+up GEMM, then silu_mul of its two parts
    (through the Triton kernels where options are given, else the operators)."""
    offsets, counts = offsets_and_counts(layout, sizes, device)
    x, x_scales, w, w_scales = args
    if options:
        gate_up = triton_block_gemm(*args, offsets, counts, out_dtype, **options)
        return triton_silu_mul(gate_up[..., :inter], gate_up[..., -inter:])
    if x_scales is None:
        gate_up = expert_gemm(x, w, offsets, counts)
    else:
        gate_up = fp8_block_gemm(x, x_scales, w, w_scales, offsets, out_dtype, counts)
    return silu_mul(gate_up[..., :inter], gate_up[..., -inter:])


# ---- CPU: the reference, fake, opcheck, bad arguments ----

CPU_CASES = [  # layout, x's shape, experts, inter, sizes, operands' dtype, out dtype
    ("grouped", (50, 64), 3, 40, [10, 10, 45], torch.float32, torch.float32),
    ("batched", (3, 7, 64), 3, 24, [7, 7, 7], torch.bfloat16, torch.bfloat16),
    ("grouped", (40, 256), 3, 160, [0, 17, 33], FP8, torch.bfloat16),
    ("batched", (2, 5, 200), 2, 32, [5, 5], FP8, torch.float32),
]


@pytest.mark.parametrize("layout, shape, experts, inter, sizes, dtype, out_dtype", CPU_CASES)
def test_the_reference_matches_float64(layout, shape, experts, inter, sizes, dtype, out_dtype):
    """In both layouts, half precision and fp32 operands with up right after gate, FP8 ones
    with up at the next 128-row block (padding rows between)."""
    args = problem(shape, experts, inter, dtype, seed=inter + shape[-1])
    got = call(expert_swiglu, args, inter, layout, sizes, out_dtype)
    sums = 2**-9 if dtype == FP8 else 2**-16  # e4m3 products in the tensor cores
    check_layout(got, args, inter, layout, sizes, out_dtype, sums)


def test_the_fake_implementation_gives_the_output_shape():
    for layout, shape, experts, inter, sizes, dtype, out_dtype in CPU_CASES:
        args = [
            None if t is None else t.to("meta") for t in problem(shape, experts, inter, dtype, 0)
        ]
        offsets, counts = offsets_and_counts(layout, sizes, "meta")
        out = expert_swiglu(*args[:4], inter, offsets, counts, out_dtype)
        assert out.device.type == "meta" and out.dtype == out_dtype
        assert out.shape == (*shape[:-1], inter)


def opcheck(args, inter, offsets, counts, out_dtype) -> None:
    """torch.library.opcheck but its test_schema (which compares inputs with torch.allclose,
    that has no float8 kernels): that the inputs come back unchanged is checked here."""
    tensors = [t for t in args if t is not None]
    before = [t.clone() for t in tensors]
    torch.library.opcheck(
        expert_swiglu,
        (*args, inter, offsets, counts, out_dtype),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
    for a, b in zip(before, tensors, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_opcheck_on_cpu(dtype):
    args = problem((9, 256), 3, 48, dtype, seed=1)
    opcheck(args, 48, sizes_tensor([3, 3, 9]), None, torch.float32)


def bad_inputs():
    x, _, w, _ = problem((9, 64), 3, 40, torch.bfloat16, seed=0)
    fp8 = problem((9, 256), 3, 40, FP8, seed=0)  # 168 rows an expert: up at row 128
    offsets = sizes_tensor([3, 3, 9])
    return [
        ((x, None, w[0], None, 40, offsets, None, x.dtype), r"stacked gate and up .* \(80, 64\)"),
        ((x, None, w, None, 41, offsets, None, x.dtype), "80 rows an expert: too few .* 41"),
        ((x, None, w, None, 0, offsets, None, x.dtype), "80 rows an expert: too few .* 0"),
        ((x, None, w, None, 40, offsets, None, torch.float32), "give x's dtype torch.bfloat16"),
        ((*fp8, 48, offsets, None, torch.bfloat16), "must start a 128-row block .* row 120"),
        ((x[:, :32], None, w, None, 40, offsets, None, x.dtype), "x has k = 32 .* k = 64"),
        ((x, None, w, None, 40, offsets[:2], None, x.dtype), r"offsets must be \[3\] int32"),
        ((*fp8[:3], None, 40, offsets, None, torch.bfloat16), "w_scales is missing"),
    ]


@pytest.mark.parametrize("args, message", bad_inputs())
def test_bad_arguments_are_a_value_error_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        expert_swiglu(*args)
    with pytest.raises(ValueError, match=message):  # the fake implementation checks too
        expert_swiglu(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in args))


# ---- CPU: the switch ----


def test_the_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert not fused_by_environment()
    for value, fused in (("0", False), ("1", True)):
        monkeypatch.setenv(SWITCH, value)
        assert fused_by_environment() is fused
        assert M.from_preset("tiny").layers[1].mlp.experts.fused_swiglu is fused
    monkeypatch.setenv(SWITCH, "yes")
    with pytest.raises(ValueError, match="REF_SERVER_FUSED_SWIGLU must be 0 or 1, got 'yes'"):
        M.from_preset("tiny")


def count_calls(monkeypatch, *modules) -> list:
    """A list that grows by one at each expert_swiglu call made through these modules."""
    calls = []

    def counted(*args):
        calls.append(args)
        return expert_swiglu(*args)

    for module in modules:
        monkeypatch.setattr(module, "expert_swiglu", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_switched_on_the_experts_give_the_same_results(dtype, monkeypatch):
    """Grouped (the GPU's path, here on the CPU) and packed rows (low-latency decode)."""
    experts = M.from_preset("tiny", seed=5, dtype=dtype).layers[1].mlp.experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 64, generator=g).to(dtype)
    ids = torch.randint(-1, 6, (37, 2), generator=g)
    weights = torch.rand(37, 2, generator=g)
    packed = torch.randn(8, 6, 64, generator=g).to(dtype)
    counts = sizes_tensor([0, 6, 3, 1, 6, 2, 0, 5])
    calls = count_calls(monkeypatch, moe)
    results = []
    for fused in (False, True):
        experts.fused_swiglu = fused
        results.append((experts.grouped(x, ids, weights), experts.packed(packed, counts)))
    assert len(calls) == 2
    (grouped, packed_out), (fused_grouped, fused_packed) = results
    assert torch.equal(fused_grouped, grouped)
    for e, count in enumerate(counts.tolist()):
        assert torch.equal(fused_packed[e, :count], packed_out[e, :count])


def test_switched_on_an_fp8_model_gives_the_same_logits(monkeypatch):
    """FP8 experts take the grouped path on the CPU; the tiny preset's inter (32) leaves 96
    padding rows between gate and up."""
    monkeypatch.delenv(SWITCH, raising=False)
    off = M.from_preset("tiny", seed=6, weight_dtype="fp8")
    monkeypatch.setenv(SWITCH, "1")
    on = M.from_preset("tiny", seed=6, weight_dtype="fp8")
    experts = [m for m in on.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 2 and all(e.fused_swiglu for e in experts)
    calls = count_calls(monkeypatch, fp8)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want, got = off(ids), on(ids)
    assert len(calls) == 2
    assert torch.equal(got, want)


# ---- the Triton kernel with the activation, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


# Half-precision operands in fp16: Triton 3.6's interpreter multiplies bf16 tiles as integers
# and rounds each step's fp16 product to fp16 before the fp32 sum (test_expert_gemm.py).
INTERPRETED_SUMS = {torch.float16: 2**-9, FP8: 2**-9}
INTERPRETED = [  # layout, x's shape, experts, inter, sizes, operands' dtype, options
    # an expert without rows, rows past the last group, a partial column tile
    ("grouped", (150, 192), 3, 96, [64, 64, 140], torch.float16, dict(split_k=1)),
    ("grouped", (150, 192), 3, 96, [64, 64, 140], torch.float16, dict(split_k=3)),
    # counts of none, all, some, more than the rows and below zero
    ("batched", (4, 70, 128), 4, 80, [0, 70, 5, 99], torch.float16, dict(split_k=2)),
    # a decode step: far more experts than rows, FEW_ROWS's 16 x 64 tiles; k in a partial step
    ("grouped", (3, 200), 8, 48, [0, 1, 1, 1, 2, 2, 3, 3], torch.float16, {}),
    # FP8: up at row 256 after gate's 160 (a partial block) and padding
    ("grouped", (130, 256), 3, 160, [0, 60, 120], FP8, dict(split_k=1)),
    ("grouped", (130, 256), 3, 160, [0, 60, 120], FP8, dict(split_k=2)),
    ("batched", (3, 66, 384), 3, 128, [66, -1, 7], FP8, dict(split_k=3)),
    ("grouped", (200, 256), 2, 128, [190, 200], FP8, dict(config=fp8_gemm.PREFILL)),
]


def interpreted_checks():
    """Each case of INTERPRETED through both load paths where TMA can take it: the fused
    kernel bit for bit the unfused kernels (the GEMM, then silu_mul), and within float64's
    bounds."""
    for layout, shape, experts, inter, sizes, dtype, options in INTERPRETED:
        args = problem(shape, experts, inter, dtype, seed=sum(shape) + inter)
        out_dtype = torch.float16 if dtype == torch.float16 else torch.bfloat16
        for tma in (False, True) if shape[-2] >= 16 else (False,):
            got = call(triton_block_gemm, args, inter, layout, sizes, out_dtype, tma=tma, **options)
            want = unfused(args, inter, layout, sizes, out_dtype, tma=tma, **options)
            assert_same_bits(got, want, layout, sizes)
            check_layout(got, args, inter, layout, sizes, out_dtype, INTERPRETED_SUMS[dtype])


# ---- the CUDA implementation ----


def poison(numel: int, dtype=torch.bfloat16) -> None:
    """NaN in the caching allocator's next block of this size (the output's, most likely)."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


# V2-Lite's experts (64, hidden 2048, inter 1408) and V3's at EP 8 (32 local, 7168, 2048)
SHAPES = [(64, 2048, 1408), (32, 7168, 2048)]


def ends_for(rows: int, experts: int, seed: int) -> list[int]:
    """Cumulative ends of `experts` random groups over at most `rows` rows (some empty)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows + 1, (experts,), generator=g).sort().values.tolist()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("tokens", [1, 8, 256, 2048])
@pytest.mark.parametrize("experts, hidden, inter", SHAPES)
def test_the_grouped_layout_on_cuda(experts, hidden, inter, tokens, dtype):
    """Rows of `tokens` tokens with 6 experts each: decode sizes through the fused Triton
    kernel, 2048 tokens through the unfused composition (torch._grouped_mm or CUTLASS): bit for
    bit the unfused operators and within float64's bounds."""
    rows = 6 * tokens
    args = problem((rows + 5, hidden), experts, inter, dtype, seed=tokens, device="cuda")
    ends = ends_for(rows, experts, seed=inter + tokens)
    want = unfused(args, inter, "grouped", ends, torch.bfloat16, "cuda")
    poison((rows + 5) * inter)
    got = call(expert_swiglu, args, inter, "grouped", ends, torch.bfloat16, "cuda")
    assert_same_bits(got, want, "grouped", ends)
    sums = 2**-9 if dtype == FP8 else 2**-16
    check_layout(got, args, inter, "grouped", ends, torch.bfloat16, sums)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("experts, hidden, inter", SHAPES)
def test_the_batched_layout_with_counts_on_cuda(experts, hidden, inter, dtype):
    args = problem((experts, 24, hidden), experts, inter, dtype, seed=inter, device="cuda")
    counts = [(0, 24, 3, 23, 30, -1)[g % 6] for g in range(experts)]
    want = unfused(args, inter, "batched", counts, torch.bfloat16, "cuda")
    poison(experts * 24 * inter)
    got = call(expert_swiglu, args, inter, "batched", counts, torch.bfloat16, "cuda")
    assert_same_bits(got, want, "batched", counts)
    sums = 2**-9 if dtype == FP8 else 2**-16
    check_layout(got, args, inter, "batched", counts, torch.bfloat16, sums)


@gpu
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("config", [fp8_gemm.FEW_ROWS, fp8_gemm.DECODE, fp8_gemm.PREFILL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_configs_load_paths_and_k_splits_on_cuda(dtype, config, tma, split_k):
    """Every tile shape, load path and a k split: the fused kernel bit for bit the unfused
    kernels with the same options; FP8 with padding rows between gate (160) and up."""
    inter, ends = 160, [200, 450, 690]
    args = problem((700, 1024), 3, inter, dtype, seed=split_k, device="cuda")
    options = dict(config=config, tma=tma, split_k=split_k)
    want = unfused(args, inter, "grouped", ends, torch.bfloat16, "cuda", **options)
    poison(700 * inter)
    got = call(triton_block_gemm, args, inter, "grouped", ends, torch.bfloat16, "cuda", **options)
    assert_same_bits(got, want, "grouped", ends)


@gpu
def test_captured_in_a_cuda_graph_and_replayed_with_new_values():
    experts, hidden, inter = SHAPES[0]
    args = problem((48, hidden), experts, inter, torch.bfloat16, seed=1, device="cuda")
    offsets = sizes_tensor(ends_for(48, experts, 1), "cuda")
    x, _, w, _ = args
    expert_swiglu(x, None, w, None, inter, offsets, None, x.dtype)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_swiglu(x, None, w, None, inter, offsets, None, x.dtype)
    new = problem((48, hidden), experts, inter, torch.bfloat16, seed=2, device="cuda")
    ends = ends_for(48, experts, 2)
    for static, value in ((x, new[0]), (w, new[2]), (offsets, sizes_tensor(ends, "cuda"))):
        static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    check_layout(out, args, inter, "grouped", ends, torch.bfloat16, 2**-16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_opcheck_on_cuda(dtype):
    args = problem((9, 256), 3, 128, dtype, seed=3, device="cuda")
    opcheck(args, 128, sizes_tensor([3, 3, 9], "cuda"), None, torch.bfloat16)


def v2_lite_experts(fp8: bool):
    """V2-Lite's 64 routed experts of one layer, random, on the GPU (bf16 or FP8)."""
    experts, hidden, inter = SHAPES[0]
    g = torch.Generator("cuda").manual_seed(8)
    weights = {
        "gate_up_proj": torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda"),
        "down_proj": torch.randn(experts, hidden, inter, generator=g, device="cuda"),
    }
    if fp8:  # (Module.to would cast the e4m3 buffers to the dtype too)
        module = FP8Experts(experts, hidden, inter).to("cuda")
    else:
        module = Experts(experts, hidden, inter).to("cuda", torch.bfloat16)
    for name, w in weights.items():
        w /= w.shape[-1] ** 0.5
        if fp8:
            values, scales = quantize_blocks(w)
            getattr(module, name).copy_(values)
            getattr(module, name + "_scale_inv").copy_(scales)
        else:
            getattr(module, name).copy_(w)
    return module


@gpu
@pytest.mark.parametrize("fp8", [False, True])
@torch.no_grad()
def test_switched_on_the_v2_lite_experts_give_the_same_results_on_cuda(fp8):
    """Decode's grouped rows (16 tokens) and packed rows with counts: the same bits with the
    switch on and off."""
    experts = v2_lite_experts(fp8)
    hidden, count = SHAPES[0][1], experts.num_experts
    g = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(16, hidden, generator=g, device="cuda").bfloat16()
    ids = torch.randint(-1, count, (16, 6), generator=g, device="cuda")
    weights = torch.rand(16, 6, generator=g, device="cuda")
    packed = torch.randn(count, 4, hidden, generator=g, device="cuda").bfloat16()
    counts = torch.randint(0, 5, (count,), generator=g, device="cuda", dtype=torch.int32)
    results = []
    for fused in (False, True):
        experts.fused_swiglu = fused
        results.append((experts.grouped(x, ids, weights), experts.packed(packed, counts)))
    (grouped, packed_out), (fused_grouped, fused_packed) = results
    assert torch.equal(fused_grouped, grouped)
    for e, rows in enumerate(counts.tolist()):
        assert torch.equal(fused_packed[e, :rows], packed_out[e, :rows])


if __name__ == "__main__":
    interpreted_checks()
