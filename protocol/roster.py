"""Who is in the federation: provisioning of identities and the public roster.

``provision`` writes a federation directory::

    roster.toml                 public: the server's address, every party's public keys
    server/secret_keys.toml     private to the server (mode 0600)
    hospital-1/secret_keys.toml private to hospital-1, ...
    tallier-1/secret_keys.toml  private to tallier-1, ... (with ``talliers``, for private voting)
    tallier-1/.config/          tallier-1's MPC certificate and key, and the federation's MPC authority

Each party has a CurveZMQ key pair (transport authentication and encryption) and an identity
(``crypto.identity``: Ed25519 to sign, X25519 to receive sealed boxes). Talliers also have an
address where the other talliers reach them for the MPC, over mutual TLS with certificates from an
authority whose key is discarded once they are issued (``crypto.tls``). In a real deployment each
party generates or receives only its own folder; all of them share ``roster.toml``.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import zmq

from crypto.identity import IdentityKeyError, PrivateIdentity, PublicIdentity
from crypto.mpc_field import MIN_PARTIES
from crypto.tls import issue_mpc_certificates

__all__ = ["Credentials", "CurveKeyPair", "Party", "Roster", "RosterError", "provision"]

ROSTER_FILE = "roster.toml"
SECRET_FILE = "secret_keys.toml"
SERVER = "server"
ROLES = ("server", "hospital", "tallier")
MPC_CERTIFICATES = ".config"  # where MPyC looks, under the tallier's working directory
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


class RosterError(ValueError):
    """A federation directory, roster or key file that is missing or malformed."""


@dataclass(frozen=True)
class CurveKeyPair:
    public: bytes  # z85, 40 characters
    secret: bytes


@dataclass(frozen=True)
class Party:
    name: str
    role: str  # one of ROLES
    curve_public: bytes
    identity: PublicIdentity
    mpc_address: tuple[str, int] | None = None  # talliers only: (host, port) for the MPC


@dataclass(frozen=True)
class Roster:
    server_address: str
    parties: dict[str, Party]

    @property
    def hospitals(self) -> list[str]:
        return [name for name, party in self.parties.items() if party.role == "hospital"]

    @property
    def talliers(self) -> list[str]:
        """In MPC party order."""
        return [name for name, party in self.parties.items() if party.role == "tallier"]

    @property
    def server(self) -> Party:
        return self.parties[SERVER]

    def party(self, name: str) -> Party:
        try:
            return self.parties[name]
        except KeyError:
            raise RosterError(f"{name!r} is not in the roster (parties: {', '.join(self.parties)})") from None

    def check_credentials(self, credentials: "Credentials") -> None:
        """Refuse to start with keys that are not the roster's: the handshake would fail silently."""
        party = self.party(credentials.name)
        if (
            zmq.curve_public(credentials.curve.secret) != credentials.curve.public
            or credentials.curve.public != party.curve_public
            or credentials.identity.public.to_text() != party.identity.to_text()
        ):
            raise RosterError(
                f"the secret keys of {credentials.name} do not match its entry in the roster "
                "(provisioned again? use the roster.toml of the same provisioning)"
            )

    @classmethod
    def load(cls, directory: Path) -> "Roster":
        document = _read_toml(directory / ROSTER_FILE, hint="run consilium-provision first")
        try:
            address = document["server"]["address"]
            parties = {}
            for entry in document["party"]:
                name, role = entry["name"], entry["role"]
                if not _NAME.match(name) or role not in ROLES or name in parties:
                    raise RosterError(f"roster entry {name!r} has a bad or repeated name or role")
                if (name == SERVER) != (role == "server"):
                    raise RosterError(f"only the party named {SERVER!r} may have the server role")
                parties[name] = Party(
                    name=name,
                    role=role,
                    curve_public=_curve_key(entry["curve_public"], name),
                    identity=PublicIdentity.from_text(entry),
                    mpc_address=_mpc_address(entry["mpc_address"], name) if role == "tallier" else None,
                )
        except (KeyError, TypeError) as error:
            raise RosterError(f"{directory / ROSTER_FILE} is malformed: missing {error}") from None
        except IdentityKeyError as error:
            raise RosterError(f"{directory / ROSTER_FILE}: {error}") from None
        if SERVER not in parties:
            raise RosterError(f"{directory / ROSTER_FILE} names no server")
        return cls(server_address=str(address), parties=parties)


@dataclass(frozen=True)
class Credentials:
    """One party's private keys."""

    name: str
    curve: CurveKeyPair
    identity: PrivateIdentity

    @classmethod
    def load(cls, directory: Path, name: str) -> "Credentials":
        path = directory / name / SECRET_FILE
        document = _read_toml(path, hint=f"is {name!r} a party of this federation?")
        try:
            curve = CurveKeyPair(
                public=_curve_key(document["curve_public"], name), secret=_curve_key(document["curve_secret"], name)
            )
            return cls(name=name, curve=curve, identity=PrivateIdentity.from_text(document))
        except KeyError as error:
            raise RosterError(f"{path} is missing {error}") from None
        except IdentityKeyError as error:
            raise RosterError(f"{path}: {error}") from None


def provision(directory: Path, *, hospitals: int, address: str, mpc_addresses: tuple[str, ...] = ()) -> Roster:
    """Create a federation directory with a server, ``hospitals`` hospitals and a tallier per MPC address."""
    if hospitals < 1:
        raise RosterError(f"a federation needs at least one hospital, got {hospitals}")
    if not re.match(r"^tcp://[^\s\"]+:\d+$", address):
        raise RosterError(f"server address must look like tcp://HOST:PORT, got {address!r}")
    if 0 < len(mpc_addresses) < MIN_PARTIES:
        raise RosterError(f"private voting needs at least {MIN_PARTIES} talliers, for an honest majority among them")
    mpc = {f"tallier-{i}": _mpc_address(a, f"tallier-{i}") for i, a in enumerate(mpc_addresses, start=1)}
    if len(set(mpc.values())) != len(mpc):
        raise RosterError("every tallier needs its own MPC address")
    if (directory / ROSTER_FILE).exists():
        raise RosterError(f"{directory} already holds a federation; choose an empty directory")
    names = [SERVER] + [f"hospital-{i}" for i in range(1, hospitals + 1)] + list(mpc)
    entries = []
    for name in names:
        public, secret = zmq.curve_keypair()
        identity = PrivateIdentity.generate()
        secrets_text = {"curve_public": public.decode(), "curve_secret": secret.decode(), **identity.to_text()}
        _write_private(directory / name / SECRET_FILE, _toml_table(secrets_text))
        role = "server" if name == SERVER else "tallier" if name in mpc else "hospital"
        entry = {"name": name, "role": role, "curve_public": public.decode(), **identity.public.to_text()}
        if name in mpc:
            entry["mpc_address"] = "%s:%d" % mpc[name]
        entries.append(entry)
    if mpc:
        _write_mpc_certificates(directory, list(mpc))
    roster = f"[server]\naddress = {_toml_string(address)}\n\n" + "".join(
        "[[party]]\n" + _toml_table(entry) + "\n" for entry in entries
    )
    # Public, but whoever can rewrite it can swap a party's keys: only its owner may write it.
    _write_private(directory / ROSTER_FILE, roster)
    return Roster.load(directory)


def _write_mpc_certificates(directory: Path, talliers: list[str]) -> None:
    authority, issued = issue_mpc_certificates(len(talliers), authority_name=f"Consilium talliers of {directory.resolve().name}")
    for index, (name, certificate) in enumerate(zip(talliers, issued)):
        folder = directory / name / MPC_CERTIFICATES
        _write_private(folder / f"party_{index}.key", certificate.private_key.decode())
        _write_private(folder / f"party_{index}.crt", certificate.certificate.decode())
        _write_private(folder / "mpyc_ca.crt", authority.decode())


def _mpc_address(text: object, owner: str) -> tuple[str, int]:
    match = re.match(r"^([A-Za-z0-9.\-]+):(\d{1,5})$", text) if isinstance(text, str) else None
    if not match or not 0 < int(match.group(2)) < 65536:
        raise RosterError(f"{owner}: an MPC address must look like HOST:PORT, got {text!r}")
    return match.group(1), int(match.group(2))


def _read_toml(path: Path, *, hint: str) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RosterError(f"no file {path} ({hint})") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise RosterError(f"cannot read {path}: {error}") from None


def _curve_key(text: object, owner: str) -> bytes:
    if not isinstance(text, str) or not _Z85_KEY.match(text):
        raise RosterError(f"{owner}: a CurveZMQ key must be 40 z85 characters")
    return text.encode("ascii")


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)


def _toml_table(values: dict[str, str]) -> str:
    return "".join(f"{key} = {_toml_string(value)}\n" for key, value in values.items())


def _toml_string(value: str) -> str:
    """A TOML literal string; our values (keys in z85 or base64, names, addresses) never contain quotes."""
    if "'" in value or "\n" in value:
        raise RosterError(f"cannot write {value!r} as a TOML literal string")
    return f"'{value}'"
