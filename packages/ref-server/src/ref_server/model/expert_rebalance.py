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

When an instance loses ranks or a rank joins it (`regroup_experts`), the ranks that were there
keep the slots they hold, the slots per rank become the fewest that give every expert one (at
least as many as the instance started with), and only what must move does
(`place_lost_experts`): an expert no rank holds any more goes into an empty slot or in place of
a redundant copy, and slots still empty (a joining rank's) take copies of the experts with the
most load a copy, each from a slot that holds it, else from where the model's weights came (its
checkpoint, or a preset's seed). Placing every slot again would move most of them (at
DeepSeek's EP32, ~600 GB to recover ~20 GB of lost experts); EPLB rebalances afterwards as it
does any load. Where a rank's slots become fewer, the moves run over as many as it had, and the
slots past the new count go after.
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
    location = moe.location
    new = torch.as_tensor(new, dtype=torch.long).cpu()
    check_placement(new, location.num_logical, location.num_physical)
    moved, lost = _transfer(moe.experts, moe.first_slot, old, new, group, reload is not None)
    location.place(new)
    if lost:
        reload(moe, lost)
    return moved


def _transfer(experts, first, old, new, group, reload: bool) -> tuple[Moved, list[int]]:
    """The weights of a rank's slots (from global slot `first`), holding `old` now, to `new`
    (both `[P]`; a slot may stay empty, -1 in both); what the instance moved, and the logical
    experts this rank's slots must load (no slot held them; with reload, else ValueError)."""
    new = torch.as_tensor(new, dtype=torch.long).cpu()
    rank, ranks = (0, 1) if group is None else (group.rank(), group.size())
    per_rank = experts.num_experts
    moves = plan_moves(old, new, ranks, reload=reload)
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
    lost = sorted({int(new[m.to]) for m in moves if m.source is None and m.to // per_rank == rank})
    slot_bytes = sum(_bytes(t[0]).numel() for t in tensors)
    between = sum(m.to // per_rank != m.source // per_rank for m in held)
    loaded = len(moves) - len(held)
    moved = Moved((len(held) - between) * slot_bytes, between * slot_bytes, loaded * slot_bytes)
    return moved, lost


def kept_slots(old, sources: list[int | None], before: int, per_rank: int) -> torch.Tensor:
    """`[len(sources) * per_rank]`: the experts of placement `old` (`[P]`, `before` slots per
    rank) where the ranks keep them, rank i having been rank sources[i] (None: a joining rank,
    which holds none) with per_rank slots now: the first of its old slots that fit, then empty
    ones (-1)."""
    old = torch.as_tensor(old, dtype=torch.long).cpu()
    kept = torch.full((len(sources) * per_rank,), -1, dtype=torch.long)
    count = min(before, per_rank)
    for i, source in enumerate(sources):
        if source is not None:
            kept[i * per_rank : i * per_rank + count] = old[
                source * before : source * before + count
            ]
    return kept


def regroup_placement(old, sources: list[int | None], before: int, per_rank: int, load=None):
    """The placements of an instance's MoE layers over new ranks: (kept, new), int64
    `[layers, len(sources) * per_rank]`. old `[layers, P]`: the slots' experts now, `before` a
    rank; rank i was rank sources[i] (None: a joining rank) and keeps its slots that fit
    (`kept`, `kept_slots`); new: kept with the experts it lacks put in and its empty slots
    filled (`place_lost_experts`, by load `[layers or fewer, E]`, the layers past it even;
    None: even)."""
    old = np.asarray(old)
    num_logical = int(old.max()) + 1
    weight = np.ones((len(old), num_logical))
    if load is not None and np.asarray(load).any():
        weight[: len(load)] = load
    kept = np.stack([kept_slots(o, sources, before, per_rank).numpy() for o in old])
    new = np.stack([place_lost_experts(k, w, per_rank) for k, w in zip(kept, weight, strict=True)])
    return kept, new


def place_lost_experts(kept: np.ndarray, load: np.ndarray, per_rank: int) -> np.ndarray:
    """kept `[slots]` (-1: an empty slot) with every expert of load `[E]` it lacks put in,
    heaviest first: into an empty slot, else in place of a copy of an expert held more than
    once, the lightest per copy; among those, on the rank with the least load per copy (there
    is always one while slots >= E). Then each slot still empty takes a copy of the expert with
    the most load per copy that its rank does not hold yet."""
    placement = kept.copy()

    def per_copy():
        copies = np.bincount(placement[placement >= 0], minlength=len(load))
        return copies, load / np.maximum(copies, 1)

    for expert in np.argsort(-load, kind="stable"):
        copies, share = per_copy()
        if copies[expert]:
            continue
        slot_load = np.where(placement >= 0, share[placement], 0)
        rank_load = slot_load.reshape(-1, per_rank).sum(axis=1)
        candidates = np.flatnonzero(placement < 0)
        if not candidates.size:
            candidates = np.flatnonzero(copies[placement] > 1)
            candidates = candidates[slot_load[candidates] == slot_load[candidates].min()]
        placement[candidates[np.argmin(rank_load[candidates // per_rank])]] = expert
    for slot in np.flatnonzero(placement < 0):
        _, share = per_copy()
        rank = placement[slot // per_rank * per_rank : (slot // per_rank + 1) * per_rank]
        share[rank[rank >= 0]] = -1  # a second copy on one rank spreads nothing
        placement[slot] = int(np.argmax(share))
    return placement


def regroup_slots(old, sources: list[int | None], before: int, new) -> tuple[torch.Tensor, ...]:
    """What a regroup's moves go from and to, over as many slots per rank as any rank has
    during them (W, the most of `before` and new's): `[ranks * W]` each, the experts the ranks
    hold now (`kept_slots` of `old`), and new's (`[ranks * per_rank]`) in the first per_rank
    slots of each rank, the slots past them as they are (they go after the moves)."""
    ranks = len(sources)
    per_rank = len(new) // ranks
    widest = max(before, per_rank)
    held = kept_slots(old, sources, before, widest)
    target = held.view(ranks, widest).clone()
    target[:, :per_rank] = torch.as_tensor(new).view(ranks, per_rank)
    return held, target.flatten()


def regroup_experts(model, sources: list[int | None], group: dist.ProcessGroup, load=None) -> Moved:
    """After an instance lost ranks or with one that joins: its MoE layers' slots over
    `group`, whose rank i was rank sources[i] before (None: a joining rank). Each rank gets
    the fewest slots that give every expert one, at least the instance's slots per rank at
    start; `regroup_placement` places every layer's slots over the group by load
    (`[MoE layers, E]`; None: even), moving only what must; weights come as `_transfer`
    says, those of experts no rank holds from where the model's came
    (`ref_server.model.checkpoint.reload_experts`). Every rank of group calls it together; a
    joining rank learns the placement in force and the load from the lowest rank that was
    there."""
    layers = model.moe_layers(mtp=True)
    location = layers[0].location
    if location is None:
        raise ValueError("placing experts over other ranks needs a model built with expert slots")
    ep, rank, ranks = model.expert_parallel, group.rank(), len(sources)
    tables = torch.stack([m.location.physical_to_logical.cpu() for m in layers])
    before = layers[0].experts.num_experts
    if None in sources:
        tables, before, load = _from_a_rank_that_was_there(sources, group, tables, before, load)
    per_rank = max(ep.initial_per_rank, -(-location.num_logical // ranks))
    widest = max(before, per_rank)  # the moves run over as many slots as any rank has
    _, placement = regroup_placement(tables.numpy(), sources, before, per_rank, load)
    ep.regroup(group, per_rank * ranks)
    moved = Moved()
    for moe, old, new in zip(layers, tables, placement, strict=True):
        held, target = regroup_slots(old, sources, before, new)
        resize_slots(moe.experts, widest)
        layer_moved, lost = _transfer(moe.experts, rank * widest, held, target, group, True)
        resize_slots(moe.experts, per_rank)
        moe.first_slot = rank * per_rank
        device = moe.location.load.device
        moe.location = ExpertLocation(location.num_logical, per_rank * ranks, ranks).to(device)
        moe.location.place(new)
        if lost:
            reload_experts(model, moe, lost)
        moved += layer_moved
    source = model.weights_from
    source = f"the checkpoint {source}" if isinstance(source, Path) else f"seed {source}"
    log.warning(
        "placed the experts of %d MoE layers over %d ranks of %d slots: %.1f MB from the "
        "ranks' slots (%.1f MB between ranks), %.1f MB from %s",
        len(layers), ranks, per_rank, (moved.copied + moved.sent) / 1e6, moved.sent / 1e6,
        moved.loaded / 1e6, source,
    )  # fmt: skip
    return moved


def _from_a_rank_that_was_there(sources, group, tables: torch.Tensor, before: int, load):
    """The placement in force (`[layers, P]`), its slots per rank and the load (or None) as
    the lowest rank of group that was there has them, on every rank (a joining one has none
    of them)."""
    root = next(i for i, s in enumerate(sources) if s is not None)
    load = None if load is None else torch.as_tensor(np.asarray(load), dtype=torch.float64)
    header = torch.tensor([*tables.shape, before, *(load.shape if load is not None else (0, 0))])
    dist.broadcast(header, group_src=root, group=group)
    layers, slots, before, load_layers, experts = header.tolist()
    if group.rank() != root:
        tables = torch.empty(layers, slots, dtype=torch.long)
        load = torch.empty(load_layers, experts, dtype=torch.float64) if load_layers else None
    dist.broadcast(tables, group_src=root, group=group)
    if load is not None:
        dist.broadcast(load, group_src=root, group=group)
    return tables, before, None if load is None else load.numpy()


def resize_slots(experts, count: int) -> None:
    """A rank's routed experts to `count` slots: the first min(count, now) keep their
    weights, new ones are zero, those past count go."""
    before = experts.num_experts
    kept = min(before, count)
    for name, tensor in [*experts.named_parameters(), *experts.named_buffers()]:
        if tensor.shape[:1] != (before,):
            continue
        resized = tensor.new_zeros(count, *tensor.shape[1:])
        resized[:kept] = tensor[:kept]
        if isinstance(tensor, nn.Parameter):
            resized = nn.Parameter(resized, requires_grad=tensor.requires_grad)
        setattr(experts, name, resized)
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
