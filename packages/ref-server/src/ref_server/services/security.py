"""Who may call what.

- The internal services (Instance, Prefill, Decode, KvTransfer) answer only calls that carry
  the deployment's shared secret in their metadata; `--role all` generates one and hands it to
  its children through the environment (never on a command line, which `ps` shows).
- The public API (the router's gRPC and HTTP) takes optional API keys. A key is also a tenant:
  a client aborts only its own requests, holds at most its share of the router's requests in
  flight, and prefix-cache hits stay within one key (its pages are hashed with a salt derived
  from it) unless `isolate_cache` is off.
- TLS for the public API is a certificate and key in PEM files.
Health checks are open everywhere: they tell nothing and orchestrators need them. A refused
call's request is never parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import grpc

SECRET_ENV = "REF_SERVER_INTERNAL_SECRET"
API_KEYS_ENV = "REF_SERVER_API_KEYS"  # comma-separated
SECRET_HEADER = "x-ref-server-secret"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def read_secret(path: str | None) -> str | None:
    """The internal secret: the file's first line, else the environment's; None if neither."""
    if path:
        try:
            secret = Path(path).read_text().strip()
        except OSError as error:
            raise ValueError(f"cannot read the internal secret from {path}: {error}") from None
        if not secret:
            raise ValueError(f"the internal secret file {path} is empty")
        return secret
    return os.environ.get(SECRET_ENV) or None


def read_api_keys(path: str | None) -> frozenset[str]:
    """API keys: one per line of the file (# comments), plus those in the environment."""
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",")]
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"cannot read API keys from {path}: {error}") from None
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return frozenset(k for k in keys if k)


def bearer(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    """The token of an `authorization: Bearer TOKEN` pair (the scheme in any case, RFC 7235)."""
    for key, value in metadata or ():
        scheme, _, token = value.partition(" ")
        if key == "authorization" and scheme.lower() == "bearer":
            return token.strip()
    return None


def _equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class ApiKeys:
    """The public API's keys; with none configured, every caller is let in anonymously."""

    def __init__(self, keys: frozenset[str], isolate_cache: bool = True) -> None:
        self.keys = keys
        self.isolate_cache = isolate_cache

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check(self, key: str | None) -> str | None:
        """The tenant of a presented key (a digest, never the key): "" when keys are off,
        None when the key is missing or wrong."""
        if not self.keys:
            return ""
        if key is not None and any(_equal(key, known) for known in self.keys):
            return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        return None

    def cache_salt(self, tenant: str) -> bytes:
        return tenant.encode() if self.isolate_cache else b""


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler that refuses without parsing the request."""

    async def refuse(request, context):
        await context.abort(code, message)

    async def refuse_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover (a generator, as streaming handlers are)

    def unread(data: bytes) -> None:
        return None

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            refuse_stream, unread, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(refuse, unread, handler.response_serializer)


class Gate(grpc.aio.ServerInterceptor):
    """Lets a call through when allowed(metadata), else UNAUTHENTICATED; health is open."""

    def __init__(self, allowed, message: str) -> None:
        self.allowed, self.message = allowed, message

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        if self.allowed(details.invocation_metadata):
            return handler
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, self.message)


def secret_gate(secret: str) -> Gate:
    def allowed(metadata) -> bool:
        given = next((v for k, v in metadata or () if k == SECRET_HEADER), None)
        return _equal(given, secret)

    return Gate(allowed, "internal service: the deployment's secret is missing or wrong")


def api_key_gate(keys: ApiKeys) -> Gate:
    return Gate(
        lambda metadata: keys.check(bearer(metadata)) is not None, "missing or wrong API key"
    )


class _WithSecret:
    def __init__(self, secret: str) -> None:
        self.pair = (SECRET_HEADER, secret)

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.pair])


class _SecretUnary(_WithSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _SecretStream(_WithSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def internal_channel(address: str, secret: str, **options) -> grpc.aio.Channel:
    """An asyncio channel to an instance whose every call carries the secret (grpc files an
    interceptor under one kind of call only: one for each)."""
    interceptors = [_SecretUnary(secret), _SecretStream(secret)]
    return grpc.aio.insecure_channel(
        address, options=list(options.items()), interceptors=interceptors
    )


def server_credentials(cert: str | None, key: str | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, or None for plaintext."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    except OSError as error:
        raise ValueError(f"cannot read the TLS certificate or key: {error}") from None
    return grpc.ssl_server_credentials([pair])
