"""Helpers the tests and the benchmark share: routing, FP8 casts, spawning ranks, and an
allocation that fails."""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import queue
import socket
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_comm.config import SCALE_BLOCK
from ep_comm.fp8 import per_token_cast_to_fp8 as per_token_cast_to_fp8  # re-exported


class _FailingTorch:
    """`torch`, but for the next call of `allocator`, which raises torch.OutOfMemoryError."""

    def __init__(self, allocator: str) -> None:
        self.allocator = allocator
        self.failed = False

    def __getattr__(self, name: str):
        if name != self.allocator or self.failed:
            return getattr(torch, name)

        def out_of_memory(*args, **kwargs):
            self.failed = True
            raise torch.OutOfMemoryError(f"torch.{name}: out of memory (simulated)")

        return out_of_memory


@contextmanager
def out_of_memory_once(module: ModuleType, allocator: str):
    """Inside, the next `torch.<allocator>(...)` that `module` calls raises
    torch.OutOfMemoryError, as on a full GPU; yields whether it has."""
    failing = _FailingTorch(allocator)
    module.torch = failing
    try:
        yield failing
    finally:
        module.torch = torch


def random_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    generator: torch.Generator,
    *,
    skew: float = 1.0,
    drop: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, expert e drawn with weight (e + 1) ** -skew (skew 0: uniform),
    each choice replaced by -1 with probability `drop`. Returns topk_idx int64 and fp32 weights."""
    popularity = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    popularity = popularity[torch.randperm(num_experts, generator=generator)]
    probs = popularity.expand(num_tokens, num_experts)
    topk_idx = torch.multinomial(probs, num_topk, replacement=False, generator=generator)
    dropped = torch.rand(num_tokens, num_topk, generator=generator) < drop
    topk_idx = topk_idx.masked_fill(dropped, -1)
    topk_weights = torch.rand(num_tokens, num_topk, generator=generator, dtype=torch.float32)
    return topk_idx, topk_weights


def per_token_cast_back(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    shape = (values.shape[0], values.shape[1] // SCALE_BLOCK, SCALE_BLOCK)
    groups = values.float().view(shape) * scales.unsqueeze(2)
    return groups.view(values.shape).to(torch.bfloat16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world_size: int,
    module_path: str,
    function: str,
    *args,
    backend: str = "gloo",
    timeout: float = 60.0,
    limit: float = 300.0,
    gpu_per_rank: bool = False,
) -> list:
    """Run `function(rank, world_size, group, *args)` from the file `module_path` in
    `world_size` spawned processes joined in a process group; return each rank's result.

    Any rank's exception fails the call with every failing rank's traceback; a rank still
    running after `limit` seconds prints its threads' Python stacks to stderr, is killed and
    reported. `timeout` is the process group's.
    With CUDA, every rank uses GPU `EP_COMM_TEST_DEVICE` (0), or with `gpu_per_rank` GPU
    rank mod the GPU count (NCCL needs one per rank).
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    where = (module_path, function)
    processes = [
        context.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                backend,
                timeout,
                limit,
                gpu_per_rank,
                *where,
                args,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[bool, object]] = {}
    try:
        while len(outcomes) < world_size:
            rank, ok, value = results.get(timeout=limit)
            outcomes[rank] = (ok, value)
    except queue.Empty:
        pass
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    missing = [r for r in range(world_size) if r not in outcomes]
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    failures += [f"rank {r}: no result within {limit:g} s" for r in missing]
    if failures:
        raise AssertionError(f"{function} failed on {world_size} ranks:\n" + "\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]


def _rank_main(
    rank,
    world_size,
    port,
    backend,
    timeout,
    limit,
    gpu_per_rank,
    module_path,
    function,
    args,
    results,
):
    faulthandler.dump_traceback_later(max(limit - 2, 1))  # where a hung rank is stuck
    try:
        if backend == "nccl" or torch.cuda.is_available():
            shared = int(os.environ.get("EP_COMM_TEST_DEVICE", "0"))
            torch.cuda.set_device(rank % torch.cuda.device_count() if gpu_per_rank else shared)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        spec = importlib.util.spec_from_file_location(f"_ep_comm_rank_{rank}", module_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        value = getattr(module, function)(rank, world_size, dist.group.WORLD, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
