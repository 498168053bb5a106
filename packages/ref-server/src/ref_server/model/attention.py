"""Multi-head latent attention (MLA), over whole sequences or against the paged latent cache.

A cached step is two operations, so two-batch overlap can run them in different stages:
`prepare` (projections, rope, the cache write and, for decode, the queries absorbing kv_b's key
half) and `core` (attention itself, the value half of kv_b and o_proj). Prefill decompresses each
sequence's cached context and attends densely; decode attends to the latent cache through
`mla_kernels.flash_mla_with_kvcache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mla_kernels
from ref_server.model.args import ModelArgs
from ref_server.model.fp8 import FP8Linear
from ref_server.model.layers import RMSNorm, rotate


class Attention(nn.Module):
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

    # A cached step's two operations. State in: attn_in `[n, hidden]` (normalized), step
    # (`StepMetadata`, None on a rank without tokens), rotation. State out: attn_out.

    def prepare(self, state, kv: torch.Tensor) -> None:
        """kv: this layer's cache `[blocks, page, 1, 576]`."""
        x, step = state.pop("attn_in"), state.step
        if step is None:
            state.attn_query = None
            return
        q_nope, q_rope, latent, k_rope = self._project(x, state.rotation)
        mla_kernels.write_kv_cache(kv, latent, k_rope, step.slot_mapping, check_values=False)
        if step.is_decode:
            state.attn_query = self._absorbed_query(q_nope, q_rope, kv.dtype)
        else:
            state.attn_query = torch.cat([q_nope, q_rope], dim=-1)

    def core(self, state, kv: torch.Tensor) -> None:
        q, step = state.pop("attn_query"), state.step
        if step is None:
            state.attn_out = self.kv_a_layernorm.weight.new_zeros(0, self.args.hidden_size)
            return
        if step.is_decode:
            out = self._absorbed_decode(q, kv, step)
        else:
            out = self._prefill_from_cache(q, kv, step)
        state.attn_out = self.o_proj(out.to(self.dtype))

    def _prefill_from_cache(self, q, cache, step):
        a, page = self.args, cache.shape[1]
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

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (the norms keep it when the projections are FP8)."""
        return self.kv_a_layernorm.weight.dtype

    def _kv_b_halves(self):
        a = self.args
        w = self.kv_b_proj.weight
        if isinstance(self.kv_b_proj, FP8Linear):
            w = self.kv_b_proj.dequantized(self.dtype)
        w = w.unflatten(0, (a.num_attention_heads, -1))
        return w.split([a.qk_nope_head_dim, a.v_head_dim], dim=1)

    def _absorbed_query(self, q_nope, q_rope, dtype):
        """One token per sequence: queries absorb kv_b's key half, so they attend to the latent
        cache (576-wide rows; values are the first 512): `[b, 1, heads, 576]`."""
        w_key, _ = self._kv_b_halves()
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_key)
        return torch.cat([q_latent, q_rope], dim=-1).to(dtype).unsqueeze(1)

    def _absorbed_decode(self, q, cache, step):
        """Attention over the latent cache, then values through kv_b's value half."""
        a = self.args
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
        _, w_value = self._kv_b_halves()
        out = torch.einsum("nhc,hvc->nhv", out.squeeze(1).to(w_value.dtype), w_value)
        return out.flatten(1)
