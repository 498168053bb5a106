"""Cached attention (CPU): a prefill step's metadata for all its sequences at once, its attention
against float64 math written out here, and decode's FP8 kv_b dequantized once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ref_server.model as M
from ref_server.model import StepBatch
from ref_server.model.attention import Attention
from ref_server.model.fp8 import FP8Linear

ARGS = M.PRESETS["tiny"]  # 4 heads, 16 + 64 query/key dims, 16 value dims, 512 + 64 latent
# (new tokens, context) per sequence: no prefix, one token on a long context, prefixes that
# end inside a page and on a page's edge
LENGTHS = [(5, 5), (1, 40), (17, 17), (9, 50), (2, 33), (16, 48)]


def ragged_batch(lengths, page: int, seed: int = 0) -> StepBatch:
    """A prefill batch of these (new, context) lengths, each sequence on scattered pages."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-context // page) for _, context in lengths)
    order = torch.randperm(len(lengths) * pages, generator=g).int()
    table = order.view(len(lengths), pages)
    query, context = [n for n, _ in lengths], [c for _, c in lengths]
    return StepBatch(torch.zeros(sum(query), dtype=torch.long), query, context, table)


def test_prefill_metadata_lists_every_context_row_and_the_sequences_bounds():
    page = 4
    batch = ragged_batch(LENGTHS, page)
    step = batch.metadata(SimpleNamespace(device=torch.device("cpu"), page_size=page))
    table = batch.block_table.tolist()
    rows = [
        [table[s][p // page] * page + p % page for p in range(context)]
        for s, (_, context) in enumerate(LENGTHS)
    ]
    assert step.context_rows.dtype == torch.int64
    assert step.context_rows.tolist() == [r for seq in rows for r in seq]
    new_rows = [seq[-n:] for seq, (n, _) in zip(rows, LENGTHS, strict=True)]
    assert step.slot_mapping.tolist() == [r for seq in new_rows for r in seq]  # each context's end
    for bounds, lens in (
        (step.cu_seqlens_q, batch.query_lens),
        (step.cu_seqlens_k, batch.context_lens),
    ):
        assert bounds.dtype == torch.int32
        assert bounds.tolist() == [sum(lens[:s]) for s in range(len(lens) + 1)]
    assert step.last_rows.tolist() == [sum(batch.query_lens[: s + 1]) - 1 for s in range(6)]
    assert (step.max_query_len, step.max_context_len) == (17, 50)
    assert step.positions.tolist() == [p for n, c in LENGTHS for p in range(c - n, c)]
    assert torch.equal(step.block_table, batch.block_table)


def test_decode_metadata_comes_through_the_same_copy():
    batch = StepBatch(torch.tensor([3, 4]), [1, 1], [7, 2], torch.tensor([[2, 0], [1, 3]]).int())
    step = batch.metadata(SimpleNamespace(device=torch.device("cpu"), page_size=4))
    assert step.is_decode and step.context_rows is None
    assert step.positions.tolist() == [6, 1] and step.slot_mapping.tolist() == [2, 5]
    assert step.block_table.dtype == torch.int32 and step.cache_seqlens.tolist() == [7, 2]


def reference_prefill(attention: Attention, q, cache, batch: StepBatch) -> torch.Tensor:
    """float64, one sequence at a time: its rows read page by page, decompressed through kv_b,
    an explicit softmax where query i of n new tokens sees keys 0 .. context - n + i."""
    a, page = attention.args, cache.shape[1]
    w = attention.kv_b_proj.weight.double()
    outputs, start = [], 0
    for s, (new, context) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        pages = batch.block_table[s].long()
        rows = torch.stack([cache[pages[p // page], p % page, 0] for p in range(context)]).double()
        latent, rope = rows.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        kv = (latent @ w.T).view(context, a.num_attention_heads, -1)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], -1)
        k = torch.cat([k_nope, rope[:, None].expand(-1, a.num_attention_heads, -1)], -1)
        scores = torch.einsum("ihd,jhd->hij", q[start : start + new].double(), k)
        seen = torch.arange(context) <= torch.arange(context - new, context)[:, None]
        weights = (scores * a.softmax_scale).masked_fill(~seen, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hij,jhv->ihv", weights, v).flatten(1))
        start += new
    return torch.cat(outputs)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_attention_matches_float64_per_sequence_math(dtype, tolerance):
    torch.manual_seed(0)
    attention = Attention(ARGS).to(dtype)
    page = 16
    batch = ragged_batch(LENGTHS, page, seed=1)
    blocks = batch.block_table.numel()
    cache = torch.randn(blocks + 1, page, 1, ARGS.cache_width).bfloat16()
    q = torch.randn(batch.num_tokens, ARGS.num_attention_heads, ARGS.qk_head_dim).to(dtype)
    step = batch.metadata(SimpleNamespace(device=torch.device("cpu"), page_size=page))
    with torch.no_grad():
        got = attention._prefill_from_cache(q, cache, step)
        want = reference_prefill(attention, q, cache, batch)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


def test_a_ragged_prefill_over_cached_prefixes_matches_the_full_pass():
    """Sequences with and without cached prefixes in one step: each one's last logits are the
    full pass's over its whole prompt (the cache is bf16, hence 2 % of the range)."""
    model = M.from_preset("tiny", seed=5)
    prompts = [
        torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(n))
        for n in (40, 9, 70, 23)
    ]
    cached = [24, 0, 64, 22]
    table = torch.arange(4 * 5, dtype=torch.int32).view(4, 5).flip(1)  # pages out of order
    cache = M.PagedKVCache(model.args, 20, 16)
    warm = [s for s, c in enumerate(cached) if c]
    model.forward_step(
        StepBatch(
            torch.cat([prompts[s][: cached[s]] for s in warm]),
            [cached[s] for s in warm],
            [cached[s] for s in warm],
            table[warm],
        ),
        cache,
    )
    ids = torch.cat([p[c:] for p, c in zip(prompts, cached, strict=True)])
    query = [len(p) - c for p, c in zip(prompts, cached, strict=True)]
    got = model.forward_step(StepBatch(ids, query, [len(p) for p in prompts], table), cache)
    for prompt, logits in zip(prompts, got, strict=True):
        want = model(prompt[None])[0, -1]
        assert (logits - want).abs().max() < 0.02 * (want.max() - want.min())


def test_fp8_kv_b_is_dequantized_once_and_again_after_its_weights_change(monkeypatch):
    model = M.from_preset("tiny", seed=2, weight_dtype="fp8")
    calls, dequantized = [], FP8Linear.dequantized

    def counted(self, dtype):
        calls.append(self)
        return dequantized(self, dtype)

    monkeypatch.setattr(FP8Linear, "dequantized", counted)
    model.generate([[5, 6, 7]], M.SamplingParams(max_tokens=4))
    assert len(calls) == model.args.num_hidden_layers  # once per layer over 3 decode steps

    attention = model.layers[0].self_attn
    proj = attention.kv_b_proj
    first = attention._kv_b_weight()
    assert torch.equal(first, dequantized(proj, attention.dtype))
    assert attention._kv_b_weight() is first
    with torch.no_grad():
        proj.weight_scale_inv.mul_(2)  # written in place
    assert attention._kv_b_weight() is first  # refreshed into the same tensor
    assert torch.equal(first, dequantized(proj, attention.dtype))
    proj.weight = (-proj.weight.float()).to(torch.float8_e4m3fn)  # a new buffer
    assert torch.equal(attention._kv_b_weight(), dequantized(proj, attention.dtype))
    attention.kv_a_layernorm.to(torch.bfloat16)  # the activations' dtype: a new tensor in it
    assert attention._kv_b_weight().dtype == torch.bfloat16
    assert torch.equal(attention._kv_b_weight(), dequantized(proj, torch.bfloat16))


def test_a_dense_kv_b_is_used_as_it_is():
    attention = M.from_preset("tiny", seed=2).layers[0].self_attn
    assert attention._kv_b_weight() is attention.kv_b_proj.weight
