"""What clients see of a failure inside the deployment: instance names and one-line reasons,
never an address, a checkpoint path or grpc's own connection details (the router's log keeps
those)."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from ref_server.services.config import ServeConfig
from ref_server.services.router import first_line

CONNECT = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:52045: "
    "Failed to connect to remote host: Connection refused"
)


def rpc_error(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "details", "seen"),
    [
        (grpc.StatusCode.UNAVAILABLE, CONNECT, "unavailable"),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", "unavailable"),
        (grpc.StatusCode.UNKNOWN, "Unexpected <class 'ValueError'>: x", "unknown"),
        (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", "cancelled"),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens must be > 0, got 0",
            "max_tokens must be > 0, got 0",
        ),
        (
            grpc.StatusCode.INTERNAL,
            "engine step failed: RuntimeError: x\nTraceback",
            "engine step failed: RuntimeError: x",
        ),
        (
            grpc.StatusCode.ABORTED,
            "KV transfer failed: cannot reach 10.1.2.3:6001 (refused)",
            "KV transfer failed: cannot reach <address> (refused)",
        ),
        (
            grpc.StatusCode.ABORTED,
            "lost ipv6:[::1]:6001 and [fe80::1]:7",
            "lost <address> and <address>",
        ),
        (grpc.StatusCode.INTERNAL, "", "internal"),
    ],
)
def test_instance_errors_reach_clients_as_one_line_without_addresses(code, details, seen):
    assert first_line(rpc_error(code, details)) == seen


def test_the_served_model_name_is_never_a_path(tmp_path):
    checkpoint = tmp_path / "models" / "DeepSeek-V2-Lite"
    assert ServeConfig(model=str(checkpoint)).model_name == "DeepSeek-V2-Lite"
    assert ServeConfig(model=f"{checkpoint}/").model_name == "DeepSeek-V2-Lite"
    assert ServeConfig(preset="tiny").model_name == "tiny"
    named = ServeConfig(model=str(checkpoint), served_model_name="deepseek-v2-lite")
    assert named.model_name == "deepseek-v2-lite"
    with pytest.raises(ValueError, match="served_model_name must not be empty"):
        ServeConfig(served_model_name=" ")
