"""The FP8 cast of activations (`ref_server::fp8_cast_activations`): on the CPU, its default
implementation against ep_comm's `per_token_cast_to_fp8`, argument checks, shapes from its fake
implementation and opcheck; its Triton kernel bit for bit against the same, on the CPU through
Triton's interpreter (where triton is installed) and on the GPU (`gpu` marker, both roundings
to e4m3), with CUDA graph replays of new values."""

from __future__ import annotations

import math

import pytest
import torch

from ep_comm.fp8 import per_token_cast_to_fp8
from ref_server.kernels.fp8_cast import blocks, cast_activations, triton_cast_activations

gpu = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_token_cast_to_fp8` on x `[..., k]`'s rows with zeros appended to whole groups:
    values e4m3 `[..., k]`, scales fp32 `[..., ceil(k/128)]`."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    padding = rows.new_zeros(rows.shape[0], blocks(k) * 128 - k)
    values, scales = per_token_cast_to_fp8(torch.cat([rows, padding], 1))
    return values[:, :k].reshape(x.shape), scales.reshape(*x.shape[:-1], blocks(k))


def assert_same_cast(got, want) -> None:
    """Values and scales bit for bit, but for the sign bits of NaNs."""
    (values, scales), (want_values, want_scales) = got, want
    assert values.dtype == FP8 and values.shape == want_values.shape
    assert scales.dtype == torch.float32 and scales.shape == want_scales.shape
    bits, want_bits = values.view(torch.uint8), want_values.view(torch.uint8)
    nan = (want_bits & 0x7F) == 0x7F  # e4m3's NaNs
    unsigned = torch.where(nan, bits & 0x7F, bits), torch.where(nan, want_bits & 0x7F, want_bits)
    mismatches = (unsigned[0] != unsigned[1]).sum().item()
    assert mismatches == 0, f"{mismatches} of {bits.numel()} values differ"
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0, equal_nan=True)


def e4m3_ties() -> torch.Tensor:
    """128 values of amax 448 (so that the scale is exactly 1): 448, -448 and the midpoints of
    all consecutive non-negative e4m3 values, alternately negated (values exactly on ties)."""
    finite = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()
    midpoints = (finite[:-1] + finite[1:]) / 2
    signs = 1 - 2 * (torch.arange(midpoints.numel()) % 2)
    return torch.cat([torch.tensor([448.0]), midpoints * signs, torch.tensor([-448.0])])


def hard_inputs(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x of shape `[..., k]` in dtype, its 128-channel groups of these kinds in turn along each
    row: normal values scaled by the group's own power of two in [2^-12, 2^12] (four in
    eight); each value scaled by its own power of two down to 2^-14 (e4m3 subnormals); zeros;
    1e-6 times normal values (under the amax floor); `e4m3_ties`."""
    g = torch.Generator().manual_seed(seed)
    rows, k = math.prod(shape[:-1]), shape[-1]
    groups = blocks(k)
    spread = torch.exp2(torch.randint(-12, 13, (rows, groups, 1), generator=g).float())
    x = torch.randn(rows, groups, 128, generator=g) * spread
    wide = torch.randn(rows, groups, 128, generator=g)
    wide *= torch.exp2(torch.randint(-14, 1, (rows, groups, 128), generator=g).float())
    tiny = torch.randn(rows, groups, 128, generator=g) * 1e-6
    kinds = ((torch.arange(rows)[:, None] + torch.arange(groups)) % 8)[..., None]
    x = torch.where(kinds == 4, wide, x)
    x = torch.where(kinds == 5, 0.0, x)
    x = torch.where(kinds == 6, tiny, x)
    x = torch.where(kinds == 7, e4m3_ties(), x)
    return x.flatten(1)[:, :k].to(dtype).reshape(shape)


def rounding_inputs(rows: int, seed: int) -> torch.Tensor:
    """fp32 `[rows, 7168]` of random bit patterns with magnitudes up to 448 (every binade,
    fp32 subnormals included) and random signs, each group's first value 448: the scales are
    1, so the values are the inputs rounded to e4m3."""
    g = torch.Generator().manual_seed(seed)
    top = torch.tensor(448.0).view(torch.int32).item()
    bits = torch.randint(0, top + 1, (rows, 56, 128), generator=g, dtype=torch.int32)
    signs = torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) << 31
    x = (bits | signs).view(torch.float32)
    x[..., 0] = 448.0
    return x.flatten(1)


def special_inputs() -> torch.Tensor:
    """fp32 `[4, 300]` with a NaN, an infinity of either sign and a group of one NaN among
    normal values elsewhere."""
    x = hard_inputs((4, 300), torch.float32, seed=11)
    x[0, 5] = float("nan")
    x[1, 130] = float("inf")
    x[2, 299] = -float("inf")
    x[3, 0:128] = 1.0
    x[3, 64] = float("nan")
    return x


# ---- CPU: the default implementation ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", [(1, 128), (7, 256), (300, 7168)])
def test_the_default_implementation_is_per_token_cast_to_fp8(rows, k, dtype):
    x = hard_inputs((rows, k), dtype, seed=rows + k)
    assert_same_cast(cast_activations(x), per_token_cast_to_fp8(x))


@pytest.mark.parametrize("shape", [(7, 300), (2, 3, 130), (5, 1), (1, 7000)])
def test_the_default_implementation_pads_a_partial_last_group_with_zeros(shape):
    x = hard_inputs(shape, torch.bfloat16, seed=sum(shape))
    assert_same_cast(cast_activations(x), reference(x))


@pytest.mark.parametrize("shape", [(0, 7168), (2, 0, 300), (3, 0)])
def test_empty_inputs_give_empty_outputs(shape):
    values, scales = cast_activations(torch.empty(shape, dtype=torch.bfloat16))
    assert values.shape == shape and values.dtype == FP8
    assert scales.shape == (*shape[:-1], blocks(shape[-1])) and scales.dtype == torch.float32


def test_nans_and_infinities_as_in_torch():
    x = special_inputs()
    assert_same_cast(cast_activations(x), reference(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 256), (2, 3, 300)])
def test_opcheck_on_cpu(shape, dtype):
    torch.library.opcheck(cast_activations, (hard_inputs(shape, dtype, seed=3),))


def test_the_fake_implementation_gives_the_output_shapes():
    values, scales = cast_activations(torch.empty(2, 5, 300, dtype=torch.bfloat16, device="meta"))
    assert values.device.type == "meta" and values.shape == (2, 5, 300) and values.dtype == FP8
    assert scales.shape == (2, 5, 3) and scales.dtype == torch.float32


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(
    "x, message",
    [
        (torch.ones(4, 128, dtype=torch.int32), "x must be one of .* got torch.int32"),
        (torch.ones(4, 128, dtype=torch.float64), "x must be one of .* got torch.float64"),
        (torch.ones(4, 128).to(FP8), "x must be one of .* got torch.float8_e4m3fn"),
        (torch.tensor(1.0), r"x must be \[..., k\], got a scalar"),
    ],
)
def test_bad_inputs_are_a_value_error_naming_the_problem(x, message, device):
    with pytest.raises(ValueError, match=message):
        cast_activations(x.to(device))


def test_the_native_cast_is_refused_off_hopper():
    with pytest.raises(ValueError, match="native_cast needs an NVIDIA GPU of sm90"):
        triton_cast_activations(torch.ones(4, 128), native_cast=True)


# ---- the Triton kernel on the CPU, through Triton's interpreter ----


def test_the_kernel_in_triton_s_interpreter(in_triton_interpreter):
    """`interpreted_checks`, in Triton's interpreter."""
    in_triton_interpreter(__file__)


# rows and k, and the dtypes tried at them: 300 x 7168 takes the interpreter seconds a dtype
INTERPRETED = [((rows, k), DTYPES) for rows in (1, 7, 300) for k in (128, 300, 7168)]
INTERPRETED[-1] = ((300, 7168), [torch.bfloat16])


def interpreted_checks():
    """The kernel (rounding to e4m3 with integer arithmetic) against `reference`: every shape
    of INTERPRETED, the rounding of random fp32 bit patterns, NaNs and infinities, leading
    dimensions, rows with a stride, a transposed input, no rows."""
    for shape, dtypes in INTERPRETED:
        for dtype in dtypes:
            x = hard_inputs(shape, dtype, seed=sum(shape))
            assert_same_cast(triton_cast_activations(x), reference(x))
    for x in (rounding_inputs(64, seed=4), special_inputs()):
        assert_same_cast(triton_cast_activations(x), reference(x))
    x = hard_inputs((2, 3, 300), torch.bfloat16, seed=5)
    assert_same_cast(triton_cast_activations(x), reference(x))
    x = hard_inputs((20, 384), torch.bfloat16, seed=6)
    for view in (x[::3], x[:, :300], x[:, :128].t()):
        assert_same_cast(triton_cast_activations(view), reference(view))
    values, scales = triton_cast_activations(torch.empty(0, 7168, dtype=torch.bfloat16))
    assert values.shape == (0, 7168) and scales.shape == (0, 56)


# ---- the GPU ----

GPU_SHAPES = [(rows, k) for rows in (1, 7, 300) for k in (128, 300, 7168)] + [
    (4096, 7168),  # a prefill's hidden states
    (2048, 18432),  # a dense MLP's intermediate
    (513, 1536),  # q_lora_rank, rows past a whole tile
]


@gpu
@pytest.mark.parametrize("native_cast", [None, False], ids=["default", "integer-rounding"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", GPU_SHAPES)
def test_the_kernel_is_the_reference_bit_for_bit_on_cuda(rows, k, dtype, native_cast):
    x = hard_inputs((rows, k), dtype, seed=rows + k).cuda()
    assert_same_cast(triton_cast_activations(x, native_cast=native_cast), reference(x))


@gpu
@pytest.mark.parametrize("native_cast", [None, False], ids=["default", "integer-rounding"])
def test_rounding_nans_and_infinities_on_cuda(native_cast):
    for x in (rounding_inputs(512, seed=7).cuda(), special_inputs().cuda()):
        assert_same_cast(triton_cast_activations(x, native_cast=native_cast), reference(x))


@gpu
def test_the_operator_on_cuda_takes_any_layout():
    x = hard_inputs((2, 3, 300), torch.bfloat16, seed=8).cuda()
    assert_same_cast(cast_activations(x), reference(x))
    x = hard_inputs((40, 384), torch.bfloat16, seed=9).cuda()
    for view in (x[::3], x[:, :300], x[:, :128].t()):
        assert_same_cast(cast_activations(view), reference(view))
    values, scales = cast_activations(torch.empty(0, 7168, dtype=torch.bfloat16, device="cuda"))
    assert values.shape == (0, 7168) and scales.shape == (0, 56)


@gpu
def test_captured_in_a_cuda_graph_and_replayed_with_new_values():
    x = hard_inputs((300, 7168), torch.bfloat16, seed=1).cuda()
    cast_activations(x)  # compiles the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cast_activations(x)
    new = hard_inputs((300, 7168), torch.bfloat16, seed=2).cuda()
    x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_cast(out, reference(new))


@gpu
def test_opcheck_on_cuda():
    torch.library.opcheck(cast_activations, (hard_inputs((2, 3, 300), torch.bfloat16, 3).cuda(),))


if __name__ == "__main__":
    interpreted_checks()
