"""Certificates for mutual TLS between the talliers' MPC parties.

MPyC's ``--ssl`` mode has each party present ``party_<i>.crt`` (with ``party_<i>.key``) and accept
only peers whose certificate chains to ``mpyc_ca.crt`` and names them ``MPyC party <i>`` (the
common name it checks as the host name). ``issue_mpc_certificates`` makes a certificate authority
for one federation, signs one certificate per party, and returns the authority's certificate
without its key: once provisioning is over nobody can add a party.

Keys are ECDSA P-256 (every OpenSSL build speaks it); certificates are valid for ten years from
issue.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["MpcCertificate", "issue_mpc_certificates", "mpc_party_name"]

_VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class MpcCertificate:
    certificate: bytes  # PEM
    private_key: bytes  # PEM, unencrypted: store it 0600


def mpc_party_name(index: int) -> str:
    """The name MPyC expects in the certificate of party ``index`` (0-based)."""
    return f"MPyC party {index}"


def issue_mpc_certificates(parties: int, *, authority_name: str) -> tuple[bytes, list[MpcCertificate]]:
    """A fresh authority's certificate (PEM) and one certificate per party, ``0 .. parties - 1``."""
    if parties < 1:
        raise ValueError(f"need at least one party, got {parties}")
    now = datetime.datetime.now(datetime.timezone.utc)
    authority_key = ec.generate_private_key(ec.SECP256R1())
    authority = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, authority_name)])
    authority_certificate = (
        _builder(authority, authority, authority_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(**_usage(key_cert_sign=True)), critical=True)
        .sign(authority_key, hashes.SHA256())
    )
    issued = []
    for index in range(parties):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, mpc_party_name(index))])
        certificate = (
            _builder(subject, authority, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(**_usage(digital_signature=True)), critical=True)
            .sign(authority_key, hashes.SHA256())
        )
        issued.append(
            MpcCertificate(
                certificate=certificate.public_bytes(serialization.Encoding.PEM),
                private_key=key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                ),
            )
        )
    return authority_certificate.public_bytes(serialization.Encoding.PEM), issued


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def _usage(**granted: bool) -> dict:
    names = (
        "digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
        "key_cert_sign", "crl_sign", "encipher_only", "decipher_only",
    )  # fmt: skip
    return {name: granted.get(name, False) for name in names}
