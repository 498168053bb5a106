"""DeepSeek-V3 in plain torch, top to bottom: norms, rope, MLA, MLP, MoE, blocks, the model.

Two ways through the model:
- `forward(input_ids)`: a full causal pass without cache, attention on decompressed heads
  (SDPA); the same contract as `transformers`' forward.
- `forward_step(batch, cache)`: new tokens of several sequences against a paged latent cache.
  Prefill decompresses each sequence's cached context and attends densely; decode (one new
  token per sequence) uses the absorbed form through `mla_kernels.flash_mla_with_kvcache`.

Module and parameter names follow the Hugging Face checkpoint, so loading is name for name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import mla_kernels
from ref_server.model.args import ModelArgs, yarn_mscale
from ref_server.model.cache import PagedKVCache, StepBatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rope dims and the factor on cos/sin (YaRN if rope_factor > 1)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    # on the CPU explicitly: models are built under torch.device("meta") before loading
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    extrapolation = 1.0 / base**exponents
    if args.rope_factor <= 1:
        return extrapolation, 1.0
    factor = args.rope_factor

    def correction_dim(rotations: float) -> float:
        length = args.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    steps = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = (steps - low) / max(high - low, 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = extrapolation / factor * (1 - keep) + extrapolation * keep
    if args.mscale and args.mscale_all_dim:
        attention_factor = yarn_mscale(factor, args.mscale) / yarn_mscale(
            factor, args.mscale_all_dim
        )
    else:
        attention_factor = yarn_mscale(factor, 1.0)
    return inv_freq, attention_factor


class Rope(nn.Module):
    """cos and sin of the rope angles at given positions, computed once per pass and shared by
    every layer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inv_freq, self.attention_factor = rope_inv_freq(args)  # not a buffer: stays fp32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions `[n]` to (cos, sin), each `[n, 1, rope / 2]` of `dtype`."""
        if self.inv_freq.device != positions.device:  # once: a copy per call would sync the host
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        cos = (angles.cos() * self.attention_factor).to(dtype).unsqueeze(-2)
        sin = (angles.sin() * self.attention_factor).to(dtype).unsqueeze(-2)
        return cos, sin


def rotate(x: torch.Tensor, rotation, interleave: bool) -> torch.Tensor:
    """x `[..., n, heads, rope]` rotated by `Rope`'s (cos, sin); interleaved pairs come out
    de-interleaved (evens then odds), as in the reference implementation."""
    cos, sin = rotation
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """Multi-head latent attention."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        h, heads = args.hidden_size, args.num_attention_heads
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, args.cache_width, bias=False)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        kv_width = args.qk_nope_head_dim + args.v_head_dim
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * kv_width, bias=False)
        self.o_proj = nn.Linear(heads * args.v_head_dim, h, bias=False)

    def _project(self, x: torch.Tensor, rotation):
        """x `[..., n, hidden]` (rotation: `Rope` at its positions) to q_nope, q_rope
        `[..., n, heads, *]`, the normalized latent
        `[..., n, kv_lora_rank]` and the rotated shared rope key `[..., n, rope]`."""
        a = self.args
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if a.q_lora_rank else self.q_proj(x)
        q = q.unflatten(-1, (a.num_attention_heads, a.qk_head_dim))
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        q_rope = rotate(q_rope, rotation, a.rope_interleave)
        k_rope = rotate(k_rope.unsqueeze(-2), rotation, a.rope_interleave).squeeze(-2)
        return q_nope, q_rope, self.kv_a_layernorm(latent), k_rope

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
        q_nope, q_rope, latent, k_rope = self._project(x, rotation)
        k, v = self._decompress(latent, k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return self.o_proj(self._attend(q, k, v, causal=True))

    def forward_step(self, x, rotation, cache: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        """x `[n, hidden]`: the new tokens; cache: this layer's `[blocks, page, 1, 576]`."""
        q_nope, q_rope, latent, k_rope = self._project(x, rotation)
        mla_kernels.write_kv_cache(cache, latent, k_rope, step.slot_mapping, check_values=False)
        if step.is_decode:
            out = self._absorbed_decode(q_nope, q_rope, cache, step)
        else:
            out = self._prefill_from_cache(q_nope, q_rope, cache, step)
        return self.o_proj(out.to(x.dtype))

    def _prefill_from_cache(self, q_nope, q_rope, cache, step):
        a, page = self.args, cache.shape[1]
        q = torch.cat([q_nope, q_rope], dim=-1)
        outputs, start = [], 0
        for s, (new, context) in enumerate(zip(step.query_lens, step.context_lens, strict=True)):
            blocks = step.block_table[s, : -(-context // page)].long()
            rows = cache[blocks].flatten(0, 2)[:context]  # [context, 576]
            latent, k_rope = rows.to(q.dtype).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
            k, v = self._decompress(latent, k_rope)
            if new == context:  # nothing cached before: a plain causal pass (a faster kernel)
                outputs.append(self._attend(q[start : start + new], k, v, causal=True))
            else:
                seen = (
                    torch.arange(context, device=q.device)
                    <= step.positions[start : start + new, None]
                )
                outputs.append(self._attend(q[start : start + new], k, v, mask=seen))
            start += new
        return torch.cat(outputs)

    def _absorbed_decode(self, q_nope, q_rope, cache, step):
        """One token per sequence: queries absorb kv_b's key half and attend to the latent cache
        (576-wide rows, values are the first 512), then values go through kv_b's value half."""
        a = self.args
        w = self.kv_b_proj.weight.unflatten(0, (a.num_attention_heads, -1))
        w_key, w_value = w.split([a.qk_nope_head_dim, a.v_head_dim], dim=1)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_key)
        q = torch.cat([q_latent, q_rope], dim=-1).to(cache.dtype).unsqueeze(1)  # [b, 1, h, 576]
        out, _ = mla_kernels.flash_mla_with_kvcache(
            q,
            cache,
            step.block_table,
            step.cache_seqlens,
            a.kv_lora_rank,
            step.tile_scheduler_metadata,
            step.num_splits,
            softmax_scale=a.softmax_scale,
            causal=True,
            check_values=False,
        )
        out = torch.einsum("nhc,hvc->nhv", out.squeeze(1).to(w.dtype), w_value)
        return out.flatten(1)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Sigmoid scores; the choice adds a per-expert bias and keeps the topk_group groups with the
    best two-expert sums; weights are the unbiased scores, normalized, times the scaling."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[n, hidden]` to weights `[n, k]` fp32 and expert ids `[n, k]` int64."""
        a = self.args
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(-1, a.n_group, a.n_routed_experts // a.n_group)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(a.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(a.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor, ids


class Experts(nn.Module):
    """This rank's routed experts, stacked (SwiGLU MLPs): gate_up_proj `[e, 2 * inter, hidden]`
    (each expert's gate_proj rows, then its up_proj rows), down_proj `[e, hidden, inter]`."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]`; ids `[n, k]` local expert ids (-1: on another rank), weights `[n, k]`:
        each token's weighted sum of its experts' outputs. Grouped GEMMs for bf16 on the GPU."""
        if x.is_cuda and x.dtype == torch.bfloat16:
            return self.grouped(x, ids, weights)
        return self.looped(x, ids, weights)

    def looped(self, x, ids, weights) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids[ids >= 0].unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out

    def grouped(self, x, ids, weights) -> torch.Tensor:
        """The same with one grouped GEMM per projection over the rows sorted by expert, and
        nothing that waits for the GPU: rows for other ranks' experts (-1) sort after every
        group, and each token's k outputs are summed in fp32 in slot order."""
        num_experts, k = self.gate_up_proj.shape[0], ids.shape[1]
        valid = ids.flatten() >= 0
        expert = torch.where(valid, ids.flatten(), num_experts)
        order = expert.argsort(stable=True)
        ends = torch.arange(1, num_experts + 1, device=ids.device)
        offsets = torch.searchsorted(expert[order], ends, out_int32=True)
        hidden = torch._grouped_mm(x[order // k], self.gate_up_proj.transpose(1, 2), offs=offsets)
        gate, up = hidden.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        per_slot = torch.empty_like(y, dtype=torch.float32)
        per_slot[order] = y.float()  # rows past the last group are left unwritten: masked below
        weighted = torch.where(valid[:, None], per_slot * weights.flatten()[:, None], 0.0)
        return weighted.unflatten(0, ids.shape).sum(dim=1).to(x.dtype)


class MoE(nn.Module):
    """Routed experts (this rank's share of them) plus shared experts. With `expert_parallel`,
    tokens travel to the ranks holding their experts through ep_comm and back."""

    def __init__(self, args: ModelArgs, expert_parallel=None) -> None:
        super().__init__()
        self.args = args
        self.expert_parallel = expert_parallel
        rank, size = (0, 1) if expert_parallel is None else expert_parallel.rank_and_size
        self.first_expert = rank * (args.n_routed_experts // size)
        self.gate = Gate(args)
        self.experts = Experts(
            args.n_routed_experts // size, args.hidden_size, args.moe_intermediate_size
        )
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args.hidden_size, shared) if args.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        if self.expert_parallel is None:
            routed = self.experts(x, ids, weights)
        else:
            routed = self.expert_parallel.exchange(x, ids, weights, self.experts)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed.view(shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, expert_parallel=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(layer):
            self.mlp = MoE(args, expert_parallel)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x: torch.Tensor, rotation, kv=None, step=None) -> torch.Tensor:
        """Without `step`, a causal pass; with it, a cached step (kv: this layer's cache)."""
        h = self.input_layernorm(x)
        if step is None:
            x = x + self.self_attn(h, rotation)
        else:
            x = x + self.self_attn.forward_step(h, rotation, kv, step)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class StepMetadata:
    """What every layer of one cached step shares, on the cache's device.

    positions, slot_mapping: `[n]` int64, each new token's position and cache row.
    block_table: `[b, max_blocks]` int32.
    last_rows: `[b]` int64, the rows whose logits the step returns; None: every row (decode).
    query_lens, context_lens: a prefill's lengths, which its per-sequence attention walks.
    cache_seqlens `[b]` int32, tile_scheduler_metadata, num_splits: a decode's kernel schedule.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    last_rows: torch.Tensor | None = None
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    cache_seqlens: torch.Tensor | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.cache_seqlens is not None

    @classmethod
    def of(cls, batch: StepBatch, cache: PagedKVCache, heads: int) -> StepMetadata:
        device = cache.device
        positions = batch.positions.to(device)
        slot_mapping = batch.slot_mapping(cache.page_size).to(device)
        block_table = batch.block_table.to(device=device, dtype=torch.int32)
        if batch.is_decode:
            return cls.decode(positions, slot_mapping, block_table, heads)
        last_rows = torch.tensor(batch.query_lens).cumsum(0).sub(1).to(device)
        return cls(
            positions, slot_mapping, block_table, last_rows, batch.query_lens, batch.context_lens
        )

    @classmethod
    def decode(cls, positions, slot_mapping, block_table, heads: int) -> StepMetadata:
        """One new token per sequence, from device tensors alone (so a CUDA graph can capture
        it): each sequence's cache then holds its token's position + 1 tokens."""
        cache_seqlens = (positions + 1).int()
        metadata, splits = mla_kernels.get_mla_metadata(cache_seqlens, heads, 1)
        return cls(
            positions, slot_mapping, block_table, None, None, None, cache_seqlens, metadata, splits
        )


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, expert_parallel=None) -> None:
        super().__init__()
        self.args = args
        self.expert_parallel = expert_parallel
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            Block(args, i, expert_parallel) for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rope = Rope(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[b, t]` int64 to logits `[b, t, vocab]` float32 (no cache)."""
        x = self.embed_tokens(input_ids)
        rotation = self.rope(torch.arange(input_ids.shape[1], device=x.device), x.dtype)
        for layer in self.layers:
            x = layer(x, rotation)
        return self.lm_head(self.norm(x)).float()

    @torch.no_grad()
    def forward_step(self, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """The new tokens of `batch` through the cache; logits `[b, vocab]` float32 of each
        sequence's last new token."""
        step = StepMetadata.of(batch, cache, self.args.num_attention_heads)
        return self.run_step(batch.input_ids.to(cache.device), step, cache)

    def idle_step(self) -> None:
        """What an expert-parallel rank without tokens runs while its peers step: every MoE
        layer's exchange with no rows of its own, so its experts serve the peers' tokens."""
        weight = self.embed_tokens.weight
        nothing = weight.new_zeros(0, self.args.hidden_size)
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp(nothing)

    def run_step(self, input_ids: torch.Tensor, step: StepMetadata, cache: PagedKVCache):
        """`forward_step` on device tensors alone: what `DecodeGraphs` captures."""
        x = self.embed_tokens(input_ids)
        rotation = self.rope(step.positions, x.dtype)
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            x = layer(x, rotation, kv, step)
        if step.last_rows is not None:
            x = x[step.last_rows]
        return self.lm_head(self.norm(x)).float()
