"""The ``auth`` package's pieces on their own: flags, token files, signatures, and ``tandem worker``'s refusal of an
incomplete set of credential flags (before it loads a model)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from auth.credentials import Credentials, add_args, from_args, to_flags
from auth.dev_certs import DevCA
from auth.signing import BadSignature, sign, verify
from auth.token import TOKEN_ENV, new_token, token_matches, write_token_file


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


def test_credentials_come_from_the_token_file_or_the_environment_and_tls_flags_go_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = new_token()
    path = write_token_file(tmp_path / "token", token)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert from_args(_parse(["--auth-token-file", str(path)])).token == token
    monkeypatch.setenv(TOKEN_ENV, "x" * 20)
    assert from_args(_parse([])).token == "x" * 20
    monkeypatch.delenv(TOKEN_ENV)
    assert from_args(_parse([])) == Credentials()
    with pytest.raises(ValueError, match="go together"):
        from_args(_parse(["--tls-cert", str(path)]))
    with pytest.raises(ValueError, match="--auth-token-file"):
        from_args(_parse(["--auth-token-file", str(tmp_path / "missing")]))
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        from_args(_parse(["--auth-token-file", str(tmp_path / "short")]))
    ca = DevCA.create(tmp_path / "ca")
    files = ca.issue(tmp_path, "w", server_name="tandem-worker")
    creds = Credentials(token, files)
    assert from_args(_parse(to_flags(creds, str(path)))) == creds


def test_token_comparison_needs_the_bearer_scheme_and_the_exact_token() -> None:
    token = new_token()
    assert token_matches(f"Bearer {token}", token)
    assert not token_matches(token, token)
    assert not token_matches(f"Bearer {token}x", token)
    assert not token_matches(None, token)


def test_a_signature_covers_every_field_whatever_their_order() -> None:
    token = new_token()
    entry = {"worker_id": "w", "address": "10.0.0.1:7000", "role": "decode", "draining": False}
    signed = sign(entry, token)
    reordered = json.dumps(dict(reversed(list(json.loads(signed).items()))))
    assert verify(reordered, token) == entry
    for field, value in (("draining", True), ("role", "prefill"), ("address", "10.0.0.2:7000")):
        tampered = {**json.loads(signed), field: value}
        with pytest.raises(BadSignature, match="does not match"):
            verify(json.dumps(tampered), token)
    with pytest.raises(BadSignature, match="does not match"):
        verify(signed, new_token())


def test_tandem_worker_refuses_half_a_tls_configuration_before_loading_a_model(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--role", "decode", "--model", str(tmp_path),
                        "--tls-cert", str(tmp_path / "c.pem")], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2 and "--tls-cert, --tls-key and --tls-ca go together" in r.stderr
