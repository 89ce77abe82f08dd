"""Mutual TLS between the router and the workers, and between workers: the same three files everywhere.

Each process holds a certificate and key issued by the cluster's CA, and the CA certificate. Both ends of every
connection present their certificate and check the other's against the CA (``CERT_REQUIRED`` on the server side
too): a client without a certificate, or with one from another CA, fails the handshake before it can send a byte
of a request. One mechanism then covers the worker gRPC API, the plain-TCP session port and the KV TCP ports,
without a protocol change on any of them.

Host names: the client checks the server's certificate against ``server_name`` when one is set (the chart issues
every worker one certificate for a cluster-wide name, as pod IPs are not known when certificates are issued), or
else against the host it dialled (``127.0.0.1`` needs an IP SAN).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc is imported where it is used: every CLI parser reads this module's flags
    import grpc


@dataclass(slots=True, frozen=True)
class TLSFiles:
    cert: str  # PEM certificate chain of this process
    key: str  # PEM private key of ``cert``
    ca: str  # PEM CA bundle that peers' certificates must chain to
    server_name: str | None = None  # the name a client expects in a server's certificate; None: the dialled host

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not path:
                raise ValueError(f"TLS needs a {name} file")
            if not Path(path).is_file():
                raise ValueError(f"TLS {name} file {path} does not exist")
        if self.server_name is not None and not self.server_name:
            raise ValueError("server_name must be None or a name")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(cert, key, ca) as bytes."""
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()


def server_context(tls: TLSFiles) -> ssl.SSLContext:
    """A server context that requires a client certificate from the cluster's CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(cafile=tls.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: TLSFiles) -> ssl.SSLContext:
    """A client context that presents this process's certificate and checks the server's name and CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(cafile=tls.ca)
    return ctx  # PROTOCOL_TLS_CLIENT: CERT_REQUIRED and check_hostname already


def server_hostname(tls: TLSFiles, host: str) -> str:
    """The name a client checks the server at ``host`` against."""
    return tls.server_name or host


def grpc_server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    import grpc

    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def grpc_channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    import grpc

    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def grpc_channel_options(tls: TLSFiles | None) -> list[tuple[str, str]]:
    """``grpc.ssl_target_name_override`` when the servers' certificates name a cluster-wide ``server_name``."""
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


def redis_tls_kwargs(url: str, tls: TLSFiles | None) -> dict[str, str]:
    """Keyword arguments for ``redis.Redis.from_url(url, ...)``: for a ``rediss://`` URL, the cluster's CA to check
    the server with and this process's certificate (Redis asks for one with ``tls-auth-clients yes``, its
    default), unless the URL's query names its own (``?ssl_ca_certs=...``). Nothing for ``redis://`` or without
    TLS files. A password goes in the URL (``rediss://:PASSWORD@host:port``), and AUTH is sent on every connect."""
    if tls is None or not url.startswith("rediss://"):
        return {}
    query = url.partition("?")[2]
    named = {kv.partition("=")[0] for kv in query.split("&") if kv}
    given = {"ssl_ca_certs": tls.ca, "ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    return {k: v for k, v in given.items() if k not in named}
