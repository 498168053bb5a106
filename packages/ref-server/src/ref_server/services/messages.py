"""Between protobuf messages and our types, with the checks that make bad requests
INVALID_ARGUMENT (one precise message each)."""

from __future__ import annotations

import torch

from ref_server.engine import FinishReason
from ref_server.model import SamplingParams
from ref_server.v1 import serving_pb2 as pb

FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


class BadRequest(ValueError):
    """A request the client must fix: INVALID_ARGUMENT."""


def sampling_params(message: pb.SamplingParams, max_tokens_limit: int) -> SamplingParams:
    if message.max_tokens <= 0:
        raise BadRequest(f"max_tokens must be > 0, got {message.max_tokens}")
    if message.max_tokens > max_tokens_limit:
        raise BadRequest(f"max_tokens {message.max_tokens} is over the limit of {max_tokens_limit}")
    if message.temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {message.temperature:g}")
    top_p = message.top_p if message.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p:g}")
    if message.top_k < 0:
        raise BadRequest(f"top_k must be >= 0, got {message.top_k}")
    return SamplingParams(
        temperature=message.temperature,
        top_p=top_p,
        top_k=message.top_k,
        max_tokens=message.max_tokens,
        seed=message.seed,
        stop_token_ids=tuple(message.stop_token_ids),
    )


def page_message(index: int, page: torch.Tensor) -> pb.KvPage:
    """A `[layers, page_size, 576]` page as bytes (bf16 and fp16 travel as 16-bit words)."""
    words = page.contiguous().view(torch.int16) if page.element_size() == 2 else page.contiguous()
    return pb.KvPage(index=index, data=words.numpy().tobytes(), dtype=str(page.dtype))


def page_tensor(message: pb.KvPage, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = getattr(torch, message.dtype.removeprefix("torch."))
    carrier = torch.int16 if dtype in (torch.bfloat16, torch.float16) else dtype
    words = torch.frombuffer(bytearray(message.data), dtype=carrier)
    return words.view(dtype).view(shape)
