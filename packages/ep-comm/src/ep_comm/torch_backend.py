"""The `torch` backend: dispatch and combine as one `all_to_all_single` of byte rows each.

Each token bound for a rank becomes one row of bytes (its values, FP8 scales, top-k ids and
weights, its index on the source rank), so one all-to-all over the process group moves
everything (gloo stages CUDA tensors through the host). Split sizes come from the exchanged
counts, which costs a host synchronization per call. It is also the tests' reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ep_comm.collectives import Collectives
from ep_comm.config import Config
from ep_comm.exchange import DispatchInput, DispatchOutput, Exchange, row_bytes
from ep_comm.handle import DispatchHandle
from ep_comm.layout import aligned, rank_prefix_matrix


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], row_bytes(tensor))


def _pack(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_as_bytes(p) for p in pieces], dim=1)


def _unpack(rows: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split byte rows back into tensors of the dtypes and row shapes of `like`."""
    out, start = [], 0
    for ref in like:
        width = row_bytes(ref)
        # reshape, not contiguous(): one row of an odd-sized packing is 'contiguous' already
        piece = rows[:, start : start + width].reshape(-1).view(ref.dtype)
        out.append(piece.reshape(rows.shape[0], *ref.shape[1:]))
        start += width
    return out


def _padded(like: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """`[rows, ...]` tensors shaped as each of `like`'s rows: -1 for integers, else 0."""
    padded = []
    for ref in like:
        value = -1 if ref.dtype in (torch.int64, torch.int32) else 0
        padded.append(torch.full((rows, *ref.shape[1:]), value, dtype=ref.dtype, device=ref.device))
    return padded


def _fill(padded: list[torch.Tensor], received: list[torch.Tensor]) -> list[torch.Tensor]:
    for out, rows in zip(padded, received, strict=True):
        out[: rows.shape[0]] = rows
    return padded


class TorchLayout(NamedTuple):
    # [sum of is_token_in_rank] int64: this rank's tokens in send order (by destination rank)
    send_token_idx: torch.Tensor


class TorchExchange(Exchange):
    def __init__(self, comm: Collectives) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    def failure(self) -> str | None:
        return None  # every failure is raised by the call it happens in

    @property
    def error_flag(self) -> None:
        return None

    def dispatch_problem(self, inp, config, handle) -> None:
        return None

    def combine_problem(self, x, topk_weights, config, handle) -> None:
        return None

    def destroy(self) -> None:
        pass  # it holds nothing between calls

    def dispatch_outputs(self, inp: DispatchInput) -> list[torch.Tensor] | None:
        """Padded outputs (then the source token index) with num_worst_tokens; None without:
        the received rows are allocated as they arrive."""
        if inp.handle is not None and inp.handle.actual_num_recv_tokens is not None:
            sources = [inp.x] + ([inp.x_scales] if inp.x_scales is not None else [])
            return _padded(sources, inp.handle.recv_src_idx.shape[0])
        if inp.handle is None and inp.num_worst_tokens:
            index = torch.empty(0, 1, dtype=torch.int32, device=inp.x.device)
            return _padded([*inp.sources(), index], inp.num_worst_tokens)
        return None

    def combine_outputs(self, x, handle: DispatchHandle, topk_weights):
        """combined_x, the fp32 sums it is rounded from, and the weights' sums."""
        num_tokens = handle.is_token_in_rank.shape[0]
        combined_x = torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
        sums = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        combined_weights = None
        if topk_weights is not None:
            shape = (num_tokens, topk_weights.shape[1])
            combined_weights = torch.zeros(shape, dtype=torch.float32, device=x.device)
        return combined_x, sums, combined_weights

    def dispatch(self, inp: DispatchInput, config: Config, outputs) -> DispatchOutput:
        del config  # the cuda backend's knobs
        rank, size = self.rank, self.size
        local = torch.cat([inp.num_tokens_per_rank, inp.num_tokens_per_expert]).to(torch.int64)
        gathered = self.comm.all_gather("dispatch: exchange counts", local).cpu()
        counts, expert_counts = gathered[:, :size], gathered[:, size:]
        received_per_rank = counts.sum(dim=0).tolist()
        worst = inp.num_worst_tokens
        if worst and max(received_per_rank) > worst:
            most = max(received_per_rank)
            raise ValueError(
                f"dispatch: rank {received_per_rank.index(most)} would receive {most} tokens, "
                f"more than num_worst_tokens={worst}"
            )

        _, token = inp.is_token_in_rank.t().nonzero(as_tuple=True)  # by destination, then token
        pieces = [t[token] for t in inp.sources()]
        pieces.append(token.to(torch.int32).unsqueeze(1))
        step = "dispatch: exchange tokens"
        received = _unpack(self.comm.all_to_all(step, _pack(pieces), counts), pieces)
        if worst:
            received = _fill(outputs, received)
        recv_src_idx = received.pop().squeeze(1)
        out = DispatchOutput.from_rows(received, inp, rank, size)
        per_rank = inp.num_experts // size
        if not worst:
            local_counts = expert_counts[:, rank * per_rank : (rank + 1) * per_rank].sum(dim=0)
            out.num_recv_tokens_per_expert = [
                aligned(int(c), inp.expert_alignment) for c in local_counts.tolist()
            ]
        actual = received_per_rank[rank]
        out.handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix_matrix(counts).to(inp.x.device),
            recv_src_idx=recv_src_idx,
            is_token_in_rank=inp.is_token_in_rank,
            num_experts=inp.num_experts,
            actual_num_recv_tokens=(
                torch.tensor([actual], dtype=torch.int32, device=inp.x.device) if worst else None
            ),
            backend_layout=TorchLayout(token),
        )
        return out

    def dispatch_cached(self, inp: DispatchInput, handle: DispatchHandle, config: Config, outputs):
        del config
        token = handle.backend_layout.send_token_idx
        x, x_scales = inp.x, inp.x_scales
        pieces = [x[token]] + ([x_scales[token]] if x_scales is not None else [])
        step = "dispatch (cached layout): exchange tokens"
        received = _unpack(self.comm.all_to_all(step, _pack(pieces), handle.counts()), pieces)
        if outputs is not None:
            received = _fill(outputs, received)
        return received[0], (received[1] if x_scales is not None else None)

    def combine(self, x, handle: DispatchHandle, topk_weights, biases, config: Config, outputs):
        del config
        counts = handle.counts()
        num_recv = int(counts[:, self.rank].sum())
        pieces = [x[:num_recv]] + ([topk_weights[:num_recv]] if topk_weights is not None else [])
        # the way back: what each rank received from us is what it now sends us
        step = "combine: return tokens"
        returned = _unpack(self.comm.all_to_all(step, _pack(pieces), counts.t()), pieces)
        combined_x, out, combined_weights = outputs
        for b in biases:
            out += b.float()
        # One destination rank at a time, in rank order: within one, a token appears once, so
        # the sums are free of atomics and the same on every run, and in the cuda backend's order.
        bounds = counts[self.rank].cumsum(0).tolist()
        for begin, end in zip([0, *bounds[:-1]], bounds, strict=True):
            token = handle.backend_layout.send_token_idx[begin:end]
            out.index_add_(0, token, returned[0][begin:end].float())
            if combined_weights is not None:
                combined_weights.index_add_(0, token, returned[1][begin:end])
        return combined_x.copy_(out), combined_weights
