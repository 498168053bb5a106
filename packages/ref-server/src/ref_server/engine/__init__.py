"""The engine of one instance: scheduler and block manager (no torch), model runner, expert
balancer."""

from ref_server.engine.block_manager import BlockManager, block_hash, prefix_hashes
from ref_server.engine.engine import Engine
from ref_server.engine.expert_balancer import EplbConfig, ExpertBalancer
from ref_server.engine.scheduler import QueueFull, Scheduler, SchedulerConfig, Step
from ref_server.engine.sequence import FinishReason, Sequence, Status

__all__ = [
    "BlockManager",
    "Engine",
    "EplbConfig",
    "ExpertBalancer",
    "FinishReason",
    "QueueFull",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "Status",
    "Step",
    "block_hash",
    "prefix_hashes",
]
