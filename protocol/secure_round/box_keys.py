"""Box keys: the X25519 keys the one-time key shares of a round are sealed to, one per hospital and round.

A hospital draws a fresh box key for each round it may take part in, certifies its public half with
its identity key for that round of that run (``statement.box_key_context``), and keeps the private
half in memory only (``BoxKeyring``). The server keeps the certified public halves it was given
(``CertifiedBoxKeys``) and lists a round's in its RoundStart; it can check each certificate but seal
nothing a member would open. Nothing sealed to a box key can be opened after its round: the keyring
forgets every key of a round that began (review 4, finding 11).
"""

from __future__ import annotations

from typing import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.sealed_box import SealedBoxError, certify_key, verify_certified_key
from consilium.protocol.secure_round.statement import RoundRefused, RoundSetting, box_key_context, check_box_keys

__all__ = ["BoxKeyring", "CertifiedBoxKeys"]


class BoxKeyring:
    """A hospital's box keys for the rounds to come: the private halves never leave this object."""

    def __init__(self, name: str, signing: Ed25519PrivateKey) -> None:
        self._name, self._signing = name, signing
        self._keys: dict[int, tuple[X25519PrivateKey, bytes]] = {}  # round -> (its key, the key's certificate)

    def new(self, run: str, round_number: int) -> bytes:
        """A fresh box key for ``round_number`` of ``run``: its public half, certified for that round."""
        key = X25519PrivateKey.generate()
        context = box_key_context(run, self._name, round_number)
        certified = certify_key(key.public_key(), signer=self._signing, context=context)
        self._keys[round_number] = (key, certified)
        return certified

    def forget_before(self, round_number: int) -> None:
        """Drop every key for a round before ``round_number``: shares sealed to one are never opened."""
        for number in [number for number in self._keys if number < round_number]:
            del self._keys[number]

    def check(
        self, setting: RoundSetting, listed: Mapping[str, bytes], identities: Mapping[str, Ed25519PublicKey]
    ) -> None:
        """``RoundRefused`` naming the server unless the round's listed box keys are certified for it and the
        one listed for this hospital is the one it holds (not, say, one it certified before a restart);
        the key is dropped then, so that a refused round's key seals nothing."""
        round_number = setting.round_number
        try:
            check_box_keys(setting, self._name, listed, identities)
            own = self._keys.get(round_number)
            if own is None or listed[self._name] != own[1]:
                raise RoundRefused(
                    f"round {round_number}: the box key listed for {self._name} is not the one it holds",
                    named=["server"],
                )
        except RoundRefused:
            self._keys.pop(round_number, None)
            raise

    def take(self, round_number: int) -> X25519PrivateKey:
        """The private key for ``round_number``, handed to that round's keys and no longer kept here."""
        key, _ = self._keys.pop(round_number)
        return key


class CertifiedBoxKeys:
    """The server's copy of each hospital's certified box key for the next round it takes part in."""

    def __init__(self, signers: Mapping[str, Ed25519PublicKey]) -> None:
        self._signers = signers
        self._keys: dict[str, tuple[int, bytes]] = {}  # hospital -> (round, its certified key for that round)

    def keep(self, run: str, name: str, round_number: int, certified: bytes, *, expected_round: int) -> str:
        """Keep ``name``'s key for ``round_number`` if its certificate checks; or say why not."""
        if round_number != expected_round:
            return f"a box key for round {round_number}, not {expected_round}"
        try:
            verify_certified_key(
                certified, signer=self._signers[name], context=box_key_context(run, name, round_number)
            )
        except SealedBoxError as error:
            return f"the box key is not {name}'s for round {round_number}: {error}"
        self._keys[name] = (round_number, certified)
        return ""

    def holds(self, name: str, round_number: int) -> bool:
        return self._keys.get(name, (0, b""))[0] == round_number

    def of(self, names: list[str]) -> dict[str, bytes]:
        """The certified keys of ``names``, each of which ``holds`` one for the round."""
        return {name: self._keys[name][1] for name in names}
