"""A hospital that pushes one class, staying inside every check of its ballot, in a real federation: its influence
on the labels is its votes. Today's defaults (3 hospitals, kNN-DPFL k = 30 and sigma = 15; AE-DPFL sigma = 1).

Three runs of each method on the same built-in digits, hospital-3 differing between them:

- **honest**: it votes as the others do;
- **class**: it casts every vote for class 3, its noise drawn honestly;
- **aimed**: it casts every vote for class 3 and puts its noise, as large as the energy cap allows, in the slots
  that would be class 3's counts were there no placement. The talliers sign and place that noise at random,
  after the fact (a pool's slots: ``tallier.ballot_checks.pool_placement``), so it no longer lands on class 3.

The share of class 3 among the labels under ``aimed`` is at most that under ``class`` plus a margin of five
standard errors of the difference. With the talliers' placement taken out (signs +1, places unchanged), this
test measured 0.80 (kNN-DPFL) and 0.84 (AE-DPFL) under ``aimed`` against 0.35 and 0.28 under ``class``, and
failed. A placement by signs alone would pass it (the margin is 0.2 on 270 labels):
``tests/unit/tallier/test_noise_placement.py`` checks that the places are a uniform permutation.

Three runs of 270 labels cannot tell 2 points apart; the second test does, by issue 46's measure (the labels that
differ from an honest run's), on one run's real noisy totals, adding hospital-3's noise to them as the talliers
would place it, under many seeds."""

import dataclasses
import inspect
import json
import math
import secrets

import numpy as np
import pytest
from consilium.protocol.wire.codec import decode
from consilium.protocol.wire.messages import TO_VOTING_SERVER, Labels
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.protocol.wire.transcript import read_transcript
from consilium.tallier.ballot_checks import pool_placement
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.voting.votes import noise_share
from test_voting_federation import _Federation

pytestmark = pytest.mark.slow


def _aimed(layout):
    """Noise the size of the range and the energy cap in the slots that would be class 3's counts, were there no
    placement: what today's checks would let a hospital put on class 3."""
    slots = np.arange(3, layout.totals, layout.classes)
    noise = np.zeros(layout.pool_values, dtype=np.int64)
    noise[slots] = min(layout.noise_range, int((layout.energy_cap / len(slots)) ** 0.5))
    return noise


_PUSHING_HOSPITAL = """
import runpy, sys
import numpy as np
import consilium.protocol.voting.voting_hospital as module

honest = module.seal_ballot


def pushing(votes, noise, **options):
    layout = options["layout"]
    np.save(VOTES + f"-round-{options['round_number']}.npy", votes)  # its honest votes, for the test's honest run
    if STRATEGY != "quiet":  # "quiet": its own votes and no noise, which the test adds afterwards
        votes = np.zeros_like(votes)
        votes[:, 3] = layout.votes_per_query  # every vote for class 3
    if STRATEGY == "aimed":  # its noise as large as the checks allow, all of it on class 3's counts
        noise = _aimed(layout)
    if STRATEGY in ("silent", "quiet"):  # no noise at all (the checks bound it from above only)
        noise = np.zeros_like(noise)
    return honest(votes, noise, **options)


AIMED

module.seal_ballot = pushing
sys.argv = ["consilium-hospital", *sys.argv[1:]]
runpy.run_module("consilium.scripts.hospital", run_name="__main__")
"""

# The default queries a round, all of a public pool of 270 built-in digits (0.75 of the 360 held out): every run
# asks the same queries, in another order, so kNN-DPFL's votes are the same in every run.
_QUERIES, _ROUNDS, _PUBLIC_FRACTION = 90, 3, "0.75"


def _run(tmp_path, method, strategy, reveal="labels"):
    """The first tallier's ``Labels`` of one run in which hospital-3 follows ``strategy``, and the run's
    configuration."""
    federation = _Federation(tmp_path / f"{method}-{strategy}")
    allow = ("--allow-histogram",) if reveal == "histogram" else ()
    try:
        transcript = federation.tmp / "transcript.msgpack"
        federation.server(
            "--method",
            method,
            "--rounds",
            str(_ROUNDS),
            "--queries-per-round",
            str(_QUERIES),
            "--public-fraction",
            _PUBLIC_FRACTION,
            "--reveal",
            reveal,
            "--transcript",
            transcript,
        )
        for name in federation.roster.talliers:
            federation.tallier(name, *allow)
        hospital_args = ("--method", method, "--epsilon-budget", "1000000", *allow)
        others = "quiet" if strategy == "silent" else "honest"
        for part, role in enumerate((others, others, strategy), start=1):
            _hospital(federation, f"hospital-{part}", part, role, hospital_args)
        assert federation.exit_code("server", timeout=600) == 0, federation.log("server")
        report = json.loads((federation.tmp / "out" / "server_report.json").read_text())
        assert all(r["refused"] == [] for r in report["rounds"])  # inside every check
        first_tallier = report["config"]["talliers"][0]
        labels = [
            message
            for record in read_transcript(transcript)
            if record["sender"] == first_tallier
            for message in [decode(record["payload"], accept=TO_VOTING_SERVER, max_bytes=1 << 26)]
            if isinstance(message, Labels)
        ]
        votes = {
            name: {r: np.load(federation.tmp / f"{name}-round-{r}.npy") for r in range(1, _ROUNDS + 1)}
            for name in federation.roster.hospitals
            if strategy == "silent"
        }
        return labels, VotingConfig.from_dict(report["config"]), votes
    finally:
        federation.close()


def _hospital(federation, name, part, strategy, hospital_args):
    if strategy == "honest":
        federation.hospital(name, part, *hospital_args)
        return
    code = _PUSHING_HOSPITAL.replace("STRATEGY", repr(strategy)).replace("VOTES", repr(str(federation.tmp / name)))
    federation.launch_python(
        code.replace("AIMED", inspect.getsource(_aimed)), name, "--name", name, "--data", "digits", "--parts", "3",
        "--part", str(part), "--timeout", "60", *hospital_args,
    )  # fmt: skip


def _labels(tmp_path, method, strategy):
    """The released labels of one run in which hospital-3 follows ``strategy``."""
    return np.concatenate([message.labels for message in _run(tmp_path, method, strategy)[0]])


@pytest.mark.parametrize("method", ["knn-dpfl", "ae-dpfl"])
def test_a_hospital_pushing_one_class_moves_the_labels_by_its_votes_not_by_its_noise(tmp_path, method):
    shares = {strategy: np.mean(_labels(tmp_path, method, strategy) == 3) for strategy in ("honest", "class", "aimed")}
    labels = _QUERIES * _ROUNDS
    margin = 5 * math.sqrt(2 * 0.25 / labels)  # five standard errors of a difference of two shares, at their largest
    print(method, {strategy: round(float(share), 3) for strategy, share in shares.items()})
    assert shares["class"] > shares["honest"]  # its votes do count
    assert shares["aimed"] <= shares["class"] + margin, shares


_DRAWS = 400


@pytest.mark.parametrize("method", ["knn-dpfl", "ae-dpfl"])
def test_a_hospital_pushing_one_class_changes_at_most_2_points_more_labels_than_its_votes_do(tmp_path, method):
    """Issue 46's measure, which three runs cannot resolve. One run opens the totals of the three hospitals' real
    votes, hospital-3's all for class 3 (``--reveal histogram``), each hospital sending its noise as zeros (inside
    every check) and keeping its own votes. The test adds the noise afterwards, as the talliers would place it
    (``pool_placement``, which ``tests/integration/test_tallier_mpc.py`` checks the MPC follows), every draw on
    fresh seeds and fresh honest pools (``noise_share``):

    - the **honest run**: every hospital's own votes and honest noise;
    - the **class vote**: hospital-3's votes all for class 3, every hospital's noise honest, on another seed;
    - each **attack**: the class vote's run with hospital-3's noise replaced by the attack's values: as many
      values of one size as the pool and the energy cap allow (``results/vote_pushing/simulate.py`` found these the
      worst), where the pool's size binds the mix of 2s and 1s with the most energy, and the noise aimed at class
      3's counts.

    The labels an attack changes from the honest run's, less those the class vote changes, are at most 2 points:
    its influence is its votes. Unplaced, the aimed noise changes over 20 points more: the test can fail."""
    rounds, config, votes = _run(tmp_path, method, "silent", reveal="histogram")
    layout, modulus = config.ballot_layout(), config.field().modulus
    class_votes = np.zeros((layout.queries, layout.classes), dtype=np.int64)
    class_votes[:, 3] = layout.votes_per_query
    for message in rounds:
        totals = np.frombuffer(message.totals, dtype="<i8").reshape(layout.queries, layout.classes)
        own = [votes[name][message.round][:, : layout.classes] for name in ("hospital-1", "hospital-2")]
        assert np.array_equal(totals, own[0] + own[1] + class_votes)  # the real run's votes, counted
    excess = _excess(config, layout, votes, [message.round for message in rounds], modulus, _DRAWS)
    print(method, f"M = {layout.pool_factor}:", excess)
    assert all(points <= 2 for name, points in excess.items() if name != "aimed, unplaced"), excess
    assert excess["aimed, unplaced"] >= 20, excess  # the test can fail
    # The checks before the pool (M = 1: range and energy cap over the round's values alone), on the same votes.
    values = layout.totals
    voting = config.voting
    alone = dataclasses.replace(
        layout,
        pool_factor=1,
        noise_range=voting.noise_range(values=values),
        energy_cap=voting.energy_cap(values=values),
    )
    before = _excess(config, alone, votes, [message.round for message in rounds], modulus, _DRAWS // 4)
    print(method, "M = 1:", before)
    if method == "ae-dpfl":  # simulated at 4.5 points (kNN-DPFL's 2.4 is too near 2 to assert)
        assert max(points for name, points in before.items() if name != "aimed, unplaced") > 2.5, before


def _excess(config, layout, votes, round_numbers, modulus, draws):
    """Each attack's labels changed from the honest run's, less the class vote's, in points, under ``layout``."""
    mechanism = config.voting.mechanism(queries=layout.queries, classes=layout.classes, level="record")
    sent, cap = layout.pool_values, layout.energy_cap
    attacks = {"aimed": _aimed(layout)}
    for size in sorted({1, 2, 3, 5, 8, 13, 20, 30, 50, layout.noise_range}):
        if size <= layout.noise_range:
            attacks[f"{min(sent, cap // size**2)} of {size}"] = np.full(min(sent, cap // size**2), size)
    twos = max(0, (cap - sent) // 3)  # the most energy M N values of 2 and 1 can carry under the cap
    if 0 < twos < sent:
        attacks[f"{twos} of 2, {sent - twos} of 1"] = np.repeat([2, 1], [twos, sent - twos])
    attacks = {name: np.pad(values, (0, sent - len(values))) for name, values in attacks.items()}
    class_votes = np.zeros((layout.queries, layout.classes), dtype=np.int64)
    class_votes[:, 3] = layout.votes_per_query
    generator = secure_generator()

    def placement(hospital):
        """Where the talliers place a hospital's pool, on a fresh seed: ``(signs, slots)``."""
        return pool_placement(1 + secrets.randbelow(modulus - 1), hospital, layout, modulus)

    def placed(values, where):
        signs, slots = where
        return (signs * values[slots]).reshape(layout.queries, layout.classes)

    def honest(hospital):
        return placed(noise_share(mechanism, layout.noise_pool, generator=generator), placement(hospital))

    excess = dict.fromkeys([*attacks, "aimed, unplaced"], 0.0)
    for round_number in round_numbers:
        own = [votes[f"hospital-{h}"][round_number][:, : layout.classes] for h in (1, 2, 3)]
        for _ in range(draws):
            honest_run = (sum(own) + sum(honest(f"hospital-{h}") for h in (1, 2, 3))).argmax(axis=1)
            others = own[0] + own[1] + class_votes + honest("hospital-1") + honest("hospital-2")
            where = placement("hospital-3")  # one round's seed, whatever hospital-3 sent: paired
            by_class = np.mean(
                (others + placed(noise_share(mechanism, layout.noise_pool, generator=generator), where)).argmax(axis=1)
                != honest_run
            )
            for name, values in [*attacks.items(), ("aimed, unplaced", None)]:
                if values is None:  # the aimed values where they were sent, were there no placement
                    pushed = np.pad(attacks["aimed"], (0, layout.totals))[: layout.totals].reshape(others.shape)
                else:
                    pushed = placed(values, where)
                changed = np.mean((others + pushed).argmax(axis=1) != honest_run)
                excess[name] += 100 * (changed - by_class) / (draws * len(round_numbers))
    return {name: round(float(points), 2) for name, points in excess.items()}
