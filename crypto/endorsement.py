"""The statement every contributor of a round signs: one sum, one set, one round, once.

A one-time-key round (``docs/explanation/secure-round.md``) is released only once every member of
its contributor set ``S`` signed the same statement, and a hospital signs one statement a round.
So a server cannot show two hospitals two different sums, or two different sets, and have both
released: every decryption that contains a hospital's update is of the one sum it signed, and its
update is released at most once, as its ledger assumes (``protocol.secure_round`` signs and checks
it). ``run`` names the run and digests every setting each signer was given
(``protocol.run.config.RunConfig.fingerprint``), so all signers took part under the same noise and
quorum; the round is in it, and a hospital's ledger refuses a run id it has seen before, so no
signature carries over to another run or round.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Mapping, Sequence

__all__ = ["one_time_statement"]

_LABEL = b"consilium one-time-key round v1"


def one_time_statement(
    *,
    run: str,
    round_number: int,
    contributors: Sequence[str],
    upload_digests: Sequence[bytes],
    sum_digest: bytes,
    round_state: Mapping[str, float],
    box_keys_digest: bytes,
    previous_result: bytes,
) -> bytes:
    """The 32 bytes every contributor of a round signs: the set, each member's upload digest, the sum's,
    the round state, the round's box keys and the previous round's result, each part length-prefixed.

    ``round_state`` is what a contributor's share was made with beyond the run's settings (the number
    of sub-clients and the clipping bound, where they adapt), each value as an IEEE double, exact for
    whole numbers and float32 values: contributors that disagree on it sign different statements."""
    parts = [_LABEL, run.encode(), b"%d" % round_number, b"%d" % len(contributors)]
    parts += [name.encode() for name in contributors] + list(upload_digests)
    parts += [sum_digest, box_keys_digest, previous_result, b"%d" % len(round_state)]
    parts += [name.encode() + b"=" + struct.pack(">d", value) for name, value in sorted(round_state.items())]
    statement = hashlib.sha256()
    for part in parts:
        statement.update(struct.pack(">Q", len(part)) + part)
    return statement.digest()
