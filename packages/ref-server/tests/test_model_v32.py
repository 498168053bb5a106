"""DeepSeek-V3.2's sparse attention: the tokens the lightning indexer picks against
transformers' DeepseekV32ForCausalLM, sparse against dense attention, FP8 index keys against
exact ones, V3.2's config and checkpoints (CPU). Logits against transformers: test_model.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import ref_server.model as M
from overlap_sched.executor import OpFailed
from ref_server.model import StepBatch, attention, indexer
from ref_server.model.args import ModelArgs
from ref_server.model.fp8 import FP8Linear
from ref_server.model.indexer import hadamard, index_scores


def transformers_choices(hf, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's indexer's picks `[t, topk]` for one sequence ids `[t]`, in transformers'
    full pass."""
    picks = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, i, out: picks.append(out[0]))
        for layer in hf.model.layers
    ]
    with torch.no_grad():
        hf(ids[None])
    for hook in hooks:
        hook.remove()
    return picks


def record_choices(monkeypatch) -> list:
    """Appends, for every call of `indexer_topk` (a layer of a cached step), the slots it picked
    `[n, topk]` and the scores of every slot of the block table `[n, slots]`."""
    calls = []
    picked = attention.indexer_topk

    def recorded(q, weights, index_keys, block_table, positions, topk):
        slots = picked(q, weights, index_keys, block_table, positions, topk)
        page = index_keys.page_size
        every = torch.arange(block_table.shape[1] * page)
        rows = index_keys.rows(block_table[:, every // page].long() * page + every % page)
        calls.append((slots, index_scores(q[:, None], weights[:, None], rows).squeeze(1)))
        return slots

    monkeypatch.setattr(attention, "indexer_topk", recorded)
    return calls


def assert_same_picks(ours: torch.Tensor, scores: torch.Tensor, theirs, position: int, tolerance):
    """One query's picks: ours (slots = positions here, -1 unused) and transformers' (which fill
    topk with masked positions past the query's) differ only in tokens whose score (ours) is
    within tolerance of the last one picked: ties, up to rounding."""
    mine = set(ours[ours >= 0].tolist())
    reference = {p for p in theirs.tolist() if p <= position}
    assert len(mine) == len(reference) == min(len(ours), position + 1)
    last = scores[sorted(mine, key=lambda p: scores[p])[0]]
    for p in mine ^ reference:
        assert abs(scores[p] - last) <= tolerance, (position, p, mine ^ reference)


def test_chosen_tokens_match_transformers_in_prefill_and_decode(checkpoints, tmp_path, monkeypatch):
    hf = checkpoints.write(tmp_path, seed=11, v32=True)
    ours = M.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(2, 300, (30,), generator=torch.Generator().manual_seed(11))
    theirs = transformers_choices(hf, tokens)

    # the full pass: the same picks as its mask
    masks = []
    for layer in ours.layers:
        layer.self_attn.indexer.register_forward_hook(lambda m, i, out: masks.append(out[0]))
    with torch.no_grad():
        ours(tokens[None])
    for mask, picks in zip(masks, theirs, strict=True):
        for p in range(len(tokens)):
            assert set(mask[p].nonzero().squeeze(1).tolist()) == {
                i for i in picks[p].tolist() if i <= p
            }

    # cached: prefill in two chunks, then decode token by token; slot = position (one sequence
    # on pages 0 and 1 in order). An fp16 latent cache rounds the later layers' inputs less
    # than bf16, so that picks differ only at closer ties.
    calls = record_choices(monkeypatch)
    cache = M.PagedKVCache(ours.args, 2, 16, torch.float16, index_dtype=torch.float32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    done, query_positions = 0, []
    for n in (7, 5, *[1] * 18):
        batch = StepBatch(tokens[done : done + n], [n], [done + n], table)
        ours.forward_step(batch, cache)
        query_positions += [range(done, done + n)] * len(ours.layers)
        done += n
    assert len(calls) == len(query_positions)
    for step, ((slots, scores), positions) in enumerate(zip(calls, query_positions, strict=True)):
        picks = theirs[step % len(ours.layers)]
        for row, p in enumerate(positions):
            tolerance = 1e-3 * scores[row, : p + 1].abs().max()
            assert_same_picks(slots[row], scores[row], picks[p], p, tolerance)
    assert len(tokens) > 2 * ours.args.index_topk  # most queries choose


def test_a_top_k_of_every_token_is_dense_attention(monkeypatch):
    """V3.2's tiny preset with a top-k past every sequence's length against the tiny preset:
    the same weights (drawn by name from the seed), the indexer's aside. The indexer's torch
    selection takes 7 queries at a time, so the prefill's 33 span several such parts."""
    monkeypatch.setattr(indexer, "QUERY_ROWS_AT_ONCE", 7)
    sparse = M.from_args(dataclasses.replace(M.PRESETS["v3.2-tiny"], index_topk=64), seed=5)
    dense = M.from_preset("tiny", seed=5)
    ids = torch.randint(2, 500, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(sparse(ids), dense(ids), rtol=1e-5, atol=1e-5)
    prompts = [ids[0, :30].tolist(), ids[1, :3].tolist()]
    params = M.SamplingParams(max_tokens=8)
    tokens, logits = sparse.generate(prompts, params, return_logits=True)
    want_tokens, want = dense.generate(prompts, params, return_logits=True)
    assert tokens == want_tokens
    for got, expected in zip(logits, want, strict=True):
        assert (got - expected).abs().max() < 0.01 * expected.abs().max()


def test_a_token_outside_the_top_k_has_no_influence(monkeypatch):
    """NaN in the latent row of a token a decode step's query does not pick leaves its logits
    bit for bit; in a picked one's, they are NaN."""
    model = M.from_preset("v3.2-tiny", seed=6)  # picks 8
    tokens = torch.randint(2, 500, (20,), generator=torch.Generator().manual_seed(6))
    cache = M.PagedKVCache(model.args, 2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    model.forward_step(StepBatch(tokens[:19], [19], [19], table), cache)
    calls = record_choices(monkeypatch)
    decode = StepBatch(tokens[19:], [1], [20], table)
    clean = model.forward_step(decode, cache)
    layer = 1
    picked = calls[layer][0][0].tolist()
    assert -1 not in picked and 19 in picked  # 8 of 20
    ignored = next(p for p in range(19) if p not in picked)
    cache.layers[layer][0, ignored] = math.nan
    assert torch.equal(model.forward_step(decode, cache), clean)
    cache.layers[layer][picked[0] // 16, picked[0] % 16] = math.nan
    assert model.forward_step(decode, cache).isnan().all()


@pytest.mark.parametrize("index_dtype", [torch.float32, torch.float8_e4m3fn])
def test_tied_scores_pick_the_earlier_tokens_whatever_the_block_table_s_width(index_dtype):
    """A score is exactly 0 where ReLU zeroes every head: of the tokens tied at the k-th place
    the earliest are picked, with a block table of the sequence's pages or a wider one (a
    server's and `generate`'s differ), so both give the same tokens. Unquantized keys scored in
    torch, FP8 ones by the indexer's kernels."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    heads, n, topk = 4, 40, 8
    keys = M.PagedKVCache(M.PRESETS["v3.2-tiny"], 4, 16, index_dtype=index_dtype).index_keys[0]
    k = torch.randn(n, 128, generator=g)
    positive = torch.randperm(n, generator=g)[:5]  # the only tokens that score above 0
    k[:, 0] = -k[:, 0].abs()
    k[positive, 0] *= -1
    keys.write(k, torch.arange(n))
    q = torch.zeros(1, heads, 128)
    q[0, :, 0] = torch.rand(heads, generator=g) + 0.1
    weights = torch.rand(1, heads, generator=g) + 0.1
    stored = keys.rows(torch.arange(n))[:, 0]  # as the cache rounded them: equal ones tie too
    zero = [p for p in range(n) if p not in positive.tolist()]
    want = sorted(sorted(positive.tolist()), key=lambda p: -stored[p].item()) + zero[: topk - 5]
    for width in (3, 4):  # 48 or 64 candidates for 40 tokens
        table = torch.arange(width, dtype=torch.int32)[None]
        slots = indexer.indexer_topk(
            q.to(index_dtype), weights, keys, table, torch.tensor([n - 1]), topk
        )
        assert slots[0].tolist() == want, width


def test_top_positions_is_the_stable_sort_s_selection():
    """Scores of few values (many ties), -0.0 beside 0.0, -inf, huge and tiny ones, rows shorter
    and longer than topk: the positions a stable descending sort puts first, -1 at -inf."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    values = torch.tensor([-math.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 2.5, 3e38])
    for width, topk in ((7, 16), (300, 16), (300, 300), (2048, 100)):
        scores = values[torch.randint(len(values), (5, width), generator=g)]
        scores[0] = -math.inf
        sorted_scores, order = scores.sort(descending=True, stable=True)
        want = order[:, :topk].int().masked_fill(sorted_scores[:, :topk] == -math.inf, -1)
        assert torch.equal(indexer.top_positions(scores, topk), want), (width, topk)


def test_sparse_attention_runs_through_mla_kernels_backend_switch(monkeypatch):
    """A cached step's sparse attention is mla_kernels' sparse MLA operator, in prefill and in
    decode: its backend switch is read (a bad value is named), and its torch reference gives
    the logits (recorded: one call per layer and step)."""
    from mla_kernels import reference

    model = M.from_preset("v3.2-tiny", seed=8)
    calls = []
    attend = reference.sparse_attention
    monkeypatch.setattr(
        reference, "sparse_attention", lambda q, *rest: calls.append(q.shape) or attend(q, *rest)
    )
    tokens = torch.randint(2, 500, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    model.generate([tokens], M.SamplingParams(max_tokens=2))
    heads, layers = model.args.num_attention_heads, model.args.num_hidden_layers
    assert calls == [(20, heads, 576)] * layers + [(1, heads, 576)] * layers
    monkeypatch.setenv("MLA_KERNELS_SPARSE_BACKEND", "fastest")
    with pytest.raises(OpFailed, match=r"'L0\.attn\.core' .* MLA_KERNELS_SPARSE_BACKEND='fastest'"):
        model.generate([tokens], M.SamplingParams(max_tokens=2))


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_sparse_step_has_no_data_dependent_shape_nor_host_read(kind):
    """A V3.2 step under fake tensors, whose values are unknown: a shape that depends on one,
    or reading one on the host, raises. That is what lets a CUDA graph capture the decode
    (`test_model_gpu.py` captures it on the GPU). Every layer dense: the experts' CPU path
    selects rows by their count (their CUDA path, which graphs capture, does not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = dataclasses.replace(M.PRESETS["v3.2-tiny"], first_k_dense_replace=3)
    model = M.from_args(args, seed=9, dtype=torch.bfloat16)
    cache = M.PagedKVCache(args, 8, 16)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    if kind == "decode":
        batch = StepBatch(torch.tensor([5, 6]), [1, 1], [21, 30], table)
    else:
        batch = StepBatch(torch.arange(2, 12), [4, 6], [20, 30], table)
    metadata = batch.metadata(cache)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        logits = model.run_step([(batch.input_ids, metadata)], cache, kind, low_latency=False)
    assert logits.shape == (2, args.vocab_size)


def test_fp8_index_keys_score_within_e4m3_rounding_of_exact_ones():
    """FP8 keys and queries (DeepSeek's) against unquantized ones (transformers'): e4m3 moves
    a value x of scale s (amax / 448) by at most 2^-4 |x| + 2^-10 s (3 mantissa bits; half the
    subnormals' step), after the Hadamard transform, which leaves exact scores as they are."""
    model = M.from_preset("v3.2-tiny", seed=7)
    layer_indexer = model.layers[0].self_attn.indexer
    g = torch.Generator().manual_seed(7)
    n = 40
    x, q_latent = torch.randn(n, 64, generator=g), torch.randn(n, 48, generator=g)
    rotation = model.rope(torch.arange(n), torch.float32)
    with torch.no_grad():
        q, weights = layer_indexer.queries(x, q_latent, rotation)
        keys = layer_indexer.keys(x, rotation)
        exact = index_scores(q, weights, keys)
        assert torch.allclose(index_scores(hadamard(q), weights, hadamard(keys)), exact, atol=1e-5)
        got = {}
        for dtype in (torch.float32, torch.float8_e4m3fn):
            index_keys = M.PagedKVCache(model.args, 3, 16, index_dtype=dtype).index_keys[0]
            q_cached, w_cached = layer_indexer.cache_step(
                x, q_latent, rotation, index_keys, torch.arange(n)
            )
            got[dtype] = index_scores(q_cached, w_cached, index_keys.rows(torch.arange(n)))
    torch.testing.assert_close(got[torch.float32], exact)
    hq, hk = hadamard(q).abs(), hadamard(keys).abs()
    error_q = 2**-4 * hq + 2**-10 * hq.amax(-1, keepdim=True) / 448
    error_k = 2**-4 * hk + 2**-10 * hk.amax(-1, keepdim=True) / 448
    per_head = (
        torch.einsum("shd,td->sht", error_q, hk)
        + torch.einsum("shd,td->sht", hq, error_k)
        + torch.einsum("shd,td->sht", error_q, error_k)
    )
    bound = torch.einsum("sh,sht->st", weights.abs(), per_head) * (1 + 1e-5)
    error = (got[torch.float8_e4m3fn] - exact).abs()
    assert (error <= bound).all()
    assert error.max() > 0.01 * exact.abs().max()  # rounded, as e4m3 does


def test_v32_configs_map_onto_model_args(checkpoints):
    from transformers import DeepseekV32Config

    args = ModelArgs.from_hf_config(checkpoints.config(v32=True, index_topk=6).to_dict())
    assert (args.index_topk, args.index_n_heads, args.index_head_dim) == (6, 8, 128)
    assert args.is_sparse and args.rope_interleave
    assert not ModelArgs.from_hf_config(checkpoints.config().to_dict()).is_sparse
    full = ModelArgs.from_hf_config(DeepseekV32Config().to_dict())
    assert (full.index_topk, full.index_n_heads, full.index_head_dim) == (2048, 64, 128)
    with pytest.raises(ValueError, match="model_type 'llama' is neither"):
        ModelArgs.from_hf_config(checkpoints.config().to_dict() | {"model_type": "llama"})
    moe_first = checkpoints.config(v32=True, mlp_layer_types=["sparse", "dense", "sparse"])
    with pytest.raises(ValueError, match=r"mlp_layer_types \['sparse', 'dense', 'sparse'\]"):
        ModelArgs.from_hf_config(moe_first.to_dict())


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(index_topk=0), r"index_topk \(0\) must be >= 1"),
        (dict(index_n_heads=0), r"index_n_heads \(0\) must be >= 1"),
        (dict(index_head_dim=96), r"index_head_dim \(96\) must be a power of two"),
        (dict(index_head_dim=256), r"index_head_dim \(256\) .* to 128"),
        (dict(index_head_dim=32), r"index_head_dim \(32\) .* from qk_rope_head_dim \(64"),
        (dict(q_lora_rank=None), "index_topk needs q_lora_rank"),
    ],
)
def test_bad_indexer_fields_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(M.PRESETS["v3.2-tiny"], **changes)


def test_v32_presets_and_their_sizes():
    assert M.PRESETS["v3.2"].num_parameters() == pytest.approx(671e9, rel=0.01)
    tiny = M.from_preset("v3.2-tiny", seed=0)
    counted = sum(t.numel() for t in [*tiny.parameters(), *tiny.buffers()])
    assert counted == tiny.args.num_parameters()
    assert M.PRESETS["v3.2-lite"].is_sparse and not M.PRESETS["v2-lite"].is_sparse
    assert M.PRESETS["v3.2-lite"].paged_decode_problem is None


def test_fp8_checkpoint_keeps_the_indexer_projections_in_fp8(checkpoints, tmp_path):
    """As DeepSeek-V3.2 publishes them: wq_b and wk in e4m3 with block scales, weights_proj
    (and the norm) not."""
    checkpoints.write(tmp_path / "bf16", seed=8, v32=True)
    dequantized = checkpoints.to_fp8_sharded(tmp_path / "bf16", tmp_path / "fp8")
    name = "model.layers.2.self_attn.indexer.wq_b.weight"
    model = M.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    assert torch.equal(model.layers[2].self_attn.indexer.wq_b.weight, dequantized[name])
    model = M.from_pretrained(tmp_path / "fp8", weight_dtype="fp8", dtype=torch.float32)
    layer_indexer = model.layers[2].self_attn.indexer
    assert isinstance(layer_indexer.wq_b, FP8Linear) and isinstance(layer_indexer.wk, FP8Linear)
    assert type(layer_indexer.weights_proj) is torch.nn.Linear
    torch.testing.assert_close(layer_indexer.wq_b.dequantized(torch.float32), dequantized[name])
