import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from crypto.endorsement import EndorsementError, aggregate_statement, check_endorsements, endorse

KEYS = {name: Ed25519PrivateKey.generate() for name in ("hospital-1", "hospital-2", "hospital-3")}
PUBLIC = {name: key.public_key() for name, key in KEYS.items()}
BASE = dict(
    run="0123abcd:00ff",
    round_number=4,
    contributors=("hospital-1", "hospital-2"),
    chunks=(b"c0", b"c1"),
    round_state={},
)


def _signed(statement, names):
    return {name: endorse(statement, KEYS[name]) for name in names}


def test_a_statement_binds_the_run_the_round_the_list_every_byte_of_the_aggregate_and_the_round_state():
    variants = [
        dict(run="0123abcd:00fe"),
        dict(round_number=5),
        dict(contributors=("hospital-2", "hospital-1")),
        dict(contributors=("hospital-1", "hospital-2", "hospital-3")),
        dict(chunks=(b"c0", b"c2")),
        dict(chunks=(b"c0c", b"1")),  # the same bytes split differently
        dict(contributors=("hospital-1hospital-2",)),
        dict(round_state={"subclients": 3}),  # contributors that trained with different v
        dict(round_state={"subclients": 4}),
        dict(round_state={"subclients": 4, "max_update_norm": 0.5}),  # ... or a different clipping bound
        dict(round_state={"subclients": 4, "max_update_norm": float(np.nextafter(np.float32(0.5), np.float32(1)))}),
        dict(round_state={"subclients": 4, "max_update_norm": 0.25}),
    ]
    statements = {aggregate_statement(**{**BASE, **change}) for change in variants}
    assert len(statements) == len(variants) and aggregate_statement(**BASE) not in statements


def test_only_every_contributors_signature_on_this_statement_is_accepted():
    statement = aggregate_statement(**BASE)
    contributors = {name: PUBLIC[name] for name in BASE["contributors"]}
    check_endorsements(statement, _signed(statement, contributors), contributors)
    other = aggregate_statement(**{**BASE, "round_number": 5})
    bad = [
        _signed(statement, ["hospital-1"]),  # one missing
        {**_signed(statement, contributors), **_signed(statement, ["hospital-3"])},  # a stranger's too
        _signed(other, contributors),  # another aggregate's
        {"hospital-1": endorse(statement, KEYS["hospital-1"]), "hospital-2": endorse(statement, KEYS["hospital-3"])},
        {"hospital-1": endorse(statement, KEYS["hospital-1"]), "hospital-2": b"\x00" * 64},
        {"hospital-1": endorse(statement, KEYS["hospital-1"]), "hospital-2": b"short"},
    ]
    for signatures in bad:
        with pytest.raises(EndorsementError):
            check_endorsements(statement, signatures, contributors)
