"""Multi-head latent attention (MLA), over whole sequences or against the paged latent cache.

A cached step is two operations, so two-batch overlap can run them in different stages:
`prepare` (projections, for decode the queries absorbing kv_b's key half, then one kernel that
writes the cache and rotates the queries) and `core` (attention itself, the value half of kv_b
and o_proj). Prefill decompresses the whole context of every sequence of the step at once and
attends densely, all sequences in one variable-length kernel on CUDA; decode attends to the
latent cache through a module with FlashMLA's call surface (`DecodeAttention`): mla_kernels,
or with the model's `kernels` "deepseek" FlashMLA itself.

A DeepSeek-V3.2 model (`ModelArgs.index_topk`) attends sparsely: its lightning indexer
(`indexer.py`) picks each query's tokens, and queries attend to those alone. In the full pass
that is a mask over decompressed heads; in a cached step, prefill and decode alike, absorbed
queries attend to the chosen latent rows (`sparse_attention`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalVariant

import mla_kernels
from ref_server.kernels.latent import cache_latent
from ref_server.kernels.rope import rope_into
from ref_server.model.args import ModelArgs
from ref_server.model.fp8 import FP8Linear
from ref_server.model.indexer import Indexer, indexer_topk
from ref_server.model.layers import FusedLinear, RMSNorm, rotate


@dataclass(frozen=True)
class DecodeAttention:
    """Paged MLA decode through `module`, which has FlashMLA's call surface (mla_kernels, or
    FlashMLA): `schedule` once per step, shared by every layer (a CUDA graph captures it), then
    `attend` in each layer. options: keywords only this module takes; page_sizes and dtypes:
    the caches it reads (None: any `PagedKVCache` allows)."""

    name: str
    module: object
    options: dict = field(default_factory=dict)
    page_sizes: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None

    def schedule(self, cache_seqlens: torch.Tensor, heads: int):
        """The split-KV schedule of a decode step (one KV head; heads: query rows per sequence,
        s_q times the model's heads): both the first API's (tile_scheduler_metadata,
        num_splits) and FlashMLA 1.0's (an object it fills at the first `attend`, and None)
        pass on to `attend` as they are."""
        return self.module.get_mla_metadata(cache_seqlens, heads, 1)

    def attend(self, q, cache, block_table, cache_seqlens, schedule, head_dim_v, softmax_scale):
        """q `[b, s_q, heads, 576]` in the cache's dtype over each sequence's cached tokens,
        query s over the first cache_seqlens - s_q + s + 1: `[b, s_q, heads, head_dim_v]`."""
        out, _ = self.module.flash_mla_with_kvcache(
            q, cache, block_table, cache_seqlens, head_dim_v, *schedule,
            softmax_scale=softmax_scale, causal=True, **self.options,
        )  # fmt: skip
        return out

    def cache_problem(self, cache) -> str | None:
        """Why this module cannot read `cache` (a `PagedKVCache`), or None."""
        if self.page_sizes and cache.page_size not in self.page_sizes:
            sizes = " or ".join(map(str, self.page_sizes))
            return f"{self.name} reads pages of {sizes} tokens, not {cache.page_size}"
        if self.dtypes and cache.dtype not in self.dtypes:
            dtypes = " or ".join(map(str, self.dtypes))
            return f"{self.name} reads caches in {dtypes}, not {cache.dtype}"
        return None


MLA_KERNELS = DecodeAttention("mla_kernels", mla_kernels, {"check_values": False})


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, decode: DecodeAttention = MLA_KERNELS) -> None:
        """decode: what absorbed decode attends to the latent cache through."""
        super().__init__()
        self.args = args
        self.decode = decode
        h, heads = args.hidden_size, args.num_attention_heads
        # the projections of the layer's input, as one GEMM
        q_name = "q_a_proj" if args.q_lora_rank else "q_proj"
        q_rows = args.q_lora_rank or heads * args.qk_head_dim
        self.qkv_a_proj = FusedLinear(h, {q_name: q_rows, "kv_a_proj_with_mqa": args.cache_width})
        if args.q_lora_rank:
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        kv_width = args.qk_nope_head_dim + args.v_head_dim
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * kv_width, bias=False)
        self.o_proj = nn.Linear(heads * args.v_head_dim, h, bias=False)
        self.indexer = Indexer(args) if args.is_sparse else None
        self._kv_b_dequantized = None  # an FP8 kv_b's weight, see `_kv_b_weight`

    def _project(self, x: torch.Tensor):
        """x `[..., n, hidden]` to the queries `[..., n, heads, qk_head_dim]`, their rope
        columns not yet rotated (`_rotate_queries`, or `cache_latent` in a cached step),
        kv_a_proj_with_mqa's output `[..., n, kv_lora_rank + rope]`, its latent not yet
        normalized nor its shared rope key rotated (`_latent`, or `cache_latent` into the
        cache), and the normalized query latent `[..., n, q_lora_rank]` (None without)."""
        a = self.args
        q, kv_a = self.qkv_a_proj.row_parts.split(self.qkv_a_proj(x))
        q_latent = self.q_a_layernorm(q) if a.q_lora_rank else None
        q = self.q_b_proj(q_latent) if a.q_lora_rank else q
        return q.unflatten(-1, (a.num_attention_heads, a.qk_head_dim)), kv_a, q_latent

    def _latent(self, kv_a: torch.Tensor, rotation):
        """kv_a_proj_with_mqa's output to the normalized latent `[..., n, kv_lora_rank]` and
        the rotated shared rope key `[..., n, rope]` (rotation: `Rope` at its positions)."""
        a = self.args
        latent, k_rope = kv_a.split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        k_rope = rotate(k_rope.unsqueeze(-2), rotation, a.rope_interleave).squeeze(-2)
        return self.kv_a_layernorm(latent), k_rope

    def _rotate_queries(self, q: torch.Tensor, rotation) -> None:
        """q's rope columns rotated in place: then q is the query that attends to decompressed
        keys, with no concatenation."""
        q_rope = q[..., self.args.qk_nope_head_dim :]
        cos, sin = rotation
        rope_into(q_rope, cos, sin, self.args.rope_interleave, q_rope)

    def _decompress(self, latent: torch.Tensor, k_rope: torch.Tensor):
        """Per-head keys `[..., t, heads, qk_head_dim]` and values `[..., t, heads, v]`."""
        a = self.args
        kv = self.kv_b_proj(latent).unflatten(-1, (a.num_attention_heads, -1))
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], -1)], dim=-1)
        return k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal=False):
        """q `[..., s, heads, d]` over k, v `[..., t, heads, *]`: `[..., s, heads * v]`."""
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2),
            k.transpose(-3, -2),
            v.transpose(-3, -2),
            attn_mask=mask,
            is_causal=causal,
            scale=self.args.softmax_scale,
        )
        return out.transpose(-3, -2).flatten(-2)

    def forward(self, x: torch.Tensor, rotation) -> torch.Tensor:
        """x `[b, t, hidden]`, a causal pass over whole sequences."""
        q, kv_a, q_latent = self._project(x)
        self._rotate_queries(q, rotation)
        k, v = self._decompress(*self._latent(kv_a, rotation))
        if self.indexer is None:
            return self.o_proj(self._attend(q, k, v, causal=True))
        chosen = self.indexer(x, q_latent, rotation)  # [b, t, t], causal
        return self.o_proj(self._attend(q, k, v, mask=chosen.unsqueeze(-3)))

    # A cached step's two operations. State in: attn_in `[n, hidden]` (normalized), step
    # (`StepMetadata`, None on a rank without tokens), rotation, and in decode decode_schedule
    # (`DecodeAttention.schedule`'s). State out: attn_out. Between them: attn_query, and in a
    # sparse model index_query (`Indexer.cache_step`'s queries and head weights).

    def prepare(self, state, kv: torch.Tensor, index_keys=None) -> None:
        """kv: this layer's cache `[blocks, page, 1, 576]`, index_keys: its indexer keys
        (`cache.IndexKeys`, in a sparse model). One `cache_latent` writes the new tokens'
        latent rows into it and rotates the queries' rope columns: into the absorbed query's
        (decode, and any sparse step), or in place (dense prefill: the projection's output is
        then the query). The indexer writes its keys beside them."""
        x, step = state.pop("attn_in"), state.step
        if step is None:
            state.attn_query = None
            return
        a, norm = self.args, self.kv_a_layernorm
        q, kv_a, q_latent = self._project(x)
        q_rope = q[..., a.qk_nope_head_dim :]
        absorbed = step.is_decode or self.indexer is not None
        if absorbed:
            query = self._absorbed_query(q)
            rope_out = query[..., a.kv_lora_rank :]
        else:
            query, rope_out = q, q_rope
        cos, sin = state.rotation
        cache_latent(
            kv_a, norm.weight, norm.eps, cos, sin, a.rope_interleave, kv, step.slot_mapping,
            q=q_rope, q_out=rope_out,
        )  # fmt: skip
        if self.indexer is not None:
            state.index_query = self.indexer.cache_step(
                x, q_latent, state.rotation, index_keys, step.slot_mapping
            )
        state.attn_query = query.to(kv.dtype) if absorbed else query

    def core(self, state, kv: torch.Tensor, index_keys=None) -> None:
        q, step = state.pop("attn_query"), state.step
        if step is None:
            state.attn_out = self.kv_a_layernorm.weight.new_zeros(0, self.args.hidden_size)
            return
        if self.indexer is not None:
            out = self._sparse(q, kv, index_keys, step, *state.pop("index_query"))
        elif step.is_decode:
            out = self._absorbed_decode(q, kv, step, state.decode_schedule)
        else:
            out = self._prefill_from_cache(q, kv, step)
        if out.shape[0] > step.num_tokens:  # a prefill graph's padding rows (`PrefillGraphs`)
            out[step.num_tokens :] = 0  # attend to nothing: zero, not what memory held
        state.attn_out = self.o_proj(out.to(self.dtype))

    def _sparse(self, q, cache, index_keys, step, index_q, index_weights):
        """Absorbed queries q `[n, heads, 576]` over the latent rows their indexer picks."""
        a = self.args
        tables = step.block_table  # to each new token's sequence's row
        if not step.is_decode:
            lens = step.cu_seqlens_q.diff()
            tables = tables.repeat_interleave(lens, dim=0, output_size=step.num_tokens)
        elif step.s_q > 1:
            tables = tables.repeat_interleave(step.s_q, dim=0)
        slots = indexer_topk(
            index_q, index_weights, index_keys, tables, step.positions, a.index_topk
        )
        out = sparse_attention(q, cache, slots, a.softmax_scale)
        return self._values(out)

    def _prefill_from_cache(self, q, cache, step):
        """q `[n, heads, qk_head_dim]`, the new tokens' queries, over each one's context in the
        cache `[blocks, page, 1, 576]` (the new tokens' rows written): `[n, heads * v]`. Every
        context row of the step is read and decompressed at once (one kv_b GEMM)."""
        a = self.args
        rows = cache.flatten(0, 2).index_select(0, step.context_rows).to(q.dtype)
        k, v = self._decompress(*rows.split([a.kv_lora_rank, a.qk_rope_head_dim], -1))
        return self._attend_ragged(q, k, v, step)

    # Ragged causal attention: q `[total_q, heads, d]` (each sequence's new tokens in turn) over
    # k `[total_k, heads, d]` and v `[total_k, heads, v]` (each sequence's whole context in
    # turn), one dtype, the lengths in step (`StepMetadata`): `[total_q, heads * v]`. A
    # sequence's new tokens end its context: query i of n sees keys 0 .. context - n + i
    # (causal from the bottom right).

    def _attend_ragged(self, q, k, v, step):
        if q.is_cuda:
            return self._attend_varlen(q, k, v, step)
        return self._attend_each(q, k, v, step)

    def _attend_varlen(self, q, k, v, step):
        """All sequences in one kernel (CUDA only): torch's flash attention (FlashAttention 2)
        in bf16 and fp16 from sm80, 1.0-1.6x its memory-efficient kernel on the H200
        (bench_prefill_attention.py); the memory-efficient kernel elsewhere (float32, older
        GPUs), which flash does not serve. Flash takes one head dim: the values are padded
        with zero columns to the keys' (a transient copy of V) and the output's extra columns
        dropped. Both align the causal mask bottom-right."""
        if _flash_serves(q, v):
            v_wide = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
            out = torch.ops.aten._flash_attention_forward(
                q, k, v_wide, step.cu_seqlens_q, step.cu_seqlens_k, step.max_query_len,
                step.max_context_len, 0.0, True, False, scale=self.args.softmax_scale,
            )[0]  # fmt: skip
            return out[..., : v.shape[-1]].flatten(-2)
        out = torch.ops.aten._efficient_attention_forward(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            bias=None,
            cu_seqlens_q=step.cu_seqlens_q,
            cu_seqlens_k=step.cu_seqlens_k,
            max_seqlen_q=step.max_query_len,
            max_seqlen_k=step.max_context_len,
            dropout_p=0.0,
            custom_mask_type=int(CausalVariant.LOWER_RIGHT),
            scale=self.args.softmax_scale,
        )[0]
        return out.squeeze(0).flatten(-2)

    def _attend_each(self, q, k, v, step):
        """One SDPA per sequence, over its slices (any device: the reference)."""
        outputs, i, j = [], 0, 0
        for new, context in zip(step.query_lens, step.context_lens, strict=True):
            seen = torch.ones(new, context, dtype=torch.bool, device=q.device).tril(context - new)
            outputs.append(
                self._attend(q[i : i + new], k[j : j + context], v[j : j + context], mask=seen)
            )
            i, j = i + new, j + context
        return torch.cat(outputs)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (the norms keep it when the projections are FP8)."""
        return self.kv_a_layernorm.weight.dtype

    def _kv_b_halves(self):
        """kv_b's weight per head, split: the key half `[heads, nope, kv_lora_rank]` and the
        value half `[heads, v, kv_lora_rank]`."""
        a = self.args
        w = self._kv_b_weight().unflatten(0, (a.num_attention_heads, -1))
        return w.split([a.qk_nope_head_dim, a.v_head_dim], dim=1)

    def _kv_b_weight(self) -> torch.Tensor:
        """kv_b's weight `[heads * (nope + v), kv_lora_rank]` in the activations' dtype. An FP8
        one is dequantized once, not at every decode step: again only after its tensors are
        replaced (`model.to`, a new buffer) or written in place (their version counters move),
        and then into the same tensor where the layout allows, so that a CUDA graph captured
        over it never reads freed memory (a graph keeps the values of its last eager
        refresh: capture again after changing weights)."""
        proj = self.kv_b_proj
        if not isinstance(proj, FP8Linear):
            return proj.weight
        sources = (proj.weight, proj.weight_scale_inv)
        stamp = (self.dtype, *(t._version for t in sources))
        cached = self._kv_b_dequantized
        if cached is None or not cached.computed_from(sources, stamp):
            weight = proj.dequantized(self.dtype)
            if cached is not None and cached.fits(weight):
                weight = cached.weight.copy_(weight)
            refs = [weakref.ref(t) for t in sources]
            self._kv_b_dequantized = _Dequantized(refs, stamp, weight)
        return self._kv_b_dequantized.weight

    def _absorbed_query(self, q):
        """One token per sequence: queries absorb kv_b's key half, so they attend to the latent
        cache (576-wide rows; values are the first 512): `[b, heads, 576]` in q's dtype. The
        per-head GEMM writes the first 512 columns; the last 64 are left for the rotated rope
        columns (`cache_latent` writes them: no concatenation)."""
        a = self.args
        w_key, _ = self._kv_b_halves()
        query = q.new_empty(q.shape[0], a.num_attention_heads, a.kv_lora_rank + a.qk_rope_head_dim)
        q_nope = q[..., : a.qk_nope_head_dim]
        torch.bmm(q_nope.transpose(0, 1), w_key, out=query[..., : a.kv_lora_rank].transpose(0, 1))
        return query

    def _absorbed_decode(self, q, cache, step, schedule):
        """Attention over the latent cache, then values through kv_b's value half."""
        a = self.args
        out = self.decode.attend(
            q.unflatten(0, (-1, step.s_q)), cache, step.block_table, step.cache_seqlens,
            schedule, a.kv_lora_rank, a.softmax_scale,
        )  # fmt: skip
        return self._values(out.flatten(0, 1))

    def _values(self, out: torch.Tensor) -> torch.Tensor:
        """Absorbed attention's output `[n, heads, kv_lora_rank]` through kv_b's value half:
        `[n, heads * v]`."""
        a = self.args
        _, w_value = self._kv_b_halves()
        out = out.to(w_value.dtype)
        values = out.new_empty(out.shape[0], a.num_attention_heads, a.v_head_dim)
        torch.bmm(out.transpose(0, 1), w_value.transpose(1, 2), out=values.transpose(0, 1))
        return values.flatten(1)


def sparse_attention(q, cache, slots, softmax_scale: float) -> torch.Tensor:
    """Absorbed queries q `[n, heads, 576]` over the cache `[blocks, page, 1, 576]` rows at
    slots `[n, topk]` (block * page + offset; -1: none), each query over its own:
    `[n, heads, 512]` in q's dtype, values the rows' first 512 columns (0 for a query without
    a valid slot). Through mla_kernels' sparse MLA operator, which both of its sparse calls
    (decode's `flash_mla_with_kvcache(..., indices=)`, prefill's `flash_mla_sparse_fwd`) run
    over the cache's rows, so that its backend switch (MLA_KERNELS_SPARSE_BACKEND) reaches
    the model; called directly because those calls take bf16 queries only, and a model's cache
    may be fp16 too."""
    rows = cache.view(-1, cache.shape[-1])
    out, _, _ = torch.ops.mla_kernels.sparse_mla(q, rows, slots.int(), softmax_scale, False)
    return out


@dataclass
class _Dequantized:
    """An FP8 weight dequantized, and what from: weak references to its tensors (values and
    scales), and the dtype and those tensors' version counters at the time."""

    sources: list[weakref.ref]
    stamp: tuple
    weight: torch.Tensor

    def computed_from(self, sources, stamp) -> bool:
        same = all(ref() is t for ref, t in zip(self.sources, sources, strict=True))
        return same and self.stamp == stamp

    def fits(self, weight: torch.Tensor) -> bool:
        mine = self.weight
        return (mine.shape, mine.dtype, mine.device) == (weight.shape, weight.dtype, weight.device)


def _flash_serves(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's flash attention takes these: bf16 or fp16 on sm80 or later, values no
    wider than the queries (they are padded up to them)."""
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and v.shape[-1] <= q.shape[-1]
        and _capability(q.device) >= (8, 0)
    )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)
