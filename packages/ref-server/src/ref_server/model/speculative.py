"""Speculative decoding with the MTP module (`ref_server.model.mtp`) as the draft model.

A round: the module drafts k tokens after a sequence's newest one (applied to its own output
for the second and third); the model verifies them in one step over the k + 1 tokens, whose
logits give the target distribution p of every drafted position and of the one after; the
drafts are accepted from the first on, greedily (while each is the model's argmax) or by the
rejection rule that keeps p (draft x, drawn from the module's q, stays with probability
min(1, p(x) / q(x)); the first rejected one is replaced by a draw from max(0, p - q),
normalized); one more token comes from p after the last accepted draft. The KV of rejected
drafts stays in the cache past the sequence's length, where the next round writes over it.
The module then reads the model's hidden states of the accepted tokens and drafts again.

Draws are seeded by (seed, position) as `sampling`'s, with a stream of their own for each use:
the same request gives the same tokens here and in the engine.

`generate_speculative` is the one-process reference; the engine's runner uses `draft` and
`accept`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ref_server.model.cache import FP8, PagedKVCache
from ref_server.model.sampling import (
    SamplingParams,
    probabilities,
    sample,
    sampling_key,
    uniform,
)
from ref_server.model.step import StepBatch

MAX_DRAFT_TOKENS = 3
# Added to a draw's key: the draft's Gumbel noise, the acceptance test, the replacement's noise.
DRAFT, ACCEPT, REPLACE = 0x5851F42D4C957F2D, 0x2545F4914F6CDD1D, 0x27BB2EE687B0B0FD


@dataclass
class SpeculativeStats:
    """Counts over verify steps: drafted tokens, accepted ones, and sequence-rounds."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_length(self) -> float:
        """Tokens a round gives a sequence on average: its accepted drafts and one more."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


def check_draft_tokens(draft_tokens: int) -> None:
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {draft_tokens}")


def _key(params: SamplingParams, position: int, stream: int) -> torch.Tensor:
    return torch.tensor([(sampling_key(params, position) + stream) % 2**63])


def _draw(probs: torch.Tensor, params: SamplingParams, position: int, stream: int) -> int:
    """A token from probs `[vocab]` (unnormalized), by the Gumbel-max trick."""
    noise = -torch.log(-torch.log(uniform(_key(params, position, stream), len(probs))[0]))
    return int((probs.double().log() + noise).argmax())


def propose(logits: torch.Tensor, params: SamplingParams, position: int):
    """The module's draft for `position` from its logits `[vocab]`, and the distribution q
    `[vocab]` it was drawn from (None for greedy params: the argmax)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits.unsqueeze(0), params)[0]
    return _draw(q, params, position, DRAFT), q


def accept(
    logits: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor | None],
    params: SamplingParams,
    position: int,
    forced_acceptance: float | None = None,
) -> list[int]:
    """The tokens a verify step gives one sequence: its accepted drafts and one more. logits
    `[len(drafts) + 1, vocab]`: the model's at the sequence's newest token and at each draft;
    drafts: the module's tokens for positions position, position + 1, ...; draft_probs: the q
    each was drawn from (None for greedy params). forced_acceptance: a benchmark's hook that
    accepts each draft with this probability whatever the models say (the text is then not
    the model's)."""
    greedy = params.greedy
    p = None if greedy else probabilities(logits, params)
    for j, (token, q) in enumerate(zip(drafts, draft_probs, strict=True)):
        at = position + j
        u = float(uniform(_key(params, at, ACCEPT), 1))
        if forced_acceptance is not None:
            kept = u < forced_acceptance
        elif greedy:
            kept = token == int(logits[j].argmax())
        else:
            kept = u * q[token] < p[j, token]
        if kept:
            continue
        if greedy or forced_acceptance is not None:
            return drafts[:j] + sample(logits[j : j + 1], [params], [at])
        residual = (p[j] - q).clamp(min=0)
        return [*drafts[:j], _draw(residual, params, at, REPLACE)]
    return drafts + sample(logits[-1:], [params], [position + len(drafts)])


@torch.no_grad()
def draft(
    model,
    cache: PagedKVCache,
    batch: StepBatch,
    hidden: torch.Tensor,
    params: list[SamplingParams],
    counts: list[int],
    steps: int = 0,
) -> tuple[list[list[int]], list[list[torch.Tensor | None]]]:
    """Drafts for each sequence of `batch` and the q of each. hidden `[n, hidden]`: the model's
    output hidden states of the tokens whose KV the module has not seen yet, each sequence's
    up to the one before its newest; batch: the token after each of those (so its newest
    last); counts: drafts per sequence (0 to MAX_DRAFT_TOKENS). Writes the module's KV of those
    tokens, and of each draft but the last. steps: the module's steps to run in all, where
    more than the drafts take (one a draft, one at least): an expert-parallel rank runs as
    many as its peer that drafts the most, the ones past its own idle (their experts' share)."""
    drafts = [[] for _ in counts]
    probs = [[] for _ in counts]
    logits, hidden = model.every_row_step(batch, cache, hidden)
    ran = 1  # module steps
    rows = [s for s, n in enumerate(counts) if n]
    last = torch.tensor(batch.query_lens).cumsum(0)[rows] - 1
    logits, hidden = logits[last], hidden[last]
    context = list(batch.context_lens)  # each sequence's newest token's position
    while rows:
        if drafts[rows[0]]:
            step = StepBatch(
                torch.tensor([drafts[s][-1] for s in rows], device=cache.device),
                [1] * len(rows),
                [context[s] for s in rows],
                batch.block_table[rows],
            )
            logits, hidden = model.every_row_step(step, cache, hidden)
            ran += 1
        for i, s in enumerate(rows):
            token, q = propose(logits[i], params[s], context[s] + 1)
            drafts[s].append(token)
            probs[s].append(q)
            context[s] += 1
        going = [i for i, s in enumerate(rows) if len(drafts[s]) < counts[s]]
        rows, hidden = [rows[i] for i in going], hidden[going]
    for _ in range(steps - ran):
        model.idle_step(cache, mtp=True)
    return drafts, probs


@torch.no_grad()
def generate_speculative(
    model,
    prompts: list[list[int]],
    params: SamplingParams | None = None,
    *,
    draft_tokens: int = 1,
    page_size: int = 64,
    cache_dtype: torch.dtype = torch.bfloat16,
    index_dtype: torch.dtype = FP8,
    forced_acceptance: float | None = None,
    stats: SpeculativeStats | None = None,
) -> list[list[int]]:
    """`generate`'s tokens for each prompt (greedy: the same; sampled: from the same
    distribution), by speculative decoding with draft_tokens drafts a round. stats: counts
    added to it; forced_acceptance as `accept`'s."""
    params = params or SamplingParams()
    check_draft_tokens(draft_tokens)
    if model.mtp is None:
        raise ValueError("speculative decoding needs a model with an MTP module")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    args = model.args
    if any(t < 0 or t >= args.vocab_size for p in prompts for t in p):
        raise ValueError(f"token ids must be in [0, {args.vocab_size})")
    stats = SpeculativeStats() if stats is None else stats
    device = model.embed_tokens.weight.device
    # a round writes the KV of up to draft_tokens positions past what it keeps
    pages = [-(-(len(p) + params.max_tokens + draft_tokens) // page_size) for p in prompts]
    cache = PagedKVCache(args, sum(pages), page_size, cache_dtype, device, index_dtype)
    first = torch.tensor([0, *pages]).cumsum(0)
    table = torch.zeros((len(prompts), max(pages)), dtype=torch.int32)
    for s, n in enumerate(pages):
        table[s, :n] = torch.arange(first[s], first[s] + n)
    stops = set(params.stop_token_ids) | ({args.eos_token_id} - {None})
    tokens = [list(p) for p in prompts]
    outputs = [[] for _ in prompts]
    computed = [0] * len(prompts)  # tokens whose KV is in the cache, the model's and the module's

    def batch_of(seqs: list[int], new: list[list[int]], before: list[int]) -> StepBatch:
        return StepBatch(
            torch.tensor([t for n in new for t in n], device=device),
            [len(n) for n in new],
            [b + len(n) for b, n in zip(before, new, strict=True)],
            table[seqs],
        )

    active = list(range(len(prompts)))
    drafts, probs = [[] for _ in active], [[] for _ in active]
    while active:
        # the uncomputed tokens (the prompt, or the newest one) and the drafts after them
        new = [tokens[s][computed[s] :] + d for s, d in zip(active, drafts, strict=True)]
        before = [computed[s] for s in active]
        logits, hidden = model.every_row_step(batch_of(active, new, before), cache)
        going, mtp_new, hidden_rows, row = [], [], [], 0
        for s, n, d, q, b in zip(active, new, drafts, probs, before, strict=True):
            known = len(n) - len(d)
            got = accept(
                logits[row + known - 1 : row + len(n)], d, q, params, len(tokens[s]),
                forced_acceptance,
            )  # fmt: skip
            if d:
                stats.rounds += 1
                stats.drafted += len(d)
                stats.accepted += len(got) - 1
            kept = known + len(got) - 1  # rows whose KV stays
            computed[s] += kept
            for token in got:
                tokens[s].append(token)
                outputs[s].append(token)
                if token in stops or len(outputs[s]) == params.max_tokens:
                    break
            else:
                going.append(s)
                # the module reads each kept row's hidden state with the token after it
                mtp_new.append(tokens[s][b + 1 : b + kept + 1])
                hidden_rows += range(row, row + kept)
            row += len(n)
        active = going
        if not active:
            break
        counts = [min(draft_tokens, params.max_tokens - len(outputs[s]) - 1) for s in active]
        before = [computed[s] - len(n) for s, n in zip(active, mtp_new, strict=True)]
        drafts, probs = draft(
            model, cache, batch_of(active, mtp_new, before), hidden[hidden_rows],
            [params] * len(active), counts,
        )  # fmt: skip
    return outputs
