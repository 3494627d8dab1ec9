"""Who is in the federation: a roster assembled from public files, and confirmed by every party.

``roster.toml`` binds names to keys::

    [roster]
    version = 1
    previous = ''                 # the digest of the version this one replaces ('' for the first)
    [server]
    address = 'tcp://server.example.org:5555'
    [[party]]                     # each party's public file (protocol.identity.party_keys), as it made it
    ...

``assemble_roster`` writes it from public files only: whoever runs it never sees a secret key. No
party trusts the file as such: each confirms it before it starts (``protocol.identity.roster_confirmation``).

Loading also refuses a roster in which two parties share a key or an MPC address.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from consilium.crypto.mpc_field import MIN_PARTIES
from consilium.protocol.identity.key_files import (
    KeyFileError,
    parse_toml,
    read_bytes,
    read_toml,
    shown,
    toml_table,
    write_private,
)
from consilium.protocol.identity.party_keys import SERVER, Credentials, Party, generate_party_keys, mpc_address

__all__ = [
    "ROSTER_FILE",
    "Roster",
    "RosterError",
    "assemble_roster",
    "check_server_address",
    "local_federation",
    "roster_changes",
]

ROSTER_FILE = "roster.toml"
_SERVER_ADDRESS = re.compile(r"^tcp://[A-Za-z0-9.\-]+:\d{1,5}$")
_DIGEST = re.compile(r"^([0-9a-f]{128})?$")
_DIGEST_CONTEXT = b"consilium roster\x00"
_FINGERPRINT_GROUPS = 12  # of five digits, each from five bytes of the digest: about 199 bits


class RosterError(KeyFileError):
    """A roster that is malformed, does not list this party's keys, or is not confirmed."""


@dataclass(frozen=True)
class Roster:
    version: int
    previous: str  # hex digest of the roster this one replaces, or ''
    server_address: str
    parties: dict[str, Party]
    digest: str  # hex SHA-512 of the file, under a context of its own
    raw: bytes = field(repr=False, default=b"")  # the file, as read: what the digest covers

    @property
    def fingerprint(self) -> str:
        """The digest as 60 decimal digits in groups of five, to be read aloud."""
        raw = bytes.fromhex(self.digest)
        return " ".join(
            f"{int.from_bytes(raw[5 * i : 5 * i + 5], 'big') % 100_000:05d}" for i in range(_FINGERPRINT_GROUPS)
        )

    @property
    def hospitals(self) -> list[str]:
        return [name for name, party in self.parties.items() if party.role == "hospital"]

    @property
    def talliers(self) -> list[str]:
        """In MPC party order."""
        return [name for name, party in self.parties.items() if party.role == "tallier"]

    @property
    def admins(self) -> list[str]:
        """Who may submit, watch and stop runs at a coordinator (``consilium-admin``): they hold no run's keys."""
        return [name for name, party in self.parties.items() if party.role == "admin"]

    @property
    def server(self) -> Party:
        return self.parties[SERVER]

    def has_fingerprint(self, fingerprint: str) -> bool:
        """Whether ``fingerprint``, as someone typed it (spaces and dashes anywhere), is this roster's."""
        return _digits(fingerprint) == _digits(self.fingerprint)

    def identities(self, names) -> dict:
        """The identity (signing) keys of ``names``, by name."""
        return {name: self.party(name).identity.signing for name in names}

    def party(self, name: str) -> Party:
        try:
            return self.parties[name]
        except KeyError:
            raise RosterError(f"{shown(name)} is not in the roster (parties: {', '.join(self.parties)})") from None

    def check_own_entry(self, credentials: Credentials) -> None:
        """Refuse a roster whose entry for this party is not exactly its keys."""
        listed = self.party(credentials.name)
        own = credentials.public()
        if (listed.role, listed.curve_public, listed.identity.to_text(), listed.mpc_certificate) != (
            own.role,
            own.curve_public,
            own.identity.to_text(),
            own.mpc_certificate,
        ):
            raise RosterError(
                f"the roster's entry for {credentials.name} is not this party's keys: refusing it "
                "(was a key swapped, or is this another federation's roster?)"
            )

    @classmethod
    def load(cls, directory: Path) -> "Roster":
        return cls.parse(directory / ROSTER_FILE)

    @classmethod
    def parse(cls, path: Path) -> "Roster":
        try:
            raw = read_bytes(path, hint="assemble it with consilium-provision")
            document = parse_toml(raw, path)
        except KeyFileError as error:
            raise RosterError(str(error)) from None
        header, server = document.get("roster"), document.get("server")
        if not isinstance(header, dict) or not isinstance(server, dict) or not isinstance(document.get("party"), list):
            raise RosterError(f"{path} is not a roster: it needs [roster], [server] and [[party]] tables")
        version, previous, address = header.get("version"), header.get("previous"), server.get("address")
        if (
            type(version) is not int
            or not 1 <= version < 2**31
            or not isinstance(previous, str)
            or not _DIGEST.fullmatch(previous)
        ):
            raise RosterError(
                f"{path}: [roster] needs a version (1, 2, ...) and the previous version's digest ('' for the first)"
            )
        if (version == 1) != (previous == ""):
            raise RosterError(f"{path}: version {version} must {'not ' if version == 1 else ''}name a previous roster")
        if not isinstance(address, str) or not _SERVER_ADDRESS.fullmatch(address):
            raise RosterError(f"{path}: the server address must look like tcp://HOST:PORT, got {shown(address)}")
        parties: dict[str, Party] = {}
        for entry in document["party"]:
            try:
                party = Party.from_entry(entry, str(path))
            except KeyFileError as error:
                raise RosterError(str(error)) from None
            if party.name in parties:
                raise RosterError(f"{path} lists {party.name} twice")
            parties[party.name] = party
        _check_parties(parties, str(path))
        return cls(version, previous, address, parties, _digest(raw), raw)


def check_server_address(address: str, what: str = "the server address") -> None:
    """``RosterError`` unless ``address`` is ``tcp://HOST:PORT``, HOST a host name or an IP address."""
    if not _SERVER_ADDRESS.fullmatch(address):
        raise RosterError(f"{what} must look like tcp://HOST:PORT, got {shown(address)}")


def assemble_roster(directory: Path, *, address: str, public_files: list[Path], previous: Path | None = None) -> Roster:
    """Write ``directory/roster.toml`` from the parties' public files (and the roster it replaces), and load it."""
    if (directory / ROSTER_FILE).exists():
        raise RosterError(f"{directory} already holds a roster; choose an empty directory")
    check_server_address(address)
    parties: dict[str, Party] = {}
    for path in public_files:
        party = Party.from_entry(read_toml(path, hint=_public_file_hint(directory, path)), str(path))
        if party.name in parties:
            raise RosterError(f"two public files name {party.name}")
        parties[party.name] = party
    _check_parties(parties, "the public files")
    version, previous_digest = 1, ""
    if previous is not None:
        before = Roster.parse(previous)
        version, previous_digest = before.version + 1, before.digest
    ordered = sorted(
        parties.values(),
        key=lambda p: ({"server": 0, "hospital": 1, "tallier": 2, "admin": 3}[p.role], _natural(p.name)),
    )
    text = (
        "[roster]\n"
        + toml_table({"version": version, "previous": previous_digest})
        + "\n[server]\n"
        + toml_table({"address": address})
        + "".join("\n[[party]]\n" + toml_table(party.to_entry()) for party in ordered)
    )
    # Public, but whoever can rewrite it can swap a party's keys: only its owner may write it.
    write_private(directory / ROSTER_FILE, text)
    return Roster.load(directory)


def _public_file_hint(directory: Path, path: Path) -> str:
    """What to do about a public file that is not where it was named: where keygen put it, if it is there."""
    kept = directory / path.name.removesuffix(".public.toml") / path.name  # keygen's --out folder, NAME/
    if path != kept and kept.is_file():
        return f"consilium-keygen wrote it to {kept}: give that path"
    return "the party makes it with consilium-keygen and sends it to the provisioner"


def roster_changes(before: Roster, after: Roster) -> list[str]:
    """What ``after`` changes of ``before``, in words: who joins, who leaves, whose keys or address change."""
    changes = [f"{name} joins" for name in after.parties if name not in before.parties]
    changes += [f"{name} leaves" for name in before.parties if name not in after.parties]
    changes += [
        f"{name}'s keys or address change"
        for name, party in after.parties.items()
        if name in before.parties and party != before.parties[name]
    ]
    if after.server_address != before.server_address:
        changes.append(f"the server's address changes from {before.server_address} to {after.server_address}")
    return changes


def local_federation(
    directory: Path, *, hospitals: int, address: str, mpc_addresses: tuple[str, ...] = (), admins: tuple[str, ...] = ()
) -> Roster:
    """A federation on one machine, made as a real one is: each party's keys in its own folder
    (``directory/NAME``), then the roster from their public files alone."""
    if hospitals < 1:
        raise RosterError(f"a federation needs at least one hospital, got {hospitals}")
    check_server_address(address)
    if 0 < len(mpc_addresses) < MIN_PARTIES:
        raise RosterError(f"private voting needs at least {MIN_PARTIES} talliers, for an honest majority among them")
    if len({mpc_address(text, "a tallier") for text in mpc_addresses}) != len(mpc_addresses):
        raise RosterError("every tallier needs its own MPC address")
    parties = [(SERVER, "server", None)] + [(f"hospital-{i}", "hospital", None) for i in range(1, hospitals + 1)]
    parties += [(f"tallier-{i}", "tallier", a) for i, a in enumerate(mpc_addresses, start=1)]
    parties += [(name, "admin", None) for name in admins]
    public_files = [
        generate_party_keys(directory / name, name=name, role=role, mpc_address_text=a) for name, role, a in parties
    ]
    return assemble_roster(directory, address=address, public_files=public_files)


def _check_parties(parties: dict[str, Party], where: str) -> None:
    if sum(party.role == "server" for party in parties.values()) != 1 or not any(
        p.role == "hospital" for p in parties.values()
    ):
        raise RosterError(f"{where}: a federation needs one server and at least one hospital")
    talliers = [party for party in parties.values() if party.role == "tallier"]
    if 0 < len(talliers) < MIN_PARTIES:
        raise RosterError(
            f"{where}: private voting needs at least {MIN_PARTIES} talliers, for an honest majority among them"
        )
    keys = [key for party in parties.values() for key in _public_keys(party)]
    if len(set(keys)) != len(keys):
        raise RosterError(f"{where}: two parties share a key")
    if len({party.mpc_address for party in talliers}) != len(talliers):
        raise RosterError(f"{where}: every tallier needs its own MPC address")


def _public_keys(party: Party) -> list[bytes]:
    text = party.identity.to_text()
    return [party.curve_public, text["sign_public"].encode(), text["box_public"].encode()] + (
        [party.mpc_certificate] if party.mpc_certificate else []
    )


def _digest(raw: bytes) -> str:
    return hashlib.sha512(_DIGEST_CONTEXT + raw).hexdigest()


def _digits(fingerprint: str) -> str:
    return re.sub(r"[\s-]", "", fingerprint)


def _natural(name: str) -> tuple:
    """hospital-2 before hospital-10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
