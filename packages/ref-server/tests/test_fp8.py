"""FP8 weights (CPU): the block and per-token quantization, the block-scaled GEMM against
float64, the loader keeping FP8 checkpoints in FP8, the FP8 model against bf16, the weight
bytes per GPU, and expert parallelism in FP8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ref_server.model as M
from ep_comm.fp8 import per_token_cast_to_fp8
from ep_comm.testing import run_ranks
from ref_server.kernels.fp8_cast import (
    dequantize_activations,
    dequantize_blocks,
    quantize_activations,
    quantize_blocks,
)
from ref_server.model import ModelArgs
from ref_server.model.checkpoint import checkpoint_tensors
from ref_server.model.fp8 import FP8Experts, FP8Linear, fp8_block_gemm

# e4m3 keeps 3 mantissa bits: rounding is within 2^-4 of a normal value, and within half the
# subnormal step (2^-10 in units of the scale) below 2^-6.
RELATIVE, SUBNORMAL = 2**-4, 2**-10


def within_e4m3_rounding(x: torch.Tensor, rounded: torch.Tensor, scale: torch.Tensor) -> bool:
    """rounded (fp32) is x (float64) rounded to e4m3 in units of scale (expanded to x's shape)."""
    bound = torch.maximum(x.abs() * RELATIVE, scale * SUBNORMAL)
    return bool(((rounded.double() - x).abs() <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("shape", [(130, 64), (3, 200, 300), (256, 128)])
def test_block_quantization_saturates_each_block_and_round_trips(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)
    w[..., :5, :7] *= 1000  # one block far larger than the others
    values, scale_inv = quantize_blocks(w)
    blocks = (-(-shape[-2] // 128), -(-shape[-1] // 128))
    assert values.dtype == torch.float8_e4m3fn and values.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (*shape[:-2], *blocks)
    # every block's largest value lands on 448, the largest finite e4m3
    per_block = quantize_blocks(values.float())[1] * 448  # each block's amax
    torch.testing.assert_close(per_block, torch.full_like(per_block, 448.0))
    expanded = dequantize_blocks(torch.ones_like(values), scale_inv).double()
    assert within_e4m3_rounding(w, dequantize_blocks(values, scale_inv), expanded)


def test_activations_are_quantized_per_token_and_128_channels():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 300, generator=g) * torch.rand(2, 5, 1, generator=g) * 10
    values, scales = quantize_activations(x)
    assert values.shape == x.shape and scales.shape == (2, 5, 3)
    expanded = dequantize_activations(torch.ones_like(values), scales).double()
    assert within_e4m3_rounding(x.double(), dequantize_activations(values, scales), expanded)
    # the cast is ep_comm's, bit for bit, where the width is a multiple of 128
    whole = x[..., :256].reshape(10, 256)
    (ours, our_scales), (theirs, their_scales) = (
        quantize_activations(whole),
        per_token_cast_to_fp8(whole),
    )
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(our_scales, their_scales)


def test_no_rows_quantize_and_multiply_to_empty_tensors():
    """An expert-parallel rank without tokens runs its FP8 layers on 0 rows."""
    values, scales = quantize_activations(torch.empty(0, 300))
    assert values.shape == (0, 300) and scales.shape == (0, 3)
    layer = FP8Linear(300, 70)
    layer.weight, layer.weight_scale_inv = quantize_blocks(torch.randn(70, 300))
    assert layer(torch.empty(0, 300)).shape == (0, 70)


def float64_reference(x_fp8, x_scales, w_fp8, w_scales) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        dequantize_activations(x_fp8, x_scales).double(),
        dequantize_blocks(w_fp8, w_scales).double(),
    )


@pytest.mark.parametrize("m, k, n", [(7, 300, 200), (33, 128, 256), (1, 1000, 70)])
def test_fp8_block_gemm_matches_float64_on_the_dequantized_operands(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = quantize_activations(torch.randn(2, m, k, generator=g))
    w = quantize_blocks(torch.randn(n, k, generator=g) * 0.1)
    a, b = float64_reference(*x, *w)

    def close(got, want):  # fp32 accumulation: relative to the sum of the terms' magnitudes
        assert got.dtype == torch.float32
        terms = a.abs().amax() * b.abs().amax() * k
        assert (got.double() - want).abs().max() <= 1e-5 * terms

    close(fp8_block_gemm(*x, *w, out_dtype=torch.float32), a @ b.T)  # a linear layer

    experts = quantize_blocks(torch.randn(3, n, k, generator=g))
    packed = quantize_activations(torch.randn(3, m, k, generator=g))
    pa, pb = float64_reference(*packed, *experts)
    close(fp8_block_gemm(*packed, *experts, out_dtype=torch.float32), pa @ pb.transpose(1, 2))

    rows = quantize_activations(torch.randn(2 * m + 3, k, generator=g))  # 3 rows past the groups
    offsets = torch.tensor([m, m, 2 * m], dtype=torch.int32)  # expert 1 gets no rows
    grouped = fp8_block_gemm(*rows, *experts, offsets, torch.float32)
    ra, rb = float64_reference(*rows, *experts)
    close(grouped[:m], ra[:m] @ rb[0].T)
    close(grouped[m : 2 * m], ra[m : 2 * m] @ rb[2].T)


def test_the_loader_keeps_fp8_checkpoints_in_fp8_and_quantizes_bf16_ones_alike(
    checkpoints, tmp_path
):
    checkpoints.write(tmp_path / "bf16", seed=5)
    checkpoints.to_fp8_sharded(tmp_path / "bf16", tmp_path / "fp8")
    stored = {}
    for shard in (tmp_path / "fp8").glob("*.safetensors"):
        stored |= load_file(shard)
    model = M.from_pretrained(tmp_path / "fp8", dtype=torch.float32, weight_dtype="fp8")

    attention = model.layers[0].self_attn
    for name in ("qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj"):
        assert isinstance(getattr(attention, name), FP8Linear)
    views = {name: (weight, scale) for name, weight, scale in checkpoint_tensors(model)}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        checkpoint = f"model.layers.0.self_attn.{name}.weight"
        weight, scale = views[checkpoint]
        assert torch.equal(weight.view(torch.uint8), stored[checkpoint].view(torch.uint8))
        assert torch.equal(scale, stored[checkpoint + "_scale_inv"])
    # q_a_proj's 48 rows, zeros up to the next 128-row block, kv_a_proj_with_mqa's 576
    fused = attention.qkv_a_proj
    assert fused.row_parts.at == {"q_a_proj": (0, 48), "kv_a_proj_with_mqa": (128, 576)}
    assert fused.weight.shape == (704, 64) and fused.weight_scale_inv.shape == (6, 1)
    assert not fused.weight[48:128].view(torch.uint8).any()
    assert model.layers[0].mlp.down_proj.weight_scale_inv.shape == (1, 1)  # [64, 96]
    assert model.layers[0].self_attn.kv_b_proj.weight_scale_inv.shape == (2, 4)  # [224, 512]
    moe = model.layers[1].mlp
    assert isinstance(moe.experts, FP8Experts)
    assert isinstance(moe.shared_experts.gate_up_proj, FP8Linear)
    for name in ("gate_proj", "up_proj", "down_proj"):
        checkpoint = f"model.layers.1.mlp.experts.5.{name}.weight"
        weight, scale = views[checkpoint]
        assert torch.equal(weight.view(torch.uint8), stored[checkpoint].view(torch.uint8))
        assert torch.equal(scale, stored[checkpoint + "_scale_inv"])
    # each expert's gate_proj (32 rows), zeros up to the next 128-row block, its up_proj
    assert moe.experts.gate_up_parts.at == {"gate_proj": (0, 32), "up_proj": (128, 32)}
    assert not moe.experts.gate_up_proj[:, 32:128].view(torch.uint8).any()
    assert moe.experts.down_proj_scale_inv.shape == (8, 1, 1)
    for kept in (model.embed_tokens.weight, model.lm_head.weight, moe.gate.weight):
        assert kept.dtype == torch.float32

    quantized = M.from_pretrained(tmp_path / "bf16", dtype=torch.float32, weight_dtype="fp8")
    for (name, a), (_, b) in zip(
        quantized.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name

    ids = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(5))
    dense = M.from_pretrained(tmp_path / "fp8", dtype=torch.float32)  # the weights dequantized
    want = dense(ids)
    assert (model(ids) - want).abs().max() < 0.1 * (want.max() - want.min())
    with pytest.raises(ValueError, match="weight_dtype 'int4'"):
        M.from_pretrained(tmp_path / "fp8", weight_dtype="int4")


# hidden 256: whole 128-channel groups; kv_lora 512 + rope 64: decode through mla_kernels
ACCURACY = ModelArgs(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    q_lora_rank=128,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    rope_factor=1.0,
    max_position_embeddings=1024,
)


@torch.no_grad()
def test_fp8_weights_against_bf16_on_the_same_random_weights():
    """bf16 generates 300 greedy tokens; over them both models' logits (full pass): the FP8
    error is a few percent of the logit range and most greedy choices agree (docs/model.md
    gives the measured figures; bf16 itself against fp32 is the yardstick)."""
    bf16 = M.from_args(ACCURACY, seed=0, dtype=torch.bfloat16)
    fp8 = M.from_args(ACCURACY, seed=0, dtype=torch.bfloat16, weight_dtype="fp8")
    prompt = [3, 14, 15, 92, 65]
    tokens = bf16.generate([prompt], M.SamplingParams(max_tokens=300))[0]
    ids = torch.tensor([prompt + tokens])
    want, got = bf16(ids)[0, len(prompt) - 1 :], fp8(ids)[0, len(prompt) - 1 :]
    error = (got - want).abs().amax(dim=-1) / (want.amax(dim=-1) - want.amin(dim=-1))
    agree = (got.argmax(dim=-1) == want.argmax(dim=-1)).float().mean()
    assert error.median() < 0.04 and error.max() < 0.35, (error.median(), error.max())
    assert agree > 0.75, agree


def test_weight_bytes_per_gpu():
    """The checkpoint's tensors (the tiny model's stacked FP8 layers hold padding rows too,
    between parts that do not fill 128-row blocks; V2-Lite's and V3's parts fill them)."""
    tiny = M.from_preset("tiny", weight_dtype="fp8")
    views = [view for _, view, _ in checkpoint_tensors(tiny)]
    fp8 = sum(v.numel() for v in views if v.dtype == torch.float8_e4m3fn)
    rest = sum(v.numel() for v in views if v.dtype != torch.float8_e4m3fn)
    args = tiny.args
    assert args.weight_bytes_per_gpu(1, "bf16") == 2 * args.num_parameters() == 2 * (fp8 + rest)
    assert args.weight_bytes_per_gpu(1, "fp8") == round(fp8 * (1 + 4 / 128**2)) + 2 * rest
    routed = 2 * args.n_routed_experts * args.expert_parameters()  # 2 MoE layers
    assert args.weight_bytes_per_gpu(1) - args.weight_bytes_per_gpu(4) == 2 * routed * 3 // 4

    v3, h200 = M.PRESETS["v3"], 141e9
    assert v3.weight_bytes_per_gpu(8, "bf16") > h200  # 198 GB
    assert v3.weight_bytes_per_gpu(8, "fp8") < h200 - 35e9  # 101 GB: room for the KV cache
    with pytest.raises(ValueError, match="expected 'bf16' or 'fp8'"):
        v3.weight_bytes_per_gpu(8, "fp4")


def test_fp8_expert_parallel_over_two_gloo_ranks_matches_one_process(checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=8)
    scenarios = str(Path(__file__).with_name("model_scenarios.py"))
    run_ranks(2, scenarios, "fp8_expert_parallel_matches_one_process", str(tmp_path), limit=300)
