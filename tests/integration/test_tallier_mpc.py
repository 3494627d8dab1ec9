"""The talliers' checked secure argmax, run by three real MPyC processes over mutual TLS with pinned certificates."""

import subprocess
import sys

import numpy as np
import pytest

from consilium.crypto.mpc_field import MpcField
from consilium.protocol.identity.roster import local_federation
from consilium.scripts.bench_tallier import party_command, share_ballots, write_input

pytestmark = pytest.mark.slow
from consilium.tallier.mpc import MpcParty, run_round
from conftest import REPO, child_environment, free_port
from tally_inputs import ballot_bits, forged_ballot, layout_for, placed_totals, split_totals

TALLIERS = 3
HOSPITALS = ("hospital-1", "hospital-2")


def federation(root):
    """A federation with three talliers, each with its keys in its own folder, and its roster."""
    addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(TALLIERS))
    return local_federation(root, hospitals=1, address=f"tcp://127.0.0.1:{free_port()}", mpc_addresses=addresses)


def _run(
    tmp_path,
    ballots,
    layout,
    *,
    reveal="labels",
    parties=range(TALLIERS),
    timeout=60.0,
    rounds=1,
    quorum=2,
    withheld=(),
    label_threshold=0,
    tampered=None,
    forged=None,
    repeat=False,
    deviant=None,
):
    """Share each hospital's ``ballots[name] = (votes, noise)`` among the talliers (but not the ``(tallier,
    hospital)`` pairs in ``withheld``; ``tampered[(tallier, hospital)](share, layout, modulus)`` changes one;
    ``forged[name]`` is a list of that hospital's parts' bits, sent under valid tags instead of its ballot), and
    run the parties in ``parties``, tallier ``i`` as ``deviating_tallier.py`` with ``deviant[i]`` if given; their
    results and exit codes."""
    shares, field = share_ballots(
        {name: b for name, b in ballots.items() if name not in (forged or {})}, TALLIERS, layout
    )
    for name, parts_bits in (forged or {}).items():
        for tallier, vector in enumerate(forged_ballot(parts_bits, TALLIERS, field.modulus)):
            shares[tallier, name] = vector
    for key in withheld:
        del shares[key]
    for key, change in (tampered or {}).items():
        shares[key] = change(shares[key], layout, field.modulus)
    write_input(
        tmp_path / "input.npz",
        shares,
        hospitals=HOSPITALS,
        layout=layout,
        quorum=quorum,
        field=field,
        reveal=reveal,
        timeout=timeout,
        rounds=rounds,
        label_threshold=label_threshold,
        repeat=repeat,
    )
    roster = federation(tmp_path / "federation")
    processes = {
        index: subprocess.Popen(
            _command(
                index,
                deviant or {},
                party_command("input.npz", f"out-{index}", tmp_path / "federation", roster.talliers[index]),
            ),
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


def _command(index, deviant, honest):
    if index not in deviant:
        return honest
    return [sys.executable, str(REPO / "tests" / "support" / "deviating_tallier.py"), deviant[index], *honest[2:]]


def _votes_only(totals, votes_per_query):
    """Two hospitals' ballots that add up to ``totals``, with no noise: the totals are the test's to set."""
    layout = layout_for(*totals.shape, votes_per_query)
    zero = np.zeros(totals.size, dtype=np.int64)
    return dict(zip(HOSPITALS, ((votes, zero) for votes in split_totals(totals, votes_per_query)))), layout


def _random_ballots(queries, classes, votes_per_query, noise_range=40, **pool):
    generator = np.random.default_rng()
    layout = layout_for(queries, classes, votes_per_query, noise_range=noise_range, **pool)
    return {
        name: (
            generator.multinomial(votes_per_query, np.full(classes, 1 / classes), size=queries),
            generator.integers(-noise_range, noise_range + 1, size=layout.pool_values),
        )
        for name in HOSPITALS
    }, layout


def _compositions(queries, classes, total):
    """``queries`` rows of ``classes`` non-negative counts that sum to ``total``."""
    return np.random.default_rng().multinomial(total, np.full(classes, 1 / classes), size=queries)


def test_the_mpc_argmax_is_the_plaintext_argmax_ties_included(tmp_path):
    totals = _compositions(300, 10, 60)
    totals[:100] = 0
    totals[:50, [2, 7]] = 30  # a tie between classes 2 and 7 ...
    totals[50:100, [0, 2, 7]] = 20  # ... and among 0, 2 and 7
    totals[100:110] = 6  # and all ten classes tied
    ballots, layout = _votes_only(totals, 30)
    outputs, codes, errors = _run(
        tmp_path, ballots, layout, rounds=2
    )  # two rounds in each process, as a tallier runs them
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    for output in (o for party in outputs.values() for o in party):
        assert np.array_equal(output["labels"], totals.argmax(axis=1))
        assert "totals" not in output
    # The tie rule: the lowest class index among the largest totals.
    assert set(outputs[0][0]["labels"][:50]) == {2} and set(outputs[0][0]["labels"][50:110]) == {0}


def test_each_voter_s_noise_enters_the_totals_signed_and_placed_anew_each_round(tmp_path):
    """From a pool of 3 N values: what lands where, as ``pool_placement`` says, in every tallier's totals."""
    ballots, layout = _random_ballots(40, 5, 30, pool_factor=3)
    outputs, codes, errors = _run(tmp_path, ballots, layout, reveal="histogram", rounds=2)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    modulus = share_ballots(ballots, TALLIERS, layout)[1].modulus
    seeds = [int(str(round_output["seed"])) for round_output in outputs[0]]
    assert seeds[0] != seeds[1]  # each round draws its own signs and places
    for party in outputs.values():
        for round_output, seed in zip(party, seeds):
            expected = placed_totals(ballots, layout, seed, modulus)
            assert np.array_equal(round_output["totals"], expected)
            assert np.array_equal(round_output["labels"], expected.argmax(axis=1))
    plain = sum(votes + np.resize(noise, votes.shape) for votes, noise in ballots.values())
    assert not np.array_equal(outputs[0][0]["totals"], plain)  # the noise did not land where it was sent


def test_an_abstention_is_a_vote_for_no_class_and_adds_to_no_total(tmp_path):
    """AE-DPFL with a teacher confidence: a last "no class" column per query, checked like any vote and dropped
    before the totals; a ballot with a vote and an abstention in one query is refused."""
    layout = layout_for(30, 4, 1, abstains=True)
    generator = np.random.default_rng()
    votes = {name: np.eye(5, dtype=np.int64)[generator.integers(0, 5, size=30)] for name in HOSPITALS}
    ballots = {name: (votes[name], np.zeros(120, dtype=np.int64)) for name in HOSPITALS}
    outputs, codes, errors = _run(tmp_path, ballots, layout, reveal="histogram")
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    assert np.array_equal(outputs[0][0]["totals"], sum(v[:, :4] for v in votes.values()))
    both = votes["hospital-2"].copy()
    both[:, 4] = 1  # an abstention in every query, beside the vote where there was one
    both[both[:, :4].sum(axis=1) == 0, 0] = 1
    forged = {"hospital-2": ballot_bits(layout, both, ballots["hospital-2"][1], layout.energy_cap)}
    (tmp_path / "forged").mkdir()
    outputs, codes, errors = _run(tmp_path / "forged", ballots, layout, quorum=1, forged=forged)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    assert list(outputs[0][0]["reasons"]) == ["its votes are not 1 per query"]


@pytest.mark.parametrize(
    "reveal, deviant", [("histogram", None), ("histogram", "again-input"), ("labels", "again-input")]
)
def test_a_round_tallied_again_counts_what_the_first_tally_kept(tmp_path, reveal, deviant):
    """A server that relays a round again gets the same totals (or labels), not a second draw of the placement to
    average; and a tallier that inputs other shares in the later tallies (as one colluding with a hospital would, to
    put its noise where the first tally's placement shows it pushes a class) changes nothing: a tally again takes no
    input."""
    ballots, layout = _random_ballots(40, 5, 30)
    outputs, codes, errors = _run(
        tmp_path, ballots, layout, reveal=reveal, rounds=3, repeat=True, deviant={1: deviant} if deviant else None
    )
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    kept = "totals" if reveal == "histogram" else "labels"
    for party in outputs.values():
        assert len({str(tally["seed"]) for tally in party}) == 1
        assert all(np.array_equal(tally[kept], party[0][kept]) for tally in party)


@pytest.mark.parametrize("reveal", ["labels", "histogram"])
def test_a_tallier_that_changes_its_kept_shares_of_the_totals_is_caught(tmp_path, reveal):
    """Its share of a total is off the line of the honest talliers' where the totals are opened, and an error the
    labels' MAC check catches where they are authenticated (``[alpha] [T]``) and compared: a deviation either way,
    which the first honest tallier to see it names (the other may hear of it from that one first)."""
    ballots, layout = _random_ballots(40, 5, 30)
    outputs, codes, errors = _run(
        tmp_path, ballots, layout, reveal=reveal, rounds=2, repeat=True, deviant={1: "again-kept"}
    )
    assert all(code != 0 for code in codes.values()), errors
    check = (
        "do not lie on one polynomial" if reveal == "histogram" else "the MAC check of the labels' arithmetic failed"
    )
    named = [h for h in (0, 2) if check in errors[h] and "a tallier deviated" in errors[h]]
    assert named, errors  # the first honest tallier to see it may end the round for the other before it does
    assert all(check in errors[h] for h in (0, 2)), errors


@pytest.mark.parametrize("reveal", ["labels", "histogram"])
def test_a_label_threshold_withholds_the_labels_of_queries_whose_top_total_is_below_it(tmp_path, reveal):
    totals = _compositions(200, 5, 60)
    totals[:20] = 0
    totals[:10, [0, 3]] = 30  # exactly at the threshold: released
    totals[10:20, [1, 2]] = [29, 31 - 29]
    totals[10:20, 4] = 29  # one vote below: withheld
    ballots, layout = _votes_only(totals, 30)
    outputs, codes, errors = _run(tmp_path, ballots, layout, reveal=reveal, label_threshold=30)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    expected = np.where(totals.max(axis=1) >= 30, totals.argmax(axis=1), 5)  # 5 classes: label 5 is "withheld"
    assert 0 < np.sum(expected == 5) < len(totals)
    for party in outputs.values():
        assert np.array_equal(party[0]["labels"], expected)
    assert set(outputs[0][0]["labels"][:10]) == {0} and set(outputs[0][0]["labels"][10:20]) == {5}


def test_a_missing_tallier_ends_the_round_with_an_error_and_no_labels(tmp_path):
    ballots, layout = _random_ballots(5, 3, 1)
    outputs, codes, errors = _run(tmp_path, ballots, layout, parties=(0, 1), timeout=5.0, rounds=2)
    assert outputs == {}
    assert codes == {0: 2, 1: 2}  # the first round's error; no second round is tried
    assert all("did not finish within 5 s" in error and "Traceback" not in error for error in errors.values())


def test_the_voters_are_the_hospitals_every_tallier_holds_a_share_from(tmp_path):
    totals = _compositions(20, 4, 2)
    ballots, layout = _votes_only(totals, 1)
    first = ballots["hospital-1"][0]
    ballots["hospital-2"] = (np.eye(4, dtype=np.int64)[(first.argmax(axis=1) + 1) % 4], ballots["hospital-2"][1])
    withheld = {(party, "hospital-2") for party in range(3)}
    outputs, codes, errors = _run(tmp_path, ballots, layout, quorum=1, withheld=withheld)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    for output in (party[0] for party in outputs.values()):
        assert list(output["voters"]) == ["hospital-1"]
        assert np.array_equal(output["labels"], first.argmax(axis=1))  # hospital-2's shares were left out everywhere


def test_a_tallier_that_says_it_holds_no_share_the_others_hold_cannot_leave_its_hospital_out(tmp_path):
    """tallier-2 withholds hospital-2's share (it could say the box never reached it): no label is released, every
    tallier says why, and hospital-2 is not quietly dropped from a count (``tallier.voter_marks``)."""
    ballots, layout = _random_ballots(5, 3, 1)
    outputs, codes, errors = _run(tmp_path, ballots, layout, quorum=1, withheld={(1, "hospital-2")})
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    marks = "hospital-2's box: tallier-1 OK, tallier-2 NONE, tallier-3 OK"
    assert all(marks in error for error in errors.values())


def test_fewer_shared_voters_than_the_quorum_release_no_label(tmp_path):
    ballots, layout = _random_ballots(5, 3, 1)
    outputs, codes, errors = _run(tmp_path, ballots, layout, withheld={(party, "hospital-1") for party in range(3)})
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    assert all("from 1 hospitals, fewer than the quorum of 2" in error for error in errors.values())


def _not_bits(layout, votes, noise):
    bits = ballot_bits(layout, votes, noise, layout.energy_cap - int(noise @ noise))
    bits[1][3::5, 0] += 200  # of 5 classes: the lowest "bit" of class 3's noise in every query
    return bits


def _beyond_the_comparisons(layout, votes, noise):
    bits = ballot_bits(layout, votes, noise, layout.energy_cap - int(noise @ noise))
    bits[0][0::5, 0] += 2**40  # far outside what any total may be for a comparison to be right
    return bits


def _two_votes_in_a_query(layout, votes, noise):
    """Every count a bit, but two classes in each query: an AE-DPFL ballot that is not one vote."""
    votes = votes.copy()
    votes[:, 3] = 1
    votes[:, 4] = 1
    votes[:, :3] = 0
    return ballot_bits(layout, votes, noise, layout.energy_cap - int(noise @ noise))


def _noise_over_its_energy(layout, votes, noise):
    """Every noise value at the edge of its range, each in it, and no slack left to balance the energy."""
    return ballot_bits(layout, votes, np.full_like(noise, layout.noise_range), 0)


@pytest.mark.parametrize(
    "forge, reason",
    [
        (_not_bits, "its bits are not bits"),
        (_beyond_the_comparisons, "its bits are not bits"),
        (_two_votes_in_a_query, "its votes are not 1 per query"),
        (_noise_over_its_energy, "its noise's energy exceeds the cap"),
    ],
    ids=["plus-200", "beyond-range", "two-votes", "over-energy"],
)
def test_a_ballot_that_is_not_votes_and_noise_is_left_out_of_every_count_and_named(tmp_path, forge, reason):
    ballots, layout = _random_ballots(40, 5, 1, noise_range=10)
    layout = layout_for(40, 5, 1, noise_range=10, energy_cap=40 * 5 * 10**2 // 2)
    for name, (votes, noise) in ballots.items():
        ballots[name] = (votes, np.clip(noise, -7, 7))  # under the cap: 200 values of at most 49
    forged = {"hospital-2": forge(layout, *ballots["hospital-2"])}
    outputs, codes, errors = _run(tmp_path, ballots, layout, quorum=1, forged=forged, reveal="histogram")
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    modulus = share_ballots(ballots, TALLIERS, layout)[1].modulus
    for output in (party[0] for party in outputs.values()):
        assert list(output["refused"]) == ["hospital-2"] and list(output["voters"]) == ["hospital-1"]
        assert list(output["reasons"]) == [reason]
        alone = placed_totals({"hospital-1": ballots["hospital-1"]}, layout, int(str(output["seed"])), modulus)
        assert np.array_equal(output["totals"], alone)  # hospital-1's ballot alone


def test_a_kNN_ballot_whose_counts_sum_to_more_than_k_is_refused(tmp_path):
    ballots, layout = _random_ballots(10, 5, 30)
    votes, noise = ballots["hospital-2"]
    more = votes.copy()
    more[:, 0] = np.minimum(more[:, 0] + 1, 30)  # 31 neighbours' votes, each count within [0, k]
    more[more.sum(axis=1) == 30, 1] += 1
    bits = ballot_bits(layout, more, noise, layout.energy_cap - int(noise @ noise))
    outputs, codes, errors = _run(tmp_path, ballots, layout, forged={"hospital-2": bits})
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    assert all(
        "1 of the 2 voters' ballots pass their checks" in e and "hospital-2 (its votes are not 30 per query)" in e
        for e in errors.values()
    ), errors


@pytest.mark.parametrize("part", ["bit", "key", "tag"])
def test_a_tallier_that_shifts_its_input_is_caught_and_no_label_is_released(tmp_path, part):
    def shift(share, layout, modulus):
        share, noise = share.copy(), layout.parts[1]
        start = layout.parts[0].values  # the noise: the second part
        where = (
            start
            + {"bit": 3 * noise.bits, "key": noise.values - noise.bits, "tag": noise.entries * noise.bits + 3}[part]
        )
        share[where] = (int(share[where]) + 200) % modulus
        return share

    ballots, layout = _random_ballots(20, 5, 30)
    outputs, codes, errors = _run(tmp_path, ballots, layout, tampered={(1, "hospital-1"): shift})
    assert outputs == {} and codes == {0: 2, 1: 2, 2: 2}
    assert all("hospital-1's ballot fail its tag check" in error for error in errors.values()), errors


@pytest.mark.parametrize(
    "where, check",
    [
        ("multiplication", "the MAC check of the labels' arithmetic failed"),
        ("comparison", "the MAC check of the labels' arithmetic failed"),
        ("random-bit", "the MAC check of the labels' arithmetic failed"),
        (
            "opening",
            "once the checked arithmetic began, the talliers' shares of an opened value do not lie on one polynomial",
        ),
    ],
)
def test_a_tallier_that_deviates_in_the_labels_arithmetic_is_caught_and_no_label_is_released(tmp_path, where, check):
    """Caught, and named as a deviation, which stops the run, never as an interruption only, which would have the
    round tallied again with fresh masks: so also a share sent off the line of the others' once the output began.
    There the first honest tallier to see it names it, and may end the round for the other before it does."""
    ballots, layout = _random_ballots(20, 5, 30)
    outputs, codes, errors = _run(tmp_path, ballots, layout, deviant={1: where}, label_threshold=40)
    assert outputs == {} and all(code != 0 for code in codes.values()), errors
    named = [h for h in (0, 2) if check in errors[h] and "a tallier deviated" in errors[h]]
    assert named == [0, 2] or (where == "opening" and named), errors


def test_a_tallier_that_runs_out_of_memory_in_the_labels_interrupts_the_round_and_no_one_is_named(tmp_path):
    """A fault of a tallier's own machine in one of MPyC's steps, once the checked arithmetic began, is an
    interruption (the round may be tallied again), never taken for a deviation that would stop the run."""
    ballots, layout = _random_ballots(20, 5, 30)
    outputs, codes, errors = _run(tmp_path, ballots, layout, deviant={1: "local-fault"})
    assert outputs == {} and all(code != 0 for code in codes.values()), errors
    assert all("deviated" not in error and "Traceback" not in error for error in errors.values()), errors
    assert all("the talliers' MPC was aborted" in error for error in errors.values()), errors  # an interruption
    # Its own error names its fault; an honest tallier may see a peer leave first, one that ended on its notice.
    assert "this tallier failed in a step of the MPC: MemoryError" in errors[1], errors


@pytest.mark.parametrize("where", ["input-mac", "ballot-check"])
def test_a_tallier_that_deviates_in_the_ballot_checks_arithmetic_is_caught_and_no_ballot_is_refused(tmp_path, where):
    """An error in the inputs' MACs, or in a bit check's inner product, would fail an honest ballot's check under
    plain MPyC; here it fails the checks' MAC check before any check opens: no ballot is refused, no label released,
    and the run stops."""
    ballots, layout = _random_ballots(20, 5, 30)
    outputs, codes, errors = _run(tmp_path, ballots, layout, deviant={1: where})
    assert outputs == {} and all(code != 0 for code in codes.values()), errors
    for honest in (0, 2):
        assert "the MAC check of the ballot checks' arithmetic failed: a tallier deviated" in errors[honest], errors
        assert "refused" not in errors[honest] and "tag check" not in errors[honest], errors


def test_honest_talliers_pass_the_labels_check_round_after_round(tmp_path):
    ballots, layout = _random_ballots(40, 10, 30)
    outputs, codes, errors = _run(tmp_path, ballots, layout, rounds=12, label_threshold=35)
    assert codes == {0: 0, 1: 0, 2: 0}, errors
    modulus = share_ballots(ballots, TALLIERS, layout)[1].modulus
    for party in outputs.values():
        for output in party:
            totals = placed_totals(ballots, layout, int(str(output["seed"])), modulus)
            expected = np.where(totals.max(axis=1) >= 35, totals.argmax(axis=1), layout.classes)
            assert np.array_equal(output["labels"], expected)


_PLAY_ROUNDS = """
import sys
from pathlib import Path
import numpy as np
from consilium.crypto.mpc_field import MpcField
from consilium.protocol.identity.party_keys import Credentials
from consilium.protocol.identity.roster import Roster
from consilium.scripts.bench_tallier import read_layout
from consilium.tallier.mpc import MpcError, run_round
from consilium.tallier.mpc_network import mpc_party
root, name, rounds, first_timeout = Path(sys.argv[1]), sys.argv[2], [int(r) for r in sys.argv[3].split(",")], float(sys.argv[5])
party = mpc_party(Roster.load(root), Credentials.load(root / name))
with np.load(sys.argv[4], allow_pickle=False) as data:
    shares = {h: data[f"share-{party.index}-{h}"] for h in ("hospital-1", "hospital-2")}
    layout = read_layout(data)
    field = MpcField(int(data["bit_length"]), int(str(data["modulus"])))
for round_number in rounds:
    try:
        result = run_round(
            party, round_number, shares, hospitals=("hospital-1", "hospital-2"), quorum=2, layout=layout,
            field=field, reveal="labels", label_threshold=0, timeout_s=first_timeout if round_number == 1 else 60.0, bad={},
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
    totals = _compositions(30, 4, 20)
    ballots, layout = _votes_only(totals, 10)
    shares, field = share_ballots(ballots, TALLIERS, layout)
    write_input(
        tmp_path / "input.npz",
        shares,
        hospitals=HOSPITALS,
        layout=layout,
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
            layout=layout_for(1, 2, 1),
            field=another,
            reveal="labels",
            label_threshold=0,
            timeout_s=1,
            bad={},
        )
