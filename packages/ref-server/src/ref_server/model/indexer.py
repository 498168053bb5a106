"""DeepSeek-V3.2's lightning indexer: which earlier tokens each query attends to.

For a query token t and a token s of its sequence at or before it:

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])

with index_n_heads queries q[t, h] = wq_b(query latent) per head, one key per token
k[s] = k_norm(wk(x[s])) (a LayerNorm, bias included), both index_head_dim wide, their first
qk_rope_head_dim dims rotated by the model's rope angles in halves (not in adjacent pairs as
MLA's), and head weights w[t] = weights_proj(x[t]) / sqrt(heads * index_head_dim). The query
attends to its index_topk best tokens (all of them in a shorter sequence).

The keys are cached in the paged cache's slots beside the latent (`cache.IndexKeys`): in FP8
e4m3 with one scale per token, as DeepSeek serves them, or unquantized. Over FP8 keys the
queries are quantized the same way, a scale per token and head folded into w, and both first
go through a Hadamard transform, as in DeepSeek's indexer: it is orthogonal, so exact scores
are unchanged, and it spreads outlying channels over all of them, so one scale a row loses
less. `transformers` keeps the keys unquantized with no transform; so does the full pass
(`Indexer.forward`).

`indexer_topk` is the cached path's selection over the cache: FP8 keys scored by the indexer's
kernels (`ref_server/kernels/indexer.py`), unquantized ones in plain torch.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ref_server.kernels.fp8_cast import quantize_activations
from ref_server.kernels.indexer import cache_slots, index_logits_paged
from ref_server.kernels.rope import rope_into
from ref_server.model.args import ModelArgs

# The selection scores and sorts `[rows, context]` at a time (the plain-torch scores of
# unquantized keys gather `[rows, context, index_head_dim]`): so many query rows at a time.
QUERY_ROWS_AT_ONCE = 256


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        heads, width = args.index_n_heads, args.index_head_dim
        self.wq_b = nn.Linear(args.q_lora_rank, heads * width, bias=False)
        self.wk = nn.Linear(args.hidden_size, width, bias=False)
        self.k_norm = nn.LayerNorm(width, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rotation) -> torch.Tensor:
        """A causal pass over whole sequences, x `[b, t, hidden]` and the query latent
        `[b, t, q_lora_rank]`: which tokens each query attends to, `[b, t, t]` bool."""
        q, weights = self.queries(x, q_latent, rotation)
        scores = index_scores(q, weights, self.keys(x, rotation))
        t = x.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        best = scores.masked_fill(~causal, -math.inf).topk(min(self.args.index_topk, t)).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, best, True) & causal

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, rotation):
        """The queries `[..., n, heads, width]` and their head weights `[..., n, heads]`
        float32 (the softmax scale and the heads' mean folded in)."""
        a = self.args
        q = self.wq_b(q_latent).unflatten(-1, (a.index_n_heads, a.index_head_dim))
        self._rotate(q, rotation)
        weights = self.weights_proj(x).float() * (a.index_n_heads * a.index_head_dim) ** -0.5
        return q, weights

    def keys(self, x: torch.Tensor, rotation) -> torch.Tensor:
        """One key per token, `[..., n, width]`."""
        k = self.k_norm(self.wk(x))
        self._rotate(k.unsqueeze(-2), rotation)
        return k

    def _rotate(self, x: torch.Tensor, rotation) -> None:
        """x `[..., n, heads, width]`'s rope dims (its first ones) rotated in place, in halves."""
        rope = x[..., : self.args.qk_rope_head_dim]
        cos, sin = rotation
        rope_into(rope, cos, sin, False, rope)

    def cache_step(self, x, q_latent, rotation, index_keys, slot_mapping):
        """A cached step's new tokens, x `[n, hidden]`: their keys written into `index_keys`
        (`cache.IndexKeys`) at slot_mapping `[n]`; their queries and head weights returned, in
        the form `indexer_topk` takes over those keys."""
        q, weights = self.queries(x, q_latent, rotation)
        k = self.keys(x, rotation)
        if index_keys.is_fp8:
            q, scales = quantize_activations(hadamard(q))
            k = hadamard(k)
            weights = weights * scales.squeeze(-1)
        index_keys.write(k, slot_mapping)
        return q, weights


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q `[..., s, heads, width]` and weights `[..., s, heads]` over keys `[..., t, width]`
    (the leading dims broadcast): `[..., s, t]` float32."""
    dots = torch.einsum("...shd,...td->...sht", q.float(), keys.float()).relu()
    return torch.einsum("...sh,...sht->...st", weights, dots)


def indexer_topk(q, weights, index_keys, block_table, positions, topk: int) -> torch.Tensor:
    """The cache slots of each query token's top-k tokens: q `[n, heads, width]` (e4m3 over FP8
    keys, its scales in weights) and weights `[n, heads]` float32 (`Indexer.cache_step`'s) over
    `index_keys` (`cache.IndexKeys`), the query's sequence's pages block_table `[n, max_blocks]`
    int32 and its position `[n]` int64: slots `[n, topk]` int32 (block * page + offset), best
    first, -1 past a query's position + 1 tokens. Among equal scores the earlier token comes
    first: scores tie exactly where ReLU zeroes every head, and the picks must not depend on how
    wide the block table is (a server's and `generate`'s differ), as torch.topk's would.

    FP8 keys are scored by `ref_server::index_logits_paged` (`kernels/indexer.py`: its torch
    reference, or its Triton kernel with REF_SERVER_INDEXER_TRITON=1 on CUDA), each query as a
    sequence of its own; unquantized ones in plain torch."""
    page = index_keys.page_size
    length = block_table.shape[1] * page
    chosen = []
    for first in range(0, q.shape[0], QUERY_ROWS_AT_ONCE):
        part = slice(first, first + QUERY_ROWS_AT_ONCE)
        scores = _scores(q[part], weights[part], index_keys, block_table[part], positions[part])
        chosen.append(cache_slots(top_positions(scores, topk), block_table[part], page))
    return F.pad(torch.cat(chosen), (0, max(topk - length, 0)), value=-1)


def _ordered(scores: torch.Tensor) -> torch.Tensor:
    """int32 of float32 scores in the same order (-0.0 made the +0.0 it equals)."""
    bits = (scores + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


_ORDERED_MINUS_INF = _ordered(torch.tensor(-math.inf)).item()


def top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The positions of each row's topk largest scores `[n, width]` float32, best first, the
    earlier among equal ones (a stable sort): int32 `[n, min(topk, width)]`, -1 for a -inf
    score."""
    # One int64 key a position, the score's order in its high half and the position reversed in
    # its low half: torch.topk over the keys makes the stable sort's selection, for a fraction
    # of a full sort's cost.
    width = scores.shape[-1]
    reversed_position = torch.arange(width - 1, -1, -1, device=scores.device)
    keys, _ = ((_ordered(scores).long() << 32) | reversed_position).topk(min(topk, width), dim=-1)
    positions = (width - 1 - (keys & 0xFFFFFFFF)).int()
    return positions.masked_fill((keys >> 32) == _ORDERED_MINUS_INF, -1)


def _scores(q, weights, index_keys, block_table, positions) -> torch.Tensor:
    """`[n, max_blocks * page]` float32: each query's score of every position its block table
    holds, -inf past its own."""
    if index_keys.is_fp8:
        seqlens = (positions + 1).int()
        logits = index_logits_paged(
            q.unsqueeze(1), weights.unsqueeze(1), index_keys.values, index_keys.scales,
            block_table, seqlens,
        )  # fmt: skip
        return logits.squeeze(1)
    page = index_keys.page_size
    candidates = torch.arange(block_table.shape[1] * page, device=q.device)
    slots = block_table[:, candidates // page].long() * page + candidates % page
    scores = index_scores(q[:, None], weights[:, None], index_keys.rows(slots)).squeeze(-2)
    return scores.masked_fill(candidates > positions[:, None], -math.inf)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x `[..., d]` (d a power of two) times the orthonormal d x d Hadamard matrix, float32."""
    return x.float() @ _hadamard_matrix(x.shape[-1], x.device)


@functools.cache
def _hadamard_matrix(d: int, device: torch.device) -> torch.Tensor:
    matrix = torch.ones(1, 1, device=device)
    while matrix.shape[0] < d:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / math.sqrt(d)
