"""The talliers' secure argmax, run by three real MPyC processes over mutual TLS with pinned certificates."""

import subprocess
import sys

import numpy as np
import pytest

from consilium.crypto.checked_shares import CheckedLayout, _share_bits
from consilium.crypto.mpc_field import MpcField
from consilium.protocol.identity.roster import local_federation
from consilium.scripts.bench_tallier import party_command, share_votes, write_input

pytestmark = pytest.mark.slow
from consilium.tallier.mpc import MpcParty, run_round
from conftest import REPO, child_environment, free_port

TALLIERS = 3
HOSPITALS = ("hospital-1", "hospital-2")


def federation(root):
    """A federation with three talliers, each with its keys in its own folder, and its roster."""
    addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(TALLIERS))
    return local_federation(root, hospitals=1, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=addresses)


def _run(
    tmp_path,
    totals,
    *,
    reveal="labels",
    parties=range(TALLIERS),
    timeout=60.0,
    rounds=1,
    quorum=2,
    withheld=(),
    first=None,
    label_threshold=0,
    tampered=None,
    forged=None,
):
    """Split ``totals`` (Q x C) into two hospitals' votes (``first`` and the rest), share each in checked shares among
    the talliers (but not the ``(tallier, hospital)`` pairs in ``withheld``; ``tampered[(tallier, hospital)](share,
    layout, modulus)`` changes one; ``forged(bits)`` changes hospital-2's bits before it shares them, under a valid
    tag), and run the parties in ``parties``; their results and exit codes."""
    queries, classes = totals.shape
    first = np.random.default_rng().integers(-5, 5, size=totals.shape) if first is None else first
    votes = {name: v.reshape(-1) for name, v in zip(HOSPITALS, (first, totals - first))}
    shares, layout, field = share_votes(votes, TALLIERS)
    if forged is not None:
        bits = forged(layout.decompose(votes[HOSPITALS[1]]))
        for tallier, vector in enumerate(_share_bits(bits, TALLIERS, field.modulus)):
            shares[tallier, HOSPITALS[1]] = vector
    for key in withheld:
        del shares[key]
    for key, change in (tampered or {}).items():
        shares[key] = change(shares[key], layout, field.modulus)
    write_input(
        tmp_path / "input.npz",
        shares,
        hospitals=HOSPITALS,
        layout=layout,
        classes=classes,
        quorum=quorum,
        field=field,
        reveal=reveal,
        timeout=timeout,
        rounds=rounds,
        label_threshold=label_threshold,
    )
    roster = federation(tmp_path / "federation")
    processes = {
        index: subprocess.Popen(
            party_command("input.npz", f"out-{index}", tmp_path / "federation", roster.talliers[index]),
            cwd=tmp_path,
            env={**child_environment(), "PYTHONPATH": str(REPO)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in parties
    }
    codes = {index: process.wait(timeout=rounds * timeout + 60) for index, process in processes.items()}
    errors = {index: process.stderr.read() for index, process in processes.items()}
    outputs = {
        index: [dict(np.load(tmp_path / f"out-{index}-{r}.npz")) for r in range(1, rounds + 1)]
        for index in parties
        if codes[index] == 0
    }
    return outputs, codes, errors


def test_the_mpc_argmax_is_the_plaintext_argmax_ties_included(tmp_path):
    generator = np.random.default_rng()
    totals = generator.integers(-400, 400, size=(300, 10))
    tied = totals[:100]
    tied[:, 2] = tied.max(axis=1) + 1  # a tie between classes 2 and 7 (and 0 in the second half) ...
    tied[:, 7] = tied[:, 2]
    tied[50:, 0] = tied[50:, 2]
    totals[100:110] = 0  # ... and all ten classes tied
    outputs, codes, errors = _run(tmp_path, totals, rounds=2)  # two rounds in each process, as a tallier runs them
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    for output in (o for party in outputs.values() for o in party):
        assert np.array_equal(output["labels"], totals.argmax(axis=1))
        assert "totals" not in output
    # The tie rule: the lowest class index among the largest totals.
    assert set(outputs[0][0]["labels"][:50]) == {2} and set(outputs[0][0]["labels"][50:110]) == {0}


@pytest.mark.parametrize("reveal", ["labels", "histogram"])
def test_a_label_threshold_withholds_the_labels_of_queries_whose_top_total_is_below_it(tmp_path, reveal):
    totals = np.random.default_rng().integers(-60, 60, size=(200, 5))
    totals[:20] = 0
    totals[:10, 3] = 30  # exactly at the threshold: released
    totals[10:20, 1] = 29  # one vote below: withheld
    outputs, codes, errors = _run(tmp_path, totals, reveal=reveal, label_threshold=30)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    expected = np.where(totals.max(axis=1) >= 30, totals.argmax(axis=1), 5)  # 5 classes: label 5 is "withheld"
    assert 0 < np.sum(expected == 5) < len(totals)
    for party in outputs.values():
        assert np.array_equal(party[0]["labels"], expected)
    assert set(outputs[0][0]["labels"][:10]) == {3} and set(outputs[0][0]["labels"][10:20]) == {5}


def test_histogram_mode_opens_the_totals(tmp_path):
    totals = np.random.default_rng().integers(-50, 50, size=(20, 4))
    outputs, codes, errors = _run(tmp_path, totals, reveal="histogram")
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    assert np.array_equal(outputs[1][0]["totals"], totals)
    assert np.array_equal(outputs[1][0]["labels"], totals.argmax(axis=1))


def test_a_missing_tallier_ends_the_round_with_an_error_and_no_labels(tmp_path):
    totals = np.zeros((5, 3), dtype=np.int64)
    outputs, codes, errors = _run(tmp_path, totals, parties=(0, 1), timeout=5.0, rounds=2)
    assert outputs == {}
    assert codes == {0: 2, 1: 2}  # the first round's error; no second round is tried
    assert all("did not finish within 5 s" in error and "Traceback" not in error for error in errors.values())


def test_the_voters_are_the_hospitals_every_tallier_holds_a_share_from(tmp_path):
    generator = np.random.default_rng()
    first = np.eye(4, dtype=np.int64)[generator.integers(0, 4, size=20)]
    totals = first + 3 * np.eye(4, dtype=np.int64)[(first.argmax(axis=1) + 1) % 4]  # hospital-2 outvotes hospital-1
    outputs, codes, errors = _run(tmp_path, totals, quorum=1, withheld={(1, "hospital-2")}, first=first)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    for output in (party[0] for party in outputs.values()):
        assert list(output["voters"]) == ["hospital-1"]
        assert np.array_equal(output["labels"], first.argmax(axis=1))  # hospital-2's shares were left out everywhere


def test_fewer_shared_voters_than_the_quorum_release_no_label(tmp_path):
    outputs, codes, errors = _run(tmp_path, np.zeros((5, 3), dtype=np.int64), withheld={(2, "hospital-1")})
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    assert all("from 1 hospitals, fewer than the quorum of 2" in error for error in errors.values())


def _plus_200_for_class_3(bits):
    bits = bits.copy()
    bits[3::5, 0] += 200  # of 5 classes: the lowest "bit" of class 3's count of every query
    return bits


def _beyond_the_comparisons(bits):
    bits = bits.copy()
    bits[0::5, 0] += 2**40  # far outside what any total may be for a comparison to be right
    return bits


@pytest.mark.parametrize("forge", [_plus_200_for_class_3, _beyond_the_comparisons], ids=["plus-200", "beyond-range"])
def test_a_hospital_whose_ballot_is_not_bits_is_left_out_of_every_count_and_named(tmp_path, forge):
    generator = np.random.default_rng()
    first = generator.integers(0, 30, size=(40, 5))
    totals = first + generator.integers(0, 30, size=(40, 5))
    outputs, codes, errors = _run(tmp_path, totals, quorum=1, first=first, forged=forge)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    for output in (party[0] for party in outputs.values()):
        assert list(output["refused"]) == ["hospital-2"] and list(output["voters"]) == ["hospital-1"]
        assert np.array_equal(output["labels"], first.argmax(axis=1))  # hospital-1's votes alone


def test_a_forged_ballot_that_leaves_too_few_voters_releases_no_label(tmp_path):
    outputs, codes, errors = _run(tmp_path, np.zeros((10, 5), dtype=np.int64), forged=_plus_200_for_class_3)
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    assert all(
        "1 of the 2 voters' ballots pass their checks" in e and "refused: hospital-2" in e for e in errors.values()
    )


@pytest.mark.parametrize("part", ["bit", "key", "tag"])
def test_a_tallier_that_shifts_its_input_is_caught_and_no_label_is_released(tmp_path, part):
    def shift(share, layout, modulus):
        share = share.copy()
        where = {"bit": 3 * layout.bits, "key": layout.values - layout.bits, "tag": layout.entries * layout.bits + 3}[
            part
        ]
        share[where] = (int(share[where]) + 200) % modulus
        return share

    totals = np.random.default_rng().integers(0, 30, size=(20, 5))
    outputs, codes, errors = _run(tmp_path, totals, tampered={(1, "hospital-1"): shift})
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    assert all("hospital-1's ballot fail its tag check" in error for error in errors.values()), errors


_PLAY_ROUNDS = """
import sys
from pathlib import Path
import numpy as np
from consilium.crypto.checked_shares import CheckedLayout
from consilium.crypto.mpc_field import MpcField
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.tallier.mpc import MpcError, mpc_party, run_round
root, name, rounds, first_timeout = Path(sys.argv[1]), sys.argv[2], [int(r) for r in sys.argv[3].split(",")], float(sys.argv[5])
party = mpc_party(Roster.load(root), Credentials.load(root / name))
with np.load(sys.argv[4], allow_pickle=False) as data:
    shares = {h: data[f"share-{party.index}-{h}"] for h in ("hospital-1", "hospital-2")}
    layout = CheckedLayout(int(data["entries"]), int(data["low"]), int(data["high"]))
    field = MpcField(int(data["bit_length"]), int(str(data["modulus"])))
for round_number in rounds:
    try:
        result = run_round(
            party, round_number, shares, hospitals=("hospital-1", "hospital-2"), quorum=2, layout=layout, classes=4,
            field=field, reveal="labels", label_threshold=0, timeout_s=first_timeout if round_number == 1 else 60.0,
        )
        print(f"round {round_number}: labels {result.labels.tolist()}", flush=True)
    except MpcError as error:
        print(f"round {round_number}: {error}", flush=True)
"""


def test_a_round_after_a_failed_one_runs_in_the_same_process(tmp_path):
    """Round 1 fails for want of tallier-3; the same two processes then tally round 2 with it. Tallier-1 gives
    up on round 1 first, so that it dials tallier-2 while tallier-2 still listens for round 1: that
    connection ends with tallier-2's round, and tallier-1 dials again."""
    roster = federation(tmp_path / "federation")
    totals = np.random.default_rng().integers(-40, 40, size=(30, 4))
    votes = {"hospital-1": totals.reshape(-1) // 2, "hospital-2": totals.reshape(-1) - totals.reshape(-1) // 2}
    shares, layout, field = share_votes(votes, TALLIERS)
    write_input(
        tmp_path / "input.npz",
        shares,
        hospitals=HOSPITALS,
        layout=layout,
        classes=4,
        quorum=2,
        field=field,
        reveal="labels",
        timeout=3.0,
        rounds=1,
        label_threshold=0,
    )

    def play(name: str, rounds: str, first_timeout: float = 60.0) -> subprocess.Popen:
        command = [
            *(sys.executable, "-c", _PLAY_ROUNDS, str(tmp_path / "federation"), name, rounds, "input.npz"),
            str(first_timeout),
        ]
        return subprocess.Popen(
            command,
            cwd=tmp_path,
            env={**child_environment(), "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first_two = [play(roster.talliers[0], "1,2", 3.0), play(roster.talliers[1], "1,2", 6.0)]
    try:
        failures = [process.stdout.readline() for process in first_two]  # each waits out round 1 alone
        third = play(roster.talliers[2], "2")
        outputs = [process.communicate(timeout=120) for process in (*first_two, third)]
    finally:
        for process in (*first_two, locals().get("third")):
            if process is not None:
                process.kill()
    assert [line.split(" (")[0] for line in failures] == [
        f"round 1: the talliers' MPC did not finish within {seconds} s" for seconds in (3, 6)
    ], failures
    expected = f"round 2: labels {totals.argmax(axis=1).tolist()}"
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [expected] * 3, outputs
    assert all("Traceback" not in error for _, error in outputs)


def _party(talliers: int) -> MpcParty:
    return MpcParty(
        index=0,
        names=("a", "b", "c")[:talliers],
        addresses=(("h", 1), ("h", 2), ("h", 3))[:talliers],
        certificates=(b"", b"", b"")[:talliers],
        certificate_file=REPO,
        key_file=REPO,
    )


def test_fewer_than_three_talliers_or_another_field_are_refused():
    with pytest.raises(ValueError, match="at least 3 talliers"):
        _party(2)
    party = _party(3)
    another = MpcField(8, MpcField.for_bound(200).modulus)
    with pytest.raises(ValueError, match="computes modulo"):
        run_round(
            party,
            1,
            {},
            hospitals=("h",),
            quorum=1,
            layout=CheckedLayout(2, 0, 1),
            classes=2,
            field=another,
            reveal="labels",
            label_threshold=0,
            timeout_s=1,
        )


def test_a_check_is_opened_masked_so_a_failing_one_shows_nothing_of_its_value(monkeypatch):
    """``_Tally.failed`` opens each check times a fresh secret random factor: a failing check of 5 is found,
    and what is opened is neither 5 nor the same twice (a bare check could carry a hospital's bits)."""
    import consilium.tallier.mpc as mpc
    from consilium.crypto.mpc_field import mpyc_runtime

    from consilium.tallier.mpc_values import harden_mpyc

    runtime = mpyc_runtime([])  # one party: MPyC's arithmetic, no network
    secint = runtime.SecInt(11)
    harden_mpyc(secint.field.modulus)  # as every round does first: an earlier test may have set another field's codec
    tally = mpc._Tally(runtime, secint, CheckedLayout(2, 0, 1), round_number=1)
    opened = []
    honest_open = mpc.open_checked

    def recording(rt, x):
        result = honest_open(rt, x)
        result.add_done_callback(lambda done: opened.append(done.result()))
        return result

    monkeypatch.setattr(mpc, "open_checked", recording)

    async def twice():
        await runtime.start()
        found = [await tally.failed([secint(5), secint(0)]) for _ in range(2)]
        await runtime.shutdown()
        return found

    assert runtime.run(twice()) == [[0], [0]]
    (first, zero_1), (second, zero_2) = opened
    assert zero_1 == zero_2 == 0 and 5 not in (first, second) and first != second
