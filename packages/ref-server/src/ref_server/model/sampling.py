"""Sampling parameters and the batched sampler.

A sampled token is the argmax of its scaled, top-k / top-p masked logits plus Gumbel noise
(the Gumbel-max trick: a draw from their softmax). The noise of token t at a sequence's
position p is a hash of (seed, p, t): one batched pass on the logits' device, no generator, no
per-row host work, and the draw depends on (seed, position, logits) only. So every way of
running a request (one process, an engine, prefill and decode in different processes, any
batch) samples the same tokens from the same logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Below this, logits / temperature overflows float32 (or the temperature itself underflows to 0
# on the way to the device) and the draw is noise: such temperatures are greedy.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    max_tokens: int = 16
    seed: int = 0
    # given as any iterable; kept as a frozenset, which the engine tests every sequence's new
    # token against at every step
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature:g}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """The token of each row of `logits` `[b, vocab]` float32, row i drawn with params[i] for
    position positions[i] of its sequence (the position the token will take)."""
    return sample_on_device(logits, params, positions).tolist()


def sample_on_device(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> torch.Tensor:
    """`sample`'s tokens `[b]` int64 on the logits' device, queued behind them: the host does
    not wait for the device."""
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if not drawn:  # top-k and top-p always keep the argmax
        return logits.argmax(dim=-1)
    device = logits.device
    scored = _scores(logits, params)
    keys = [sampling_key(params[r], positions[r]) for r in drawn]
    scored[_to(device, drawn)] += _gumbel(_to(device, keys), scored.shape[1])
    return scored.argmax(dim=-1)


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution `sample` draws each row of logits `[rows, vocab]` from, row i with
    params[i] (not greedy ones), float32."""
    return _scores(logits, params).softmax(dim=-1)


def _scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`scores` of each row with its params (temperature 1 for greedy ones), top-k and top-p
    applied where any row asks for them."""
    device, vocab = logits.device, logits.shape[1]
    temperature = _to(device, [1.0 if p.greedy else p.temperature for p in params])
    if not any(p.top_k or p.top_p < 1 for p in params):
        return scores(logits, temperature)
    top_k = _to(device, [p.top_k or vocab for p in params])
    return scores(logits, temperature, top_k, _to(device, [p.top_p for p in params]))


def scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row of logits `[rows, vocab]` over its temperature `[rows]`, float32; with top_k
    `[rows]` int64 (vocab: all tokens) and top_p `[rows]`, -inf outside the row's top_k best
    tokens, then outside the fewest best ones whose probabilities reach top_p (the best one
    always stays). No host reads: CUDA graphs capture it."""
    scaled = logits.float() / temperature.unsqueeze(-1)
    if top_k is None:
        return scaled
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[1], device=scaled.device)
    ordered = ordered.masked_fill(rank >= top_k.unsqueeze(-1), float("-inf"))
    probs = ordered.softmax(dim=-1)
    ordered = ordered.masked_fill(
        probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(-1), float("-inf")
    )
    return torch.empty_like(scaled).scatter_(1, order, ordered)


def _to(device: torch.device, values: list) -> torch.Tensor:
    """values on `device` without waiting for its queue (a blocking copy from the host would
    wait for the step's kernels before the sampler's own could be queued)."""
    return torch.tensor(values).to(device, non_blocking=True)


def _signed(constant: int) -> int:
    return constant - 2**64 if constant >= 2**63 else constant


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical shift of int64 words (torch shifts them arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def sampling_key(params: SamplingParams, position: int) -> int:
    """The key of a draw for `position` of a sequence sampled with params."""
    return (params.seed * 1_000_003 + position) % 2**63


def _gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[rows, vocab]` float32 standard Gumbel noise from `uniform`."""
    return (-torch.log(-torch.log(uniform(keys, vocab)))).float()


def uniform(keys: torch.Tensor, count: int) -> torch.Tensor:
    """`[rows, count]` float64 uniform in (0, 1): splitmix64 of (key, column), int64 arithmetic
    wrapping alike on every device."""
    tokens = torch.arange(count, device=keys.device)
    z = keys.unsqueeze(-1) * _signed(0x9E3779B97F4A7C15) + tokens
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).double() + 0.5) / 2**53
