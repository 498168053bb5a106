"""The few collectives ep_comm uses, with errors that say which rank failed at which step.

Every call waits at most `timeout` (`device_timeout` where it follows kernels that wait on peers
themselves); a peer that never arrives (it crashed, or raised before calling) makes the others
raise `EPCommError` instead of hanging. Before moving data, ranks
exchange their arguments' signature and any local validation problem (`agree`), so that bad
arguments on one rank raise a clear `ValueError` on every rank.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

MESSAGE_BYTES = 4096  # a rank's signature and problem, JSON-encoded
HOST_MARGIN = timedelta(seconds=5)


class EPCommError(RuntimeError):
    """A collective failed or timed out."""


class Collectives:
    def __init__(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout = timeout
        # A rank's kernels may wait `timeout` for a peer whose own kernels waited `timeout` for
        # a third: collectives after device work wait that long (and a margin), so that every
        # rank leaves a failed step from the same collective.
        self.device_timeout = 2 * timeout + HOST_MARGIN
        # gloo moves CPU tensors only: CUDA tensors go through host memory there.
        self.through_cpu = dist.get_backend(group) == dist.Backend.GLOO
        self.device = torch.device("cpu")
        if not self.through_cpu:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def wait(self, step: str, work, timeout: timedelta | None = None) -> None:
        timeout = timeout or self.timeout
        try:
            work.wait(timeout=timeout)
        except RuntimeError as error:
            raise EPCommError(
                f"ep_comm rank {self.rank}/{self.size}: {step} failed or timed out after "
                f"{timeout.total_seconds():g} s waiting for the other ranks ({error})"
            ) from error

    def agree(
        self,
        step: str,
        signature: dict,
        problem: str | None,
        failure: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        """Raise on every rank if any rank has a `problem` (ValueError) or an earlier `failure`
        (EPCommError), or if the signatures differ; waits at most `timeout` (default: the
        buffer's)."""
        problem = problem and problem[:1000]  # the whole entry must fit MESSAGE_BYTES
        failure = failure and failure[:1000]
        payload = json.dumps([signature, problem, failure]).encode()
        if len(payload) > MESSAGE_BYTES:
            raise ValueError(f"{step}: argument signature too long ({len(payload)} bytes)")
        local = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.empty_like(local) for _ in range(self.size)]
        try:
            work = dist.all_gather(gathered, local, group=self.group, async_op=True)
            self.wait(step, work, timeout)
        except EPCommError as error:
            if failure is not None:  # the likelier cause
                raise EPCommError(failure) from error
            raise
        entries = [json.loads(bytes(t.cpu().tolist()).rstrip(b"\0")) for t in gathered]
        failures = [(rank, entry[2]) for rank, entry in enumerate(entries) if entry[2]]
        if failures:  # the same error everywhere: the lowest rank's
            rank, first = failures[0]
            raise EPCommError(first if rank == self.rank else f"{step}: rank {rank}: {first}")
        if problem is not None:
            raise ValueError(problem)
        for rank, (_, other_problem, _) in enumerate(entries):
            if other_problem is not None:
                raise ValueError(f"{step}: rank {rank} rejected its arguments: {other_problem}")
        for key in signature:
            values = [entry[0].get(key) for entry in entries]
            if any(v != values[0] for v in values):
                listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise ValueError(f"{step}: ranks disagree on {key} ({listing})")

    def allocated(self, step: str, allocate, *args, **kwargs) -> tuple:
        """(allocate's result, None), or (None, a failure for `agree`) if it failed (out of
        memory: torch.OutOfMemoryError on a GPU, RuntimeError on the CPU). A call's outputs are
        allocated before the ranks agree on it, so that a rank that cannot hold them fails that
        agreement on every rank instead of leaving its peers mid-call."""
        try:
            return allocate(*args, **kwargs), None
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            return None, (
                f"ep_comm rank {self.rank}/{self.size}: {step} could not allocate its outputs "
                f"({type(error).__name__}: {error}); nothing was sent"
            )

    def all_gather(
        self, step: str, tensor: torch.Tensor, timeout: timedelta | None = None
    ) -> torch.Tensor:
        """`[size, *tensor.shape]`: every rank's tensor (same shape on every rank); waits at
        most `timeout` (default: the buffer's)."""
        local = tensor.to(self.device)
        gathered = [torch.empty_like(local) for _ in range(self.size)]
        work = dist.all_gather(gathered, local, group=self.group, async_op=True)
        self.wait(step, work, timeout)
        return torch.stack(gathered).to(tensor.device)

    def all_to_all(self, step: str, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by destination rank in, rows grouped by source rank out (uint8 rows).

        counts: `[src, dst]` rows every rank sends every rank (host).
        """
        send_counts, recv_counts = counts[self.rank].tolist(), counts[:, self.rank].tolist()
        send = rows.to(self.device)
        received = torch.empty(
            (sum(recv_counts), *rows.shape[1:]), dtype=rows.dtype, device=self.device
        )
        work = dist.all_to_all_single(
            received,
            send,
            output_split_sizes=list(recv_counts),
            input_split_sizes=list(send_counts),
            group=self.group,
            async_op=True,
        )
        self.wait(step, work)
        return received.to(rows.device)
