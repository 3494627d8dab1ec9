"""The audit suite's ground truth: every process started with this folder on PYTHONPATH records its secrets.

The audit tests (``tests/test_audit.py``) must know what the hospitals kept secret in order to check
that none of it reaches the server or a tallier. Python imports this module at start-up in every
process of a federation the tests launch with ``CONSILIUM_AUDIT_RECORD=<folder>``; it wraps the two
places where a hospital's secrets take their last plaintext form and appends them, pickled, to
``<folder>/<pid>.pickle``:

- ``SecretContext.encrypt_update``: the integer update, and the run's secrets (BFV key, check key);
- ``seal_ballot`` and the ``share`` it calls: the noisy votes, and the share for each tallier (in the
  order of the talliers' names), in one entry.

Servers and talliers never call either. Talliers' MPC traffic is recorded instead: every byte a
process receives from its MPyC peers is appended to ``<folder>/<pid>.mpc``. With ``CONSILIUM_AUDIT_ZERO_VOTES=1``
every hospital votes zero for every class (the noise and everything after it unchanged), so that
what the talliers open is the noise alone. Otherwise the processes run their own code; each also
imports TenSEAL and MPyC at start-up and writes these records.
"""

import os

if os.environ.get("CONSILIUM_AUDIT_RECORD"):
    import pickle
    import threading
    from pathlib import Path

    import numpy as np

    import sys

    # MPyC reads its options from sys.argv when first imported: give it the tallier's (crypto.mpc_field).
    _argv, sys.argv = sys.argv, [sys.argv[0], "--no-log"]
    import mpyc.asyncoro

    sys.argv = _argv
    import crypto.bfv
    import protocol.ballots
    import protocol.voting_hospital

    _path = Path(os.environ["CONSILIUM_AUDIT_RECORD"]) / f"{os.getpid()}.pickle"

    def _record(entry: dict) -> None:
        with _path.open("ab") as file:
            pickle.dump(entry, file)

    _encrypt_update = crypto.bfv.SecretContext.encrypt_update

    def _recorded_encrypt_update(self, values, *, round_number, hospital, **options):
        _record({"kind": "update", "hospital": hospital, "round": round_number,
                 "values": np.asarray(values, dtype=np.int64), "secrets": self.to_bytes()})  # fmt: skip
        return _encrypt_update(self, values, round_number=round_number, hospital=hospital, **options)

    crypto.bfv.SecretContext.encrypt_update = _recorded_encrypt_update

    _ballot = threading.local()  # the ballot being sealed in this thread, which share() completes
    _seal_ballot = protocol.voting_hospital.seal_ballot

    def _recorded_seal_ballot(noisy_votes, **options):
        _ballot.entry = {"kind": "ballot", "hospital": options["hospital"], "round": options["round_number"],
                         "talliers": list(options["tallier_keys"]), "noisy_votes": np.asarray(noisy_votes, dtype=np.int64)}  # fmt: skip
        boxes = _seal_ballot(noisy_votes, **options)
        _record(_ballot.entry)
        return boxes

    protocol.voting_hospital.seal_ballot = _recorded_seal_ballot

    _share = protocol.ballots.share

    def _recorded_share(values, parties, modulus):
        shares = _share(values, parties, modulus)
        _ballot.entry |= {"shares": [np.asarray(share) for share in shares], "modulus": modulus}
        return shares

    protocol.ballots.share = _recorded_share

    _data_received = mpyc.asyncoro.MessageExchanger.data_received

    def _recorded_data_received(self, data):
        with _path.with_suffix(".mpc").open("ab") as file:
            file.write(data)
        return _data_received(self, data)

    mpyc.asyncoro.MessageExchanger.data_received = _recorded_data_received

    if os.environ.get("CONSILIUM_AUDIT_ZERO_VOTES") == "1":
        _noisy_votes = protocol.voting_hospital.noisy_votes
        protocol.voting_hospital.noisy_votes = lambda votes, *rest: _noisy_votes(np.zeros_like(votes), *rest)
