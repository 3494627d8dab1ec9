"""A tallier's own certificate for mutual TLS between the talliers' MPC parties.

Each tallier makes its key pair and a self-signed certificate on its own machine
(``make_mpc_certificate``); the roster pins every tallier's certificate, and a tallier accepts a
peer only if the peer presents exactly the certificate pinned for the party number it claims
(``tallier.mpc_network``). There is no certificate authority: nobody holds a key that could
vouch for another tallier.

Keys are ECDSA P-256 (every OpenSSL build speaks it); certificates are valid for ten years.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "CertificateError",
    "MpcCertificate",
    "certificate_from_pem",
    "certificate_from_text",
    "certificate_pem",
    "certificate_text",
    "make_mpc_certificate",
]

_VALIDITY = datetime.timedelta(days=3650)


class CertificateError(ValueError):
    """A certificate that does not decode."""


@dataclass(frozen=True)
class MpcCertificate:
    certificate: bytes  # DER: public, pinned in the roster
    private_key: bytes  # PEM, unencrypted: it never leaves its tallier's folder (mode 0600)


def make_mpc_certificate(subject: str) -> MpcCertificate:
    """A fresh P-256 key and a self-signed certificate naming ``subject``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return MpcCertificate(
        certificate=certificate.public_bytes(serialization.Encoding.DER),
        private_key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def certificate_text(der: bytes) -> str:
    """A certificate as one line of base64, as the roster writes it."""
    return base64.b64encode(der).decode("ascii")


def certificate_from_text(text: object) -> bytes:
    """The DER certificate that ``certificate_text`` wrote (``CertificateError``)."""
    try:
        der = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
        x509.load_der_x509_certificate(der)
    except (binascii.Error, ValueError):
        raise CertificateError("an MPC certificate must be one line of base64 DER") from None
    return der


def certificate_pem(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


def certificate_from_pem(pem: bytes) -> bytes:
    """The DER form of a PEM certificate (``CertificateError``)."""
    try:
        return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
    except ValueError:
        raise CertificateError("not a PEM certificate") from None
