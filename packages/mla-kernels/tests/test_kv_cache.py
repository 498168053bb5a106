import pytest
import torch

import mla_kernels
from mla_kernels.fp8_layout import E4M3_MAX, FP8_TOKEN_BYTES, dequantize_fp8, quantize_fp8


def test_bf16_write_round_trips_exactly(generator):
    cache = torch.full((4, 16, 2, 576), float("nan"), dtype=torch.bfloat16)
    latent = torch.randn(5, 2, 512, generator=generator)
    rope = torch.randn(5, 2, 64, generator=generator)
    slots = torch.tensor([63, 0, 17, 40, 5])
    mla_kernels.write_kv_cache(cache, latent, rope, slots)
    flat = cache.view(64, 2, 576)
    assert torch.equal(flat[slots, :, :512], latent.bfloat16())
    assert torch.equal(flat[slots, :, 512:], rope.bfloat16())
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert flat[untouched].isnan().all()


def test_single_kv_head_accepts_2d_inputs(generator):
    cache = torch.zeros(2, 64, 1, 576, dtype=torch.float16)
    latent, rope = torch.randn(3, 512, generator=generator), torch.randn(3, 64, generator=generator)
    mla_kernels.write_kv_cache(cache, latent, rope, torch.tensor([1, 64, 127], dtype=torch.int32))
    assert torch.equal(cache.view(128, 576)[64, :512], latent[1].half())


def test_fp8_write_stays_within_e4m3_rounding(generator):
    cache = torch.zeros(2, 32, 1, FP8_TOKEN_BYTES, dtype=torch.float8_e4m3fn)
    # Mixed magnitudes per 128-group, including values far below the group's maximum.
    latent = torch.randn(7, 1, 512, generator=generator) * torch.logspace(-3, 2, 512)
    rope = torch.randn(7, 1, 64, generator=generator)
    slots = torch.arange(7) * 9
    mla_kernels.write_kv_cache(cache, latent, rope, slots, is_fp8_kvcache=True)
    restored = dequantize_fp8(cache.view(64, 1, FP8_TOKEN_BYTES)[slots])
    scales = latent.view(7, 1, 4, 128).abs().amax(-1).clamp(min=1e-4) / E4M3_MAX
    scale = scales.repeat_interleave(128, dim=-1)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a normal value; below 2**-6 (in units
    # of the scale) the steps are a fixed 2**-9.
    bound = torch.maximum(latent.abs() / 16, scale * 2**-10) * 1.0001
    assert ((restored[..., :512] - latent).abs() <= bound).all()
    assert torch.equal(restored[..., 512:], rope.bfloat16().float())
    group_max = restored[..., :512].view(7, 1, 4, 128).abs().amax(-1)
    torch.testing.assert_close(
        group_max, latent.view(7, 1, 4, 128).abs().amax(-1), rtol=1 / 16, atol=0
    )


def test_fp8_layout_bytes():
    latent = torch.zeros(1, 512)
    latent[0, 130] = -896.0  # group 1's amax: scale 2.0, stored as -448
    packed = quantize_fp8(latent, torch.full((1, 64), 1.5)).view(torch.uint8)[0]
    assert packed.shape == (656,)
    assert packed[130].item() == 0xFE  # e4m3 -448
    scales = packed[512:528].view(torch.float32)
    assert scales.tolist() == pytest.approx([1e-4 / 448, 2.0, 1e-4 / 448, 1e-4 / 448])
    assert packed[528:].view(torch.bfloat16).float().eq(1.5).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"slots": torch.tensor([0, 64])},
            "slot_mapping\\[1\\] = 64 is outside the cache's 64 slots",
        ),
        ({"slots": torch.tensor([-1, 3])}, "slot_mapping\\[0\\] = -1 is outside"),
        ({"slots": torch.tensor([[0, 1]])}, "slot_mapping must be a 1-D int32/int64 tensor"),
        ({"slots": torch.tensor([0.0, 1.0])}, "slot_mapping must be a 1-D int32/int64 tensor"),
        ({"latent": torch.zeros(2, 1, 500)}, "latent must be \\[2, 1, 512\\]"),
        ({"rope": torch.zeros(3, 1, 64)}, "rope must be \\[2, 1, 64\\]"),
        (
            {"cache": torch.zeros(1, 64, 1, 512, dtype=torch.bfloat16)},
            "k_cache must be a contiguous",
        ),
        ({"cache": torch.zeros(1, 64, 1, 576)}, "k_cache must be bfloat16 or float16"),
        ({"fp8": True}, "k_cache must be a contiguous \\[num_blocks, page_size, h_kv, 656\\]"),
    ],
)
def test_write_errors_name_the_problem(change, message):
    args = {
        "cache": torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16),
        "latent": torch.zeros(2, 1, 512),
        "rope": torch.zeros(2, 1, 64),
        "slots": torch.tensor([0, 1]),
        "fp8": False,
    } | change
    with pytest.raises(ValueError, match=message):
        mla_kernels.write_kv_cache(
            args["cache"], args["latent"], args["rope"], args["slots"], args["fp8"]
        )
