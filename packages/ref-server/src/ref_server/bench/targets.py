"""Where a benchmark sends its requests: the router's gRPC API or an OpenAI-compatible HTTP API.

A target is probed once before the runs (`probe`: is it there, which model, how many tokens
fit, ValueError or RuntimeError with one line if not), then opened for a run (`async with`)
and sent requests concurrently from one event loop (`send`), each giving a `Record`.

- gRPC (`GrpcTarget`): `ref_server.v1.Router.Generate` over one asyncio channel, with the
  request built by `ref_server.client.request`; every chunk carries its token ids, so each
  token's arrival time is exact, and the usage comes in the `complete` message.
- OpenAI (`OpenAITarget`): `POST /v1/completions` with the prompt as token ids, streamed
  (server-sent events, `stream_options.include_usage`) through httpx. Chunks carry text, not
  token ids, and a server sends none for a token whose text it holds back (a possible stop
  string, a character spanning tokens) or merges tokens for a slow reader, so a request's
  tokens (the usage's `completion_tokens`) are taken as evenly spaced from its first chunk to
  its last: exact for TTFT and TPOT, and for a steady decode rate, as in a full batch.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np

from ref_server.bench.report import Record
from ref_server.bench.workload import BenchRequest
from ref_server.client import FINISH_REASONS, Client, request
from ref_server.v1 import serving_pb2_grpc as rpc

PROBE_TIMEOUT_S = 10


@dataclass(frozen=True)
class ModelFacts:
    name: str
    vocab_size: int | None  # None where the API does not say (another OpenAI server)
    max_model_len: int | None


@dataclass(frozen=True)
class RequestOptions:
    temperature: float = 0.0  # 0: greedy
    timeout_s: float = 600.0  # for one request, start to end


class GrpcTarget:
    api = "grpc"

    def __init__(self, address: str, options: RequestOptions, api_key=None, tls_ca=None) -> None:
        self.address, self.options = address, options
        self.api_key, self.tls_ca = api_key, tls_ca
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def probe(self) -> ModelFacts:
        try:
            with Client(self.address, api_key=self.api_key, tls_ca=self.tls_ca) as client:
                info = client.model_info(timeout=PROBE_TIMEOUT_S)
                server = client.server_info(timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as error:
            raise RuntimeError(
                f"cannot reach the router at {self.address}: {error.code().name}: {error.details()}"
            ) from None
        if not server.serving:
            raise RuntimeError(f"the router at {self.address} does not serve: {server.problem}")
        return ModelFacts(info.name, info.vocab_size, info.max_model_len)

    async def __aenter__(self) -> GrpcTarget:
        if self.tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(Path(self.tls_ca).read_bytes())
            self.channel = grpc.aio.secure_channel(self.address, credentials)
        else:
            self.channel = grpc.aio.insecure_channel(self.address)
        self.router = rpc.RouterStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def send(self, job: BenchRequest, seed: int, origin: float) -> Record:
        """Run one request; times relative to `origin` (a time.perf_counter() value)."""
        record = Record(time.perf_counter() - origin, len(job.prompt), job.max_tokens)
        message = request(
            job.prompt, max_tokens=job.max_tokens, temperature=self.options.temperature, seed=seed
        )
        call = self.router.Generate(message, timeout=self.options.timeout_s, metadata=self.metadata)
        try:
            async for response in call:
                now = time.perf_counter() - origin
                kind = response.WhichOneof("payload")
                if kind == "chunk":
                    record.token_s += [now] * len(response.chunk.token_ids)
                elif kind == "complete":
                    record.finish_reason = FINISH_REASONS[response.complete.finish_reason]
                    record.prompt_tokens = response.complete.usage.prompt_tokens
                    record.cached_tokens = response.complete.usage.cached_tokens
        except grpc.aio.AioRpcError as error:
            record.error, record.detail = error.code().name, error.details() or ""
        if not record.error and not record.finish_reason:
            record.error = "no complete message"
        record.end_s = time.perf_counter() - origin
        return record


class OpenAITarget:
    api = "openai"

    def __init__(self, url: str, options: RequestOptions, api_key=None, tls_ca=None) -> None:
        self.address, self.options = url.rstrip("/"), options
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.verify = ssl.create_default_context(cafile=tls_ca) if tls_ca else True

    def probe(self) -> ModelFacts:
        """The served model (its id names it in every request that follows)."""
        address = f"{self.address}/v1/models"
        try:
            answer = httpx.get(
                address, headers=self.headers, verify=self.verify, timeout=PROBE_TIMEOUT_S
            )
        except httpx.HTTPError as error:
            raise RuntimeError(f"cannot reach {address}: {error}") from None
        if answer.status_code != 200:
            raise RuntimeError(f"{address} answered HTTP {answer.status_code}: {answer.text}")
        try:
            card = answer.json()["data"][0]
            self.model = card["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RuntimeError(f"{address} did not list a model: {answer.text[:200]}") from None
        # vocab_size and max_model_len are extensions (ref-server's; vLLM's has the latter)
        return ModelFacts(self.model, card.get("vocab_size"), card.get("max_model_len"))

    async def __aenter__(self) -> OpenAITarget:
        # no pool limit: httpx queues requests beyond 100 connections by default
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(
            headers=self.headers, verify=self.verify, timeout=None, limits=limits
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def send(self, job: BenchRequest, seed: int, origin: float) -> Record:
        """Run one request; times relative to `origin` (a time.perf_counter() value)."""
        record = Record(time.perf_counter() - origin, len(job.prompt), job.max_tokens)
        try:
            await asyncio.wait_for(self._stream(job, seed, origin, record), self.options.timeout_s)
        except asyncio.TimeoutError:
            record.error = "timeout"
        except httpx.HTTPError as error:
            record.error, record.detail = type(error).__name__, str(error)
        record.end_s = time.perf_counter() - origin
        if not record.error and not record.finish_reason:
            record.error = "no finish_reason"
        return record

    async def _stream(self, job: BenchRequest, seed: int, origin: float, record: Record) -> None:
        body = {
            "model": self.model,
            "prompt": job.prompt,
            "max_tokens": job.max_tokens,
            "temperature": self.options.temperature,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self.http.stream("POST", f"{self.address}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                record.error = f"HTTP {answer.status_code}"
                record.detail = _message((await answer.aread()).decode(errors="replace"))
                return
            chunk_s, texts, tokens = [], 0, None  # arrivals, chunks with text, usage's count
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - origin
                try:
                    event = json.loads(line.removeprefix("data: "))
                except ValueError:
                    record.error, record.detail = "malformed event", line[:200]
                    return
                if "error" in event:
                    record.error = f"HTTP {event['error'].get('code')}"
                    record.detail = str(event["error"].get("message", ""))
                    return
                for choice in event.get("choices") or ():
                    chunk_s.append(now)
                    texts += bool(choice.get("text"))
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                if usage := event.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                    tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
        if chunk_s:
            count = tokens if tokens is not None else max(texts, 1)
            record.token_s = np.linspace(chunk_s[0], chunk_s[-1], count).tolist()


def _message(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200]
