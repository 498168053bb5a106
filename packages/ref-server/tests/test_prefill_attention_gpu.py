"""Prefill attention on the GPU (`gpu` marker): all sequences of a step in one of torch's
variable-length kernels (flash in bf16, memory-efficient in float32) against float64 math over
the whole ragged batch and against the per-sequence path (the CPU's, run on the GPU), without
waiting for the device; a V2-Lite-sized layer through `forward_step` as with the per-sequence
path."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import ref_server.model as M
from ref_server.model import StepBatch
from ref_server.model.attention import Attention

pytestmark = pytest.mark.gpu

ARGS = M.PRESETS["v2-lite"]  # 16 heads, 128 + 64 query/key dims, 128 value dims
PAGE = 64
# (new tokens, context): one token on a long context, a long prompt without prefix, prefixes
# ending inside a page and on a page's edge, a short prompt
LENGTHS = [(1, 1500), (700, 700), (33, 200), (128, 1000), (5, 5), (64, 256)]


def ragged_batch(lengths, seed: int = 0) -> StepBatch:
    """A prefill batch of these (new, context) lengths, each sequence on scattered pages."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-context // PAGE) for _, context in lengths)
    table = torch.randperm(len(lengths) * pages, generator=g).int().view(len(lengths), pages)
    query, context = [n for n, _ in lengths], [c for _, c in lengths]
    return StepBatch(torch.zeros(sum(query), dtype=torch.long), query, context, table)


def dense_reference(attention: Attention, q, cache, batch: StepBatch) -> torch.Tensor:
    """float64 over the whole batch at once: every context read through the block table,
    decompressed through kv_b, one explicit softmax over all keys where a query sees the keys
    of its own sequence up to its position."""
    a = attention.args
    tables = batch.block_table.long()
    rows = torch.cat(
        [
            cache[tables[s, : -(-c // PAGE)]].flatten(0, 2)[:c]
            for s, c in enumerate(batch.context_lens)
        ]
    ).double()
    latent, rope = rows.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
    kv = (latent @ attention.kv_b_proj.weight.double().T).unflatten(-1, (a.num_attention_heads, -1))
    k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], -1)
    k = torch.cat([k_nope, rope[:, None].expand(-1, a.num_attention_heads, -1)], -1)
    b = len(batch.query_lens)
    q_seq = torch.repeat_interleave(torch.arange(b), torch.tensor(batch.query_lens))
    k_seq = torch.repeat_interleave(torch.arange(b), torch.tensor(batch.context_lens))
    k_pos = torch.cat([torch.arange(c) for c in batch.context_lens])
    seen = ((q_seq[:, None] == k_seq) & (k_pos <= batch.positions[:, None])).to(q.device)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * a.softmax_scale
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhv->ihv", weights, v).flatten(1)


def prefill_inputs(dtype, seed: int = 0):
    """A random attention layer in dtype, a random bf16 cache, queries and the step."""
    torch.manual_seed(seed)
    attention = Attention(ARGS).to(device="cuda", dtype=dtype)
    batch = ragged_batch(LENGTHS, seed)
    cache = torch.randn(batch.block_table.numel() + 1, PAGE, 1, ARGS.cache_width, device="cuda")
    q = torch.randn(batch.num_tokens, ARGS.num_attention_heads, ARGS.qk_head_dim, device="cuda")
    pages = SimpleNamespace(device=torch.device("cuda"), page_size=PAGE)
    step = batch.metadata(pages)
    return attention, q.to(dtype), cache.bfloat16(), batch, step


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_varlen_prefill_matches_float64_and_the_per_sequence_path(dtype, tolerance, monkeypatch):
    attention, q, cache, batch, step = prefill_inputs(dtype)
    with torch.no_grad():
        varlen = attention._prefill_from_cache(q, cache, step)
        monkeypatch.setattr(attention, "_attend_varlen", attention._attend_each)
        each = attention._prefill_from_cache(q, cache, step)
        want = dense_reference(attention, q, cache, batch)
    assert varlen.dtype == dtype and varlen.shape == each.shape
    torch.testing.assert_close(varlen.double(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(each.double(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(varlen, each, rtol=tolerance, atol=tolerance)


def test_varlen_prefill_does_not_wait_for_the_device():
    attention, q, cache, _, step = prefill_inputs(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            attention._prefill_from_cache(q, cache, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_v2_lite_layer_prefills_through_forward_step_as_with_the_per_sequence_path(
    monkeypatch,
):
    """One V2-Lite-sized layer (dense, so no expert choice can flip), bf16: prompts prefilled
    in part, then a ragged step of their rest beside whole prompts; the logits of both steps
    and the cache match the per-sequence path within bf16 rounding."""
    args = dataclasses.replace(ARGS, num_hidden_layers=1, vocab_size=4096)
    model = M.from_args(args, seed=4, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 4096, (n,), generator=g) for n in (900, 1, 300, 130, 64)]
    cached = [640, 0, 257, 0, 63]
    table = torch.randperm(80, generator=g).int().view(5, 16)
    warm = [s for s, c in enumerate(cached) if c]
    steps = [
        StepBatch(
            torch.cat([prompts[s][: cached[s]] for s in warm]).cuda(),
            [cached[s] for s in warm],
            [cached[s] for s in warm],
            table[warm],
        ),
        StepBatch(
            torch.cat([p[c:] for p, c in zip(prompts, cached, strict=True)]).cuda(),
            [len(p) - c for p, c in zip(prompts, cached, strict=True)],
            [len(p) for p in prompts],
            table,
        ),
    ]

    def run():
        cache = M.PagedKVCache(args, 80, PAGE, device="cuda")
        return [model.forward_step(batch, cache) for batch in steps], cache.layers[0]

    got, got_cache = run()
    monkeypatch.setattr(Attention, "_attend_varlen", Attention._attend_each)
    want, want_cache = run()
    for g_logits, w_logits in zip(got, want, strict=True):
        assert ((g_logits - w_logits).abs().amax(dim=-1) < 0.02 * w_logits.abs().max()).all()
    assert torch.equal(got_cache, want_cache)  # one layer: the rows do not depend on attention
