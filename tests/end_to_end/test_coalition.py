"""The server with one hospital, in a real federation: the issue's first test of the one-time round.

A real server process (its transcript keeping whole messages) and two real hospital processes, with
hospital-3 played in this process, honestly, so that every secret it holds is in hand: its box keys,
the shares the others sealed to it, its own key's dealing, its update. Given all of it and every
byte the server received, the attacker opens the round's sum, and neither other hospital's update.
"""

import numpy as np
import pytest
from scripted import HospitalProcess, ScriptedHospital, ServerProcess

from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.key_shares import rebuild
from consilium.crypto.one_time_keys import check_zero_slots, decrypt_sum, sum_uploads, unpack_ring
from consilium.protocol.wire.messages import (
    TO_SERVER,
    Aggregate,
    Endorsements,
    Hello,
    Proofs,
    Release,
    Releases,
    RoundStart,
    Update,
)
from consilium.protocol.secure_round.statement import released_from
from consilium.protocol.wire.transcript import read_messages

pytestmark = pytest.mark.slow


def test_the_server_with_one_hospital_opens_the_sum_and_no_single_update(tmp_path):
    server = ServerProcess(tmp_path, 3, "--rounds", "1", "--round-timeout", "60", "--transcript-payloads")
    real = [
        HospitalProcess(server.federation, f"hospital-{i}", i, 3, tmp_path / f"hospital-{i}.log", "--send-offset", "0")
        for i in (1, 2)
    ]
    h3 = ScriptedHospital(server, "hospital-3")
    try:
        h3.send(Hello())
        config = h3.welcome()
        start = h3.expect(RoundStart)
        own_values = h3.random_update(3)
        h3.send(h3.upload(start, own_values))
        h3.send(h3.endorse(h3.expect(Aggregate)))
        h3.send(h3.prove(h3.expect(Endorsements)))
        h3.send(h3.release(h3.expect(Proofs)))
        h3.send(h3.confirm(h3.expect(Releases)))
        report = server.finish()
        for hospital in real:
            assert hospital.process.wait(timeout=60) == 0
    finally:
        server.close()
        for hospital in real:
            hospital.kill()
    assert report["rounds"][0]["status"] == "released"

    # The attacker: every message the server received, and all of hospital-3's secrets.
    received = list(read_messages(tmp_path / "transcript.msgpack", accept=TO_SERVER))
    uploads = {s: m for s, m, _ in received if isinstance(m, Update) and m.round == 1}
    releases = {s: m for s, m, _ in received if isinstance(m, Release) and m.round == 1}
    public = PublicContext(config.bfv_parameters())
    params, q = public.params, public.params.ciphertext_modulus
    round_keys = h3.rounds[1]
    a = round_keys._setting.public_polynomials
    data_slots = params.digits.slots_for(params.vector_length)
    rows = {name: unpack_ring(public, list(u.chunks), "upload") for name, u in uploads.items()}

    def opens(total, key) -> bool:
        try:
            check_zero_slots(public, decrypt_sum(public, total, key, a), data_slots)
        except BfvError:
            return False
        return True

    # The sum opens under the key the releases rebuild, and decodes to every update together.
    shares = {
        config.hospitals.index(name) + 1: released_from(public, r.share, r.masks, r.signature).release.share
        for name, r in releases.items()
    }
    sum_key = rebuild(dict(sorted(shares.items())[:2]), 2, q)
    everything = sum_uploads(public, list(rows.values()))
    assert opens(everything, sum_key)
    opened = decrypt_sum(public, everything, sum_key, a)
    assert np.array_equal(params.digits.from_slots(opened[:data_slots], params.vector_length), h3.opened[1])

    # hospital-3's own key, from the dealing it kept; the other two keys' sum; each share it holds of them.
    own_key = rebuild({1: h3.dealt[1][0].share, 2: h3.dealt[1][1].share}, 2, q)
    others = ((sum_key.astype(object) - own_key.astype(object)) % q).astype(np.uint64)
    assert opens(sum_uploads(public, [rows["hospital-1"], rows["hospital-2"]]), others)  # their sum, yes
    for name in ("hospital-1", "hospital-2"):
        candidates = [others, sum_key, own_key, round_keys._shares[name].share, *(s for s in shares.values())]
        assert not any(opens(rows[name], key) for key in candidates), name  # each alone, no
