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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ref_server.model.expert_location import check_placement


@dataclass(frozen=True)
class Move:
    """Slot `to` gets the weights slot `source` holds now (global slot ids), or with `ride`
    those slot `source` (of the same rank) receives in the same move."""

    to: int
    source: int
    ride: bool = False


@dataclass(frozen=True)
class Moved:
    """What an instance's slots took in during a re-placement, in bytes (the same on every
    rank: the plan is)."""

    copied: int = 0  # from a slot of the same rank
    sent: int = 0  # between ranks

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.copied + other.copied, self.sent + other.sent)


def plan_moves(old, new, ranks: int) -> list[Move]:
    """The moves that take slots from placement `old` to `new` (`[P]` ints, P/ranks slots per
    rank), in slot order: a changed slot copies from the lowest slot of its rank holding its
    new expert now, else rides on the first slot of its rank receiving that expert from a
    peer, else takes it from holder number (slot mod holders) elsewhere."""
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
            raise ValueError(f"expert {expert} has no slot in the placement in force")
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
    location, experts = moe.location, moe.experts
    if location is None:
        raise ValueError("this MoE layer has one fixed slot per expert: nothing to re-place")
    new = torch.as_tensor(new, dtype=torch.long).cpu()
    check_placement(new, location.num_logical, location.num_physical)
    rank, ranks = (0, 1) if group is None else (group.rank(), group.size())
    per_rank, first = experts.num_experts, moe.first_slot
    moves = plan_moves(location.physical_to_logical.cpu(), new, ranks)
    tensors = expert_tensors(experts)

    def read(slots: list[int]) -> torch.Tensor:
        parts = [_bytes(t[s - first]) for s in slots for t in tensors]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    mine = [m for m in moves if m.to // per_rank == rank]
    local = [m for m in mine if m.source // per_rank == rank and not m.ride]
    copied = _by_slot(local, read([m.source for m in local]))
    received = _exchange(moves, per_rank, rank, ranks, read, tensors, group)
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
    slot_bytes = sum(_bytes(t[0]).numel() for t in tensors)
    between = sum(m.to // per_rank != m.source // per_rank for m in moves)
    return Moved((len(moves) - between) * slot_bytes, between * slot_bytes)


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
