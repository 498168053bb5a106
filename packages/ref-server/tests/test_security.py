"""Who may call what (CPU, tiny preset, real processes): the internal services answer only
the deployment's secret, a decode instance dials only registered prefill instances, and the
public API takes API keys (each a tenant: its own aborts, its own prefix cache) over TLS."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ref_server.client import Client
from ref_server.services.deployment import Deployment
from ref_server.services.router_api import caller
from ref_server.services.security import SECRET_HEADER, ApiKeys, bearer
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

INTERNAL_CALLS = {
    "Instance.Register": lambda ch: rpc.InstanceStub(ch).Register(pb.RegisterRequest(), timeout=5),
    "Instance.GetLoad": lambda ch: rpc.InstanceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5),
    "KvTransfer.Pull": lambda ch: list(
        rpc.KvTransferStub(ch).Pull(pb.PullRequest(kv_handle="anything"), timeout=5)
    ),
    "KvTransfer.ShareCache": lambda ch: rpc.KvTransferStub(ch).ShareCache(
        pb.ShareCacheRequest(), timeout=5
    ),
    "Prefill.Prefill": lambda ch: rpc.PrefillStub(ch).Prefill(
        pb.PrefillRequest(request_id="x", token_ids=[5], sampling=pb.SamplingParams(max_tokens=1)),
        timeout=5,
    ),
}


@pytest.mark.parametrize("call", sorted(INTERNAL_CALLS))
@pytest.mark.parametrize("secret", [None, "wrong"])
def test_internal_calls_without_the_secret_are_refused(tiny_deployment, call, secret):
    address = tiny_deployment.addresses("prefill")[0]
    metadata = [(SECRET_HEADER, secret)] if secret else []
    channel = grpc.intercept_channel(grpc.insecure_channel(address), _Metadata(metadata))
    with pytest.raises(grpc.RpcError) as refused:
        INTERNAL_CALLS[call](channel)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "secret" in refused.value.details()
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open


def test_a_decode_instance_dials_only_registered_prefill_instances(tiny_deployment):
    """Even with the secret, Decode naming an address the router did not register is refused
    before anything dials it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    secret = tiny_deployment.env["REF_SERVER_INTERNAL_SECRET"]
    address = tiny_deployment.addresses("decode")[0]
    channel = grpc.intercept_channel(
        grpc.insecure_channel(address), _Metadata([(SECRET_HEADER, secret)])
    )
    message = pb.DecodeRequest(
        request_id="relay",
        token_ids=[5, 6],
        first_token=7,
        sampling=pb.SamplingParams(max_tokens=4),
        prefill_address=f"127.0.0.1:{listener.getsockname()[1]}",
        kv_handle="relay",
        num_pages=1,
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(rpc.DecodeStub(channel).Decode(message, timeout=5))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not a registered prefill instance" in refused.value.details()
    with pytest.raises(TimeoutError):
        listener.accept()  # nobody dialled it
    listener.close()


def raw_call(channel: grpc.Channel, method: str, payload: bytes, metadata=()):
    """(status code, details) of `method` called with `payload` as the request's bytes."""
    streaming = method.endswith(("/Decode", "/Generate"))
    kind = channel.unary_stream if streaming else channel.unary_unary
    call = kind(method, request_serializer=bytes, response_deserializer=bytes)
    try:
        answer = call(payload, timeout=10, metadata=metadata)
        if streaming:
            list(answer)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    "method", ["/ref_server.v1.Prefill/Prefill", "/ref_server.v1.Decode/Decode"]
)
def test_an_instance_parses_a_request_only_after_the_secret_and_names_a_bad_one(
    tiny_deployment, method
):
    """Bytes that are no request: without the secret UNAUTHENTICATED (never parsed), with it
    INVALID_ARGUMENT (grpc alone says UNKNOWN or INTERNAL)."""
    role = "prefill" if "Prefill" in method else "decode"
    secret = tiny_deployment.env["REF_SERVER_INTERNAL_SECRET"]
    with grpc.insecure_channel(tiny_deployment.addresses(role)[0]) as channel:
        code, details = raw_call(channel, method, b"\xff\xff")
        assert (code, details) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "internal service: the deployment's secret is missing or wrong",
        )
        code, details = raw_call(channel, method, b"\xff\xff", [(SECRET_HEADER, secret)])
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("the request does not decode: Error parsing message"), details


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata to every call of a sync channel."""

    def __init__(self, pairs) -> None:
        self.pairs = list(pairs)

    def _details(self, details):
        return _Details(
            details.method, details.timeout, [*(details.metadata or ()), *self.pairs],
            details.credentials, details.wait_for_ready, details.compression,
        )  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready = credentials, wait_for_ready
        self.compression = compression


def test_the_bearer_scheme_is_taken_in_any_case():
    for value in ("Bearer key-1", "bearer key-1", "BEARER  key-1 "):
        assert bearer([("x-other", "Bearer no"), ("authorization", value)]) == "key-1"
    assert bearer([("authorization", "Basic key-1")]) is None
    assert bearer([("authorization", "Bearerkey-1")]) is None


def test_a_caller_s_owner_and_tenant():
    """Without keys: the connection owns its requests, the client's address (as the HTTP API
    names it) is the tenant whose share they take. With keys: the key's tenant is both, and
    salts its cache."""
    for peer, address in [
        ("ipv4:10.1.2.3:50123", "10.1.2.3"),
        ("ipv6:%5B::1%5D:50123", "::1"),
        ("ipv6:[fe80::1]:7", "fe80::1"),
        ("unix:/run/router.sock", "unix:/run/router.sock"),
    ]:
        assert caller(ApiKeys(frozenset()), [], peer) == (peer, address, b"")
    peer = "ipv4:10.1.2.3:50123"
    keys = ApiKeys(frozenset({"key-1"}))
    owner, tenant, salt = caller(keys, [("authorization", "bearer key-1")], peer)
    assert owner == tenant == keys.check("key-1") and len(tenant) == 16
    assert salt == tenant.encode()  # isolated caches are the default


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, serving):
    """A deployment with two API keys and TLS on the public gRPC and HTTP APIs (a certificate
    for 127.0.0.1 from a test CA); a prefix cache per key, by default."""
    folder = tmp_path_factory.mktemp("keyed")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = folder / "cert.pem", folder / "key.pem", folder / "ca.pem"
    cert.write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems) + ca.cert_pem.bytes())
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    keys = folder / "keys.txt"
    keys.write_text("# tenants\nkey-alpha\nkey-beta\n")
    config = serving.config(api_key_file=str(keys), tls_cert=str(cert), tls_key=str(key))
    running = Deployment(config, startup_timeout=120)
    yield running, str(ca_file)
    running.stop()


def test_the_public_api_needs_a_key_over_tls(keyed):
    running, ca = keyed
    with Client(running.address, api_key="key-alpha", tls_ca=ca) as client:
        assert client.generate([5, 6, 7], temperature=0, max_tokens=3).finish_reason == "length"
        assert client.health() == "SERVING"
    for key in (None, "key-gamma"):
        with Client(running.address, api_key=key, tls_ca=ca) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate([5, 6, 7], temperature=0, max_tokens=3)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError):
                client.server_info()
            assert client.health() == "SERVING"  # open, as orchestrators need
    with Client(running.address, api_key="key-alpha") as plain, pytest.raises(grpc.RpcError):
        plain.generate([5, 6, 7], temperature=0, max_tokens=3, timeout=5)  # no TLS: no connection


def test_the_router_parses_a_request_only_after_its_key(keyed):
    running, ca = keyed
    credentials = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    method = "/ref_server.v1.Router/Generate"
    with grpc.secure_channel(running.address, credentials) as channel:
        code, details = raw_call(channel, method, b"\xff\xff")
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        key = [("authorization", "bearer key-alpha")]  # the scheme in any case
        code, details = raw_call(channel, method, b"\xff\xff", key)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]))
        message.sampling.max_tokens, message.sampling.temperature = 2, 0
        replies = list(rpc.RouterStub(channel).Generate(message, metadata=key, timeout=60))
        assert replies[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH


def test_with_api_keys_every_http_path_but_health_needs_one(keyed):
    running, ca = keyed
    trust = ssl.create_default_context(cafile=ca)
    base = f"https://127.0.0.1:{running.config.http_port}"
    with httpx.Client(base_url=base, verify=trust) as http:
        for path in ("/metrics", "/version", "/v1/models", "/v1/models/tiny", "/v1/nothing"):
            refused = http.get(path)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["message"] == "missing or wrong API key"
            wrong = http.get(path, headers={"Authorization": "Bearer key-gamma"})
            assert wrong.status_code == 401, path
        assert http.get("/health").status_code == 200
        key = {"Authorization": "bearer key-beta"}  # the scheme in any case
        assert "ref_server_requests_total" in http.get("/metrics", headers=key).text
        assert http.get("/v1/models/tiny", headers=key).json()["id"] == "tiny"
        body = dict(prompt=[5], max_tokens=2)
        assert http.post("/v1/completions", json=body).status_code == 401


def test_the_http_api_needs_a_key_over_tls(keyed):
    running, ca = keyed
    base = f"https://127.0.0.1:{running.config.http_port}"
    trust = ssl.create_default_context(cafile=ca)
    http = httpx.Client(verify=trust)
    good = openai.OpenAI(base_url=f"{base}/v1", api_key="key-beta", http_client=http)
    done = good.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert done.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="key-gamma", http_client=http)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
    assert httpx.get(f"{base}/health", verify=trust).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health")  # the test CA is not trusted by default


def test_a_tenant_aborts_only_its_own_requests(keyed):
    running, ca = keyed
    with (
        Client(running.address, api_key="key-alpha", tls_ca=ca) as alpha,
        Client(running.address, api_key="key-beta", tls_ca=ca) as beta,
    ):
        stream = alpha.responses([5, 6], temperature=0, max_tokens=300, request_id="shared-id")
        next(stream)
        with pytest.raises(grpc.RpcError) as refused:
            beta.abort("shared-id")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        # the same id is free for another tenant while alpha's runs
        assert beta.generate(
            [5, 6], temperature=0, max_tokens=2, request_id="shared-id"
        ).finish_reason
        alpha.abort("shared-id")
        assert list(stream)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT


def test_prefix_cache_hits_stay_within_a_tenant(keyed):
    running, ca = keyed
    prefix = list(range(100, 164))  # four pages
    with (
        Client(running.address, api_key="key-alpha", tls_ca=ca) as alpha,
        Client(running.address, api_key="key-beta", tls_ca=ca) as beta,
    ):
        assert alpha.generate([*prefix, 1], temperature=0, max_tokens=2).usage.cached_tokens == 0
        assert beta.generate([*prefix, 2], temperature=0, max_tokens=2).usage.cached_tokens == 0
        assert alpha.generate([*prefix, 3], temperature=0, max_tokens=2).usage.cached_tokens == 64
        assert beta.generate([*prefix, 4], temperature=0, max_tokens=2).usage.cached_tokens == 64
