"""Who may call what (CPU, tiny preset, real processes): the internal services answer only
the deployment's secret, a decode instance dials only registered prefill instances, and the
public API takes API keys (each a tenant: its own aborts, its own prefix cache) over TLS."""

from __future__ import annotations

import socket
import ssl

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ref_server.client import Client
from ref_server.services.deployment import Deployment
from ref_server.services.security import SECRET_HEADER
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


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, serving):
    """A deployment with two API keys, a cache per key, and TLS on the public gRPC and HTTP
    APIs (a certificate for 127.0.0.1 from a test CA)."""
    folder = tmp_path_factory.mktemp("keyed")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = folder / "cert.pem", folder / "key.pem", folder / "ca.pem"
    cert.write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems) + ca.cert_pem.bytes())
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    keys = folder / "keys.txt"
    keys.write_text("# tenants\nkey-alpha\nkey-beta\n")
    config = serving.config(
        api_key_file=str(keys), isolate_cache=True, tls_cert=str(cert), tls_key=str(key)
    )
    running = Deployment(config, startup_timeout=120)
    yield running, str(ca_file)
    running.stop()


def test_the_public_api_needs_a_key_over_tls(keyed):
    running, ca = keyed
    with Client(running.address, api_key="key-alpha", tls_ca=ca) as client:
        assert client.generate([5, 6, 7], max_tokens=3).finish_reason == "length"
        assert client.health() == "SERVING"
    for key in (None, "key-gamma"):
        with Client(running.address, api_key=key, tls_ca=ca) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate([5, 6, 7], max_tokens=3)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError):
                client.server_info()
            assert client.health() == "SERVING"  # open, as orchestrators need
    with Client(running.address, api_key="key-alpha") as plain, pytest.raises(grpc.RpcError):
        plain.generate([5, 6, 7], max_tokens=3, timeout=5)  # no TLS: no connection


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
        stream = alpha.responses([5, 6], max_tokens=300, request_id="shared-id")
        next(stream)
        with pytest.raises(grpc.RpcError) as refused:
            beta.abort("shared-id")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        # the same id is free for another tenant while alpha's runs
        assert beta.generate([5, 6], max_tokens=2, request_id="shared-id").finish_reason
        alpha.abort("shared-id")
        assert list(stream)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT


def test_prefix_cache_hits_stay_within_a_tenant(keyed):
    running, ca = keyed
    prefix = list(range(100, 164))  # four pages
    with (
        Client(running.address, api_key="key-alpha", tls_ca=ca) as alpha,
        Client(running.address, api_key="key-beta", tls_ca=ca) as beta,
    ):
        assert alpha.generate([*prefix, 1], max_tokens=2).usage.cached_tokens == 0
        assert beta.generate([*prefix, 2], max_tokens=2).usage.cached_tokens == 0
        assert alpha.generate([*prefix, 3], max_tokens=2).usage.cached_tokens == 64
        assert beta.generate([*prefix, 4], max_tokens=2).usage.cached_tokens == 64
