"""How a party confirms the roster before it starts, and signs the versions that follow it.

``protocol.identity.roster.assemble_roster`` writes the roster from public files only, but a provisioner
could still swap a party's public keys for its own, so no party trusts the file as such. Before it
starts, each party checks (``confirm_roster``):

1. **Its own entry** is exactly its keys (CurveZMQ, identity, and a tallier's MPC certificate).
2. **The roster is confirmed**, in one of two ways:

   - its *fingerprint* (``Roster.fingerprint``: SHA-512 of the file, shown as 60 digits in groups
     of five that people can read aloud, as Signal's safety numbers) equals the one the consortium
     compared out of band (``--roster-fingerprint``). The social protocol makes this sound: each
     party reads the number aloud only after its own entry checked out (``consilium-roster
     fingerprint`` checks it first), so when every party has read the same number, no entry in
     that file is anyone's but its owner's;
   - or it names as ``previous`` the roster this party last confirmed, adds no party and changes
     no party's keys (it removes parties, or moves the server), and carries the signature
     (``roster.signatures.toml``, made by ``consilium-roster sign``) of every party of that roster
     that stays in this one, under the keys that roster confirmed. A newcomer's keys, or new keys
     under a known name, are vouched for by no signature (each signer checked its own entry only),
     so such a version needs the fingerprint compared again, by every party, the newcomer included.

   A roster this party confirmed before is accepted as it is; a fingerprint confirms any roster but
   one of a lower version than the roster confirmed before. Each party keeps a copy of the
   roster it last confirmed in its own folder (``accepted_roster.toml``), with a MAC under a key
   derived from its identity (``accepted_roster.mac``), so that a copy put in its place is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from pathlib import Path

from cryptography.exceptions import InvalidSignature

from consilium.protocol.identity.key_files import KeyFileError, read_toml, shown, toml_table
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster, RosterError, roster_changes
from consilium.training.privacy.durable import replace_file

__all__ = ["ACCEPTED_ROSTER_FILE", "SIGNATURES_FILE", "confirm_roster", "join_federation", "sign_roster"]

SIGNATURES_FILE = "roster.signatures.toml"
ACCEPTED_ROSTER_FILE = "accepted_roster.toml"
ACCEPTED_ROSTER_MAC_FILE = "accepted_roster.mac"
_ACCEPTED_ROSTER_LABEL = b"consilium accepted roster v1"
_SIGNATURE_CONTEXT = b"consilium roster signature\x00"


def sign_roster(directory: Path, credentials: Credentials) -> list[str]:
    """Add this party's signature over the roster in ``directory`` to its signatures file; what the
    roster changes of the one this party confirmed last (a signature vouches for no newcomer)."""
    roster = Roster.load(directory)
    roster.check_own_entry(credentials)
    accepted = _accepted(credentials)
    if accepted is None or roster.previous != accepted.digest:
        raise RosterError(
            "a party signs only the version that follows the roster it confirmed last (it names that one as previous)"
        )
    changes = roster_changes(accepted, roster)
    _check_signable(changes)
    signatures = _signatures(directory)
    signatures[credentials.name] = credentials.identity.signing.sign(_signed(roster))
    text = "[signatures]\n" + toml_table(
        {name: base64.b64encode(value).decode() for name, value in sorted(signatures.items())}
    )
    _replace_private(directory / SIGNATURES_FILE, text.encode())
    return changes


def confirm_roster(directory: Path, credentials: Credentials, fingerprint: str | None) -> Roster:
    """The roster in ``directory``, once this party has checked its own entry and that the roster is
    confirmed (module docstring); ``RosterError`` saying why not. Keeps the confirmed copy."""
    roster = Roster.load(directory)
    roster.check_own_entry(credentials)
    accepted = _accepted(credentials, required=fingerprint is None)
    if fingerprint is not None:
        if not roster.has_fingerprint(fingerprint):
            again = (
                " (this party confirmed this roster before: start it without --roster-fingerprint)"
                if accepted and accepted.digest == roster.digest
                else ""
            )
            raise RosterError(
                f"the roster's fingerprint is {roster.fingerprint}, not the {shown(fingerprint)} given: refusing it "
                f"(compare it again out of band; a key may have been swapped){again}"
            )
        if accepted is not None and roster.version < accepted.version:
            raise RosterError(
                f"this is roster version {roster.version}, older than version {accepted.version}, which this party confirmed: refusing to go back"
            )
    elif accepted is not None and accepted.digest == roster.digest:
        return roster
    elif accepted is None:
        raise RosterError(
            "the roster is not confirmed: compare its fingerprint (consilium-roster fingerprint) with every party out of band "
            "and pass it with --roster-fingerprint"
        )
    else:
        _check_signed_successor(directory, roster, accepted)
    _replace_private(credentials.folder / ACCEPTED_ROSTER_FILE, roster.raw)
    _replace_private(
        credentials.folder / ACCEPTED_ROSTER_MAC_FILE, _accepted_mac(credentials, roster.raw).hex().encode()
    )
    return roster


def join_federation(directory: Path, name: str, fingerprint: str | None) -> tuple[Roster, Credentials]:
    """What a party loads at start: its keys from ``directory/name`` and the roster, confirmed."""
    credentials = Credentials.load(directory / name)
    if credentials.name != name:
        raise RosterError(f"{directory / name} holds the keys of {credentials.name}, not of {name}")
    return confirm_roster(directory, credentials, fingerprint), credentials


def _check_signed_successor(directory: Path, roster: Roster, accepted: Roster) -> None:
    if roster.previous != accepted.digest:
        raise RosterError(
            "the roster is not confirmed: it is not the one this party confirmed before, nor does it name that one as previous; "
            "compare its fingerprint out of band and pass --roster-fingerprint"
        )
    _check_signable(roster_changes(accepted, roster))
    signatures = _signatures(directory)
    message = _signed(roster)
    for name, party in accepted.parties.items():
        if name not in roster.parties:
            continue
        signature = signatures.get(name)
        if signature is None:
            raise RosterError(f"the new roster version lacks {name}'s signature ({SIGNATURES_FILE}); refusing it")
        try:
            party.identity.signing.verify(signature, message)
        except InvalidSignature:
            raise RosterError(
                f"{name}'s signature over the new roster version does not verify under its confirmed key"
            ) from None


def _check_signable(changes: list[str]) -> None:
    """Signatures confirm a version that only removes parties or moves the server: every key in it was
    confirmed before. A newcomer, or a name under new keys, is vouched for by nobody's signature (the
    signers checked their own entries only), so it needs the fingerprint compared again, by every party."""
    new = [change for change in changes if change.endswith(" joins") or "keys or address change" in change]
    if new:
        raise RosterError(
            f"the new roster version has keys no party confirmed ({'; '.join(new)}): signatures cannot confirm it; "
            "compare its fingerprint out of band with every party, the newcomers included, and pass --roster-fingerprint"
        )


def _accepted(credentials: Credentials, *, required: bool = True) -> Roster | None:
    """The roster this party confirmed last, checked against the MAC it keeps beside it (made with a key
    only the party holds), or None if it confirmed none. A damaged copy is refused unless ``required``
    is false (the fingerprint is given: it confirms the roster on its own)."""
    path = credentials.folder / ACCEPTED_ROSTER_FILE
    if not path.exists():
        return None
    try:
        raw = path.read_bytes()
        mac = bytes.fromhex((credentials.folder / ACCEPTED_ROSTER_MAC_FILE).read_text().strip())
        if not hmac.compare_digest(mac, _accepted_mac(credentials, raw)):
            raise RosterError("its MAC does not verify")
        return Roster.parse(path)
    except (OSError, ValueError, KeyFileError) as error:
        if not required:
            return None
        raise RosterError(
            f"the copy of the roster this party confirmed ({path}) is damaged or was replaced ({error}); "
            "confirm the roster again with --roster-fingerprint"
        ) from None


def _accepted_mac(credentials: Credentials, raw: bytes) -> bytes:
    return hmac.new(credentials.mac_key(_ACCEPTED_ROSTER_LABEL), raw, hashlib.sha512).digest()


def _replace_private(path: Path, data: bytes) -> None:
    try:
        replace_file(path, data)
    except OSError as error:
        raise RosterError(f"cannot write {path}: {error}") from None


def _signatures(directory: Path) -> dict[str, bytes]:
    path = directory / SIGNATURES_FILE
    if not path.exists():
        return {}
    table = read_toml(path, hint="").get("signatures")
    if not isinstance(table, dict):
        raise RosterError(f"{path} has no [signatures] table")
    try:
        return {str(name): base64.b64decode(value, validate=True) for name, value in table.items()}
    except (binascii.Error, TypeError, ValueError):
        raise RosterError(f"{path}: a signature is not base64") from None


def _signed(roster: Roster) -> bytes:
    return _SIGNATURE_CONTEXT + bytes.fromhex(roster.digest)
