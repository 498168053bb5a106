"""`ModelArgs`: every hyper-parameter of a DeepSeek-V3-architecture model, with presets.

Field names follow the Hugging Face `config.json` of DeepSeek-V3 and V3.2, so a checkpoint's
config maps onto them directly (`ModelArgs.from_hf_config`). A model with `index_topk` is a
V3.2: its attention is sparse, each query attending to the tokens its lightning indexer picks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# mla_kernels' paged decode works on 576-wide cache rows: a 512 latent and a 64 rope part.
MLA_KERNEL_LATENT = 512
MLA_KERNEL_ROPE = 64


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # the dense layers' MLP
    moe_intermediate_size: int = 2048  # one expert's MLP
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3  # the first layers have a dense MLP instead of MoE
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536  # None: a plain query projection (as in V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8  # expert groups; top-k runs within the topk_group best ones
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # rope dims rotate in adjacent pairs (DeepSeek's layout)
    # YaRN (rope_factor 1: plain rope)
    rope_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # DeepSeek-V3.2's sparse attention (DSA): the lightning indexer's heads and their width, and
    # how many cached tokens each query attends to; None: dense attention (V3, V2-Lite).
    index_topk: int | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    # DeepSeek-V3's multi-token-prediction module (0 or 1): one more decoder layer that drafts
    # the token after next for speculative decoding (`ref_server.model.mtp`)
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.n_routed_experts % self.n_group:
            problems.append(f"n_routed_experts ({self.n_routed_experts}) not divisible by n_group")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group ({self.topk_group}) outside 1..n_group ({self.n_group})")
        per_group = self.n_routed_experts // max(self.n_group, 1)
        if self.num_experts_per_tok > self.topk_group * per_group:
            problems.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) > experts in the chosen groups "
                f"({self.topk_group} x {per_group})"
            )
        if per_group < 2 and self.n_group > 1:
            problems.append("group scores sum each group's top 2 experts: need >= 2 per group")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            problems.append("first_k_dense_replace outside 0..num_hidden_layers")
        if self.index_topk is not None:
            problems += self._indexer_problems()
        if self.num_nextn_predict_layers not in (0, 1):
            problems.append(
                f"num_nextn_predict_layers ({self.num_nextn_predict_layers}): 0 or 1 supported"
            )
        if problems:
            raise ValueError("unsupported model config: " + "; ".join(problems))

    def _indexer_problems(self) -> list[str]:
        problems = []
        if self.index_topk < 1:
            problems.append(f"index_topk ({self.index_topk}) must be >= 1")
        if self.index_n_heads < 1:
            problems.append(f"index_n_heads ({self.index_n_heads}) must be >= 1")
        width = self.index_head_dim
        if not self.qk_rope_head_dim <= width <= 128 or width & (width - 1):
            problems.append(
                f"index_head_dim ({width}) must be a power of two (a Hadamard transform precedes "
                f"FP8) from qk_rope_head_dim ({self.qk_rope_head_dim}, its rope part) to 128 "
                "(one FP8 scale per key)"
            )
        if not self.q_lora_rank:
            problems.append("index_topk needs q_lora_rank: the indexer reads the query latent")
        return problems

    @property
    def is_sparse(self) -> bool:
        """DeepSeek-V3.2: attention over the indexer's top-k tokens."""
        return self.index_topk is not None

    def indexer_parameters(self) -> int:
        """One layer's lightning indexer (0 without): wq_b, wk, k_norm (a LayerNorm: weight and
        bias), weights_proj."""
        if not self.is_sparse:
            return 0
        h, width, heads = self.hidden_size, self.index_head_dim, self.index_n_heads
        return self.q_lora_rank * heads * width + h * width + 2 * width + h * heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values per token per layer in the latent cache: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_factor > 1 and self.mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim) ** 2
        return scale

    @property
    def paged_decode_problem(self) -> str | None:
        """Why mla_kernels cannot run this model's decode, or None."""
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (MLA_KERNEL_LATENT, MLA_KERNEL_ROPE):
            return (
                f"paged decode runs through mla_kernels, which needs kv_lora_rank "
                f"{MLA_KERNEL_LATENT} and qk_rope_head_dim {MLA_KERNEL_ROPE}; this model has "
                f"{self.kv_lora_rank} and {self.qk_rope_head_dim}"
            )
        return None

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return max(self.num_hidden_layers - self.first_k_dense_replace, 0)

    def attention_parameters(self) -> int:
        """One layer's MLA projections and norms."""
        h, heads = self.hidden_size, self.num_attention_heads
        q = h * heads * self.qk_head_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank * (heads * self.qk_head_dim + 1)
        kv = h * self.cache_width + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h + 2 * h + self.indexer_parameters()

    def matmul_flops(self, tokens: int) -> float:
        """Every active parameter twice per token (the embedding is a lookup, not a matmul)."""
        return 2 * (self.num_parameters(active=True) - self.vocab_size * self.hidden_size) * tokens

    def prefill_flops(self, new: int, cached: int = 0) -> float:
        """FLOPs of computing `new` tokens after `cached` ones: the matmuls and attention."""
        return self.matmul_flops(new) + self.attention_flops(new, cached)

    def attention_flops(self, new: int, cached: int = 0, absorbed: bool = False) -> float:
        """FLOPs of the attention of `new` tokens after `cached` ones, all layers: scores and
        values over each new token's context, on the decompressed heads, or `absorbed` (as
        decode's kernels compute it) with scores over the latent and rope key and values over
        the latent. A sparse model attends absorbed (`absorbed` is moot) over the index_topk
        tokens its indexer picks, and its indexer scores every token of the context (its
        heads' dot products)."""
        layers = self.num_hidden_layers
        pairs = attended_pairs(new, cached)
        absorbed_width = self.cache_width + self.kv_lora_rank
        if not self.is_sparse:
            width = absorbed_width if absorbed else self.qk_head_dim + self.v_head_dim
            return 2 * layers * self.num_attention_heads * width * pairs
        picked = attended_pairs(new, cached, self.index_topk)
        attention = 2 * layers * self.num_attention_heads * absorbed_width * picked
        return attention + 2 * layers * self.index_n_heads * self.index_head_dim * pairs

    def expert_parameters(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or those one token uses (`active`: its routed and shared experts)."""
        h = self.hidden_size
        experts = self.num_experts_per_tok if active else self.n_routed_experts
        moe = (experts + self.n_shared_experts) * self.expert_parameters()
        moe += self.n_routed_experts * (h + 1)  # the gate and its bias
        moe_layers = self.num_hidden_layers - self.first_k_dense_replace
        dense = self.first_k_dense_replace * 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        layers = self.num_hidden_layers * self.attention_parameters() + dense + moe_layers * moe
        return layers + embeddings + h

    def weight_bytes_per_gpu(self, ep_size: int = 1, weight_dtype: str = "bf16") -> int:
        """Bytes of weights one GPU holds with the routed experts split over `ep_size` ranks
        and everything else replicated on each (data-parallel attention). "bf16": 2 bytes a
        weight; "fp8": the projections DeepSeek stores in FP8 (attention, dense and shared
        MLPs, routed experts) take 1 byte plus a 4-byte scale per 128 x 128 block (partial
        blocks counted as full ones' share), the rest (embeddings, head, router, norms) bf16."""
        if weight_dtype not in ("bf16", "fp8"):
            raise ValueError(f"weight_dtype {weight_dtype!r}: expected 'bf16' or 'fp8'")
        h, layers = self.hidden_size, self.num_hidden_layers
        moe_layers = layers - self.first_k_dense_replace
        k_norm = 2 * self.index_head_dim if self.is_sparse else 0
        norms = layers * (2 * h + (self.q_lora_rank or 0) + self.kv_lora_rank + k_norm) + h
        attention = layers * self.attention_parameters() - (norms - h)
        dense = self.first_k_dense_replace * 3 * h * self.intermediate_size
        shared = moe_layers * self.n_shared_experts * self.expert_parameters()
        routed = moe_layers * self.n_routed_experts * self.expert_parameters()
        rest = self.num_parameters() - attention - dense - shared - routed
        projections = attention + dense + shared + routed // ep_size
        if weight_dtype == "bf16":
            return 2 * (projections + rest)
        return round(projections * (1 + 4 / 128**2)) + 2 * rest

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArgs:
        """From a Hugging Face DeepSeek-V3 or V3.2 `config.json` (V2/V3 field names, and
        V3.2's index_* ones)."""
        model_type = config.get("model_type")
        if model_type not in (None, "deepseek_v3", "deepseek_v32"):
            raise ValueError(f"model_type {model_type!r} is neither deepseek_v3 nor deepseek_v32")
        scoring = config.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"scoring_func {scoring!r}: only sigmoid (DeepSeek-V3) is supported")
        if config.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"topk_method {config['topk_method']!r}: only noaux_tc is supported")
        if (
            config.get("num_key_value_heads", config["num_attention_heads"])
            != config["num_attention_heads"]
        ):
            raise ValueError("MLA has as many key/value heads as attention heads")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in fields}
        if model_type == "deepseek_v32":
            values.setdefault("index_topk", 2048)  # transformers' DeepseekV32Config default
            values["rope_interleave"] = True  # its MLA rope is interleaved, with no such field
            layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 3)
            kinds = config.get("mlp_layer_types")
            if kinds and kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
                raise ValueError(
                    f"mlp_layer_types {kinds}: only the first first_k_dense_replace ({dense}) "
                    "layers may be dense, and the rest must be MoE"
                )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "yarn":
            values["rope_factor"] = rope.get("factor") or (
                config["max_position_embeddings"] / rope["original_max_position_embeddings"]
            )
            for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
                if rope.get(key) is not None:
                    values[key] = rope[key]
            values["mscale"] = rope.get("mscale") or 0.0
            values["mscale_all_dim"] = rope.get("mscale_all_dim") or 0.0
        elif kind == "default":
            values["rope_factor"] = 1.0
        else:
            raise ValueError(f"rope type {kind!r}: only default and yarn are supported")
        for key in ("eos_token_id", "bos_token_id"):
            if isinstance(values.get(key), list):
                values[key] = values[key][0]
        return cls(**values)


def attended_pairs(new: int, cached: int, limit: int | None = None) -> float:
    """(query, key) pairs of `new` tokens after `cached` ones, each token seeing its context
    (itself included), or at most `limit` tokens of it."""
    if limit is None:
        return new * cached + new * (new + 1) / 2
    whole = max(0, min(new, limit - cached))  # the first ones, whose whole context fits
    return attended_pairs(whole, cached) + (new - whole) * limit


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


PRESETS = {
    # Small enough for CPU tests in seconds; decode still runs through mla_kernels (512 + 64).
    "tiny": ModelArgs(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        rope_factor=4.0,
        original_max_position_embeddings=256,
        max_position_embeddings=1024,
    ),
    # DeepSeek-V2-Lite's shapes (16B parameters, 2.4B active) with V3's routing: one GPU.
    "v2-lite": ModelArgs(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        first_k_dense_replace=1,
        num_attention_heads=16,
        q_lora_rank=None,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        original_max_position_embeddings=4096,
        max_position_embeddings=163840,
        bos_token_id=100000,
        eos_token_id=100001,
    ),
    # DeepSeek-V3 (671B): for shapes and cost; not loaded here.
    "v3": ModelArgs(),
}
# DeepSeek-V3.2: the same with sparse attention. The tiny one picks 8 tokens with 4 index
# heads; the lite one has DeepSeek's indexer (64 heads of 128, top 2,048) on
# V2-Lite's shapes with a query latent (which the indexer reads) as in V2 and V3.
PRESETS |= {
    "v3.2-tiny": dataclasses.replace(PRESETS["tiny"], index_topk=8, index_n_heads=4),
    "v3.2-lite": dataclasses.replace(PRESETS["v2-lite"], q_lora_rank=1536, index_topk=2048),
    "v3.2": dataclasses.replace(PRESETS["v3"], index_topk=2048),
}
