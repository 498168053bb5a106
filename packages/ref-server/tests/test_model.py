"""The model against transformers' DeepseekV3ForCausalLM (and DeepseekV32ForCausalLM) on the
same checkpoints (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.flop_counter import FlopCounterMode

import ref_server.model as M
from ep_comm.testing import run_ranks
from ref_server.model import CheckpointError, SamplingParams, StepBatch
from ref_server.model.sampling import sample

CONFIGS = {
    "q_lora, yarn, 4 groups choose 2": {},
    "no q_lora, plain rope, 1 group": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "2 dense layers, 2 groups choose 1, raw weights": dict(
        first_k_dense_replace=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    "all MoE, half-split rope": dict(first_k_dense_replace=0, rope_interleave=False),
    "V3.2, top 8": dict(v32=True),
    "V3.2, top 5, plain rope, all MoE": dict(
        v32=True,
        index_topk=5,
        first_k_dense_replace=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_match_transformers(name, checkpoints, tmp_path):
    hf = checkpoints.write(tmp_path, seed=len(name), **CONFIGS[name])
    ours = M.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(len(name)))
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(ours(ids), want, rtol=1e-4, atol=1e-5)

    # paged prefill then absorbed decode through mla_kernels (bf16 cache), step by step; V3.2's
    # index keys unquantized, as transformers keeps them
    prompts = [ids[0, :9].tolist(), ids[1, :4].tolist()]
    out, logits = ours.generate(
        prompts, SamplingParams(max_tokens=6), return_logits=True, index_dtype=torch.float32
    )
    for prompt, tokens, got in zip(prompts, out, logits, strict=True):
        ref = reference_logits(hf, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        assert (got - ref).abs().max() < 0.02 * ref.abs().max()
        assert tokens == ref.argmax(dim=-1).tolist()


def test_chunked_prefill_against_a_cache_matches_the_full_pass(checkpoints, tmp_path):
    hf = checkpoints.write(tmp_path, seed=3)
    ours = M.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = M.PagedKVCache(ours.args, num_blocks=4, page_size=16)
    table = torch.tensor([[3, 0, 2]], dtype=torch.int32)  # pages out of order
    done = 0
    for chunk in (13, 20, 7):
        batch = StepBatch(torch.tensor(tokens[done : done + chunk]), [chunk], [done + chunk], table)
        got = ours.forward_step(batch, cache)[0]
        done += chunk
        want = reference_logits(hf, tokens[:done])[-1]
        assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_forward_runs_any_mla_shape_but_paged_decode_needs_512_plus_64(checkpoints, tmp_path):
    hf = checkpoints.write(tmp_path, seed=4, kv_lora_rank=96, qk_rope_head_dim=16)
    ours = M.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours(ids), reference_logits(hf, ids[0].tolist())[None])
    with pytest.raises(ValueError, match="needs kv_lora_rank 512 and qk_rope_head_dim 64"):
        ours.generate([[2, 3]])


def test_fp8_block_scaled_checkpoint_loads_as_its_dequantized_weights(checkpoints, tmp_path):
    checkpoints.write(tmp_path / "bf16", seed=5)
    dequantized = checkpoints.to_fp8_sharded(tmp_path / "bf16", tmp_path / "fp8")
    plain = tmp_path / "dequantized"
    plain.mkdir()
    save_file(dequantized, plain / "model.safetensors")
    (plain / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    fp8 = M.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    reference = M.from_pretrained(plain, dtype=torch.float32)
    for (name, a), (_, b) in zip(
        fp8.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    original = dict(M.from_pretrained(tmp_path / "bf16", dtype=torch.float32).named_parameters())
    name = "layers.1.mlp.experts.down_proj"  # stacked: expert 2 is [2]
    weight, rounded = original[name][2], dict(fp8.named_parameters())[name][2]
    assert not torch.equal(weight, rounded)  # the FP8 weights really were rounded,
    assert (weight - rounded).abs().max() <= weight.abs().max() * 2**-4  # to e4m3 precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_gemms_match_the_expert_loop(dtype):
    """The GPU's grouped path (torch._grouped_mm over rows sorted by expert) against the loop,
    here on the CPU: some experts get no rows, some rows route to another rank (-1)."""
    experts = M.from_preset("tiny", seed=2, dtype=dtype).layers[1].mlp.experts
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 64, generator=g).to(dtype)
    ids = torch.randint(-1, 6, (37, 2), generator=g)  # experts 6 and 7 idle
    weights = torch.rand(37, 2, generator=g)
    looped, grouped = experts.looped(x, ids, weights), experts.grouped(x, ids, weights)
    assert looped[(ids < 0).all(dim=1)].abs().max() == 0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped, looped, rtol=tolerance, atol=tolerance)
    # an expert-parallel rank may receive no tokens at all
    assert experts.grouped(x[:0], ids[:0], weights[:0]).shape == (0, 64)


def test_generation_is_deterministic_and_seeded():
    model = M.from_preset("tiny", seed=1)
    prompts = [[5, 6, 7, 8], [9, 10]]
    greedy = model.generate(prompts, SamplingParams(max_tokens=8))
    assert greedy == model.generate(prompts, SamplingParams(max_tokens=8))
    assert all(len(t) == 8 for t in greedy)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=8, seed=11)
    first = model.generate(prompts, sampled)
    assert first == model.generate(prompts, sampled)
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=8, seed=12)
    assert model.generate(prompts, other) != first
    stop = greedy[0][2]
    stopped = model.generate(prompts[:1], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
    assert stopped == [greedy[0][: greedy[0].index(stop) + 1]]


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])


def draw(params: SamplingParams, n: int = 20_000, logits=LOGITS) -> torch.Tensor:
    """Token frequencies over n positions of one sequence."""
    tokens = sample(logits.expand(n, -1), [params] * n, list(range(n)))
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double() / n


@pytest.mark.parametrize(
    "params, probs",
    [
        (SamplingParams(temperature=1.0, seed=3), LOGITS.softmax(0)),
        (SamplingParams(temperature=0.5, seed=4), (LOGITS / 0.5).softmax(0)),
        (SamplingParams(temperature=1.0, top_k=2, seed=5), LOGITS[:2].softmax(0)),
        # probabilities .462 .280 .170 ...: the two best reach 0.6
        (SamplingParams(temperature=1.0, top_p=0.6, seed=6), LOGITS[:2].softmax(0)),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=7), LOGITS[:3].softmax(0)),
    ],
)
def test_sampling_follows_the_softmax_within_its_cut(params, probs):
    want = torch.zeros(LOGITS.numel(), dtype=torch.float64)
    want[: probs.numel()] = probs.double()
    got = draw(params)
    assert (got - want).abs().max() < 4 * (0.25 / 20_000) ** 0.5  # four standard errors


def test_sampling_depends_on_seed_and_position_only():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 300, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=s) for s in range(5)]
    positions = [3, 7, 7, 100, 2]
    together = sample(logits, params, positions)
    assert together == [
        sample(logits[i : i + 1], [p], [q])[0]
        for i, (p, q) in enumerate(zip(params, positions, strict=True))
    ]
    assert sample(logits, params, [q + 1 for q in positions]) != together
    greedy = [SamplingParams(), *params[1:]]
    assert sample(logits, greedy, positions)[0] == int(logits[0].argmax())


def test_a_greedy_batch_is_each_row_s_argmax_whatever_its_cuts():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(top_k=k, top_p=p) for k, p in [(0, 1), (1, 1), (5, 0.1)] * 2]
    assert sample(logits, params, list(range(6))) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-46, 1e-39, 1e-20, 9e-6])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    """Below it logits / temperature overflows float32, or the temperature underflows to 0 on
    its way to the device while noise is still added: either way the draw was noise."""
    logits = torch.randn(64, 300)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(63)]
    params.append(SamplingParams(temperature=1.0, seed=1))  # a sampled row beside them
    got = sample(logits, params, list(range(64)))
    assert got[:63] == logits[:63].argmax(dim=-1).tolist()


def test_stop_token_ids_are_kept_as_a_frozenset():
    params = SamplingParams(stop_token_ids=[7, 3, 7])
    assert params.stop_token_ids == frozenset({3, 7})
    assert isinstance(params.stop_token_ids, frozenset)


def test_prefill_flops_count_what_the_model_computes():
    """Against torch's FLOP counter on a full pass of the tiny model on the CPU: the matmuls
    within 1 % (norm weights are parameters but not matmuls), attention exactly (the CPU's
    SDPA multiplies whole T x T squares, prefill_flops counts the causal T (T + 1) / 2)."""
    model = M.from_preset("tiny", seed=0)
    args, t = model.args, 40
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(2, args.vocab_size, (1, t)))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) == {"aten.mm", "aten.bmm"}
    assert counts["aten.mm"] == pytest.approx(args.matmul_flops(t), rel=0.01)
    attention = args.prefill_flops(t) - args.matmul_flops(t)
    assert counts["aten.bmm"] == pytest.approx(attention * 2 * t / (t + 1), rel=1e-12)
    per_pair = attention / (t * (t + 1) / 2)
    assert args.prefill_flops(3, 5) - args.prefill_flops(3) == pytest.approx(
        15 * per_pair
    )  # 3 x 5 more


def test_prefill_flops_of_sparse_attention_count_the_picked_tokens_and_the_indexer():
    """V3.2: each new token attends to at most index_topk tokens in the absorbed form (576-wide
    scores, 512-wide values a head) and its indexer scores every token of its context (64
    heads of 128 a layer): against a sum over the tokens, before, across and past the top-k."""
    args = M.PRESETS["v3.2"]
    layers, heads = args.num_hidden_layers, args.num_attention_heads
    for new, cached in ((100, 0), (3000, 0), (1000, 1500), (500, 5000), (1, 100_000)):
        contexts = range(cached + 1, cached + new + 1)
        picked = sum(min(c, 2048) for c in contexts)
        want = 2 * layers * (heads * (576 + 512) * picked + 64 * 128 * sum(contexts))
        assert args.prefill_flops(new, cached) - args.matmul_flops(new) == want


def test_attention_flops_of_absorbed_decode_are_flashmlas_count():
    """A decode token attending over the latent cache (absorbed: 576-wide scores, 512-wide
    values a head) costs what FlashMLA's benchmark counts, 2 h_q seqlen (576 + 512) a layer; on
    decompressed heads 2 h_q seqlen (192 + 128); V3.2 attends absorbed over its top 2,048 either
    way and its indexer scores the whole context (64 heads of 128)."""
    v3, v32 = M.PRESETS["v3"], M.PRESETS["v3.2"]
    for seqlen in (1, 4_989, 131_072):
        absorbed = 61 * 2 * 128 * seqlen * (576 + 512)
        assert v3.attention_flops(1, seqlen - 1, absorbed=True) == absorbed
        assert v3.attention_flops(1, seqlen - 1) == 61 * 2 * 128 * seqlen * (192 + 128)
        sparse = 61 * 2 * (128 * min(seqlen, 2048) * (576 + 512) + 64 * 128 * seqlen)
        assert v32.attention_flops(1, seqlen - 1) == sparse
        assert v32.attention_flops(1, seqlen - 1, absorbed=True) == sparse


def test_presets_and_their_sizes():
    assert M.PRESETS["v3"].num_parameters() == pytest.approx(671e9, rel=0.01)
    assert M.PRESETS["v3"].num_parameters(active=True) == pytest.approx(37e9, rel=0.02)
    assert M.PRESETS["v2-lite"].num_parameters() == pytest.approx(15.7e9, rel=0.01)
    tiny = M.from_preset("tiny", seed=0)
    counted = sum(t.numel() for t in [*tiny.parameters(), *tiny.buffers()])
    assert counted == tiny.args.num_parameters()
    assert tiny(torch.tensor([[3, 4, 5]])).shape == (1, 3, tiny.args.vocab_size)
    again = M.from_preset("tiny", seed=0)
    assert all(
        torch.equal(a, b) for a, b in zip(tiny.parameters(), again.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        M.from_preset("huge")


def test_tokenizers(checkpoints, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = M.from_preset("tiny")
    text = "MoE, très bien"
    assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
    vocab = {"[UNK]": 0, "hello": 5, "world": 9}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    checkpoints.write(tmp_path, seed=6)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = M.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.tokenizer.encode("hello world", add_special_tokens=False) == [5, 9]
    assert loaded.tokenizer.encode("hello world") == [0, 5, 9]  # config.json's bos_token_id


def test_bad_checkpoints_are_named(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        M.from_pretrained(tmp_path / "nowhere")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        M.from_pretrained(tmp_path / "empty")

    good = tmp_path / "good"
    checkpoints.write(good, seed=7)
    tensors = load_file(good / "model.safetensors")
    config = json.loads((good / "config.json").read_text())

    def variant(name: str, tensors=tensors, **changes) -> Path:
        path = tmp_path / name
        path.mkdir()
        save_file(tensors, path / "model.safetensors")
        (path / "config.json").write_text(json.dumps(config | changes))
        return path

    missing = dict(tensors)
    del missing["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.mlp\.experts\.3\.up"):
        M.from_pretrained(variant("missing", missing))
    with pytest.raises(CheckpointError, match=r"shape: model\.layers\.0\.mlp\.gate_proj\.weight"):
        M.from_pretrained(variant("shape", intermediate_size=100))
    with pytest.raises(ValueError, match="only sigmoid"):
        M.from_pretrained(variant("softmax", scoring_func="softmax"))
    with pytest.raises(ValueError, match="not divisible by n_group"):
        M.from_pretrained(variant("groups", n_group=3))
    fp8 = dict(tensors)
    fp8["model.layers.0.mlp.up_proj.weight"] = fp8["model.layers.0.mlp.up_proj.weight"].to(
        torch.float8_e4m3fn
    )
    with pytest.raises(CheckpointError, match=r"is FP8 but .*up_proj\.weight_scale_inv"):
        M.from_pretrained(variant("fp8", fp8))
    sharded = variant("sharded")
    index = {"weight_map": dict.fromkeys(tensors, "model-00002-of-00002.safetensors")}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"names model-00002-of-00002\.safetensors"):
        M.from_pretrained(sharded)


def test_generation_arguments_are_checked():
    model = M.from_preset("tiny")
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([[]])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        model.generate([[600]])
    for bad, match in (
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_expert_parallel_over_two_gloo_ranks_matches_one_process(checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=8)
    scenarios = str(Path(__file__).with_name("model_scenarios.py"))
    run_ranks(2, scenarios, "expert_parallel_matches_one_process", str(tmp_path), limit=300)
    run_ranks(2, scenarios, "an_idle_rank_serves_its_experts", str(tmp_path), limit=300)
