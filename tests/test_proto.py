"""The committed generated protobuf/gRPC code must be exactly what grpcio-tools produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_frames_survive_any_split_and_an_oversized_length_is_refused() -> None:
    """wire/framing.py, the plain-TCP Session transport's wire format: frames come out whole however the bytes
    are cut on the way, and a length over MAX_FRAME is a protocol error before any of its body arrives."""
    import random

    from wire.framing import MAX_FRAME, FrameBuffer, FrameError, frame

    payloads = [b"", b"x", bytes(range(256)) * 40, b"tail"]
    wire = b"".join(frame(p) for p in payloads)
    rng = random.Random(3)
    for _ in range(50):
        buf, out, pos = FrameBuffer(), [], 0
        while pos < len(wire):
            step = rng.randrange(1, 300)
            out += buf.feed(wire[pos:pos + step])
            pos += step
        assert out == payloads
    with pytest.raises(FrameError, match="exceeds"):
        FrameBuffer().feed((MAX_FRAME + 1).to_bytes(4, "big") + b"abc")
