#!/usr/bin/env bash
# Install sglang-router (SGLang's Rust model gateway, PyPI `sglang-router`) into its own virtualenv, as the peer of
# `tandem bench gateway --sglang-router VENV_DIR/bin/sglang-router`.
#
# Usage: bench/sglang_router/install.sh [VENV_DIR]    (default: .venv-sglang-router, relative to the repo root)
#
# Its own venv: it brings its own aiohttp/fastapi/pydantic pins, none of which Tandem needs. Idempotent: does
# nothing if VENV_DIR/bin/sglang-router already runs.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
VENV_DIR="${1:-.venv-sglang-router}"
case "$VENV_DIR" in
  /*) ;;
  *) VENV_DIR="$REPO_ROOT/$VENV_DIR" ;;
esac
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
VERSION="0.3.2"

if [ -x "$VENV_DIR/bin/sglang-router" ] && "$VENV_DIR/bin/sglang-router" --help >/dev/null 2>&1; then
  echo "sglang-router already installed in $VENV_DIR; nothing to do."
  exit 0
fi

echo "Creating venv at $VENV_DIR with $PYTHON_BIN"
"$PYTHON_BIN" -m venv "$VENV_DIR"
"$VENV_DIR/bin/python" -m pip install "sglang-router==$VERSION"
"$VENV_DIR/bin/sglang-router" --help >/dev/null
echo "sglang-router $VERSION installed: $VENV_DIR/bin/sglang-router"
