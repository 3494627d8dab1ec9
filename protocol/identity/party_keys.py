"""One party's keys, made on the machine that uses them (``consilium-keygen``).

``generate_party_keys`` fills a party's own folder (in a federation directory, ``FEDERATION/NAME``)::

    secret_keys.toml    its CurveZMQ and identity secret keys (mode 0600); they never leave the folder
    mpc.key, mpc.crt    a tallier's MPC key (0600) and its self-signed certificate
    NAME.public.toml    its public keys, and a tallier's MPC address and certificate

The public file is exactly the party's ``[[party]]`` entry in the roster: the provisioner assembles
the roster from public files alone (``protocol.identity.roster``) and never sees a secret. Each party has a
CurveZMQ key pair (transport authentication and encryption) and an identity (``crypto.identity``:
Ed25519 to sign, X25519 to receive sealed boxes); a tallier also has a TLS key and certificate for
the MPC (``crypto.tls``), which the roster pins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import zmq
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from consilium.crypto.identity import IdentityKeyError, PrivateIdentity, PublicIdentity
from consilium.crypto.tls import (
    CertificateError,
    certificate_from_pem,
    certificate_from_text,
    certificate_pem,
    certificate_text,
    make_mpc_certificate,
)
from consilium.protocol.identity.key_files import KeyFileError, read_toml, shown, toml_table, write_private

__all__ = [
    "Credentials",
    "CurveKeyPair",
    "MPC_CERTIFICATE_FILE",
    "MPC_KEY_FILE",
    "Party",
    "ROLES",
    "SECRET_FILE",
    "SERVER",
    "generate_party_keys",
    "public_file_name",
]

SECRET_FILE = "secret_keys.toml"
MPC_KEY_FILE = "mpc.key"
MPC_CERTIFICATE_FILE = "mpc.crt"
SERVER = "server"
ROLES = ("server", "hospital", "tallier", "admin")  # an admin submits and watches runs at a coordinator
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_MPC_ADDRESS = re.compile(r"^([A-Za-z0-9.\-]+):(\d{1,5})$")
_LEDGER_KEY_LABEL = b"consilium privacy ledger mac v1"


@dataclass(frozen=True)
class CurveKeyPair:
    public: bytes  # z85, 40 characters
    secret: bytes


@dataclass(frozen=True)
class Party:
    """A party's public entry: its public file, and its ``[[party]]`` table in the roster."""

    name: str
    role: str  # one of ROLES
    curve_public: bytes
    identity: PublicIdentity
    mpc_address: tuple[str, int] | None = None  # talliers only: (host, port) for the MPC
    mpc_certificate: bytes | None = None  # talliers only: DER, self-signed, pinned

    def to_entry(self) -> dict[str, str]:
        entry = {
            "name": self.name,
            "role": self.role,
            "curve_public": self.curve_public.decode(),
            **self.identity.to_text(),
        }
        if self.role == "tallier":
            entry["mpc_address"] = "%s:%d" % self.mpc_address
            entry["mpc_certificate"] = certificate_text(self.mpc_certificate)
        return entry

    @classmethod
    def from_entry(cls, entry: object, where: str) -> "Party":
        """A party from its table, or ``KeyFileError`` saying what is wrong in ``where``."""
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where}: a party entry must be a table")
        name, role = entry.get("name"), entry.get("role")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise KeyFileError(
                f"{where}: a party name must be 1 to 63 lower-case letters, digits or dashes, got {shown(name)}"
            )
        if role not in ROLES or (name == SERVER) != (role == "server"):
            raise KeyFileError(
                f"{where}: {name} has role {shown(role)}; the server is named {SERVER!r}, the others are hospitals, talliers or admins"
            )
        expected = {"name", "role", "curve_public", "sign_public", "box_public"} | (
            {"mpc_address", "mpc_certificate"} if role == "tallier" else set()
        )
        if set(entry) != expected:
            raise KeyFileError(f"{where}: {name}'s entry must hold exactly {', '.join(sorted(expected))}")
        try:
            return cls(
                name=name,
                role=role,
                curve_public=_curve_key(entry["curve_public"], name),
                identity=PublicIdentity.from_text(entry),
                mpc_address=mpc_address(entry["mpc_address"], name) if role == "tallier" else None,
                mpc_certificate=certificate_from_text(entry["mpc_certificate"]) if role == "tallier" else None,
            )
        except (IdentityKeyError, CertificateError) as error:
            raise KeyFileError(f"{where}: {name}: {error}") from None


@dataclass(frozen=True)
class Credentials:
    """One party's secret keys, as ``generate_party_keys`` wrote them in its folder."""

    name: str
    role: str
    folder: Path
    curve: CurveKeyPair
    identity: PrivateIdentity
    mpc_address: tuple[str, int] | None = None  # a tallier's, as it declared it

    @property
    def ledger_key(self) -> bytes:
        """The key of this party's privacy ledger's MACs (``training.privacy.ledger``)."""
        return self.mac_key(_LEDGER_KEY_LABEL)

    def mac_key(self, label: bytes) -> bytes:
        """A key for MACs over this party's own files, one per ``label``, derived from its identity so
        that it lives and dies with the party's secret file and nobody else can make one."""
        raw = self.identity.signing.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(raw)

    @property
    def mpc_key_file(self) -> Path:
        return self.folder / MPC_KEY_FILE

    @property
    def mpc_certificate_file(self) -> Path:
        return self.folder / MPC_CERTIFICATE_FILE

    def mpc_certificate(self) -> bytes | None:
        """A tallier's own certificate (DER), as its folder holds it; None for other roles."""
        if self.role != "tallier":
            return None
        try:
            return certificate_from_pem(self.mpc_certificate_file.read_bytes())
        except (OSError, CertificateError) as error:
            raise KeyFileError(f"cannot read {self.mpc_certificate_file}: {error}") from None

    def public(self) -> Party:
        """The public entry these keys make: what the roster must list for this party, exactly."""
        return Party(
            self.name, self.role, self.curve.public, self.identity.public, self.mpc_address, self.mpc_certificate()
        )

    @classmethod
    def load(cls, folder: Path) -> "Credentials":
        path = folder / SECRET_FILE
        document = read_toml(
            path,
            hint=f"this party's keys stay in the folder consilium-keygen made; a new roster.toml goes into the "
            f"federation folder that holds {folder.name}/, and only a party new to the federation makes keys, "
            "with consilium-keygen",
        )
        try:
            name, role = document["name"], document["role"]
            if not isinstance(name, str) or not _NAME.fullmatch(name) or role not in ROLES:
                raise KeyFileError(f"{path}: bad name or role")
            curve = CurveKeyPair(
                public=_curve_key(document["curve_public"], name), secret=_curve_key(document["curve_secret"], name)
            )
            if zmq.curve_public(curve.secret) != curve.public:
                raise KeyFileError(f"{path}: the CurveZMQ secret key does not match its public key")
            address = mpc_address(document["mpc_address"], name) if role == "tallier" else None
            return cls(
                name=name,
                role=role,
                folder=folder,
                curve=curve,
                identity=PrivateIdentity.from_text(document),
                mpc_address=address,
            )
        except KeyError as error:
            raise KeyFileError(f"{path} is missing {error}") from None
        except (IdentityKeyError, zmq.ZMQError) as error:
            raise KeyFileError(f"{path}: {error}") from None


def public_file_name(name: str) -> str:
    return f"{name}.public.toml"


def generate_party_keys(folder: Path, *, name: str, role: str, mpc_address_text: str | None = None) -> Path:
    """Make a party's keys in ``folder``, on the machine that will use them; the path of its public file.

    A tallier needs the ``HOST:PORT`` where the other talliers reach it for the MPC."""
    if role not in ROLES:
        raise KeyFileError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
    if (role == "tallier") != (mpc_address_text is not None):
        raise KeyFileError("a tallier needs its MPC address (HOST:PORT), and only a tallier has one")
    if (folder / SECRET_FILE).exists():
        raise KeyFileError(f"{folder} holds a party's keys already; choose an empty folder")
    public, secret = zmq.curve_keypair()
    identity = PrivateIdentity.generate()
    mpc = make_mpc_certificate(f"Consilium {name} MPC") if role == "tallier" else None
    party = Party(
        name=name,
        role=role,
        curve_public=public,
        identity=identity.public,
        mpc_address=mpc_address(mpc_address_text, name) if mpc else None,
        mpc_certificate=mpc.certificate if mpc else None,
    )
    entry = party.to_entry()  # checks the name and address before anything is written
    Party.from_entry(entry, f"the keys of {name}")
    if mpc:
        write_private(folder / MPC_KEY_FILE, mpc.private_key)
        write_private(folder / MPC_CERTIFICATE_FILE, certificate_pem(mpc.certificate))
    secrets_text = {
        "name": name,
        "role": role,
        "curve_public": public.decode(),
        "curve_secret": secret.decode(),
        **identity.to_text(),
    }
    if mpc:
        secrets_text["mpc_address"] = entry["mpc_address"]
    write_private(folder / SECRET_FILE, toml_table(secrets_text))
    public_file = folder / public_file_name(name)
    write_private(public_file, toml_table(entry))
    return public_file


def mpc_address(text: object, owner: str) -> tuple[str, int]:
    match = _MPC_ADDRESS.fullmatch(text) if isinstance(text, str) else None
    if not match or not 0 < int(match.group(2)) < 65536:
        raise KeyFileError(f"{owner}: an MPC address must look like HOST:PORT, got {shown(text)}")
    return match.group(1).lower(), int(match.group(2))  # host names are case-blind: one host, one spelling


def _curve_key(text: object, owner: str) -> bytes:
    if not isinstance(text, str) or not _Z85_KEY.fullmatch(text):
        raise KeyFileError(f"{owner}: a CurveZMQ key must be 40 z85 characters")
    return text.encode("ascii")
