"""SwiGLU's activation operators (`ref_server::silu_mul`, `ref_server::silu_mul_fp8`): on the
CPU, bit for bit the torch code the model ran before them (`F.silu(gate) * up`, then
`quantize_activations`), with opcheck, fake shapes, torch.compile and argument checks; their
Triton kernels on the CPU through Triton's interpreter (where triton is installed); on the GPU
(`gpu` marker), the kernels bit for bit against torch's CUDA formula at the models' sizes and
layouts, on NaN-poisoned outputs, without recompiling for new row counts, in CUDA graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ref_server.kernels.activation import (
    DTYPES,
    silu_mul,
    silu_mul_fp8,
    triton_silu_mul,
    triton_silu_mul_fp8,
)
from ref_server.kernels.fp8_cast import cast_activations, quantize_activations

gpu = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
# inter of V2-Lite's routed and shared experts, V3's experts (routed and shared) and dense MLPs
INTERS = [1408, 2816, 2048, 18432]
ROWS = [0, 1, 7, 300]
# gate and up: two tensors (MLP, FP8 experts), the halves of [rows, 2 inter] (grouped bf16
# experts) or of [experts, rows, 2 inter] (the packed layout)
LAYOUTS = ["separate", "chunked", "batched"]
# gate's specials, each with up = -1.25 in the first row; up's, each with gate = 2
SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 1e-5]
SPECIALS += [100.0, -100.0, -88.75, 88.0, 65504.0]  # -88.75: exp(88.75) overflows fp32
# How far the interpreter's fp32 silu may be from silu's exact value, relative: numpy's exp
# and torch's differ by a few units in the last place, and the sum and division round.
INTERPRETED_SILU = 2**-19


def torch_formula(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The model's SwiGLU activation before the operators."""
    return F.silu(gate) * up


def gate_and_up(shape, dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) `shape` in dtype, contiguous: gate normal times a power of two in [2^-2, 2^4]
    per value (silu's curve and tails); up normal times a power of two in [2^-10, 2^6] per row
    and 128 channels (so FP8 scales differ), one group in eight zeros and one 1e-6 times
    normal values (under the FP8 amax floor); SPECIALS in the first row."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-2, 5, shape, generator=g))
    rows, inter = gate[..., 0].numel(), shape[-1]
    groups = -(-inter // 128)
    spread = torch.exp2(torch.randint(-10, 7, (rows, groups, 1), generator=g).float())
    up = torch.randn(rows, groups, 128, generator=g) * spread
    kinds = ((torch.arange(rows)[:, None] + torch.arange(groups)) % 8)[..., None]
    up = torch.where(kinds == 5, 0.0, up)
    up = torch.where(kinds == 6, 1e-6 * torch.randn(up.shape, generator=g), up)
    up = up.flatten(1)[:, :inter].reshape(shape)
    n = len(SPECIALS)
    if rows and inter >= 2 * n:
        first_gate, first_up = gate.view(-1, inter)[0], up.view(-1, inter)[0]
        first_gate[:n], first_up[:n] = torch.tensor(SPECIALS), -1.25
        first_gate[n : 2 * n], first_up[n : 2 * n] = 2.0, torch.tensor(SPECIALS)
    return gate.to(dtype).contiguous(), up.to(dtype).contiguous()


def problem(rows, inter, dtype, layout="chunked", seed=0, device="cpu"):
    """(gate, up) `[rows, inter]` (`[3, rows, inter]` batched) laid out as `layout` says."""
    if layout == "separate":
        return tuple(t.to(device) for t in gate_and_up((rows, inter), dtype, seed))
    lead = (rows,) if layout == "chunked" else (3, rows)
    gate, up = gate_and_up((*lead, inter), dtype, seed)
    gate_up = torch.cat([gate, up], dim=-1).to(device)
    return gate_up.chunk(2, dim=-1)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Contiguous, want's shape and dtype, bit for bit but for NaNs' bits (NaN where want is)."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = torch.int32 if want.dtype == torch.float32 else torch.int16
    differ = (got.view(bits) != want.view(bits)) & ~nan
    assert not differ.any(), f"{differ.sum().item()} of {got.numel()} values differ"


def assert_same_cast(got, want) -> None:
    """FP8 (values, scales) bit for bit, but for the sign bits of NaNs."""
    (values, scales), (want_values, want_scales) = got, want
    assert values.dtype == FP8 and values.shape == want_values.shape and values.is_contiguous()
    bits, want_bits = values.view(torch.uint8), want_values.view(torch.uint8)
    nan = (want_bits & 0x7F) == 0x7F  # e4m3's NaNs
    unsigned = torch.where(nan, bits & 0x7F, bits), torch.where(nan, want_bits & 0x7F, want_bits)
    mismatches = (unsigned[0] != unsigned[1]).sum().item()
    assert mismatches == 0, f"{mismatches} of {bits.numel()} values differ"
    assert_same_bits(scales, want_scales)


# ---- CPU ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows, inter", [(7, 1408), (1, 2048), (300, 300)])
def test_the_operators_on_the_cpu_are_the_torch_formula_bit_for_bit(rows, inter, layout, dtype):
    gate, up = problem(rows, inter, dtype, layout, seed=rows + inter)
    want = torch_formula(gate, up)
    assert_same_bits(silu_mul(gate, up), want)
    assert_same_cast(silu_mul_fp8(gate, up), quantize_activations(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_rounds_silu_to_the_dtype_then_the_product(dtype):
    """What the kernel reproduces: for half precision, torch's F.silu(gate) * up is silu in
    fp32 rounded to the dtype, then the fp32 product rounded again; rounding once differs."""
    gate, up = problem(300, 1408, dtype, seed=1)
    g = gate.float()
    silu = (g / (1 + torch.exp(-g))).to(dtype)
    assert_same_bits(torch_formula(gate, up), (silu.float() * up.float()).to(dtype))
    rounded_once = (g / (1 + torch.exp(-g)) * up.float()).to(dtype)
    assert not torch.equal(rounded_once, torch_formula(gate, up))


def test_permuted_and_strided_inputs_give_contiguous_results():
    """Permuted leading dims, channels with a stride, mixed layouts of gate and up."""
    gate, up = problem(5, 256, torch.bfloat16, "batched", seed=2)
    views = [
        (gate.transpose(0, 1), up.transpose(0, 1)),
        (gate[..., ::2], up[..., ::2]),
        (gate.contiguous(), up),
    ]
    for g, u in views:
        assert_same_bits(silu_mul(g, u), torch_formula(g, u))
        assert_same_cast(silu_mul_fp8(g, u), quantize_activations(torch_formula(g, u)))


@pytest.mark.parametrize("shape", [(0, 1408), (3, 0, 2048), (4, 0)])
def test_empty_inputs_give_empty_outputs(shape):
    gate = up = torch.empty(shape, dtype=torch.bfloat16)
    assert silu_mul(gate, up).shape == shape
    values, scales = silu_mul_fp8(gate, up)
    assert values.shape == shape and scales.shape == (*shape[:-1], -(-shape[-1] // 128))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_on_cpu(layout):
    # without the first row, whose NaNs opcheck's comparisons refuse
    args = tuple(t[1:] for t in problem(5, 300, torch.bfloat16, layout, seed=3))
    torch.library.opcheck(silu_mul, args)
    torch.library.opcheck(silu_mul_fp8, args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fake_implementations_give_the_outputs(dtype):
    gate, up = torch.empty(2, 5, 2 * 1408, dtype=dtype, device="meta").chunk(2, dim=-1)
    out = silu_mul(gate, up)
    assert out.device.type == "meta" and out.shape == (2, 5, 1408) and out.dtype == dtype
    assert out.is_contiguous()
    values, scales = silu_mul_fp8(gate, up)
    assert values.device.type == "meta" and values.shape == (2, 5, 1408) and values.dtype == FP8
    assert scales.shape == (2, 5, 11) and scales.dtype == torch.float32


def test_torch_compile_traces_the_operators_whole():
    def swiglu(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return silu_mul(gate, up), silu_mul_fp8(gate, up)

    gate, up = problem(7, 300, torch.bfloat16, seed=4)
    gate_up = torch.cat([gate, up], dim=-1)
    out, cast = torch.compile(swiglu, fullgraph=True, backend="aot_eager")(gate_up)
    assert_same_bits(out, torch_formula(gate, up))
    assert_same_cast(cast, quantize_activations(torch_formula(gate, up)))


def test_gradients_are_not_supported_but_the_forward_runs():
    gate, up = problem(3, 128, torch.float32, "separate", seed=5)
    gate.requires_grad_()
    out = silu_mul(gate, up)
    assert_same_bits(out.detach(), torch_formula(gate, up).detach())
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def bad_inputs():
    gate, up = problem(3, 256, torch.bfloat16, "separate")
    return [
        ((gate, up[:, :255]), r"one shape: gate is \(3, 256\), up \(3, 255\)"),
        ((gate, up.view(3, 2, 128)), r"one shape: gate is \(3, 256\), up \(3, 2, 128\)"),
        ((gate, up.float()), "one dtype: gate is torch.bfloat16, up torch.float32"),
        ((gate.double(), up.double()), "gate must be one of .* got torch.float64"),
        ((gate, up.to(FP8)), "up must be one of .* got torch.float8_e4m3fn"),
        ((gate.int(), up), "gate must be one of .* got torch.int32"),
        ((gate[0, 0], up[0, 0]), r"gate must be \[\.\.\., inter\], got a scalar"),
        ((gate, up.to("meta")), "one device: gate is on cpu, up on meta"),
    ]


@pytest.mark.parametrize("operator", [silu_mul, silu_mul_fp8], ids=["silu_mul", "fp8"])
@pytest.mark.parametrize("args, message", bad_inputs())
def test_bad_arguments_are_a_value_error_naming_the_problem(args, message, operator):
    with pytest.raises(ValueError, match=message):
        operator(*args)
    if all(t.device.type == "cpu" for t in args):  # the fake implementations check too
        with pytest.raises(ValueError, match=message):
            operator(*(t.to("meta") for t in args))


@pytest.mark.parametrize("kernel", [triton_silu_mul, triton_silu_mul_fp8])
def test_the_kernels_check_their_arguments_before_any_launch(kernel):
    gate, up = problem(3, 256, torch.bfloat16, "separate")
    with pytest.raises(ValueError, match="one dtype"):
        kernel(gate, up.half())


# ---- the Triton kernels on the CPU, through Triton's interpreter ----


def test_the_kernels_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x through fp32 to dtype as Triton's interpreter rounds: fp32 to bf16 truncated, else to
    nearest even."""
    x = x.float()
    if dtype == torch.bfloat16:
        x = (x.view(torch.int32) & -65536).view(torch.float32)
    return x.to(dtype)


def assert_interpreted_silu_mul(got: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """got: silu_mul(gate, up) by its kernel in the interpreter, where the fp32 silu is within
    INTERPRETED_SILU of silu's value (with torch's fp32 exp, so that it overflows where the
    kernel's does) and bf16 roundings truncate. Then got lies between the results of the two
    ends of that interval (the rest is monotonic: rounding to gate's dtype, the product with
    up, rounding), each rounded as the interpreter rounds; NaN exactly where they are. But in
    bf16 where silu or the product is an fp32 subnormal: the interpreter converts those to bf16
    wrongly (it normalizes their mantissas)."""
    assert got.dtype == gate.dtype and got.shape == gate.shape and got.is_contiguous()
    silu = gate.double() / (1 + torch.exp(-gate.float()).double())
    ends = [
        rounded(rounded(silu * (1 + d), gate.dtype).float() * up.float(), gate.dtype)
        for d in (-INTERPRETED_SILU, INTERPRETED_SILU)
    ]
    low, high = torch.minimum(*ends), torch.maximum(*ends)
    nan = low.isnan()
    assert torch.equal(got.isnan(), nan)
    checked = ~nan
    if gate.dtype == torch.bfloat16:
        for exact in (silu.abs(), (silu * up.double()).abs()):
            checked &= (exact == 0) | (exact >= 2**-126)
    outside = ((got < low) | (got > high)) & checked
    assert not outside.any(), f"{outside.sum().item()} of {got.numel()} values outside"


def interpreted_check(gate: torch.Tensor, up: torch.Tensor) -> None:
    """silu_mul's kernel as `assert_interpreted_silu_mul` says; silu_mul_fp8's bit for bit
    the default cast of silu_mul's kernel's result (the intermediate rounds alike in both)."""
    out = triton_silu_mul(gate, up)
    assert_interpreted_silu_mul(out, gate, up)
    assert_same_cast(triton_silu_mul_fp8(gate, up), cast_activations(out))


def interpreted_checks():
    """Every dtype at 7 rows, every inter at 1 (chunked halves); every layout; 300 rows (more
    than one tile of rows, a partial group); views that are copied first; no rows. (The
    interpreter takes seconds for a few thousand programs: the GPU tests take every shape.)"""
    for dtype in DTYPES:
        interpreted_check(*problem(7, 1408, dtype, seed=7))
    for inter in INTERS:
        interpreted_check(*problem(1, inter, torch.bfloat16, seed=inter))
    for layout in LAYOUTS:
        interpreted_check(*problem(7, 2816, torch.float16, layout, seed=8))
    interpreted_check(*problem(300, 300, torch.bfloat16, seed=300))
    gate, up = problem(5, 384, torch.float16, "batched", seed=6)
    interpreted_check(gate.transpose(0, 1), up.transpose(0, 1))
    interpreted_check(gate[..., ::3], up[..., ::3])
    gate, up = problem(0, 2048, torch.bfloat16)
    assert triton_silu_mul(gate, up).shape == (0, 2048)
    values, scales = triton_silu_mul_fp8(gate, up)
    assert values.shape == (0, 2048) and scales.shape == (0, 16)


# ---- GPU ----


def poison(*like: torch.Tensor) -> None:
    """All-ones bits (NaN in every float dtype, e4m3 included) in the caching allocator's next
    blocks of these tensors' sizes (those of the outputs, most likely)."""
    blocks = [torch.full((t.nbytes,), 255, dtype=torch.uint8, device="cuda") for t in like]
    del blocks


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", INTERS)
def test_silu_mul_on_cuda_is_torch_s_formula_bit_for_bit(inter, rows, dtype, layout):
    gate, up = problem(rows, inter, dtype, layout, seed=inter + rows, device="cuda")
    want = torch_formula(gate, up)
    poison(want)
    assert_same_bits(silu_mul(gate, up), want)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", INTERS)
def test_silu_mul_fp8_on_cuda_is_the_formula_quantized_bit_for_bit(inter, rows, dtype, layout):
    gate, up = problem(rows, inter, dtype, layout, seed=inter + rows, device="cuda")
    want = quantize_activations(torch_formula(gate, up))
    poison(*want)
    assert_same_cast(silu_mul_fp8(gate, up), want)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_s_cuda_rounding_is_the_kernel_s(dtype):
    """Torch's CUDA F.silu(gate) * up is silu in fp32 (expf and IEEE division) rounded to the
    dtype, then the fp32 product rounded again: what the kernel computes."""
    gate, up = problem(300, 2048, dtype, seed=7, device="cuda")
    g = gate.float()
    silu = (g / (1 + torch.exp(-g))).to(dtype)
    assert_same_bits(torch_formula(gate, up), (silu.float() * up.float()).to(dtype))


@gpu
def test_the_kernels_on_cuda_take_any_layout():
    """Permuted leading dims and channels with a stride (copied first), mixed layouts."""
    gate, up = problem(40, 384, torch.bfloat16, "batched", seed=8, device="cuda")
    views = [
        (gate.transpose(0, 1), up.transpose(0, 1)),
        (gate[..., ::3], up[..., ::3]),
        (gate.contiguous(), up),
    ]
    for g, u in views:
        want = torch_formula(g, u)
        assert_same_bits(silu_mul(g, u), want)
        assert_same_cast(silu_mul_fp8(g, u), quantize_activations(want))


@gpu
def test_new_row_counts_compile_nothing_and_wait_for_nothing(monkeypatch):
    """After one call per layout, other row counts (decode batch sizes, a prefill) run the
    compiled kernels, and nothing waits for the device."""
    import triton

    for layout in ("separate", "chunked"):
        args = problem(7, 1408, torch.bfloat16, layout, device="cuda")
        silu_mul(*args), silu_mul_fp8(*args)  # compiles
    problems = [
        problem(rows, 1408, torch.bfloat16, layout, device="cuda")
        for layout in ("separate", "chunked")
        for rows in (1, 2, 16, 17, 300)
    ]
    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: compiled.append(kw))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for args in problems:
            silu_mul(*args), silu_mul_fp8(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [kw["repr"] for kw in compiled] == []


@gpu
@pytest.mark.parametrize("layout", ["separate", "batched"])
def test_captured_in_a_cuda_graph_and_replayed_with_new_values(layout):
    gate, up = problem(7, 1408, torch.bfloat16, layout, seed=1, device="cuda")
    silu_mul(gate, up), silu_mul_fp8(gate, up)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul(gate, up)
        cast = silu_mul_fp8(gate, up)
    for seed in (2, 3):
        for static, new in zip(
            (gate, up), problem(7, 1408, torch.bfloat16, layout, seed, "cuda"), strict=True
        ):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = torch_formula(gate, up)
        assert_same_bits(out, want)
        assert_same_cast(cast, quantize_activations(want))


@gpu
def test_opcheck_on_cuda():
    gate, up = problem(9, 300, torch.bfloat16, "batched", seed=3, device="cuda")
    args = gate[1:], up[1:]  # without the first row's NaNs, which opcheck refuses
    torch.library.opcheck(silu_mul, args)
    torch.library.opcheck(silu_mul_fp8, args)


if __name__ == "__main__":
    interpreted_checks()
