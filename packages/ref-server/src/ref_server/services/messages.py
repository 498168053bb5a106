"""Between protobuf messages and our types, with the checks that make bad requests
INVALID_ARGUMENT (one precise message each)."""

from __future__ import annotations

import secrets
import zlib

import torch

from ref_server.engine import FinishReason
from ref_server.model import SamplingParams
from ref_server.v1 import serving_pb2 as pb

FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
# The cache dtypes a page may come in: a name from the wire never reaches getattr(torch, ...).
PAGE_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)
}


# What a request that does not say gets, over gRPC and HTTP alike (OpenAI's defaults; a chat
# completion's max_tokens is the rest of the context instead).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request the client must fix: INVALID_ARGUMENT; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def random_seed() -> int:
    """The seed of a request that gives none: its own, so that clients never share draws."""
    return secrets.randbits(63)


def checked_sampling(max_tokens_limit: int, **fields) -> SamplingParams:
    """SamplingParams from fields (max_tokens, temperature, ...), or BadRequest naming the
    first bad one."""
    max_tokens = fields["max_tokens"]
    if max_tokens <= 0:
        raise BadRequest(f"max_tokens must be > 0, got {max_tokens}", "max_tokens")
    if max_tokens > max_tokens_limit:
        message = f"max_tokens {max_tokens} is over the limit of {max_tokens_limit}"
        raise BadRequest(message, "max_tokens")
    try:
        return SamplingParams(**fields)
    except ValueError as error:  # SamplingParams' messages begin with the field's name
        field = str(error).split(" ", 1)[0].rstrip(":")
        raise BadRequest(str(error), field if field in fields else None) from None


def sampling_params(message: pb.SamplingParams, max_tokens_limit: int) -> SamplingParams:
    """The message's parameters, absent ones at their defaults."""

    def given(name: str, default):
        return getattr(message, name) if message.HasField(name) else default

    return checked_sampling(
        max_tokens_limit,
        temperature=given("temperature", DEFAULT_TEMPERATURE),
        top_p=given("top_p", 1.0),
        top_k=message.top_k,
        max_tokens=given("max_tokens", DEFAULT_MAX_TOKENS),
        seed=message.seed if message.HasField("seed") else random_seed(),
        stop_token_ids=message.stop_token_ids,
    )


# Pages travel as integer words of their dtype's size (numpy knows neither bf16 nor fp8).
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def sampling_message(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=sorted(params.stop_token_ids),
        seed=params.seed,
    )


def page_message(index: int, page: torch.Tensor, kv_handle: str) -> pb.KvPage:
    """A page (`PagedKVCache.read_page`'s bytes, or any tensor) as bytes, with its checksum."""
    data = page.contiguous().view(WORDS[page.element_size()]).numpy().tobytes()
    dtype = str(page.dtype).removeprefix("torch.")
    return pb.KvPage(
        index=index, data=data, dtype=dtype, kv_handle=kv_handle, crc32=zlib.crc32(data)
    )


def page_tensor(message: pb.KvPage, shape: tuple[int, ...]) -> torch.Tensor:
    """The page a KvPage carries; ValueError when it is damaged or not a page of `shape`."""
    dtype = PAGE_DTYPES.get(message.dtype)
    if dtype is None:
        raise ValueError(f"page {message.index} has an unknown dtype {message.dtype!r}")
    if zlib.crc32(message.data) != message.crc32:
        raise ValueError(f"page {message.index} fails its checksum")
    if len(message.data) != torch.Size(shape).numel() * dtype.itemsize:
        raise ValueError(f"page {message.index} holds {len(message.data)} bytes, not {shape}")
    words = torch.frombuffer(bytearray(message.data), dtype=WORDS[dtype.itemsize])
    return words.view(dtype).view(shape)
