"""Regenerate (or ``--check``) the committed protobuf/gRPC code.

The ``.proto`` files live at ``proto/tandem/v1`` and are compiled with the repository root as the include path, so
the generated modules import each other as ``proto.tandem.v1.*``: exactly the installed package layout.
``--check`` regenerates into a temporary directory and fails on any difference from what is committed.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "tandem" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *[str(p.relative_to(ROOT)) for p in protos]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return [out_root / "proto" / "tandem" / "v1" / (p.stem + s) for p in protos for s in SUFFIXES]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="fail if the committed code differs from a fresh build")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        stale = []
        for f in files:
            committed = PROTO_DIR / f.name
            if args.check:
                if not committed.is_file() or not filecmp.cmp(f, committed, shallow=False):
                    stale.append(committed.name)
            else:
                shutil.copy(f, committed)
    if stale:
        print(f"generated protobuf code is stale: {stale}; run `python -m proto.generate`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
