"""Where one MoE layer's experts live, when an instance balances them (EPLB), and their load.

Without it (the default) rank r of R holds logical experts [r E/R, (r+1) E/R), one slot each.
With it the layer has P >= E physical slots, P/R per rank, and slot p holds logical expert
`physical_to_logical[p]`: a hot expert may hold several slots (replicas, identical weights).
The router still chooses logical experts; `to_physical` sends each choice to one of its
replicas, chosen by the choice's place in the batch (token row * k + slot, modulo the count),
so the replicas share an expert's tokens evenly and the choice needs no random state.

Every table is a buffer on the model's device, changed only in place (`place`), so CUDA graphs
that captured the mapping follow a re-placement. So does the load: `load` `[P]` int64 counts
the choices routed to each slot since the last `take_load`; the low-latency dispatch adds what
this rank's slots received into `received` `[P/R]` int32 (ep_comm's
`cumulative_local_expert_recv_stats`) instead, which `take_load` folds in.
"""

from __future__ import annotations

import torch
from torch import nn


def default_placement(num_logical: int, num_physical: int) -> torch.Tensor:
    """`[P]` int64: slot p holds expert p % E (the first P - E experts get a second slot)."""
    return torch.arange(num_physical) % num_logical


class ExpertLocation(nn.Module):
    def __init__(self, num_logical: int, num_physical: int, ranks: int = 1) -> None:
        super().__init__()
        if num_physical < num_logical:
            raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} experts")
        if num_physical % ranks:
            raise ValueError(f"{num_physical} physical experts do not split over {ranks} ranks")
        self.num_logical, self.num_physical = num_logical, num_physical
        most = num_physical - num_logical + 1  # the replicas one expert can have
        buffers = {
            "physical_to_logical": torch.zeros(num_physical, dtype=torch.long),
            "logical_to_physical": torch.zeros(num_logical, most, dtype=torch.long),
            "replica_count": torch.ones(num_logical, dtype=torch.long),
            "load": torch.zeros(num_physical, dtype=torch.long),
            "received": torch.zeros(num_physical // ranks, dtype=torch.int32),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)

    def place(self, physical_to_logical) -> None:
        """Put the layer's slots to these experts: physical_to_logical `[P]` ints, every expert
        in at least one slot. The tables change in place; the weights are the caller's."""
        slots = torch.as_tensor(physical_to_logical, dtype=torch.long).cpu()
        check_placement(slots, self.num_logical, self.num_physical)
        count = torch.bincount(slots, minlength=self.num_logical)
        table = torch.full(self.logical_to_physical.shape, -1, dtype=torch.long)
        order = torch.argsort(slots, stable=True)  # each expert's slots, lowest first
        starts = torch.cumsum(count, 0) - count
        replica = torch.arange(self.num_physical) - starts[slots[order]]
        table[slots[order], replica] = order
        self.physical_to_logical.copy_(slots)
        self.logical_to_physical.copy_(table)
        self.replica_count.copy_(count)

    def to_physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids `[n, k]` int64 to the slots serving them `[n, k]` int64; -1 (no
        expert: a CUDA graph's padding row) stays -1."""
        n, k = ids.shape
        choice = torch.arange(n * k, device=ids.device).view(n, k)
        chosen = ids.clamp(min=0)
        slots = self.logical_to_physical[chosen, choice % self.replica_count[chosen]]
        return slots.masked_fill(ids < 0, -1)

    def count(self, slots: torch.Tensor) -> None:
        """Add a batch's choices `[n, k]` (slot ids; -1 counts nowhere) to `load`."""
        chosen = slots.flatten()
        self.load.index_add_(0, chosen.clamp(min=0), (chosen >= 0).long())

    def take_load(self, first_slot: int) -> torch.Tensor:
        """The load counted since the last call `[P]` int64 (this rank's share: what it routed,
        plus what its slots first_slot.. received through the low-latency dispatch), and
        zero the counts."""
        load = self.load.clone()
        load[first_slot : first_slot + self.received.numel()] += self.received.long()
        self.load.zero_()
        self.received.zero_()
        return load


def check_placement(slots: torch.Tensor, num_logical: int, num_physical: int) -> None:
    """ValueError naming what is wrong with a layer's physical-to-logical map."""
    if slots.shape != (num_physical,):
        raise ValueError(f"a placement needs {num_physical} slots, got shape {tuple(slots.shape)}")
    if slots.numel() and (slots.min() < 0 or slots.max() >= num_logical):
        raise ValueError(f"slots must hold experts in [0, {num_logical})")
    missing = sorted(set(range(num_logical)) - set(slots.tolist()))
    if missing:
        raise ValueError(f"experts {missing[:8]} have no slot")
