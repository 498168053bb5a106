"""Dispatch and combine as an exchange of byte rows, over either transport.

Each token bound for a rank becomes one row of bytes (its values, FP8 scales, top-k ids and
weights, its index on the source rank; padded to 16 bytes), so one all-to-all moves
everything. The transport moves rows: `Collectives` (`torch` backend: `all_to_all_single`
over the process group) or `IpcTransport` (`cuda` backend: our kernels writing into peers'
CUDA IPC buffers). Split sizes come from the exchanged counts, which costs a host
synchronization per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ep_comm.handle import DispatchHandle
from ep_comm.layout import aligned, rank_prefix_matrix, to_local_experts


@dataclass
class DispatchInput:
    x: torch.Tensor  # [num_tokens, hidden] bf16 or float8_e4m3fn
    x_scales: torch.Tensor | None  # [num_tokens, hidden / 128] fp32 with FP8 x
    topk_idx: torch.Tensor | None  # [num_tokens, num_topk] int64, global expert ids or -1
    topk_weights: torch.Tensor | None  # [num_tokens, num_topk] fp32
    is_token_in_rank: torch.Tensor  # [num_tokens, num_ranks] bool
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int


@dataclass
class DispatchOutput:
    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None  # local expert ids or -1
    recv_topk_weights: torch.Tensor | None  # 0 where recv_topk_idx is -1
    num_recv_tokens_per_expert: list[int]
    handle: DispatchHandle


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * math.prod(tensor.shape[1:])


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], _row_bytes(tensor))


def _pack(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Rows of bytes, padded to a multiple of 16 (the cuda transport copies 16-byte units)."""
    rows = [_as_bytes(p) for p in pieces]
    width = sum(r.shape[1] for r in rows)
    pad = -width % 16
    if pad:
        rows.append(torch.zeros(rows[0].shape[0], pad, dtype=torch.uint8, device=rows[0].device))
    return torch.cat(rows, dim=1)


def _unpack(rows: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split byte rows back into tensors of the dtypes and row shapes of `like`."""
    out, start = [], 0
    for ref in like:
        width = _row_bytes(ref)
        piece = rows[:, start : start + width].contiguous().view(ref.dtype)
        out.append(piece.reshape(rows.shape[0], *ref.shape[1:]))
        start += width
    return out


def _pad_rows(tensor: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    padded = torch.full((rows, *tensor.shape[1:]), value, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    return padded


class TokenExchange:
    def __init__(self, transport, rank: int, size: int) -> None:
        """transport: `all_gather(step, tensor)` and `all_to_all(step, rows, counts, num_sms)`."""
        self.transport = transport
        self.rank, self.size = rank, size
        self.num_sms = 20

    def dispatch(self, inp: DispatchInput, counts: torch.Tensor, expert_counts: torch.Tensor):
        """counts `[src, dst]` tokens (host); expert_counts `[src, num_experts]` (host)."""
        rank, per_rank = self.rank, inp.num_experts // self.size
        _, token = inp.is_token_in_rank.t().nonzero(as_tuple=True)  # by destination, then token
        pieces = [inp.x[token]]
        if inp.x_scales is not None:
            pieces.append(inp.x_scales[token])
        if inp.topk_idx is not None:
            pieces += [inp.topk_idx[token], inp.topk_weights[token]]
        pieces.append(token.to(torch.int32).unsqueeze(1))
        step = "dispatch: exchange tokens"
        received = self.transport.all_to_all(step, _pack(pieces), counts, self.num_sms)
        unpacked = _unpack(received, pieces)
        recv_x = unpacked.pop(0)
        recv_x_scales = unpacked.pop(0) if inp.x_scales is not None else None
        recv_topk_idx = recv_topk_weights = None
        if inp.topk_idx is not None:
            recv_topk_idx, recv_topk_weights = to_local_experts(
                unpacked.pop(0), unpacked.pop(0), rank, per_rank
            )
        recv_src_idx = unpacked.pop(0).squeeze(1)

        num_recv = recv_x.shape[0]
        local_counts = expert_counts[:, rank * per_rank : (rank + 1) * per_rank].sum(dim=0)
        per_expert = [aligned(int(c), inp.expert_alignment) for c in local_counts.tolist()]
        actual = None
        if inp.num_worst_tokens:
            worst = inp.num_worst_tokens
            recv_x = _pad_rows(recv_x, worst, 0)
            recv_x_scales = None if recv_x_scales is None else _pad_rows(recv_x_scales, worst, 0)
            if recv_topk_idx is not None:
                recv_topk_idx = _pad_rows(recv_topk_idx, worst, -1)
                recv_topk_weights = _pad_rows(recv_topk_weights, worst, 0)
            recv_src_idx = _pad_rows(recv_src_idx, worst, -1)
            actual = torch.tensor([num_recv], dtype=torch.int32, device=recv_x.device)
            per_expert = []
        handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix_matrix(counts).to(inp.x.device),
            recv_src_idx=recv_src_idx,
            is_token_in_rank=inp.is_token_in_rank,
            send_token_idx=token,
            num_experts=inp.num_experts,
            num_recv_tokens=num_recv,
            actual_num_recv_tokens=actual,
        )
        return DispatchOutput(
            recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert, handle
        )

    def dispatch_cached(
        self, x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle
    ):
        token = handle.send_token_idx
        pieces = [x[token]] + ([x_scales[token]] if x_scales is not None else [])
        step = "dispatch (cached layout): exchange tokens"
        received = self.transport.all_to_all(step, _pack(pieces), handle.counts(), self.num_sms)
        unpacked = _unpack(received, pieces)
        if handle.actual_num_recv_tokens is not None:
            worst = handle.recv_src_idx.shape[0]
            unpacked = [_pad_rows(t, worst, 0) for t in unpacked]
        return unpacked[0], (unpacked[1] if x_scales is not None else None)

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: list[torch.Tensor],
    ):
        num_recv = handle.num_recv_tokens
        pieces = [x[:num_recv]] + ([topk_weights[:num_recv]] if topk_weights is not None else [])
        # the way back: what each rank received from us is what it now sends us
        back = handle.counts().t().contiguous()
        returned = self.transport.all_to_all(
            "combine: return tokens", _pack(pieces), back, self.num_sms
        )
        unpacked = _unpack(returned, pieces)
        num_tokens = handle.is_token_in_rank.shape[0]
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        combined_weights = None
        if topk_weights is not None:
            combined_weights = torch.zeros(
                num_tokens, topk_weights.shape[1], dtype=torch.float32, device=x.device
            )
        # One source rank at a time, in rank order: within one, a token appears once, so the
        # sums are free of atomics and the same on every run.
        bounds = handle.counts()[self.rank].cumsum(0).tolist()
        for begin, end in zip([0, *bounds[:-1]], bounds, strict=True):
            token = handle.send_token_idx[begin:end]
            out.index_add_(0, token, unpacked[0][begin:end].float())
            if combined_weights is not None:
                combined_weights.index_add_(0, token, unpacked[1][begin:end])
        for b in bias:
            out += b.float()
        return out.to(x.dtype), combined_weights
