"""An instance's expert load balancer (EPLB): every `interval` steps, a new placement from the
load its MoE layers counted, moved in while the instance serves.

The MoE layers count the tokens routed to each expert slot on the GPU (`ExpertLocation.load`,
inside CUDA graphs too). Only when a window of `interval` steps ends are the counts read: every
rank's are summed (one all_reduce of `[MoE layers, slots]`), folded onto logical experts, and
`ref_server.balance.rebalance_experts` places the slots anew for the instance's ranks, keeping
in place what it can. Then `layers_per_step` layers move after each following step
(`move_layer`), so no one step waits for every layer's weights. A window runs on while layers
move; the counts it reads cover every step since the last read.

Every rank of an instance steps together (`ModelRunner.plan`), so each calls `step_done` after
the same steps, reads the same summed load and computes the same placement; the ranks' moves
pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ref_server.balance import rebalance_experts, write_placement
from ref_server.model.expert_parallel import group_of, ranks_of
from ref_server.model.expert_rebalance import Moved, move_layer


@dataclass(frozen=True)
class EplbConfig:
    """interval: steps per load window; layers_per_step: MoE layers moved after each step
    once a window ends; save_to: a file that rank 0 writes each placement to once every layer
    holds it (`read_placement` reads it)."""

    interval: int
    layers_per_step: int = 1
    save_to: Path | None = None

    def __post_init__(self) -> None:
        if self.interval < 1 or self.layers_per_step < 1:
            raise ValueError(
                f"the EPLB interval ({self.interval}) and layers per step "
                f"({self.layers_per_step}) must be >= 1"
            )


class ExpertBalancer:
    def __init__(self, model, config: EplbConfig) -> None:
        """model: one whose MoE layers have expert slots (`num_physical_experts`)."""
        self.layers = model.moe_layers(mtp=True)
        if not self.layers or self.layers[0].location is None:
            raise ValueError("expert balancing needs a model built with num_physical_experts")
        self.args = model.args
        self.expert_parallel = model.expert_parallel
        self.interval, self.layers_per_step = config.interval, config.layers_per_step
        self.steps = 0
        self.pending: list[tuple[int, np.ndarray]] = []  # (MoE layer, its new placement)
        self.rebalances = 0  # placements computed
        self.moved = Moved()  # the bytes the instance moved since the start
        shape = (len(self.layers), self.layers[0].location.num_logical)
        self.counted = torch.zeros(shape, dtype=torch.long)  # this rank's, folded so far
        self.last_load = np.zeros(shape, dtype=np.int64)  # the last window's, summed
        self.save_to = config.save_to

    @property
    def group(self) -> dist.ProcessGroup | None:
        return group_of(self.expert_parallel)

    @property
    def ranks(self) -> int:
        return ranks_of(self.expert_parallel)

    def placement(self) -> np.ndarray:
        """`[MoE layers, slots]` int64: the logical expert each slot holds now."""
        return np.stack([m.location.physical_to_logical.cpu().numpy() for m in self.layers])

    def step_done(self) -> None:
        """After each step every rank ran: move the next layers, or end a window."""
        self.steps += 1
        if self.pending:
            self.move(self.layers_per_step)
        if self.steps % self.interval == 0:
            self.rebalance()

    def move(self, layers: int | None = None) -> None:
        """Move the next `layers` pending layers (None: all of them), every rank together;
        once none is left, the placement is saved."""
        for layer, new in self.pending[:layers]:
            self._fold(layer)  # counted by the slots it has now
            self.moved += move_layer(self.layers[layer], new, self.group)
        del self.pending[:layers]
        if not self.pending:
            self._save()

    def rebalance(self) -> None:
        """Read the window's load and queue the layers whose placement changes (none after a
        window without tokens: there is nothing to balance)."""
        self.last_load, current = self.load(), self.placement()
        if not self.last_load.any():
            return
        placement = rebalance_experts(
            self.last_load, current.shape[1], self.args.n_group, 1, self.ranks, previous=current
        )
        self.rebalances += 1
        self.pending = [
            (i, new) for i, new in enumerate(placement.phy2log) if (new != current[i]).any()
        ]
        if not self.pending:
            self._save()

    def before_regroup(self) -> np.ndarray:
        """Before the instance's slots are placed over fewer ranks: the load to place them by
        (the last window's, summed over every rank then); this rank's counts are kept, and no
        layer is left to move."""
        for layer in range(len(self.layers)):
            self._fold(layer)
        self.pending = []
        return self.last_load

    def load(self) -> np.ndarray:
        """`[MoE layers, logical experts]` int64: the tokens routed to each expert since the
        last read, summed over the ranks (the counts restart)."""
        for layer in range(len(self.layers)):
            self._fold(layer)
        load, self.counted = self.counted, torch.zeros_like(self.counted)
        if self.group is not None:
            on_cuda = dist.get_backend(self.group) == dist.Backend.NCCL
            load = load.to(self.layers[0].location.load.device) if on_cuda else load
            dist.all_reduce(load, group=self.group)
        return load.cpu().numpy()

    def _fold(self, layer: int) -> None:
        """Add a layer's slot counts to its experts' (the GPU waits for the step here)."""
        location = self.layers[layer].location
        slots = location.take_load(self.layers[layer].first_slot).cpu()
        self.counted[layer].index_add_(0, location.physical_to_logical.cpu(), slots)

    def _save(self) -> None:
        if self.save_to is not None and (self.group is None or self.group.rank() == 0):
            write_placement(self.save_to, self.placement(), self.layers[0].location.num_logical)
