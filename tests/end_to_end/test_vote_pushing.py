"""A hospital that pushes one class, staying inside every check of its ballot, in a real federation: its influence
on the labels is its votes. Today's defaults (3 hospitals, kNN-DPFL k = 30 and sigma = 15; AE-DPFL sigma = 1).

Three runs of each method on the same built-in digits, hospital-3 differing between them:

- **honest**: it votes as the others do;
- **class**: it casts every vote for class 3, its noise drawn honestly;
- **aimed**: it casts every vote for class 3 and puts its noise, as large as the energy cap allows, on class 3's
  count of every query: where today's checks let it fill its noise's range with votes for class 3. The talliers
  sign and place that noise at random, after the fact, so it no longer lands on class 3.

The share of class 3 among the labels under ``aimed`` is at most that under ``class`` plus a margin of five
standard errors of the difference. With the talliers' placement taken out (signs +1, places unchanged), this
test measured 0.80 (kNN-DPFL) and 0.84 (AE-DPFL) under ``aimed`` against 0.35 and 0.28 under ``class``, and
failed. A placement by signs alone would pass it (the margin is 0.2 on 324 labels):
``tests/unit/tallier/test_noise_placement.py`` checks that the places are a uniform permutation.

Three runs of 324 labels cannot tell 2 points apart; the second test does, on one run's real noisy totals, by
adding hospital-3's noise to them as the talliers would place it, under many seeds, paired with honest noise."""

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
from consilium.tallier.ballot_checks import noise_placement
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.voting.votes import noise_share
from test_voting_federation import _Federation

pytestmark = pytest.mark.slow


def _aimed_size(layout):
    """The size of each of its noise values on class 3's counts: as large as the range and the energy cap allow."""
    return min(layout.noise_range, int((layout.energy_cap / layout.queries) ** 0.5))


_PUSHING_HOSPITAL = """
import runpy, sys
import numpy as np
import consilium.protocol.voting.voting_hospital as module

honest = module.seal_ballot


def pushing(votes, noise, **options):
    layout = options["layout"]
    votes = np.zeros_like(votes)
    votes[:, 3] = layout.votes_per_query  # every vote for class 3
    if STRATEGY in ("aimed", "silent"):  # its noise as large as the checks allow, all of it on class 3's counts;
        noise = np.zeros_like(noise)  # or none at all (the checks bound it from above only)
    if STRATEGY == "aimed":
        noise.reshape(layout.queries, layout.classes)[:, 3] = _aimed_size(layout)
    return honest(votes, noise, **options)


AIMED_SIZE

module.seal_ballot = pushing
sys.argv = ["consilium-hospital", *sys.argv[1:]]
runpy.run_module("consilium.scripts.hospital", run_name="__main__")
"""

_QUERIES, _ROUNDS = 108, 3  # of a public pool of 324 built-in digits: 0.9 of the held-out records


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
            "0.9",
            "--reveal",
            reveal,
            "--transcript",
            transcript,
        )
        for name in federation.roster.talliers:
            federation.tallier(name, *allow)
        hospital_args = ("--method", method, "--epsilon-budget", "1000000", *allow)
        federation.hospital("hospital-1", 1, *hospital_args)
        federation.hospital("hospital-2", 2, *hospital_args)
        if strategy == "honest":
            federation.hospital("hospital-3", 3, *hospital_args)
        else:
            code = _PUSHING_HOSPITAL.replace("STRATEGY", repr(strategy))
            code = code.replace("AIMED_SIZE", inspect.getsource(_aimed_size))
            federation.launch_python(
                code, "hospital-3", "--name", "hospital-3", "--data", "digits", "--parts", "3", "--part", "3",
                "--timeout", "60", *hospital_args,
            )  # fmt: skip
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
        return labels, VotingConfig.from_dict(report["config"])
    finally:
        federation.close()


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
def test_a_hospital_pushing_one_class_moves_the_labels_by_at_most_2_points_more_than_its_votes_do(tmp_path, method):
    """The issue's 2 points, which three runs cannot resolve (above): one run, in which hospital-3 casts every vote
    for class 3 and sends no noise (inside every check), opens the noisy totals of the others' votes and noise and
    its votes (``--reveal histogram``). To each round's totals the test adds hospital-3's noise as the talliers
    would have placed it (``noise_placement``, under fresh random seeds): the aimed noise, noise of one size as
    the cap allows it (``shaped``, as ``results/vote_pushing/simulate.py`` tries), or an honest draw
    (``noise_share``). On the same real totals, the aimed noise's labels are class 3 at most 2 points more often
    than honest noise's (simulated: about 1 point less, with a spread of about 0.6 points between runs of 324
    labels), and any shaped noise's at most 4 (simulated: at most 0.5 points more, 0.9 in an earlier run, with a
    spread of up to 0.8). Without the placement the aimed noise adds over 20 points: the test can fail."""
    rounds, config = _run(tmp_path, method, "silent", reveal="histogram")
    layout, modulus = config.ballot_layout(), config.field().modulus
    count = layout.queries * layout.classes
    mechanism = config.voting.mechanism(queries=layout.queries, classes=layout.classes, level="record")
    aimed = np.zeros((layout.queries, layout.classes), dtype=np.int64)
    aimed[:, 3] = _aimed_size(layout)
    chosen = {"aimed": aimed.reshape(-1)}
    for size in sorted({1, 2, 3, 5, 8, 13, 20, 30, 50, layout.noise_range} - set(range(layout.noise_range + 1, 99))):
        chosen[f"shaped {size}"] = np.zeros(count, dtype=np.int64)  # as many values of one size as the cap allows
        chosen[f"shaped {size}"][: layout.energy_cap // size**2] = size
    generator = secure_generator()
    pushed = dict.fromkeys([*chosen, "honest noise", "aimed, unplaced"], 0.0)
    for message in rounds:
        totals = np.frombuffer(message.totals, dtype="<i8").reshape(-1)
        assert np.array_equal(totals.reshape(layout.queries, -1).argmax(axis=1), message.labels)
        for _ in range(_DRAWS):
            seed = 1 + secrets.randbelow(modulus - 1)  # the round's seed, opened once every ballot is in
            signs, places = noise_placement(seed, "hospital-3", count, modulus)
            honest = noise_share(
                mechanism, radius=layout.noise_range, energy_cap=layout.energy_cap, generator=generator
            )
            for strategy, noise in [*chosen.items(), ("honest noise", honest)]:
                pushed[strategy] += _share_of_class_3(totals + signs * noise[places], layout) / (_DRAWS * len(rounds))
        pushed["aimed, unplaced"] += _share_of_class_3(totals + chosen["aimed"], layout) / len(rounds)
    print(method, {strategy: round(share, 4) for strategy, share in pushed.items()})
    assert pushed["aimed"] <= pushed["honest noise"] + 0.02, pushed
    assert all(pushed[strategy] <= pushed["honest noise"] + 0.04 for strategy in chosen), pushed
    assert pushed["aimed, unplaced"] >= pushed["honest noise"] + 0.2, pushed  # the test can fail


def _share_of_class_3(totals, layout):
    return float(np.mean(totals.reshape(layout.queries, layout.classes).argmax(axis=1) == 3))
