"""Generation in one process: the reference the server is checked against.

Each sequence gets its own contiguous pages of a fresh paged cache; all prompts are prefilled
in one step, then every step decodes one token for each unfinished sequence (absorbed MLA
through mla_kernels). Sampling is seeded by (seed, position): the same request gives the same
tokens here and in the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ref_server.model.cache import PagedKVCache, StepBatch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    max_tokens: int = 16
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at `position` of a sequence from `[vocab]` float32 logits. The draw depends on
    (seed, position) only, so every way of running a request (one process, an engine, prefill
    and decode in different processes) samples the same tokens."""
    if params.temperature == 0:
        return int(logits.argmax())
    generator = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % 2**63)
    logits = logits.float().cpu() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p  # keeps at least one
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    params: SamplingParams = SamplingParams(),
    *,
    page_size: int = 64,
    cache_dtype: torch.dtype = torch.bfloat16,
    return_logits: bool = False,
):
    """Token ids generated for each prompt (stopping at eos or a stop id, which is kept);
    with return_logits also each step's logits `[steps, vocab]` per prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    args = model.args
    if any(t < 0 or t >= args.vocab_size for p in prompts for t in p):
        raise ValueError(f"token ids must be in [0, {args.vocab_size})")
    device = model.embed_tokens.weight.device
    pages = [-(-(len(p) + params.max_tokens) // page_size) for p in prompts]
    cache = PagedKVCache(args, sum(pages), page_size, cache_dtype, device)
    first = torch.tensor([0, *pages]).cumsum(0)
    table = torch.full((len(prompts), max(pages)), 0, dtype=torch.int32)
    for s, n in enumerate(pages):
        table[s, :n] = torch.arange(first[s], first[s] + n)
    stops = set(params.stop_token_ids) | ({args.eos_token_id} - {None})
    outputs = [[] for _ in prompts]
    logits_out = [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    active = list(range(len(prompts)))
    new_tokens = [list(p) for p in prompts]
    while active:
        batch = StepBatch(
            input_ids=torch.tensor([t for s in active for t in new_tokens[s]], device=device),
            query_lens=[len(new_tokens[s]) for s in active],
            context_lens=[lengths[s] for s in active],
            block_table=table[active],
        )
        logits = model.forward_step(batch, cache)
        still = []
        for row, s in enumerate(active):
            token = sample(logits[row], params, lengths[s])
            outputs[s].append(token)
            if return_logits:
                logits_out[s].append(logits[row].cpu())
            new_tokens[s] = [token]
            lengths[s] += 1
            if token not in stops and len(outputs[s]) < params.max_tokens:
                still.append(s)
        active = still
    if return_logits:
        return outputs, [torch.stack(rows) for rows in logits_out]
    return outputs
