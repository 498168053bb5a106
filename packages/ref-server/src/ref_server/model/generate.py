"""Generation in one process: the reference the server is checked against.

Each sequence gets its own contiguous pages of a fresh paged cache; all prompts are prefilled
in one step, then every step decodes one token for each unfinished sequence (absorbed MLA
through mla_kernels). Sampling is seeded by (seed, position): the same request gives the same
tokens here and in the server.
"""

from __future__ import annotations

import torch

from ref_server.model.cache import FP8, PagedKVCache
from ref_server.model.sampling import SamplingParams, sample
from ref_server.model.step import StepBatch


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    params: SamplingParams | None = None,
    *,
    page_size: int = 64,
    cache_dtype: torch.dtype = torch.bfloat16,
    index_dtype: torch.dtype = FP8,
    return_logits: bool = False,
):
    """Token ids generated for each prompt (stopping at eos or a stop id, which is kept);
    with return_logits also each step's logits `[steps, vocab]` per prompt. index_dtype: a
    V3.2 model's indexer keys' in the cache (`PagedKVCache`)."""
    params = params or SamplingParams()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    args = model.args
    if any(t < 0 or t >= args.vocab_size for p in prompts for t in p):
        raise ValueError(f"token ids must be in [0, {args.vocab_size})")
    device = model.embed_tokens.weight.device
    pages = [-(-(len(p) + params.max_tokens) // page_size) for p in prompts]
    cache = PagedKVCache(args, sum(pages), page_size, cache_dtype, device, index_dtype)
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
        tokens = sample(logits, [params] * len(active), [lengths[s] for s in active])
        still = []
        for row, (s, token) in enumerate(zip(active, tokens, strict=True)):
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
