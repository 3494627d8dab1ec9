"""The audit suite (``pytest -m audit``): the threat model checked on real runs, byte by byte.

Each run is ``consilium-federation``: real server, hospital and tallier processes over CurveZMQ,
the talliers' MPC in MPyC over mutual TLS. The server keeps every message it receives
(``--transcript-payloads``), each tallier every message the server relays to it, and
``tests/audit/audit_site`` records, as ground truth, what the hospitals kept secret (updates, run keys,
noisy votes, shares) and every byte each tallier receives from its MPC peers. The checks then ask
of the record what a curious server or tallier could learn, and each comes with a check that it
fails on a planted leak (``test_the_checks_catch_planted_leaks``).
"""

from __future__ import annotations
from tally_inputs import placed_totals

import copy
import json
import math
import os
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zstandard
from scipy import stats

from conftest import REPO, party_ledger, run_launcher
from consilium.crypto.bfv import BfvError, PublicContext
from consilium.crypto.bfv_parameters import select_bfv_parameters
from consilium.crypto.key_shares import rebuild
from consilium.crypto.key_shares import release as release_of_shares
from consilium.crypto.one_time_keys import (
    OneTimeKey,
    check_zero_slots,
    decrypt_sum,
    public_polynomials,
    sum_uploads,
    unpack_ring,
)
from consilium.protocol.run.config import RunConfig
from consilium.protocol.wire.messages import TO_SERVER, TO_TALLIER, TO_VOTING_SERVER, Labels, Release, Update
from consilium.protocol.secure_round.statement import released_from
from consilium.protocol.wire.transcript import read_messages
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.tallier.voter_marks import marks_input
from consilium.training.privacy.accounting import release_of
from consilium.training.privacy.ledger import PrivacyLedger
from consilium.training.methods.dopamine import DopamineSettings, NoisyGradientStep
from consilium.training.methods.intermediaries import expected_noise_norm, next_subclient_count
from consilium.training.methods.registry import ledger_release
from consilium.training.models.build import build_model
from consilium.training.models.spec import ModelSpec
from consilium.training.methods.per_example import ClippedGradients
from consilium.training.privacy.secure_random import secure_generator
from consilium.training.privacy.skellam import SkellamMechanism

pytestmark = [pytest.mark.audit, pytest.mark.slow]
AUDIT_SITE = Path(__file__).parent / "audit_site"
DOPAMINE_ROUNDS = 4
DOPAMINE = ("--expected-batch-size", "15", "--noise-multiplier", "1.0", "--epsilon-budget", "100")
# Adaptive v, at a noise where it moves within its bounds rather than sitting at one of them. From
# v = 1 it stays put only if the noisy norm sum S comes out 3.6 standard deviations above the most
# it can be, in each of the first three rounds (odds below 1e-10).
DP_FEDAVG = (
    "--method",
    "dp-fedavg",
    "--subclients",
    "1",
    "--adaptive-subclients",
    "8",
    "--clip-quantile",
    "0.5",
    "--noise-multiplier",
    "1.0",
    "--server-optimizer",
    "fedadam",
    "--epsilon-budget",
    "1000",
)
VOTING = (
    "--method",
    "knn-dpfl",
    "--rounds",
    "2",
    "--feature-dimensions",
    "10",
    "--student-epochs",
    "5",
    "--round-timeout",
    "60",
)
# Six-sigma bands: a correct run fails one of these checks with probability below 1e-8.
SIGMAS = 6.0


def _audited_run(
    tmp_path_factory, name: str, *argv: str, fixed_votes: bool = False
) -> tuple[Path, dict, list[dict], list[dict]]:
    """A federation run with ground truth: (out, report, what the hospitals kept secret, for each tallier process
    the MPC bytes it received and the values its code opened)."""
    base = tmp_path_factory.mktemp(name)
    record = base / "record"
    record.mkdir()
    environment = {
        "PYTHONPATH": os.pathsep.join([str(AUDIT_SITE), str(REPO)]),
        "CONSILIUM_AUDIT_RECORD": str(record),
        "CONSILIUM_AUDIT_FIXED_VOTES": "1" if fixed_votes else "0",
    }
    out = base / "run"
    result = run_launcher("federation", "--out", out, *argv, environment=environment)
    assert result.returncode == 0, result.stderr
    secrets = [entry for path in sorted(record.glob("*.pickle")) for entry in _pickled(path)]
    talliers = [
        {"received": path.read_bytes(), "opened": _pickled(path.with_suffix(".opened"))}
        for path in sorted(record.glob("*.mpc"))
    ]
    return out, json.loads((out / "report.json").read_text()), secrets, talliers


def _pickled(path: Path) -> list:
    entries = []
    if path.exists():
        with path.open("rb") as file:
            while True:
                try:
                    entries.append(pickle.load(file))
                except EOFError:
                    return entries
    return entries


@pytest.fixture(scope="module")
def dopamine(tmp_path_factory):
    return _audited_run(
        tmp_path_factory,
        "dopamine",
        "--rounds",
        str(DOPAMINE_ROUNDS),
        "--round-timeout",
        "30",
        "--transcript-payloads",
        *DOPAMINE,
    )


@pytest.fixture(scope="module")
def dp_fedavg(tmp_path_factory):
    return _audited_run(
        tmp_path_factory,
        "dp-fedavg",
        "--rounds",
        str(DOPAMINE_ROUNDS),
        "--round-timeout",
        "30",
        "--transcript-payloads",
        *DP_FEDAVG,
    )


@pytest.fixture(scope="module")
def voting(tmp_path_factory):
    return _audited_run(tmp_path_factory, "voting", *VOTING)


@pytest.fixture(scope="module")
def fixed_votes(tmp_path_factory):
    return _audited_run(tmp_path_factory, "fixed-votes", *VOTING, "--reveal", "histogram", fixed_votes=True)


# -- what a leak looks like ---------------------------------------------------------------------------------


def _encodings(values: np.ndarray, modulus: int) -> dict[str, bytes]:
    """The forms a leaked integer vector would most likely take on the wire."""
    v = np.asarray(values, dtype=np.int64)
    reduced = np.mod(v, modulus)
    fits_int16 = v.size and np.abs(v).max() < 2**15
    return {
        "int64": v.astype("<i8").tobytes(),
        "int32": v.astype("<i4").tobytes(),
        **({"int16": v.astype("<i2").tobytes()} if fits_int16 else {}),
        "int64, big-endian": v.astype(">i8").tobytes(),
        "int32, big-endian": v.astype(">i4").tobytes(),
        "float32": v.astype("<f4").tobytes(),
        "float64": v.astype("<f8").tobytes(),
        "msgpack": msgpack.packb(v.tolist()),
        "mod, uint64": reduced.astype("<u8").tobytes(),
        **({"mod, uint32": reduced.astype("<u4").tobytes()} if modulus < 2**32 else {}),
    }


_SHORTEST_WINDOW = 8


def _leaks(received: list[bytes], secrets: dict[str, bytes], *, width: int = 32) -> list[str]:
    """The secrets of which ``2 w`` contiguous bytes appear in any received byte string.

    ``w`` is ``width``, or half the secret when it is shorter, but at least 8 bytes; a secret of fewer
    than 8 is searched whole. A copy of ``2 w`` bytes holds one of the secret's ``w``-byte windows
    that start at a multiple of ``w``; windows of fewer than 4 distinct bytes (a run of zeros, say)
    are too common to count, so a secret made only of such windows is never found."""
    owners: dict[int, dict[bytes, str]] = {}
    for name, data in secrets.items():
        w = min(len(data), max(_SHORTEST_WINDOW, min(width, len(data) // 2)))
        for start in range(0, len(data) - w + 1, w):
            window = data[start : start + w]
            if len(set(window)) >= 4:
                owners.setdefault(w, {}).setdefault(window, name)
    found = set()
    for blob in received:
        for w, owner in owners.items():
            for start in range(len(blob) - w + 1):
                name = owner.get(blob[start : start + w])
                if name is not None:
                    found.add(name)
    return sorted(found)


def _uniform_and_independent(shares: np.ndarray, votes: np.ndarray, modulus: int) -> float:
    """The smallest p-value of tests that the shares are uniform in the field, that their low 16 bits
    are uniform, and that both laws are the same where the votes are high as where they are low
    (Kolmogorov-Smirnov on shares / modulus; chi-square on the low bits)."""
    shares = np.asarray(shares, dtype=np.uint64)
    u = shares.astype(np.float64) / modulus
    low = (shares % np.uint64(1 << 16)).astype(np.int64)
    high = votes > np.mean(votes)  # for bits: where they are 1
    bins = 64  # the low 16 bits, in 64 bins of 1024 values each
    counts = np.bincount(low >> 10, minlength=bins)
    crossed = np.array([np.bincount(low[high] >> 10, minlength=bins), np.bincount(low[~high] >> 10, minlength=bins)])
    crossed = crossed[:, crossed.sum(axis=0) > 0]  # bins nobody fell in: the uniformity test already fails
    return min(
        stats.kstest(u, "uniform").pvalue,
        stats.ks_2samp(u[high], u[~high]).pvalue,
        stats.chisquare(counts).pvalue,
        stats.chi2_contingency(crossed).pvalue if crossed.shape[1] > 1 else 0.0,
    )


def _variance_in_band(samples: np.ndarray, variance: float) -> bool:
    """Whether the sample variance of zero-mean draws lies within SIGMAS standard errors of ``variance``.

    The standard error of the sample variance is ``sqrt((m4 - variance^2) / n)``; the fourth moment
    is taken from the samples themselves."""
    n = samples.size
    fourth = np.mean(samples.astype(np.float64) ** 4)
    error = np.sqrt(max(fourth - variance**2, 0.0) / n)
    mean_error = np.sqrt(variance / n)
    return abs(np.var(samples) - variance) <= SIGMAS * error and abs(samples.mean()) <= SIGMAS * mean_error


# -- Dopamine: the server's view ----------------------------------------------------------------------------


def _dopamine_parts(run):
    out, report, secrets, _ = run
    config = RunConfig.from_dict(report["config"])
    received = list(read_messages(out / "server" / "transcript.msgpack", accept=TO_SERVER))
    updates = [s for s in secrets if s["kind"] == "update"]
    return out, report, config, received, updates


def _released_sums(config: RunConfig, report: dict, received: list) -> dict[int, np.ndarray]:
    """Each released round's sum, opened from what the server received alone: the contributors'
    uploads and their releases of the sum's key."""
    public = PublicContext(config.bfv_parameters())
    params, q = public.params, public.params.ciphertext_modulus
    sums = {}
    for record in report["rounds"]:
        if record["status"] != "released":
            continue
        number, members = record["round"], record["contributors"]
        uploads = [m for sender, m, _ in received if isinstance(m, Update) and m.round == number and sender in members]
        shares = {
            config.hospitals.index(sender) + 1: released_from(public, m.share, m.masks, m.signature).release.share
            for sender, m, _ in received
            if isinstance(m, Release) and m.round == number
        }
        key = rebuild(dict(sorted(shares.items())[: config.key_threshold]), config.key_threshold, q)
        total = sum_uploads(public, [unpack_ring(public, list(m.chunks), "upload") for m in uploads])
        slots = decrypt_sum(
            public, total, key, public_polynomials(params, run=report["run_fingerprint"], round_number=number)
        )
        sums[number] = params.digits.from_slots(
            slots[: params.digits.slots_for(params.vector_length)], params.vector_length
        )
    return sums


def _released_vectors(config: RunConfig, report: dict, received: list) -> dict[int, np.ndarray]:
    """Each released round's vector (the method's ``read_sum`` of the sum), as the server computes it."""
    rounds = {r["round"]: r for r in report["rounds"]}
    return {
        number: config.training.with_round_state(rounds[number]["round_state"]).read_sum(
            total, len(rounds[number]["contributors"]), config.parameter_count
        )
        for number, total in _released_sums(config, report, received).items()
    }


def test_no_update_or_key_reaches_the_server_in_any_encoding(dopamine):
    _, _, config, received, updates = _dopamine_parts(dopamine)
    params = config.bfv_parameters()
    secrets = {}
    for u in updates:
        for kind in ("values", "gradient"):  # what it sent, and its gradient before the noise
            forms = _encodings(u[kind], params.plain_modulus)
            forms["slots, uint64"] = params.digits.to_slots(u[kind]).astype("<u8").tobytes()  # as BFV encodes them
            secrets |= {f"{u['hospital']} round {u['round']} {kind} ({form})": data for form, data in forms.items()}
    keys = [u["key"] for u in updates]
    assert len(set(keys)) == len(keys)  # a key for every upload: none encrypts two
    for u in updates:
        secrets[f"{u['hospital']} round {u['round']} one-time key"] = u["key"]
    assert _leaks([raw for _, _, raw in received], secrets) == []
    assert len(updates) == DOPAMINE_ROUNDS * len(config.hospitals)  # the ground truth saw every update


def test_each_upload_opens_under_its_own_one_time_key_and_no_other(dopamine):
    """Every upload is the encryption of exactly the update its hospital recorded, under the key it drew
    for it; no other hospital's key of that round, nor a key the server makes, opens it; every upload
    has the same length and no structure (it does not compress)."""
    _, report, config, received, updates = _dopamine_parts(dopamine)
    params = config.bfv_parameters()
    public = PublicContext(params)
    data_slots = params.digits.slots_for(params.vector_length)
    truth = {(u["hospital"], u["round"]): u for u in updates}
    uploads = [(sender, m) for sender, m, _ in received if isinstance(m, Update)]
    assert len(uploads) == len(updates)
    assert len({tuple(len(c) for c in m.chunks) for _, m in uploads}) == 1
    server_key = (
        np.random.default_rng().integers(0, params.ciphertext_modulus, params.poly_modulus_degree).astype(np.uint64)
    )
    for sender, message in uploads:
        a = public_polynomials(params, run=report["run_fingerprint"], round_number=message.round)
        upload = unpack_ring(public, list(message.chunks), "upload")
        own = np.frombuffer(truth[sender, message.round]["key"], dtype="<u8")
        slots = decrypt_sum(public, upload, own, a)
        check_zero_slots(public, slots, data_slots)
        opened = params.digits.from_slots(slots[:data_slots], params.vector_length)
        np.testing.assert_array_equal(opened, truth[sender, message.round]["values"])
        others = [
            np.frombuffer(u["key"], dtype="<u8") for (h, r), u in truth.items() if r == message.round and h != sender
        ]
        for key in [*others, server_key]:
            with pytest.raises(BfvError, match="zero slots"):
                check_zero_slots(public, decrypt_sum(public, upload, key, a), data_slots)
        blob = b"".join(message.chunks)
        assert len(zstandard.ZstdCompressor(level=19).compress(blob)) > 0.97 * len(blob)


@pytest.mark.parametrize("method", ["dopamine", "dp_fedavg"])
def test_the_released_noise_has_the_variance_the_accountant_assumes(method, request):
    """Each released vector is ``c (sum of the rounded rows + Sk(K_c mu)) + offset``, with the method's
    public ``c``: ``1 / (gamma B K_c)`` for Dopamine's gradients, ``-1 / (gamma v K_c)`` for DP-FedAvg's
    sub-client updates (and its own for each statistic slot, with adaptive clipping's count offset).

    Read back to integers from what the server received, it equals the sum of the hospitals' recorded
    shares; less their recorded rows, what is left has the variance ``2 K_c mu`` that the server's
    ledger charged for."""
    out, report, config, received, updates = _dopamine_parts(request.getfixturevalue(method))
    mechanism = config.mechanism()
    vectors = _released_vectors(config, report, received)
    assert len(vectors) == DOPAMINE_ROUNDS
    totals = []
    rounds = {r["round"]: r for r in report["rounds"]}
    for number, vector in vectors.items():
        contributors = rounds[number]["contributors"]
        training = config.training.with_round_state(rounds[number]["round_state"])
        offset = training.read_sum(np.zeros(mechanism.dimension), len(contributors), config.parameter_count).astype(
            np.float64
        )
        c = training.read_sum(np.ones(mechanism.dimension), len(contributors), config.parameter_count) - offset
        total = np.rint((vector - offset) / c).astype(np.int64)
        np.testing.assert_array_equal(total, sum(u["values"] for u in updates if u["round"] == number))
        rows = sum(u["gradient"] for u in updates if u["round"] == number)
        assert np.count_nonzero(rows) > 0.5 * rows.size  # something to hide
        totals.append(total - rows)
    # The server's ledger charged exactly these rounds of this mechanism: the mu checked below.
    charged = PrivacyLedger()
    charged.begin_run(config.run_id, report["run_fingerprint"])
    for number in vectors:
        charged.record(
            ledger_release(config.training, mechanism, len(config.hospitals), config.coalition(len(config.hospitals))),
            run_id=config.run_id,
            round_number=number,
        )
    server_ledger = party_ledger(out / "federation" / "server", out / "server")
    assert server_ledger.epsilon(config.delta) == pytest.approx(charged.epsilon(config.delta))
    assert _variance_in_band(np.concatenate(totals), 2 * mechanism.mu(len(config.hospitals)))
    for hospital in config.hospitals:  # and each hospital added its own share, not another's
        shares = np.concatenate([u["values"] - u["gradient"] for u in updates if u["hospital"] == hospital])
        assert _variance_in_band(shares, 2 * mechanism.share_mu), hospital


def test_dp_fedavg_reports_every_level_and_each_hospital_is_charged_at_the_hospital_level(dp_fedavg):
    """A hospital's v sub-clients move the sum together: its ledger, which its budget binds on, is
    charged every round at max(v, 2) times a sub-client's sensitivity (2: one record's), with v at
    the most adaptive v allows whatever v the round ran with, and the report gives every level."""
    out, report, _, _ = dp_fedavg
    config = RunConfig.from_dict(report["config"])
    final = report["final"]
    assert final["rounds_released"] == DOPAMINE_ROUNDS
    levels = final["epsilon_levels"]
    assert list(levels) == ["hospital", "record", "subclient"] and levels["hospital"] == final["epsilon"]
    expected = {level: PrivacyLedger() for level in levels}
    for ledger in expected.values():
        ledger.begin_run(config.run_id, report["run_fingerprint"])
    for record in report["rounds"]:
        for level, release in config.training.levels(
            config.mechanism(), len(record["contributors"]), config.coalition(len(config.hospitals))
        ).items():
            expected[level].record(release, run_id=config.run_id, round_number=record["round"])
    assert config.training.levels(config.mechanism(), 3, 1)["hospital"].l2_sensitivity == pytest.approx(
        8 * config.mechanism().l2_sensitivity
    )
    for level, ledger in expected.items():
        assert levels[level] == pytest.approx(ledger.epsilons(config.delta))
    assert all(
        0 < levels["subclient"][view] < levels["record"][view] < levels["hospital"][view] for view in levels["hospital"]
    )
    for hospital in config.hospitals:
        ledger = party_ledger(out / "federation" / hospital)
        assert ledger.epsilons(config.delta) == pytest.approx(levels["hospital"])


def test_adaptive_v_and_c_are_computed_from_the_server_s_transcript_alone(dp_fedavg):
    """An auditor recomputes each round's v and C from what the server received (each round's released
    vector and the senders of its uploads) and the public configuration alone, and gets what every
    hospital actually trained with: the number of sub-clients and the scale they were rounded at.

    - v: Jiang et al.'s ``v <- v sqrt(N E||zeta_v|| / S)``, rounded into ``[1, max]``, with
      ``zeta_v`` the noise on the mean of the ``v K_c`` sub-client updates;
    - C: Andrew et al.'s ``C <- C exp(-eta (B / (v K_c) - q))``, from the released count ``B`` of
      sub-clients within C (the fraction kept within [0, 1]), in float32."""
    out, report, config, received, updates = _dopamine_parts(dp_fedavg)
    dimension = config.parameter_count
    releases = _released_vectors(config, report, received)
    uploads = {}
    for sender, message, _ in received:
        if isinstance(message, Update):
            uploads.setdefault(message.round, set()).add(sender)
    v, bound, computed = config.training.subclients, config.training.max_update_norm, {}
    for round_number in sorted(releases):
        computed[round_number] = {"subclients": v, "max_update_norm": bound}
        mechanism = config.training.with_round_state(computed[round_number]).mechanism(dimension)
        norm_sum, within = np.asarray(releases[round_number], dtype="<f4")[dimension:].astype(np.float64)
        contributors = len(uploads[round_number])
        sigma = np.sqrt(2 * contributors * mechanism.share_mu) / mechanism.scale / (v * contributors)
        fraction = min(max(within / (v * contributors), 0.0), 1.0)
        bound = float(
            np.float32(
                bound * math.exp(-config.training.clip_learning_rate * (fraction - config.training.target_quantile))
            )
        )
        v = next_subclient_count(
            v,
            hospitals=contributors,
            noise_norm=expected_noise_norm(sigma, dimension),
            update_norm_sum=norm_sum,
            most=config.training.max_subclients,
        )
    assert len(computed) == DOPAMINE_ROUNDS
    assert (
        len({c["subclients"] for c in computed.values()}) > 1
        and len({c["max_update_norm"] for c in computed.values()}) > 1
    )  # teeth
    trained = {(u["hospital"], u["round"]): (u["rows"], u["scale"]) for u in updates}
    scales = {r: config.training.with_round_state(c).mechanism(dimension).scale for r, c in computed.items()}
    assert trained == {(h, r): (c["subclients"], scales[r]) for h in config.hospitals for r, c in computed.items()}
    assert {r["round"]: r["round_state"] for r in report["rounds"]} == computed


def test_ciphertext_sizes_do_not_depend_on_the_plaintext():
    """Zeros, random and extreme vectors give uploads of one fixed length."""
    params = select_bfv_parameters(max_contributors=3, vector_length=3000, sum_bound=40_000)
    public = PublicContext(params)
    a = public_polynomials(params, run="run", round_number=1)
    half = params.plain_modulus // 2
    rng = np.random.default_rng()
    vectors = {
        "zeros": np.zeros(3000, dtype=np.int64),
        "random": rng.integers(-half, half, 3000, endpoint=True),
        "largest": np.full(3000, half, dtype=np.int64),
        "smallest": np.full(3000, -half, dtype=np.int64),
    }
    sizes = {}
    for name, vector in vectors.items():
        slots = params.slots_of(vector)
        for _ in range(5):
            chunks = OneTimeKey(public, threshold=2, parties=3).encrypt(slots, a)
            sizes.setdefault(name, set()).add(tuple(len(c) for c in chunks))
    assert len(set().union(*sizes.values())) == 1, sizes


# -- voting: the server's and the talliers' views ----------------------------------------------------------


def _ballots(secrets: list[dict]) -> list[dict]:
    return [entry for entry in secrets if entry["kind"] == "ballot"]


def _bits(ballot: dict) -> np.ndarray:
    """The bits a ballot's shares add up to: its votes', its noise's and its slack's, in the order they travel."""
    layout = ballot["layout"]
    slack = layout.energy_cap - int(ballot["noise"] @ ballot["noise"])
    values = (ballot["votes"].reshape(-1), ballot["noise"], np.array([slack]))
    return np.concatenate([part.decompose(v).reshape(-1) for part, v in zip(layout.parts, values)])


def _share_bits(ballot: dict, share: np.ndarray) -> np.ndarray:
    """A tallier's share of ``_bits``: the bits of each part of its share, without the tags and keys."""
    return np.concatenate([bits.reshape(-1) for bits, _, _ in ballot["layout"].split(share)])


def _comparisons(config: VotingConfig) -> list[int]:
    """How many comparisons each batch of the labels' argmax makes (``tallier.authenticated``): a tournament
    level by level, then the threshold's."""
    batches, entrants = [], config.classes
    while entrants > 1:
        batches.append(entrants // 2 * config.queries_per_round)
        entrants = entrants // 2 + entrants % 2
    return batches + ([config.queries_per_round] if config.label_threshold else [])


def _per_round(config: VotingConfig) -> int:
    """How many values a tallier's code opens in a round: the marks, the pins, the challenge, the checks' MAC check,
    the checks and the barrier; then the totals (``--reveal histogram``), or three per comparison batch, the
    last MAC check and the labels."""
    if config.reveal == "histogram":
        return len(config.talliers) + 7
    return len(config.talliers) + 6 + 3 * len(_comparisons(config)) + 2


def _seeds(talliers: list[dict], config: VotingConfig) -> dict[int, int]:
    """Each round's challenge, as the first tallier's code opened it after the marks of the boxes and the pins."""
    per_round = _per_round(config)
    return {r: talliers[0]["opened"][(r - 1) * per_round + len(config.talliers) + 1][0] for r in (1, 2)}


def _noisy_totals(ballots: list[dict], round_number: int, voters, seed: int) -> np.ndarray:
    """The totals the talliers compute: the voters' votes and their noise, signed and placed by the round's seed."""
    counted = [b for b in ballots if b["round"] == round_number and b["hospital"] in voters]
    return placed_totals(
        {b["hospital"]: (b["votes"], b["noise"]) for b in counted}, counted[0]["layout"], seed, counted[0]["modulus"]
    ).reshape(-1)


def test_no_vote_share_or_total_reaches_the_server_or_a_tallier(voting):
    out, report, secrets, talliers = voting
    ballots = _ballots(secrets)
    seeds = _seeds(talliers, VotingConfig.from_dict(report["config"]))
    assert len(ballots) == 2 * len(report["config"]["hospitals"]) and all("shares" in b for b in ballots)
    modulus = ballots[0]["modulus"]
    votes = {
        f"{b['hospital']} round {b['round']} {name} ({form})": data
        for b in ballots
        for name, values in (("votes", b["votes"]), ("noise", b["noise"]), ("bits", _bits(b)))
        for form, data in _encodings(values, modulus).items()
    }
    totals = {
        f"round {r} totals ({form})": data
        for r in (1, 2)
        for form, data in _encodings(
            _noisy_totals(ballots, r, report["config"]["hospitals"], seeds[r]), modulus
        ).items()
    }
    shares = {
        f"{b['hospital']} round {b['round']} share for {t}": s.astype("<u8").tobytes()
        for b in ballots
        for t, s in zip(b["talliers"], b["shares"])
    }
    server = [raw for _, _, raw in read_messages(out / "server" / "transcript.msgpack", accept=TO_VOTING_SERVER)]
    assert server and _leaks(server, votes | totals | shares) == []
    for tallier in report["config"]["talliers"]:
        relayed = [raw for _, _, raw in read_messages(out / tallier / "transcript.msgpack", accept=TO_TALLIER)]
        assert relayed and _leaks(relayed, votes | totals | shares) == []  # its own shares come sealed, as boxes
    mpc = [tallier["received"] for tallier in talliers]
    assert len(mpc) == len(report["config"]["talliers"]) and all(mpc)
    assert _leaks(mpc, votes | totals) == []  # the MPC exchanges Shamir shares, never a total


def test_a_tallier_s_shares_are_uniform_and_independent_of_the_votes(voting):
    _, report, secrets, _ = voting
    ballots = _ballots(secrets)
    bits = np.concatenate([_bits(b) for b in ballots])
    for index, tallier in enumerate(report["config"]["talliers"]):
        shares = np.concatenate([_share_bits(b, b["shares"][b["talliers"].index(tallier)]) for b in ballots])
        assert _uniform_and_independent(shares, bits, ballots[0]["modulus"]) > 1e-6, (index, tallier)


def test_only_the_winning_labels_leave_the_talliers(voting):
    out, report, secrets, talliers = voting
    ballots = _ballots(secrets)
    config = VotingConfig.from_dict(report["config"])
    classes = config.classes
    # What each tallier's code opened in the MPC, round by round: every tallier's marks of the boxes, every
    # tallier's kept placement (none: the round's first tally), the challenge's seed, the MAC check of the checks'
    # arithmetic (zero), every ballot's tag check, then its bit, sum and energy checks (masked; zero: all honest),
    # the barrier; for each batch of the
    # argmax's comparisons, the MAC check (zero), its random bits' squares and the masked differences; then the
    # last MAC check (zero), and the labels.
    per_round, modulus = _per_round(config), config.field().modulus
    bits = config.field().bit_length - 1
    seeds = _seeds(talliers, config)
    for tallier in talliers:
        assert len(tallier["opened"]) == 2 * per_round
        for round_number in (1, 2):
            opened = tallier["opened"][(round_number - 1) * per_round : round_number * per_round]
            *marks, pinned, seed, checks_mac_check, tag_checks, other_checks, barrier = opened[
                : len(config.talliers) + 6
            ]
            arithmetic = opened[len(config.talliers) + 6 :]
            for batch, comparisons in enumerate(_comparisons(config)):
                check, squares, masked = arithmetic[3 * batch : 3 * batch + 3]
                assert len(squares) == bits * comparisons and len(masked) == comparisons and check == [0]
                assert all(pow(value % modulus, (modulus - 1) // 2, modulus) == 1 for value in squares)
                assert all(0 <= value < modulus // 2 for value in masked)  # d + 2^k + r: never reduced mod p
            *_, mac_check, labels = arithmetic
            assert mac_check == [0]
            every_box_ok = marks_input(round_number, config.hospitals, set(config.hospitals), {})  # tallier.voter_marks
            assert all(m == every_box_ok for m in marks)
            assert (
                seed == [seeds[round_number]] and checks_mac_check == [0] and tag_checks == [0] * len(config.hospitals)
            )
            assert other_checks == [0] * (3 * len(config.hospitals))
            assert pinned == [0] * len(config.talliers) and barrier == [0]
            totals = _noisy_totals(ballots, round_number, config.hospitals, seeds[round_number]).reshape(-1, classes)
            assert labels == list(np.argmax(totals, axis=1))
    from_talliers = [
        (s, m)
        for s, m, _ in read_messages(out / "server" / "transcript.msgpack", accept=TO_VOTING_SERVER)
        if s in report["config"]["talliers"] and isinstance(m, Labels)
    ]
    assert len(from_talliers) == 2 * len(report["config"]["talliers"])
    for _, labels in from_talliers:
        totals = _noisy_totals(ballots, labels.round, labels.voters, seeds[labels.round]).reshape(-1, classes)
        assert labels.totals == b"" and list(labels.labels) == list(np.argmax(totals, axis=1))  # ties: the lowest class


def test_the_opened_totals_of_known_votes_carry_the_accountant_s_noise(fixed_votes):
    """Every hospital casts all its votes for class 0, so the noisy totals the talliers open are known votes and
    the noise, signed and placed."""
    out, report, secrets, talliers = fixed_votes
    config = VotingConfig.from_dict(report["config"])
    ballots, seeds = _ballots(secrets), _seeds(talliers, config)
    opened = [
        m
        for s, m, _ in read_messages(out / "server" / "transcript.msgpack", accept=TO_VOTING_SERVER)
        if isinstance(m, Labels) and s == config.talliers[0]
    ]
    assert len(opened) == 2
    noise = []
    for labels in opened:
        total = np.frombuffer(labels.totals, dtype="<i8")
        np.testing.assert_array_equal(total, _noisy_totals(ballots, labels.round, labels.voters, seeds[labels.round]))
        votes = np.zeros((config.queries_per_round, config.classes), dtype=np.int64)
        votes[:, 0] = len(labels.voters) * config.voting.votes_per_query
        noise.append(total - votes.reshape(-1))
    mechanism = config.voting.mechanism(queries=config.queries_per_round, classes=config.classes, level="record")
    assert _variance_in_band(np.concatenate(noise), 2 * mechanism.mu(config.voting.quorum))
    for hospital in config.hospitals:
        share = np.concatenate([b["noise"] for b in ballots if b["hospital"] == hospital])
        assert _variance_in_band(share, 2 * mechanism.share_mu), hospital


# -- an empirical lower bound on epsilon --------------------------------------------------------------------

CANARY_TRIALS = 1500  # per world: with the canary, and without it
CANARY_NOISE = 2.0  # where 750 test trials can bound epsilon above the accountant's (2.17), were the noise missing
FAILURE = 1e-6  # a bound the test asserts fails with at most this probability: the test is not flaky


def test_an_empirical_lower_bound_on_epsilon_stays_below_the_accountant_s(record_property):
    """The canary's release, with and without it: the bound stays below the accountant's epsilon, and
    the canary moves the release's projection by at most ``1 / sigma`` of its standard deviation.

    The second check is the sharper one: ``gamma C <= Delta_2`` and the noise's standard deviation
    is ``sigma Delta_2``, so a canary clipped to C shifts the score by at most ``1 / sigma`` of it."""
    inside, outside, accountant = _canary_scores(CANARY_NOISE, CANARY_TRIALS)
    bound = _epsilon_lower_bound(inside, outside, delta=1e-5)
    at_95 = _epsilon_lower_bound(inside, outside, delta=1e-5, failure=0.05)
    record_property("epsilon_lower_bound", bound)
    record_property("epsilon_lower_bound_95", at_95)
    record_property("epsilon_accountant", accountant)
    print(
        f"canary audit (sigma {CANARY_NOISE}, one step): epsilon >= {bound:.2f} (or {at_95:.2f} at 95% confidence); accountant {accountant:.2f}"
    )
    assert _best_possible_bound(CANARY_TRIALS - CANARY_TRIALS // 2, delta=1e-5) > accountant  # the test can fail
    assert bound <= accountant
    assert _separation_within(inside, outside, CANARY_NOISE)


def _separation_within(inside: np.ndarray, outside: np.ndarray, noise_multiplier: float) -> bool:
    """Whether the scores' separation (in standard deviations) is at most ``1 / sigma``, within SIGMAS errors."""
    separation = (inside.mean() - outside.mean()) / outside.std()
    error = np.sqrt(1 / inside.size + 1 / outside.size + separation**2 / (2 * outside.size))
    return bool(separation <= 1 / noise_multiplier + SIGMAS * error)


def _best_possible_bound(trials: int, *, delta: float, failure: float = FAILURE) -> float:
    """The bound of a test that never errs on ``trials`` trials per world: the most these trials can show."""
    rate = _upper(0, trials, failure / 2)
    return float(np.log((1 - delta - rate) / rate))


def _canary_scores(
    noise_multiplier: float, trials: int, *, accountant_noise: float | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """The canary's score in ``trials`` released sums with it and without it, and the accountant's epsilon.

    Two hospitals (quorum 2) each take Dopamine's step at sample rate 1 on a linear model and encrypt
    their shares; the sum is decrypted as a release is. Hospital 1 may hold the canary, a record whose
    gradient is clipped to C; the score projects the release on that gradient. The accountant's
    epsilon is that of one such step at ``accountant_noise`` (by default, the noise actually added).
    """
    import torch

    def settings(noise: float) -> DopamineSettings:
        return DopamineSettings(
            sample_rate=1.0,
            noise_multiplier=noise,
            max_grad_norm=1.0,
            quorum=2,
            expected_batch_size=5.0,
            learning_rate=0.1,
            momentum=0.0,
        )

    model = build_model(ModelSpec("mlp", (2,), 2, ()))
    rng = np.random.default_rng()
    records = [(rng.normal(size=(4, 2)).astype(np.float32), rng.integers(0, 2, 4)) for _ in range(2)]
    canary_x = np.full((1, 2), 50.0, dtype=np.float32)
    with torch.no_grad():  # labelled against the model's guess, so that its gradient is clipped to C
        canary = (canary_x, 1 - model(torch.tensor(canary_x)).argmax(dim=1).numpy())
    with_canary = tuple(np.concatenate([a, b]) for a, b in zip(records[0], canary))

    def step(x, y) -> NoisyGradientStep:  # Opacus wraps a model once: each step gets its own copy
        return NoisyGradientStep(copy.deepcopy(model), x, y, settings(noise_multiplier))

    worlds = {"in": [step(*with_canary), step(*records[1])], "out": [step(*records[0]), step(*records[1])]}
    mechanism = worlds["in"][0].mechanism
    direction = next(ClippedGradients(copy.deepcopy(model), *canary, 1.0).batches(np.array([0])))[0]
    bound = mechanism.sum_bound(contributors=2, expected_batch_size=5.0).levels
    params = select_bfv_parameters(max_contributors=2, vector_length=mechanism.dimension, sum_bound=bound)
    public = PublicContext(params)
    scores = {}
    for world, steps in worlds.items():
        values = []
        for round_number in range(1, trials + 1):
            values.append(float(_encrypted_sum(public, [step()[0] for step in steps], round_number) @ direction))
        scores[world] = np.array(values)
    charged = settings(noise_multiplier if accountant_noise is None else accountant_noise).mechanism(
        mechanism.dimension
    )
    epsilon = PrivacyLedger().epsilon(1e-5, extra=release_of(charged, sample_rate=1.0, contributors=2, coalition=1))
    return scores["in"], scores["out"], epsilon


def _encrypted_sum(public: PublicContext, shares: list[np.ndarray], round_number: int) -> np.ndarray:
    """The hospitals' shares summed as the secure round sums them: each under its one-time key, the
    sum opened with the key both hospitals' releases rebuild."""
    params, q = public.params, public.params.ciphertext_modulus
    a = public_polynomials(params, run="audit", round_number=round_number)
    keys, uploads = [], []
    for share in shares:
        slots = params.slots_of(share)
        keys.append(OneTimeKey(public, threshold=2, parties=2))
        uploads.append(unpack_ring(public, keys[-1].encrypt(slots, a), "upload"))
    releases = {x: release_of_shares([key.dealing.shares[x - 1] for key in keys], q).share for x in (1, 2)}
    slots = decrypt_sum(public, sum_uploads(public, uploads), rebuild(releases, 2, q), a)
    return params.values_of(slots)


def _epsilon_lower_bound(inside: np.ndarray, outside: np.ndarray, *, delta: float, failure: float = FAILURE) -> float:
    """A lower bound on epsilon from a test that guesses "canary in" above a threshold.

    The threshold is chosen on the first half of the scores; on the second half, Clopper-Pearson upper
    bounds on the false positive and false negative rates (each failing with probability
    ``failure / 2``) give ``epsilon >= ln((1 - delta - FNR) / FPR)``, which holds for any
    (epsilon, delta)-DP release but with probability ``failure`` (Jagielski, Ullman and Oprea 2020).
    With a few thousand trials such a bound is far below a Gaussian mechanism's epsilon: it catches a
    release with much less noise than accounted, not a small error in the accountant."""
    half = len(inside) // 2
    fit_in, fit_out, test_in, test_out = inside[:half], outside[:half], inside[half:], outside[half:]

    def estimate(threshold: float) -> float:  # (k + 1) / (n + 1): one more false positive always costs
        false_positive = (np.sum(fit_out > threshold) + 1) / (half + 1)
        return np.log(max(1 - delta - np.mean(fit_in <= threshold), 1e-12) / false_positive)

    # Between two fitted scores, never on one. A threshold on (or just under) the highest score
    # without the canary let a few test scores above it count as false positives, and with separable
    # scores that sank the bound below the accountant's in about one run in sixty.
    fitted = np.sort(np.concatenate([fit_in, fit_out]))
    threshold = max((fitted[1:] + fitted[:-1]) / 2, key=estimate)
    false_positive = _upper(int(np.sum(test_out > threshold)), len(test_out), failure / 2)
    false_negative = _upper(int(np.sum(test_in <= threshold)), len(test_in), failure / 2)
    return float(np.log(max(1 - delta - false_negative, 1e-12) / false_positive))


def _upper(events: int, trials: int, failure: float) -> float:
    """Clopper-Pearson upper confidence bound on a rate, exceeded with probability ``failure``."""
    return 1.0 if events == trials else float(stats.beta.ppf(1 - failure, events + 1, trials - events))


# -- a high-power audit of the noise path -------------------------------------------------------------------

# sigma: one release at quorum 2 costs about 2 and about 8 by the accountant (2.17 and 8.64 at d = 32).
NOISE_PATH_SIGMAS = (2.0, 0.6)
NOISE_PATH_DIMENSION = 32
NOISE_PATH_CANARIES = 400_000  # released coordinates holding a canary: one rounding each, about 20 us
NOISE_PATH_NULLS = 2_000_000  # released coordinates of noise alone: cheap, and they tighten the false positives


@dataclass(frozen=True)
class NoisePathAudit:
    bound: float  # epsilon >= bound, but with probability FAILURE
    bound_95: float  # the same at 95% confidence
    accountant: float
    noise_as_accounted: bool  # the noise's variance and mean are the accountant's, within SIGMAS errors
    shift_within_sensitivity: bool  # the canary moves its coordinate by at most Delta_2, within SIGMAS errors

    @property
    def passes(self) -> bool:
        return self.bound <= self.accountant and self.noise_as_accounted and self.shift_within_sensitivity


@pytest.mark.parametrize("noise_multiplier", NOISE_PATH_SIGMAS)
def test_the_noise_path_bounds_epsilon_at_half_the_accountant_s_or_more(noise_multiplier, record_property):
    audit = _audit_noise_path(noise_multiplier, NOISE_PATH_CANARIES, NOISE_PATH_NULLS)
    record_property("epsilon_lower_bound", audit.bound)
    record_property("epsilon_accountant", audit.accountant)
    print(
        f"noise-path audit (sigma {noise_multiplier}, one release, quorum 2): epsilon >= {audit.bound:.2f} "
        f"(failure {FAILURE:g}; {audit.bound_95:.2f} at 95% confidence); accountant {audit.accountant:.2f}"
    )
    assert audit.passes, audit
    assert audit.bound >= audit.accountant / 2, audit


def test_the_noise_path_audit_fails_a_hospital_that_adds_80_percent_of_the_noise(monkeypatch):
    """Each hospital's share planted at 80% of the accounted variance (89% of the standard deviation):
    the bound stays below the accountant's, so it is the noise's variance that gives the bug away."""
    honest = SkellamMechanism.noise_share

    def planted(self, generator):
        return honest(replace(self, share_mu=0.8 * self.share_mu), generator)

    monkeypatch.setattr(SkellamMechanism, "noise_share", planted)
    audit = _audit_noise_path(NOISE_PATH_SIGMAS[0], NOISE_PATH_CANARIES // 10, NOISE_PATH_NULLS // 10)
    assert audit.bound <= audit.accountant and not audit.noise_as_accounted and not audit.passes, audit


def _audit_noise_path(noise_multiplier: float, canaries: int, nulls: int) -> NoisePathAudit:
    """The released sum of two hospitals' shares (quorum 2), made by the functions a hospital calls
    (``SkellamMechanism.round_examples`` and ``noise_share``, each hospital with its own
    ``secure_generator``), coordinate by coordinate.

    White box: a canary is a Dirac gradient ``C e_j``, the gradient of largest influence on
    coordinate ``j``. Hospital 1 holds one in each of the ``d`` coordinates (each row has norm C, so
    nothing is clipped); coordinate ``j`` of the release then has the law it has with canary ``j``
    present, and in a release of the noise alone, the law with it absent (no other record touches
    ``j``). Rows are rounded independently and the noise is independent across coordinates, so the
    coordinates are independent trials. The threshold test guesses "present" above a threshold
    fixed in advance from the accountant's own law of the release (the Skellam noise and the
    rounding of ``gamma C``) for the expected counts, so every trial tests it (no half is spent
    choosing); Clopper-Pearson bounds on its error rates give the bound (``_bound_at``).
    """
    mechanism = SkellamMechanism.calibrate(
        dimension=NOISE_PATH_DIMENSION, max_grad_norm=1.0, noise_multiplier=noise_multiplier, quorum=2
    )
    accountant = PrivacyLedger().epsilon(
        1e-5, extra=release_of(mechanism, sample_rate=1.0, contributors=2, coalition=1)
    )
    canary_rows = np.eye(NOISE_PATH_DIMENSION)  # C = 1
    present = np.concatenate(
        [
            mechanism.round_examples(canary_rows, first) + mechanism.noise_share(first) + mechanism.noise_share(second)
            for first, second in (
                (secure_generator(), secure_generator()) for _ in range(-(-canaries // NOISE_PATH_DIMENSION))
            )
        ]
    )
    generators = (secure_generator(), secure_generator())
    absent = np.concatenate(
        [
            mechanism.noise_share(generators[0]) + mechanism.noise_share(generators[1])
            for _ in range(-(-nulls // NOISE_PATH_DIMENSION))
        ]
    )
    variance = 2 * mechanism.mu(contributors=2)
    shift = present.mean() - absent.mean()
    shift_error = np.sqrt(variance / present.size + variance / absent.size)
    return NoisePathAudit(
        bound=_bound_at(present, absent, mechanism, FAILURE),
        bound_95=_bound_at(present, absent, mechanism, 0.05),
        accountant=accountant,
        noise_as_accounted=_variance_in_band(absent, variance),
        shift_within_sensitivity=bool(shift <= mechanism.l2_sensitivity + SIGMAS * shift_error),
    )


def _bound_at(present: np.ndarray, absent: np.ndarray, mechanism: SkellamMechanism, failure: float) -> float:
    """``ln((1 - delta - FNR) / FPR)`` at the threshold that the accountant's law of the release makes
    best for these counts, with Clopper-Pearson upper bounds on both rates (each failing with
    probability ``failure / 2``): a lower bound on epsilon at delta = 1e-5 but with probability ``failure``."""
    delta = 1e-5
    noise = stats.skellam(mechanism.mu(contributors=2), mechanism.mu(contributors=2))
    low = math.floor(mechanism.scale)  # the canary's coordinate rounds to low or low + 1
    up = mechanism.scale - low
    thresholds = low + 0.5 + np.arange(0, 12 * math.sqrt(2 * mechanism.mu(contributors=2)))
    false_positive = noise.sf(thresholds)
    false_negative = (1 - up) * noise.cdf(thresholds - low) + up * noise.cdf(thresholds - low - 1)

    def bound(false_negatives: int, false_positives: int) -> float:
        rate_fn = _upper(false_negatives, present.size, failure / 2)
        rate_fp = _upper(false_positives, absent.size, failure / 2)
        return float(np.log(max(1 - delta - rate_fn, 1e-12) / rate_fp))

    expected = [
        bound(round(fn * present.size), round(fp * absent.size)) for fn, fp in zip(false_negative, false_positive)
    ]
    threshold = thresholds[int(np.argmax(expected))]
    return bound(int(np.sum(present <= threshold)), int(np.sum(absent > threshold)))


# -- each check fails on a planted leak ---------------------------------------------------------------------


def test_the_checks_catch_planted_leaks():
    rng = np.random.default_rng()
    modulus = 2**61 - 1
    votes = rng.integers(-40, 80, 2000)
    # A plaintext copy inside a message, in any of the encodings, is found.
    for t in (modulus, 1032193):
        for form, data in _encodings(votes, t).items():
            assert _leaks([rng.bytes(500) + data[100:400] + rng.bytes(500)], {form: data}) == [form]
    # So is a short one (a query's ten-class histogram), whole or in part.
    histogram = np.array([3, -12, 40, 7, 0, 55, -38, 19, 1, 72])
    for form, data in _encodings(histogram, 1032193).items():
        assert _leaks([rng.bytes(500) + data + rng.bytes(500)], {form: data}) == [form]
        if len(data) >= 32:
            assert _leaks([rng.bytes(500) + data[len(data) // 2 - 16 :] + rng.bytes(500)], {form: data}) == [form]
    # A "share" that is the vote itself, has only 32 random bits, or carries the vote in its low bits.
    assert _uniform_and_independent(np.mod(votes, modulus), votes, modulus) < 1e-6
    assert _uniform_and_independent(rng.integers(0, 2**32, votes.size), votes, modulus) < 1e-6
    high_bits = rng.integers(0, 2**29, votes.size).astype(np.uint64) << np.uint64(32)
    assert _uniform_and_independent(high_bits | np.mod(votes, 2**32).astype(np.uint64), votes, modulus) < 1e-6
    # Half the noise's standard deviation is a quarter of its variance: outside the band.
    assert not _variance_in_band(rng.normal(0, 50, 4000), 100.0**2)
    assert _variance_in_band(rng.normal(0, 100, 4000), 100.0**2)


def test_the_canary_audit_catches_a_release_without_noise():
    """Hospitals that add no noise while the accountant charges sigma 2: the empirical bound exceeds it."""
    inside, outside, accountant = _canary_scores(0.0, CANARY_TRIALS // 3, accountant_noise=CANARY_NOISE)
    assert _epsilon_lower_bound(inside, outside, delta=1e-5) > accountant
    assert not _separation_within(inside, outside, CANARY_NOISE)


def test_the_canary_audit_catches_a_third_of_the_noise():
    """Hospitals adding a third of the accounted standard deviation move the canary's score three times as far.

    Why not half: with ``gamma C`` a little below ``Delta_2`` (the rounding's slack), half the noise
    moves the score by about 0.95 standard deviations, and at these 500 trials per world the band
    ``1/sigma + 6`` standard errors reaches 0.92: a coin toss, not a test. A third moves it by about
    1.45, six standard errors clear of the band. (At the property test's 1500 trials the band is
    0.74, and half the noise would be caught there.)"""
    inside, outside, _ = _canary_scores(CANARY_NOISE / 3, CANARY_TRIALS // 3)
    assert not _separation_within(inside, outside, CANARY_NOISE)
