"""A small client of the Router service (the demo, tests and scripts use it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc


@dataclass
class Result:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: pb.Usage | None = None
    first_token_s: float = 0.0  # time to the first chunk
    total_s: float = 0.0


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.router = rpc.RouterStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None):
        return self.router.Generate(request, timeout=timeout)

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None, on_chunk=None
    ) -> Result:
        """Run one request to its end; on_chunk(chunk) sees each chunk as it arrives."""
        start = time.monotonic()
        result = Result(request.request_id)
        for message in self.stream(request, timeout):
            result.request_id = message.request_id
            kind = message.WhichOneof("payload")
            if kind == "chunk":
                if not result.token_ids:
                    result.first_token_s = time.monotonic() - start
                result.token_ids += list(message.chunk.token_ids)
                result.text += message.chunk.text
                if on_chunk is not None:
                    on_chunk(message.chunk)
            elif kind == "complete":
                result.finish_reason = pb.FinishReason.Name(message.complete.finish_reason)
                result.usage = message.complete.usage
        result.total_s = time.monotonic() - start
        return result


def request(text=None, token_ids=None, request_id="", **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from text or token ids and sampling fields (max_tokens, ...)."""
    message = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if text is not None:
        message.text = text
    if token_ids is not None:
        message.token_ids.ids.extend(token_ids)
    return message
