"""The generated gRPC code in src/ref_server/v1 is what the proto says (nox -s protos)."""

from pathlib import Path

from grpc_tools import protoc

PACKAGE = Path(__file__).parents[1]


def test_generated_code_matches_the_proto(tmp_path):
    proto = PACKAGE / "proto" / "ref_server" / "v1" / "serving.proto"
    status = protoc.main(
        [
            "protoc",
            f"-I{PACKAGE / 'proto'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(proto),
        ]
    )
    assert status == 0
    for name in ("serving_pb2.py", "serving_pb2_grpc.py", "serving_pb2.pyi"):
        fresh = (tmp_path / "ref_server" / "v1" / name).read_text()
        committed = (PACKAGE / "src" / "ref_server" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `nox -s protos`"
