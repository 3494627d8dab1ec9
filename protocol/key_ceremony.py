"""The key ceremony, both sides: how every hospital of a run comes to hold its one BFV secret key.

The server never holds the key; it only relays. At the start it welcomes the hospitals and tells
the key holder to create the key (``Welcome.generate_key``). Every other hospital, and later any
hospital that joins (again), makes a box key for this run alone, certifies it with its identity
(``RunKey``) and keeps it in memory only. A hospital that holds the key (the key holder at the
start, any hospital of the run later) checks each certificate against the roster and seals the
key to it (``KeySetup``), bound to the run and the recipient; the server relays each box
(``SealedKey``), and the recipient, once the box opens, says ``KeyReady``. A newcomer that does not
hold the key by the deadline is turned away.

    server                      key holder / sealer              newcomer
      |-- Welcome(generate_key) --->|                                |
      |-- Welcome ------------------------------------------------->|
      |<------------------------------------------------ RunKey ----|
      |<-- KeyReady ----------------|                                |
      |-- KeyRequest(run keys) ---->|  (checks each certificate)     |
      |<-- KeySetup(sealed boxes) --|                                |
      |-- SealedKey ------------------------------------------------>|
      |<------------------------------------------------ KeyReady --|
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from crypto.bfv import BfvError, SecretContext
from crypto.sealed_box import SealedBoxError, certify_key, open_box, seal, verify_certified_key
from protocol.channel import ServerChannel
from protocol.config import RunConfig
from protocol.messages import KeyReady, KeyRequest, KeySetup, ProtocolError, RunKey, SealedKey, Welcome
from protocol.party_keys import Credentials
from protocol.roster import Roster

if TYPE_CHECKING:  # a hospital needs nothing of the server's side
    from protocol.participants import Participants

__all__ = ["HospitalKeys", "hand_out_key", "run_key_context", "sealed_key_context"]

log = logging.getLogger("consilium.server")  # only the server's side logs


def sealed_key_context(run: str, recipient: str) -> bytes:
    """What a sealed BFV secret context is bound to: this run (``RunConfig.fingerprint``), this recipient."""
    return f"consilium/bfv-secret-context/v2|{run}|{recipient}".encode()


def run_key_context(run: str, owner: str) -> bytes:
    """What a hospital's per-run box key is certified for: this run (``RunConfig.fingerprint``), this hospital."""
    return f"consilium/run-box-key/v2|{run}|{owner}".encode()


# -- the server's side ----------------------------------------------------------------------------


def hand_out_key(
    participants: Participants,
    welcome: dict,
    *,
    key_exists: bool,
    key_holder: str,
    deadline: float,
    timeout_s: float,
) -> list[str]:
    """Welcome the hospitals that said Hello (``welcome``: the Welcome's fields but ``generate_key``)
    and see that each holds the key by ``deadline`` (``timeout_s`` after the ceremony began);
    returns those that do, in the order they said so."""
    newcomers, participants.joining = participants.joining, []
    parties = participants.parties
    for name in newcomers:
        parties.send(name, Welcome(**welcome, generate_key=not key_exists and name == key_holder))
    ready: list[str] = []
    run_keys: dict[str, bytes] = {}
    while set(ready) | set(run_keys) != set(newcomers):
        got = participants.next_message(deadline)
        if got is None:
            break
        sender, message = got
        if sender not in newcomers or sender in ready or sender in run_keys:
            parties.reject(sender, message, "expected nothing while hospitals join")
        elif isinstance(message, KeyReady):
            ready.append(sender)
        elif isinstance(message, RunKey):
            run_keys[sender] = message.certified_key
        else:
            parties.reject(sender, message, "expected key ready or a run key")
    sealers = participants.active + sorted(ready, key=lambda name: name != key_holder)
    if run_keys and sealers:
        ready += _relay_key(participants, sealers[0], run_keys, deadline, timeout_s)
    for name in (
        set(newcomers) - set(ready) - set(participants.joining)
    ):  # (one that said Hello again is welcomed again)
        participants.turn_away(name, f"did not take the run's key within {timeout_s:g} s")
    return ready


def _relay_key(
    participants: Participants, sealer: str, run_keys: dict[str, bytes], deadline: float, timeout_s: float
) -> list[str]:
    """Have ``sealer`` seal the key to each run key, relay the boxes; those that confirm hold the key."""
    parties = participants.parties
    parties.send(sealer, KeyRequest(run_keys=run_keys))
    while True:
        got = participants.next_message(deadline)
        if got is None:
            log.warning("%s sealed no key within %g s", sealer, timeout_s)
            return []
        sender, message = got
        if not (isinstance(message, KeySetup) and sender == sealer):
            parties.reject(sender, message, f"expected {sealer}'s key setup")
        elif set(message.sealed_keys) != set(run_keys):
            parties.reject(
                sender, message, f"sealed keys are for {sorted(message.sealed_keys)}, not {sorted(run_keys)}"
            )
        else:
            break
    for name, box in message.sealed_keys.items():
        parties.send(name, SealedKey(box=box, sealer=sealer))
    ready: list[str] = []
    while set(ready) != set(run_keys):
        got = participants.next_message(deadline)
        if got is None:
            break
        sender, message = got
        if isinstance(message, KeyReady) and sender in run_keys and sender not in ready:
            ready.append(sender)
        else:
            parties.reject(sender, message, "expected key ready")
    return ready


# -- a hospital's side ----------------------------------------------------------------------------


class HospitalKeys:
    """A hospital's half of the ceremony in one run (``run``: its ``RunConfig.fingerprint``)."""

    def __init__(self, credentials: Credentials, roster: Roster, config: RunConfig, run: str) -> None:
        self._credentials = credentials
        self._roster = roster
        self._config = config
        self._run = run

    def hold(self, secret: SecretContext | None, channel: ServerChannel, *, generate: bool) -> SecretContext:
        """The run's key: the one held already; a new one where the server asks this hospital to create it (only
        the key holder may be asked); or one sealed by a hospital that holds it (``receive``)."""
        if secret is not None:
            return secret
        if not generate:
            return self.receive(channel)
        if self._credentials.name != self._config.key_holder:
            raise ProtocolError(
                f"the server asks {self._credentials.name} to create the run's key; only {self._config.key_holder} does"
            )
        return SecretContext.generate(self._config.bfv_parameters(), run_id=self._config.run_id)

    def receive(self, channel: ServerChannel) -> SecretContext:
        """The run's BFV key, sealed by a hospital that holds it to a box key made for this run alone."""
        # Never written anywhere: once the box is open the key is gone, and no later leak of this
        # hospital's long-term keys opens the box in anyone's records.
        name = self._credentials.name
        run_key = X25519PrivateKey.generate()
        certified = certify_key(
            run_key.public_key(), signer=self._credentials.identity.signing, context=run_key_context(self._run, name)
        )
        channel.send(RunKey(certified_key=certified))
        sealed = channel.expect(SealedKey)
        if sealed.sealer not in self._config.hospitals or sealed.sealer == name:
            raise ProtocolError(
                f"the BFV key is said to be sealed by {sealed.sealer!r}, not another hospital of the run"
            )
        try:
            secret_bytes = open_box(
                sealed.box,
                recipient=run_key,
                sender=self._roster.party(sealed.sealer).identity.signing,
                context=sealed_key_context(self._run, name),
            )
            return SecretContext.from_bytes(secret_bytes, self._config.bfv_parameters(), run_id=self._config.run_id)
        except (SealedBoxError, BfvError) as error:
            raise ProtocolError(f"the BFV key from {sealed.sealer} is unusable: {error}") from None
        finally:
            del run_key

    def seal(self, secret: SecretContext, request: KeyRequest) -> KeySetup:
        """The key sealed to each hospital whose run key the server relays, once its certificate checks."""
        secret_bytes = secret.to_bytes()
        sealed = {
            name: seal(
                secret_bytes,
                recipient=run_key,
                sender=self._credentials.identity.signing,
                context=sealed_key_context(self._run, name),
            )
            for name, run_key in self._certified_run_keys(request.run_keys).items()
        }
        return KeySetup(sealed_keys=sealed)

    def _certified_run_keys(self, run_keys: dict[str, bytes]) -> dict[str, X25519PublicKey]:
        """The other hospitals' run keys, each checked against its owner's identity in the roster."""
        expected = set(self._config.hospitals) - {self._credentials.name}
        if not run_keys:
            raise ProtocolError("the server asks to seal the key to no hospital")
        if not set(run_keys) <= expected:
            raise ProtocolError(
                f"the server asks to seal the key to {sorted(set(run_keys) - expected)}, not in this run"
            )
        keys = {}
        for name, certified in run_keys.items():
            try:
                keys[name] = verify_certified_key(
                    certified,
                    signer=self._roster.party(name).identity.signing,
                    context=run_key_context(self._run, name),
                )
            except SealedBoxError as error:
                raise ProtocolError(f"the run key the server relays for {name} is not {name}'s: {error}") from None
        return keys
