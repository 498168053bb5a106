"""The work one GPU does per step at DeepSeek's operating points, under perfectly even routing
(docs/reproduction.md, Per-rank work): routed (token, expert) pairs, rows per expert and per
GPU, shared-expert rows, and the bytes DeepEP's low-latency accounting moves per GPU per MoE
layer.

The dimensions are plain numbers (the V3 preset of `ref_server.model.ModelArgs`, whose package
imports torch; the tests check they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from ref_server.repro import published
from ref_server.repro.terms import Term, derived, positive

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class V3Dims:
    """The DeepSeek-V3 dimensions the per-rank work depends on; names as in `ModelArgs`
    (index_topk: DeepSeek-V3.2's sparse attention, None for V3's dense one)."""

    hidden_size: int = 7168
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_topk: int | None = None
    index_head_dim: int = 128

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def dispatch_bytes_per_pair(self) -> int:
        """DeepEP low-latency dispatch message: FP8 values, an fp32 scale per 128 channels and
        16 bytes of metadata (7,408 B at hidden 7168)."""
        return self.hidden_size + self.hidden_size // 128 * 4 + 16

    @property
    def combine_bytes_per_pair(self) -> int:
        """DeepEP low-latency combine message: BF16 values (14,336 B at hidden 7168)."""
        return 2 * self.hidden_size

    def kv_bytes_per_token_per_layer(self, fp8: bool) -> int:
        """The latent cache row: FP8 (512 e4m3 values, an fp32 scale per 128, 64 bf16 rope
        values: 656 B) or BF16 (576 values: 1,152 B); in V3.2 beside it the indexer's key,
        e4m3 with an fp32 scale as DeepSeek keeps it (132 B)."""
        index_key = self.index_head_dim + 4 if self.index_topk is not None else 0
        if fp8:
            latent = self.kv_lora_rank + self.kv_lora_rank // 128 * 4
            return latent + 2 * self.qk_rope_head_dim + index_key
        return 2 * (self.kv_lora_rank + self.qk_rope_head_dim) + index_key


V3 = V3Dims()


@dataclass(frozen=True)
class OperatingPoint:
    """A phase's layout: `gpus` expert-parallel ranks holding `physical_experts` expert slots,
    each GPU computing `tokens_per_gpu` new tokens per forward (decode: one per request) in
    `microbatches` microbatches. source and note: where the layout comes from, as for a Term."""

    phase: str
    gpus: int
    tokens_per_gpu: int
    microbatches: int = 2
    physical_experts: int = 288
    source: str = "assumed"
    note: str = "a layout chosen by the caller"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        for name in ("gpus", "tokens_per_gpu", "microbatches", "physical_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.physical_experts % self.gpus:
            raise ValueError(
                f"physical_experts ({self.physical_experts}) must split evenly over the "
                f"{self.gpus} GPUs"
            )
        if self.tokens_per_gpu % self.microbatches:
            raise ValueError(
                f"tokens_per_gpu ({self.tokens_per_gpu}) must split evenly into "
                f"{self.microbatches} microbatches"
            )
        self.tokens_term()  # checks source and note as a Term does

    def tokens_term(self) -> Term:
        """tokens_per_gpu as a term carrying the layout's source."""
        return Term(
            f"{self.phase}_tokens_per_gpu", self.tokens_per_gpu, "tok", self.source, self.note
        )


PREFILL_EP32 = OperatingPoint(
    "prefill",
    gpus=32,
    tokens_per_gpu=16_384,
    source="published",
    note="EP32, 288 expert slots (day 6); 16,384 tokens a GPU in 2 microbatches "
    f"({published.PROFILE})",
)
DECODE_EP144 = OperatingPoint(
    "decode",
    gpus=144,
    tokens_per_gpu=128,
    source="published",
    note="EP144, 288 expert slots (day 6); 128 requests a GPU, 2 microbatches "
    f"({published.PROFILE})",
)


@dataclass(frozen=True)
class RankWork:
    """Per MoE layer: pairs cluster-wide, rows per physical expert and per GPU, shared rows, and
    low-latency bytes per GPU (own-node and self traffic included; an upper bound for prefill,
    whose normal mode sends a token once per destination rank)."""

    routed_pairs: int
    rows_per_physical_expert: float
    local_experts: int
    rows_per_gpu: float
    shared_rows: int
    dispatch_bytes_per_gpu: float
    combine_bytes_per_gpu: float

    def terms(self, point: OperatingPoint) -> list[Term]:
        """Each figure as a term derived from the layout `point` (this work's)."""
        layout = f"{point.phase} EP{point.gpus}, {point.tokens_per_gpu} tokens a GPU, even routing"
        return [
            derived(
                f"{point.phase}_{name}", getattr(self, name), unit, [point.tokens_term()], layout
            )
            for name, unit in (
                ("routed_pairs", "pair"),
                ("rows_per_physical_expert", "row"),
                ("local_experts", "expert"),
                ("rows_per_gpu", "row"),
                ("shared_rows", "row"),
                ("dispatch_bytes_per_gpu", "B"),
                ("combine_bytes_per_gpu", "B"),
            )
        ]


def per_rank_work(dims: V3Dims, point: OperatingPoint) -> RankWork:
    if point.physical_experts < dims.n_routed_experts:
        raise ValueError(
            f"physical_experts ({point.physical_experts}) below the {dims.n_routed_experts} "
            "routed experts"
        )
    pairs = point.gpus * point.tokens_per_gpu * dims.num_experts_per_tok
    per_expert = pairs / point.physical_experts
    local = point.physical_experts // point.gpus
    rows = per_expert * local
    return RankWork(
        routed_pairs=pairs,
        rows_per_physical_expert=per_expert,
        local_experts=local,
        rows_per_gpu=rows,
        shared_rows=point.tokens_per_gpu * dims.n_shared_experts,
        dispatch_bytes_per_gpu=rows * dims.dispatch_bytes_per_pair,
        combine_bytes_per_gpu=rows * dims.combine_bytes_per_pair,
    )


def kv_cache_bytes(dims: V3Dims, requests: int, kv_length: float, fp8: bool) -> float:
    """Bytes of latent cache one GPU holds for `requests` of `kv_length` tokens, all layers."""
    if requests < 1 or kv_length <= 0:
        raise ValueError(f"requests ({requests}) and kv_length ({kv_length}) must be positive")
    per_token = dims.num_hidden_layers * dims.kv_bytes_per_token_per_layer(fp8)
    return requests * kv_length * per_token


def memory_check(weights: Term, kv_cache: Term, capacity: Term, requests: Term) -> list[Term]:
    """HBM left over on one GPU (negative: it does not fit), bytes, and how many of the
    `requests` whose cache `kv_cache` is would fit beside the weights."""
    for term in (weights, kv_cache, capacity):
        if term.unit != "B":
            raise ValueError(f"{term.name} must be in bytes (B), got {term.unit!r}")
    positive(requests)
    left = capacity.value - weights.value - kv_cache.value
    per_request = kv_cache.value / requests.value
    fitting = max(0, (capacity.value - weights.value) // per_request)
    inputs = [weights, kv_cache, capacity]
    return [
        derived(
            "hbm_left", left, "B", inputs, f"{capacity.name} - {weights.name} - {kv_cache.name}"
        ),
        derived(
            "decode_requests_that_fit",
            fitting,
            "request",
            [*inputs, requests],
            f"({capacity.name} - {weights.name}) / ({kv_cache.name} / {requests.name}), rounded "
            "down",
        ),
    ]
