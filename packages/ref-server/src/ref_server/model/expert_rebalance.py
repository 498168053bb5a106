"""Moving one MoE layer's experts to a new placement while the instance serves (EPLB).

Between two steps, every rank of the instance calls `move_layer` on the same layer with the
same new placement. Each slot whose expert changes gets the new expert's weights from a slot
that holds it now, in SGLang's order of cases: unchanged; a local copy, where a slot of the
same rank holds it; a free ride, where another slot of the rank receives it from a peer
(copied from there once it has arrived, so it crosses once); else from a peer, chosen by the
slot's index among the holders so that no one rank sends every copy of a hot expert. Each rank
sends a peer everything it needs from it in one message, a byte buffer of all the expert's
tensors (FP8 weights and their scales alike). The sources are read before any
slot is written, so a slot may be both a source and a destination. The weights and then the
routing tables change in place, so captured CUDA graphs replay the new placement.

`plan_moves` is the whole decision, pure and the same on every rank, so every send has its
receive.

When an instance loses ranks (`regroup_experts`), the survivors keep the slots they hold, each
gets as many more as every expert needs a slot among them, and only the experts no survivor
holds move: each into an empty slot or in place of a redundant copy (`place_lost_experts`),
from where the model's weights came (its checkpoint, or a preset's seed). Placing every slot
over the survivors again would move most of them (at DeepSeek's EP32, ~600 GB to recover
~20 GB of lost experts); EPLB rebalances the survivors afterwards as it does any load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ref_server.model.checkpoint import reload_experts
from ref_server.model.expert_location import ExpertLocation, check_placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    """Slot `to` gets the weights slot `source` holds now (global slot ids), or with `ride`
    those slot `source` (of the same rank) receives in the same move; source None: no slot
    holds the expert (its rank was lost), whose weights are loaded again."""

    to: int
    source: int | None
    ride: bool = False


@dataclass(frozen=True)
class Moved:
    """What an instance's slots took in during a re-placement, in bytes (the same on every
    rank: the plan is)."""

    copied: int = 0  # from a slot of the same rank
    sent: int = 0  # between ranks
    loaded: int = 0  # from the checkpoint (or a preset's seed): no slot held them

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.copied + other.copied, self.sent + other.sent, self.loaded + other.loaded)


def plan_moves(old, new, ranks: int, reload: bool = False) -> list[Move]:
    """The moves that take slots from placement `old` to `new` (`[P]` ints, P/ranks slots per
    rank), in slot order: a changed slot copies from the lowest slot of its rank holding its
    new expert now, else rides on the first slot of its rank receiving that expert from a
    peer, else takes it from holder number (slot mod holders) elsewhere. old may have empty
    slots (-1). An expert no slot holds is a ValueError, or with reload a `Move(slot, None)`."""
    old, new = torch.as_tensor(old).tolist(), torch.as_tensor(new).tolist()
    per_rank = len(old) // ranks
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old):
        holders.setdefault(expert, []).append(slot)
    moves, arriving = [], {}  # (rank, expert): the slot of the rank receiving it from a peer
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        if expert not in holders:
            if not reload:
                raise ValueError(f"expert {expert} has no slot in the placement in force")
            moves.append(Move(slot, None))
            continue
        rank = slot // per_rank
        near = [s for s in holders[expert] if s // per_rank == rank]
        if near:
            moves.append(Move(slot, near[0]))
        elif (rank, expert) in arriving:
            moves.append(Move(slot, arriving[rank, expert], ride=True))
        else:
            arriving[rank, expert] = slot
            moves.append(Move(slot, holders[expert][slot % len(holders[expert])]))
    return moves


def expert_tensors(experts) -> list[torch.Tensor]:
    """The tensors of a rank's routed experts stacked by slot, in name order."""
    named = [*experts.named_parameters(), *experts.named_buffers()]
    return [
        t for _, t in sorted(named, key=lambda n: n[0]) if t.shape[:1] == (experts.num_experts,)
    ]


@torch.no_grad()
def move_layer(moe, new, group: dist.ProcessGroup | None = None) -> Moved:
    """Put `moe`'s slots to placement `new` (`[P]` ints, every expert held), moving weights
    as `plan_moves` says; every rank of `group` calls it together. What the instance moved."""
    if moe.location is None:
        raise ValueError("this MoE layer has one fixed slot per expert: nothing to re-place")
    return _move(moe, moe.location.physical_to_logical.cpu(), new, group)


def _move(moe, old: torch.Tensor, new, group, reload: Callable | None = None) -> Moved:
    """`moe`'s slots, holding `old` now, to `new`; reload(moe, experts): load this rank's
    slots of these logical experts (no slot held them) once the placement is in force."""
    location, experts = moe.location, moe.experts
    new = torch.as_tensor(new, dtype=torch.long).cpu()
    check_placement(new, location.num_logical, location.num_physical)
    rank, ranks = (0, 1) if group is None else (group.rank(), group.size())
    per_rank, first = experts.num_experts, moe.first_slot
    moves = plan_moves(old, new, ranks, reload=reload is not None)
    held = [m for m in moves if m.source is not None]
    tensors = expert_tensors(experts)

    def read(slots: list[int]) -> torch.Tensor:
        parts = [_bytes(t[s - first]) for s in slots for t in tensors]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    mine = [m for m in held if m.to // per_rank == rank]
    local = [m for m in mine if m.source // per_rank == rank and not m.ride]
    copied = _by_slot(local, read([m.source for m in local]))
    received = _exchange(held, per_rank, rank, ranks, read, tensors, group)
    for slot, data in (*copied.items(), *received.items()):
        offset = 0
        for t in tensors:
            size = _bytes(t[0]).numel()
            _bytes(t[slot - first]).copy_(data[offset : offset + size])
            offset += size
    for move in (m for m in mine if m.ride):
        for t in tensors:
            t[move.to - first].copy_(t[move.source - first])
    location.place(new)
    lost = sorted({int(new[m.to]) for m in moves if m.source is None and m.to // per_rank == rank})
    if lost:
        reload(moe, lost)
    slot_bytes = sum(_bytes(t[0]).numel() for t in tensors)
    between = sum(m.to // per_rank != m.source // per_rank for m in held)
    loaded = len(moves) - len(held)
    return Moved((len(held) - between) * slot_bytes, between * slot_bytes, loaded * slot_bytes)


def kept_slots(old, survivors: list[int], before: int, per_rank: int) -> torch.Tensor:
    """`[len(survivors) * per_rank]`: the experts of placement `old` (`[P]`, `before` slots per
    rank) where the survivors keep them, survivor i being rank i with per_rank >= before
    slots: its old slots first, then empty ones (-1)."""
    old = torch.as_tensor(old, dtype=torch.long).cpu()
    kept = torch.full((len(survivors) * per_rank,), -1, dtype=torch.long)
    for i, survivor in enumerate(survivors):
        kept[i * per_rank : i * per_rank + before] = old[
            survivor * before : (survivor + 1) * before
        ]
    return kept


def regroup_placement(old, survivors: list[int], before: int, num_logical: int, load=None):
    """The placements of an instance's MoE layers once it lost ranks: (kept, new), int64
    `[layers, len(survivors) * per_rank]`. old `[layers, P]`: the slots' experts now, `before`
    a rank; survivor i (rank survivors[i] before) keeps its slots and gets as many more as the
    experts need (per_rank: at least num_logical / survivors); kept: the survivors' slots before
    anything moves (`kept_slots`), new: kept with the experts only lost ranks held put in
    (`place_lost_experts`, by load `[layers or fewer, num_logical]`, the layers past it even;
    None: even). Nothing else moves: EPLB balances the survivors later, as it does any load."""
    old = np.asarray(old)
    ranks = len(survivors)
    per_rank = max(before, -(-num_logical // ranks))
    weight = np.ones((len(old), num_logical))
    if load is not None and np.asarray(load).any():
        weight[: len(load)] = load
    kept = np.stack([kept_slots(o, survivors, before, per_rank).numpy() for o in old])
    new = np.stack([place_lost_experts(k, w, per_rank) for k, w in zip(kept, weight, strict=True)])
    return kept, new


def place_lost_experts(kept: np.ndarray, load: np.ndarray, per_rank: int) -> np.ndarray:
    """kept `[slots]` (-1: an empty slot) with every expert of load `[E]` it lacks put in,
    heaviest first: into an empty slot, else in place of a copy of an expert held more than
    once, the lightest per copy; among those, on the rank with the least load per copy. There
    is always one while slots >= E."""
    placement = kept.copy()
    held = set(placement[placement >= 0].tolist())
    for expert in np.argsort(-load, kind="stable"):
        if expert in held:
            continue
        copies = np.bincount(placement[placement >= 0], minlength=len(load))
        per_copy = np.where(placement >= 0, load[placement] / np.maximum(copies[placement], 1), 0)
        rank_load = per_copy.reshape(-1, per_rank).sum(axis=1)
        candidates = np.flatnonzero(placement < 0)
        if not candidates.size:
            candidates = np.flatnonzero(copies[placement] > 1)
            candidates = candidates[per_copy[candidates] == per_copy[candidates].min()]
        placement[candidates[np.argmin(rank_load[candidates // per_rank])]] = expert
        held.add(int(expert))
    return placement


def regroup_experts(model, survivors: list[int], group: dist.ProcessGroup, load=None) -> Moved:
    """After an instance lost ranks: its MoE layers' slots over `group`, whose rank i was rank
    survivors[i] before, placed as `regroup_placement` says by load (`[MoE layers, E]`, the same
    on every rank; None: even; the MTP module's layer, past the model's, stays even); weights
    come as `_move` says, those of experts no survivor holds from where the model's came
    (`ref_server.model.checkpoint.reload_experts`). The survivors call it together."""
    layers = model.moe_layers() + ([model.mtp.mlp] if model.mtp else [])
    location = layers[0].location
    if location is None:
        raise ValueError("placing experts over fewer ranks needs a model built with expert slots")
    current = np.stack([m.location.physical_to_logical.cpu().numpy() for m in layers])
    kept, placement = regroup_placement(
        current, survivors, layers[0].experts.num_experts, location.num_logical, load
    )
    ranks = len(survivors)
    per_rank = kept.shape[1] // ranks
    model.expert_parallel.regroup(group, per_rank * ranks)
    moved = Moved()
    for moe, old, new in zip(layers, kept, placement, strict=True):
        resize_slots(moe.experts, per_rank)
        moe.first_slot = group.rank() * per_rank
        device = moe.location.load.device
        moe.location = ExpertLocation(location.num_logical, per_rank * ranks, ranks).to(device)
        old = torch.from_numpy(old)
        moved += _move(moe, old, new, group, lambda m, experts: reload_experts(model, m, experts))
    source = model.weights_from
    source = f"the checkpoint {source}" if isinstance(source, Path) else f"seed {source}"
    log.warning(
        "placed the experts of %d MoE layers over %d ranks of %d slots: %.1f MB from the "
        "survivors' slots (%.1f MB between ranks), %.1f MB from %s",
        len(layers), ranks, per_rank, (moved.copied + moved.sent) / 1e6, moved.sent / 1e6,
        moved.loaded / 1e6, source,
    )  # fmt: skip
    return moved


def resize_slots(experts, count: int) -> None:
    """A rank's routed experts to `count` slots (at least as many as now): each slot keeps
    its weights, the new ones are zero."""
    before = experts.num_experts
    for name, tensor in [*experts.named_parameters(), *experts.named_buffers()]:
        if tensor.shape[:1] != (before,):
            continue
        grown = tensor.new_zeros(count, *tensor.shape[1:])
        grown[:before] = tensor
        if isinstance(tensor, nn.Parameter):
            grown = nn.Parameter(grown, requires_grad=tensor.requires_grad)
        setattr(experts, name, grown)
    experts.num_experts = count


def _exchange(moves, per_rank, rank, ranks, read, tensors, group) -> dict[int, torch.Tensor]:
    """Send each peer the slots it needs from this rank, receive those this rank needs; the
    received bytes by destination slot."""
    if ranks == 1:
        return {}
    slot_bytes = sum(_bytes(t[0]).numel() for t in tensors)
    device = tensors[0].device
    staged = dist.get_backend(group) == dist.Backend.GLOO and device.type != "cpu"
    ops, inbox = [], {}
    for peer in range(ranks):
        address = dist.get_global_rank(group, peer)
        if peer == rank:
            continue
        outgoing = [m for m in moves if m.source // per_rank == rank and m.to // per_rank == peer]
        incoming = [m for m in moves if m.source // per_rank == peer and m.to // per_rank == rank]
        if outgoing:
            data = read([m.source for m in outgoing])
            ops.append(dist.P2POp(dist.isend, data.cpu() if staged else data, address, group))
        if incoming:
            buffer = torch.empty(len(incoming) * slot_bytes, dtype=torch.uint8)
            buffer = buffer if staged else buffer.to(device)
            ops.append(dist.P2POp(dist.irecv, buffer, address, group))
            inbox[peer] = (incoming, buffer)
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    arrived = {}
    for incoming, buffer in inbox.values():
        arrived.update(_by_slot(incoming, buffer.to(device)))
    return arrived


def _by_slot(moves: list[Move], data: torch.Tensor) -> dict[int, torch.Tensor]:
    """The moves' destination slots to their shares of `data`, the slots' bytes in order."""
    return dict(zip((m.to for m in moves), data.chunk(len(moves)), strict=True)) if moves else {}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (written through)."""
    return t.view(-1).view(torch.uint8)
