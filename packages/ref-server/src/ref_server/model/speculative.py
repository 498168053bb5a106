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

import numpy as np
import torch

from ref_server.model.cache import FP8, PagedKVCache
from ref_server.model.sampling import (
    SamplingParams,
    probabilities,
    sample_on_device,
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


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """int64 values on `device`, without waiting for its queue."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def draw_key(params: SamplingParams, position: int, stream: int) -> int:
    """The key of a draw for `position` of a sequence sampled with params, in `stream`."""
    return (sampling_key(params, position) + stream) % 2**63


def _keys(params: list[SamplingParams], positions: list[int], stream: int, device) -> torch.Tensor:
    """`draw_key` of each (params[i], positions[i]) on `device`."""
    return _on(device, [draw_key(p, at, stream) for p, at in zip(params, positions, strict=True)])


def draws(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A token from each row of probs `[rows, vocab]` (unnormalized), by the Gumbel-max trick
    with the row's key: `[rows]` on the device."""
    noise = -torch.log(-torch.log(uniform(keys, probs.shape[1])))
    return (probs.double().log() + noise).argmax(dim=-1)


def propose(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]):
    """The module's drafts from its logits `[rows, vocab]`, row i's for positions[i] of a
    sequence sampled with params[i]: the tokens `[rows]` int64 on the logits' device (the host
    does not wait), and the distribution q `[vocab]` each was drawn from (None for greedy
    params: the argmax)."""
    tokens = logits.argmax(dim=-1)
    probs = [None] * len(params)
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    if sampled:
        device = logits.device
        at = _on(device, sampled)
        params = [params[r] for r in sampled]
        q = probabilities(logits[at], params)
        keys = _keys(params, [positions[r] for r in sampled], DRAFT, device)
        tokens[at] = draws(q, keys)
        for k, r in enumerate(sampled):
            probs[r] = q[k]
    return tokens, probs


def accept(
    logits: torch.Tensor,
    first_rows: list[int],
    drafts: list[list[int]],
    draft_probs: list[list[torch.Tensor | None]],
    params: list[SamplingParams],
    positions: list[int],
    forced_acceptance: float | None = None,
) -> list[list[int]]:
    """The tokens a verify step gives each sequence: its accepted drafts and one more. logits
    `[rows, vocab]`: the model's, sequence i's at its newest token and at each draft in the
    rows from first_rows[i] on; drafts[i]: its module's tokens for positions positions[i],
    positions[i] + 1, ...; draft_probs[i]: the q each was drawn from (None for greedy params).
    forced_acceptance: a benchmark's hook that accepts each draft with this probability
    whatever the models say (the text is then not the model's). The whole batch is decided on
    the logits' device and read back once."""
    device = logits.device
    rows = [(i, j) for i, d in enumerate(drafts) for j in range(len(d) + 1)]
    row_params = [params[i] for i, _ in rows]
    row_positions = [positions[i] + j for i, j in rows]
    logits = logits[_on(device, [first_rows[i] + j for i, j in rows])]
    # each row's token after its sequence's drafts before it: the one more token when those are
    # all kept, and the greedy or forced rule's replacement of its own draft
    after = sample_on_device(logits, row_params, row_positions)
    tested = [r for r, (i, j) in enumerate(rows) if j < len(drafts[i])]  # one a draft
    tested_params = [row_params[r] for r in tested]
    tested_positions = [row_positions[r] for r in tested]
    tokens = _on(device, [t for d in drafts for t in d])
    u = uniform(_keys(tested_params, tested_positions, ACCEPT, device), 1)[:, 0]
    tested_at = _on(device, tested)
    replaced = after[tested_at]
    if forced_acceptance is not None:
        kept = u < forced_acceptance
    else:
        kept = tokens == replaced  # greedy: while the draft is the argmax
        sampled = [k for k, p in enumerate(tested_params) if not p.greedy]
        if sampled:
            q = [draft_probs[i][j] for i, d in enumerate(drafts) for j in range(len(d))]
            at = _on(device, sampled)
            kept[at], replaced[at] = _reject(
                logits[tested_at[at]],
                tokens[at],
                torch.stack([q[k] for k in sampled]),
                u[at],
                [tested_params[k] for k in sampled],
                [tested_positions[k] for k in sampled],
            )
    outcome = torch.cat([after, replaced, kept.long()]).tolist()
    after, replaced, kept = (
        outcome[: len(rows)],
        outcome[len(rows) : len(rows) + len(tested)],
        outcome[len(rows) + len(tested) :],
    )
    results, row, test = [], 0, 0
    for d in drafts:
        n = next((j for j in range(len(d)) if not kept[test + j]), len(d))
        results.append([*d[:n], replaced[test + n] if n < len(d) else after[row + n]])
        row, test = row + len(d) + 1, test + len(d)
    return results


def _reject(logits, tokens, q, u, params, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule for sampled drafts `tokens` `[m]`, each drawn from its row of q
    `[m, vocab]` and tested against the logits' row (its uniform draw in u): whether each is
    kept (u q(x) < p(x)), and its replacement, a draw from max(0, p - q)."""
    p = probabilities(logits, params)
    drafted = tokens.unsqueeze(1)
    kept = u * q.gather(1, drafted)[:, 0] < p.gather(1, drafted)[:, 0]
    replacement = draws((p - q).clamp(min=0), _keys(params, positions, REPLACE, logits.device))
    return kept, replacement


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
    probs = [[] for _ in counts]
    logits, hidden = model.every_row_step(batch, cache, hidden)
    ran = 1  # module steps
    rows = [s for s, n in enumerate(counts) if n]
    last = torch.tensor(batch.query_lens).cumsum(0)[rows] - 1
    logits, hidden = logits[last], hidden[last]
    context = list(batch.context_lens)  # each sequence's newest token's position
    drafted = []  # each draft step's sequences and their tokens on the device
    while rows:
        tokens, q = propose(logits, [params[s] for s in rows], [context[s] + 1 for s in rows])
        drafted.append((rows, tokens))
        for i, s in enumerate(rows):
            probs[s].append(q[i])
            context[s] += 1
        going = [i for i, s in enumerate(rows) if len(probs[s]) < counts[s]]
        rows, hidden = [rows[i] for i in going], hidden[going]
        if rows:
            table = batch.block_table[rows]
            step = StepBatch(tokens[going], [1] * len(rows), [context[s] for s in rows], table)
            logits, hidden = model.every_row_step(step, cache, hidden)
            ran += 1
    for _ in range(steps - ran):
        model.idle_step(cache, mtp=True)
    drafts = [[] for _ in counts]
    if drafted:  # read back once
        values = iter(torch.cat([t for _, t in drafted]).tolist())
        for rows, _ in drafted:
            for s in rows:
                drafts[s].append(next(values))
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
        ends = np.cumsum([len(n) for n in new]).tolist()  # where each sequence's rows end
        results = accept(
            logits, [end - len(d) - 1 for end, d in zip(ends, drafts, strict=True)], drafts,
            probs, [params] * len(active), [len(tokens[s]) for s in active], forced_acceptance,
        )  # fmt: skip
        going, mtp_new, hidden_rows = [], [], []
        for s, n, d, got, b, end in zip(active, new, drafts, results, before, ends, strict=True):
            known, row = len(n) - len(d), end - len(n)
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
