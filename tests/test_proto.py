"""The committed generated protobuf/gRPC code must be exactly what grpcio-tools produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_proto_code_matches_a_fresh_regeneration() -> None:
    """Regenerate into a temporary directory and compare byte for byte (``python -m proto.generate --check``)."""
    proc = subprocess.run([sys.executable, "-m", "proto.generate", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_generated_modules_import_package_relative() -> None:
    """The gRPC module imports its messages as ``proto.tandem.v1``, the installed package path."""
    grpc_src = (ROOT / "proto/tandem/v1/worker_pb2_grpc.py").read_text()
    assert "from proto.tandem.v1 import worker_pb2" in grpc_src
    from proto.tandem.v1 import worker_pb2

    assert worker_pb2.DESCRIPTOR.package == "tandem.v1"
