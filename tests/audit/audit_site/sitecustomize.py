"""The audit suite's ground truth: every process started with this folder on PYTHONPATH records its secrets.

The audit tests (``tests/audit/test_audit.py``) must know what the hospitals kept secret in order to check
that none of it reaches the server or a tallier. Python imports this module at start-up in every
process of a federation the tests launch with ``CONSILIUM_AUDIT_RECORD=<folder>``; it wraps the two
places where a hospital's secrets take their last plaintext form and appends them, pickled, to
``<folder>/<pid>.pickle``:

- ``HospitalRound.upload``: the integer update, the one-time key it was encrypted under (NTT form,
  uint64), and the hospital's rounded gradient sum before its noise was added, with the number of
  rows it sums and the scale they were rounded at (``SkellamMechanism.round_examples``, called just
  before in the same step: examples for Dopamine, sub-clients for DP-FedAvg);
- ``seal_ballot`` and the ``share_ballot`` it calls: the votes, the noise, the share for each
  tallier (in the order of the talliers' names) and the ballot's layout, in one entry.

Servers and talliers never call either. Talliers' MPC traffic is recorded instead: every byte a
process receives from its MPyC peers is appended to ``<folder>/<pid>.mpc``, and every value the
talliers' own code (``tallier/mpc.py`` and ``tallier/authenticated.py``, the comparisons' squares
and masked values included) opens with ``open_checked`` is appended, as a list of ints, to
``<folder>/<pid>.opened``. With ``CONSILIUM_AUDIT_FIXED_VOTES=1``
every hospital casts all its votes for class 0 in every query (the noise and everything after it
unchanged), so that what the talliers open is known votes and the noise. Otherwise the processes run their own code; each also
imports TenSEAL and MPyC at start-up and writes these records.
"""

import os

if os.environ.get("CONSILIUM_AUDIT_RECORD"):
    import pickle
    import sys
    import threading
    from pathlib import Path

    import numpy as np
    from consilium.crypto.mpc_field import import_mpyc

    import_mpyc()  # MPyC reads its options from sys.argv when first imported: not this process's

    from consilium.protocol.secure_round import hospital_round
    from consilium.protocol.voting import ballots, voting_hospital
    from consilium.tallier import mpc_network, mpc_values
    from consilium.training.privacy import skellam

    _path = Path(os.environ["CONSILIUM_AUDIT_RECORD"]) / f"{os.getpid()}.pickle"

    def _record(entry: dict) -> None:
        with _path.open("ab") as file:
            pickle.dump(entry, file)

    _gradient = []  # this step's rounded gradient sum and its rows: a hospital takes one step at a time
    _round_examples = skellam.SkellamMechanism.round_examples

    def _recorded_round_examples(self, examples, generator):
        rounded = _round_examples(self, examples, generator)
        _gradient[:] = [(rounded, len(np.asarray(examples).reshape(-1, self.dimension)), self.scale)]
        return rounded

    skellam.SkellamMechanism.round_examples = _recorded_round_examples

    _upload = hospital_round.HospitalRound.upload

    def _recorded_upload(self, slots, box_keys, identities):
        gradient, rows, scale = _gradient.pop() if _gradient else ([], 0, None)
        uploaded = _upload(self, slots, box_keys, identities)
        params = self._setting.params
        data = slots[: params.digits.slots_for(params.vector_length)]
        _record(
            {
                "kind": "update",
                "hospital": self._name,
                "round": self._setting.round_number,
                "values": np.asarray(params.digits.from_slots(data, params.vector_length), dtype=np.int64),
                "gradient": np.asarray(gradient, dtype=np.int64),
                "rows": rows,
                "scale": scale,
                "key": np.ascontiguousarray(self._key._key, dtype="<u8").tobytes(),
            }
        )
        return uploaded

    hospital_round.HospitalRound.upload = _recorded_upload

    _ballot = threading.local()  # the ballot being sealed in this thread, which share() completes
    _seal_ballot = voting_hospital.seal_ballot

    def _recorded_seal_ballot(votes, noise, **options):
        if os.environ.get("CONSILIUM_AUDIT_FIXED_VOTES") == "1":
            votes = np.zeros_like(votes)
            votes[:, 0] = options["layout"].votes_per_query
        _ballot.entry = {
            "kind": "ballot",
            "hospital": options["hospital"],
            "round": options["round_number"],
            "talliers": list(options["tallier_keys"]),
            "votes": np.asarray(votes, dtype=np.int64),
            "noise": np.asarray(noise, dtype=np.int64),
        }
        boxes = _seal_ballot(votes, noise, **options)
        _record(_ballot.entry)
        return boxes

    voting_hospital.seal_ballot = _recorded_seal_ballot

    _share_ballot = ballots.share_ballot

    def _recorded_share_ballot(votes, noise, layout, parties, modulus):
        shares = _share_ballot(votes, noise, layout, parties, modulus)
        _ballot.entry |= {"shares": [np.asarray(share) for share in shares], "modulus": modulus, "layout": layout}
        return shares

    ballots.share_ballot = _recorded_share_ballot

    _data_received = mpc_network._PinnedExchanger.data_received

    def _recorded_data_received(self, data):
        with _path.with_suffix(".mpc").open("ab") as file:
            file.write(data)
        return _data_received(self, data)

    mpc_network._PinnedExchanger.data_received = _recorded_data_received

    _open_checked = mpc_values.open_checked  # before tallier.mpc imports it

    def _record_opened(done) -> None:
        if not done.cancelled() and done.exception() is None:
            with _path.with_suffix(".opened").open("ab") as file:
                pickle.dump([int(v) for v in np.ravel(np.asarray(done.result(), dtype=object))], file)

    def _recorded_open_checked(runtime, x):
        opened = _open_checked(runtime, x)
        if Path(sys._getframe(1).f_code.co_filename).parts[-2:] in {
            ("tallier", "mpc.py"),
            ("tallier", "authenticated.py"),
        }:
            opened.add_done_callback(_record_opened)
        return opened

    mpc_values.open_checked = _recorded_open_checked
