"""A throwaway certificate authority and the certificates it issues, for tests and trying mTLS on one host.

Each leaf certificate serves both ends (server and client authentication) and names ``127.0.0.1``, ``localhost``
and any extra DNS names given (the chart's cluster-wide worker name, e.g.). A production cluster gets its
certificates from its own CA (cert-manager in the chart); nothing here is meant to outlive a test.
``cryptography`` is imported when called, so importing ``auth`` does not need it.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from auth.tls import TLSFiles


@dataclass(slots=True, frozen=True)
class DevCA:
    cert: str
    key: str

    @classmethod
    def create(cls, directory: str | Path, name: str = "tandem-dev-ca") -> DevCA:
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (_builder(subject, subject, key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, _sha256()))
        return cls(_write(d / f"{name}.crt", cert), _write_key(d / f"{name}.key", key))

    def issue(self, directory: str | Path, name: str, dns_names: tuple[str, ...] = (),
              server_name: str | None = None) -> TLSFiles:
        """A key and certificate for ``name``, signed by this CA, as ``TLSFiles`` (with this CA as ``ca``)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        ca_cert = x509.load_pem_x509_certificate(Path(self.cert).read_bytes())
        ca_key: Any = serialization.load_pem_private_key(Path(self.key).read_bytes(), password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        sans += [x509.DNSName(n) for n in dns_names]
        cert = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca_cert.subject,
                         key.public_key())
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, _sha256()))
        return TLSFiles(_write(d / f"{name}.crt", cert), _write_key(d / f"{name}.key", key), self.cert, server_name)


def _sha256() -> Any:
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _builder(subject: Any, issuer: Any, public_key: Any) -> Any:
    from cryptography import x509

    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _write(path: Path, cert: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _write_key(path: Path, key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    path.touch(mode=0o600)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)
