"""Whether a step runs two microbatches: each rank's wish, then one answer for all ranks.

Two microbatches pay only when a rank has enough tokens for one microbatch's compute to hide
the other's communication; below a threshold one batch is faster. Expert-parallel ranks meet
in every dispatch and combine, so they must all run the same number of microbatches: `agree`
settles it with one small all_gather per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MODES = ("decode", "prefill")

_IDLE = -1  # votes: this, 0 for one batch, or 1 + the index in MODES of the mode wanted
_ONE_BATCH = 0


@dataclass(frozen=True)
class Thresholds:
    """New tokens per rank from which a step runs two microbatches; mixed steps use prefill's."""

    decode: int = 64
    prefill: int = 512

    def __post_init__(self) -> None:
        for mode in MODES:
            value = getattr(self, mode)
            if value < 2:
                raise ValueError(
                    f"Thresholds.{mode} is {value}: two microbatches need at least 2 tokens"
                )


def wants_overlap(num_tokens: int, mode: str, thresholds: Thresholds = Thresholds()) -> bool:
    """Whether a rank with `num_tokens` new tokens in a `mode` step would run two microbatches."""
    _check_mode(mode)
    if num_tokens < 0:
        raise ValueError(f"num_tokens is {num_tokens}: it cannot be negative")
    return num_tokens >= getattr(thresholds, mode)


def agree(wants: bool, mode: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """The mode every rank runs two microbatches in this step, or None for one batch.

    wants: whether this rank would run two microbatches (see `wants_overlap`).
    mode: "decode" or "prefill"; None when this rank has no tokens (idle): then `wants` is
    ignored and the rank follows the others.
    group: the ranks that must agree; None, or a group of one rank, communicates nothing.

    Two microbatches run only if every non-idle rank wants them in the same mode; any other
    mix, or every rank idle, gives None. Every rank of `group` must call this, and all get the
    same answer: one all_gather of an int64 per rank, on the current CUDA device for a NCCL
    group, on the CPU otherwise.
    """
    if mode is None:
        vote = _IDLE
    else:
        _check_mode(mode)
        vote = 1 + MODES.index(mode) if wants else _ONE_BATCH
    if group is None or dist.get_world_size(group) == 1:
        votes = {vote}
    else:
        votes = set(_all_gather(vote, group))
    votes.discard(_IDLE)
    if len(votes) != 1:  # all idle, or the ranks disagree
        return None
    (agreed,) = votes
    return None if agreed == _ONE_BATCH else MODES[agreed - 1]


def _all_gather(vote: int, group: dist.ProcessGroup) -> list[int]:
    if dist.get_backend(group) == dist.Backend.NCCL:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.tensor([vote], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.cat(every).tolist()


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
