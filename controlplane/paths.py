"""Where a local Tandem keeps its files: ``$TANDEM_HOME`` (default ``~/.cache/tandem``), the built-in tiny model
under it, and the state file of a running ``tandem up`` with its cluster token file beside it (0600: ``tandem
scale``, a separate process, reads the token from there to call the guarded ``Control.SetReplicas``). Here rather
than in ``cli`` so that the control plane needs nothing from the command line's modules."""

from __future__ import annotations

import os
from pathlib import Path

TANDEM_HOME = Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
DEFAULT_MODEL_DIR = TANDEM_HOME / "tiny-llama"
STATE_FILE = TANDEM_HOME / "up.json"


def token_file_for(state_file: Path) -> Path:
    """Where a ``tandem up`` with ``state_file`` keeps its cluster token."""
    return state_file.with_suffix(".token")
