"""What one process of a cluster holds to talk to the others: the cluster token, and TLS files when TLS is on.

The choice: mutual TLS on every connection between the parts (worker gRPC API, session port, KV TCP port) when
TLS is configured, plus the cluster token on the admin RPCs always (``auth.token``).

- mTLS authenticates the peer at the transport, before any request is parsed, with one mechanism for gRPC and for
  the two plain-TCP protocols; a token alone would have to be added to each protocol's handshake, and over plain TCP
  it would be readable on the wire. It is what the chart turns on (``--tls-cert/--tls-key/--tls-ca``).
- The token stays because loopback ``tandem up`` runs without TLS (certificates to generate and rotate for a
  single-host toy cluster buy nothing against a local process that can read the same files), and there the admin
  RPCs (``Drain``, ``Snapshot``, ``Abort``, ``KVEvents``) must still be refused to anyone but the cluster. It also
  keys the HMAC that signs registry entries in Redis (``auth.signing``). Without TLS the data-plane RPCs stay open
  on loopback, as the OpenAI port is.

KV transfers: the tcp backend's connections are mutual TLS with the same files (kvtransfer/config.py). NIXL's
peering data (agent metadata, memory descriptors) crosses only inside ``Reserve``/``Prefill`` on the mTLS gRPC
channel, but UCX then moves the bytes on its own transport (RDMA, shared memory, its own TCP), which Tandem
neither encrypts nor authenticates; the torch backend's TCPStore and gloo pair are likewise outside it. A worker
with TLS on and ``--kv-backend nixl|torch`` says so at start; on such a network, the NetworkPolicies fence the KV
ports to the cluster's pods.

Flags (``add_args``): ``--auth-token-file`` (else ``TANDEM_CLUSTER_TOKEN``), ``--tls-cert``, ``--tls-key``,
``--tls-ca``, ``--tls-server-name``; the chart sets them from mounted Secrets.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from auth.tls import TLSFiles
from auth.token import bearer, check_token, ensure_cluster_token, env_token, read_token_file


@dataclass(slots=True, frozen=True)
class Credentials:
    token: str | None = None
    tls: TLSFiles | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata that carries the token (empty without one)."""
        return () if self.token is None else (("authorization", bearer(self.token)),)

    @classmethod
    def from_env(cls, tls: TLSFiles | None = None) -> Credentials:
        """The token from ``TANDEM_CLUSTER_TOKEN`` (None if unset)."""
        return cls(env_token(), tls)

    @classmethod
    def for_cluster(cls, tls: TLSFiles | None = None) -> Credentials:
        """The token of the cluster this process belongs to, created in its environment if there is none yet
        (``auth.token.ensure_cluster_token``): what in-repo callers that start their own workers use."""
        return cls(ensure_cluster_token(), tls)


def add_args(p: argparse.ArgumentParser) -> None:
    """The credential flags shared by ``tandem worker``, ``python -m router.serve`` and ``tandem up``."""
    p.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="file holding the cluster token that admin RPCs must carry (default: $TANDEM_CLUSTER_TOKEN)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this process's certificate: turns mTLS on")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="the CA that every peer's certificate chains to")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="the name workers' certificates carry (default: the host dialled)")


def from_args(args: argparse.Namespace) -> Credentials:
    """Credentials from ``add_args``' flags; ValueError naming the flag on a bad or incomplete set."""
    tls_flags = (args.tls_cert, args.tls_key, args.tls_ca)
    tls = None
    if any(tls_flags):
        if not all(tls_flags):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
        tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    elif args.tls_server_name:
        raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
    try:
        token = read_token_file(args.auth_token_file) if args.auth_token_file else env_token()
    except OSError as e:
        raise ValueError(f"--auth-token-file: {e}") from None
    return Credentials(token, tls)


def to_flags(creds: Credentials, token_file: str | None = None) -> list[str]:
    """The flags that give a child process ``creds``' TLS files (and ``token_file``, if the token is in one)."""
    out = [] if token_file is None else ["--auth-token-file", token_file]
    if creds.tls is not None:
        out += ["--tls-cert", creds.tls.cert, "--tls-key", creds.tls.key, "--tls-ca", creds.tls.ca]
        if creds.tls.server_name:
            out += ["--tls-server-name", creds.tls.server_name]
    return out
