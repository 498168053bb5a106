"""A Python client of the router's public gRPC API (`ref_server.v1.Router`).

    from ref_server.client import Client

    with Client("127.0.0.1:50051") as client:            # api_key=..., tls_ca="ca.pem"
        result = client.generate("Hello", max_tokens=32, temperature=0.7, seed=1)
        print(result.text, result.finish_reason, result.usage.cached_tokens)
        for chunk in client.stream([1, 2, 3], max_tokens=8):   # token ids in, chunks out
            print(chunk.text, end="", flush=True)

Sampling keywords are `SamplingParams` fields; those not given take the server's defaults,
the HTTP API's too: max_tokens (16), temperature (1; 0: greedy), top_p (1), top_k (0: all),
seed (a random one), stop (strings), stop_token_ids. Without `timeout` a request has no
deadline (the router's ceiling applies). Failures raise `grpc.RpcError`, whose `code()` and
`details()` say what went wrong (INVALID_ARGUMENT with the bad field, RESOURCE_EXHAUSTED when
the router is full, UNAVAILABLE when no instance can serve, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Result:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop, length or abort
    usage: pb.Usage | None = None  # prompt_tokens, completion_tokens, cached_tokens
    first_token_s: float = 0.0  # time to the first chunk
    total_s: float = 0.0


def request(
    prompt: str | list[int] | pb.GenerateRequest, request_id: str = "", **sampling
) -> pb.GenerateRequest:
    """A GenerateRequest from text or token ids and sampling keywords (a request as is)."""
    if isinstance(prompt, pb.GenerateRequest):
        return prompt
    stops = sampling.pop("stop", ())
    message = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    message.sampling.stop.extend([stops] if isinstance(stops, str) else stops)
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(prompt)
    return message


class Client:
    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        tls_ca: str | Path | None = None,
        tls: bool = False,
    ) -> None:
        """tls_ca: a PEM file of the router certificate's CA (implies tls); tls alone trusts
        the system's CAs."""
        if tls_ca is not None or tls:
            roots = Path(tls_ca).read_bytes() if tls_ca is not None else None
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self.channel = grpc.secure_channel(address, credentials)
        else:
            self.channel = grpc.insecure_channel(address)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.router = rpc.RouterStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def responses(
        self, prompt, *, request_id: str = "", timeout: float | None = None, **sampling
    ) -> Iterator[pb.GenerateResponse]:
        """Every GenerateResponse of a request (chunks, then complete or error)."""
        message = request(prompt, request_id, **sampling)
        return self.router.Generate(message, timeout=timeout, metadata=self.metadata)

    def stream(self, prompt, **kwargs) -> Iterator[pb.Chunk]:
        """The chunks of a request as they come (token_ids and text each)."""
        for response in self.responses(prompt, **kwargs):
            if response.WhichOneof("payload") == "chunk":
                yield response.chunk

    def generate(
        self, prompt, *, on_chunk: Callable[[pb.Chunk], None] | None = None, **kwargs
    ) -> Result:
        """Run one request to its end; on_chunk(chunk) sees each chunk as it arrives."""
        start = time.monotonic()
        result = Result(kwargs.get("request_id", ""))
        for response in self.responses(prompt, **kwargs):
            result.request_id = response.request_id
            kind = response.WhichOneof("payload")
            if kind == "chunk":
                if not result.token_ids:
                    result.first_token_s = time.monotonic() - start
                result.token_ids += list(response.chunk.token_ids)
                result.text += response.chunk.text
                if on_chunk is not None:
                    on_chunk(response.chunk)
            elif kind == "complete":
                result.finish_reason = FINISH_REASONS[response.complete.finish_reason]
                result.usage = response.complete.usage
        result.total_s = time.monotonic() - start
        return result

    def abort(self, request_id: str, timeout: float | None = 10) -> None:
        """End one of this client's requests (its stream completes with finish reason abort)."""
        self.router.Abort(
            pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata
        )

    def model_info(self, timeout: float | None = 10) -> pb.ModelInfo:
        return self.router.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
        )

    def server_info(self, timeout: float | None = 10) -> pb.ServerInfo:
        return self.router.GetServerInfo(
            pb.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata
        )

    def health(self, service: str = "", timeout: float | None = 10) -> str:
        """SERVING or NOT_SERVING (the router's, or a service's by its full name)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        check = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
