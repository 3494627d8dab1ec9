import json
import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp
from scipy.special import logsumexp
from scipy.stats import skellam

from consilium.training.privacy.accounting import VIEWS, Release, release_of, tolerated_coalition
from consilium.training.privacy.ledger import LedgerError, PrivacyLedger
from consilium.training.privacy.budget import PrivacyBudget
from consilium.training.privacy.rdp import ORDERS, gaussian_rdp, poisson_subsampled_rdp, rdp_to_epsilon, skellam_rdp
from consilium.training.privacy.skellam import SkellamMechanism

KEY = bytes(range(32))  # a party's ledger key (protocol.identity.party_keys.Credentials.ledger_key)


def _mechanism(noise_multiplier=2.1, quorum=3, dimension=1586):
    return SkellamMechanism.calibrate(
        dimension=dimension, max_grad_norm=1.0, noise_multiplier=noise_multiplier, quorum=quorum
    )


def _ledger(path=None, run="0123abcd"):
    ledger = PrivacyLedger(path, key=KEY)
    ledger.begin_run(run, f"{run}:settings")
    return ledger


@pytest.mark.parametrize("sample_rate, sigma", [(0.1, 2.1), (0.01, 0.8), (0.5, 5.0)])
def test_the_subsampling_bound_is_opacus_sampled_gaussian_for_the_gaussian(sample_rate, sigma):
    """The limit where they must agree: with the Gaussian's RDP plugged in, the bound is Mironov et al.'s."""
    ours = poisson_subsampled_rdp(ORDERS, sample_rate, gaussian_rdp(ORDERS, noise_multiplier=sigma))
    opacus = np.array(compute_rdp(q=sample_rate, noise_multiplier=sigma, steps=1, orders=list(map(float, ORDERS))))
    assert np.allclose(ours, opacus, rtol=1e-9)


def test_a_quorum_of_skellam_shares_costs_what_central_dp_sgd_costs():
    """Sk(K_min mu) on sensitivity Delta_2 at 2 mu = sigma^2 Delta_2^2: Opacus's epsilon for sigma, within 0.1%."""
    mechanism = _mechanism()
    ledger = _ledger()
    release = release_of(mechanism, sample_rate=0.1, contributors=3, coalition=1)
    for round_number in range(1, 101):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
    central = RDPAccountant()
    central.history = [(2.1, 0.1, 100)]
    expected = central.get_epsilon(1e-5)
    assert expected <= ledger.epsilon(1e-5) <= 1.001 * expected


def test_skellam_costs_more_than_the_gaussian_and_converges_to_it():
    gaussian = gaussian_rdp(ORDERS, noise_multiplier=1.0)
    gaps = []
    for mu in (10.0, 1e3, 1e5):
        l2 = math.sqrt(2 * mu)  # variance 2 mu = (1.0 * l2)^2
        skellam = skellam_rdp(ORDERS, l2_sensitivity=l2, l1_sensitivity=min(l2**2, 40 * l2), mu=mu)
        assert np.all(skellam > gaussian)
        gaps.append(np.max(skellam / gaussian - 1))
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3


def test_views_know_zero_one_a_coalition_and_all_but_one_share():
    mechanism = _mechanism(noise_multiplier=2.0, quorum=4)
    release = dict(release_of(mechanism, sample_rate=0.1, contributors=5, coalition=2).mu)
    assert release["server"] == pytest.approx(5 * mechanism.share_mu)
    assert release["peer_hospital"] == pytest.approx(4 * mechanism.share_mu)
    assert release["coalition"] == pytest.approx(3 * mechanism.share_mu)  # tau = 3 of 5: two pool with the server
    assert release["collusion"] == pytest.approx(mechanism.share_mu)  # sigma / sqrt(K_min)
    # A coalition as large as the contributors still leaves the record's own hospital's share.
    assert dict(release_of(mechanism, sample_rate=0.1, contributors=3, coalition=4).mu)["coalition"] == pytest.approx(
        mechanism.share_mu
    )
    lone = dict(release_of(mechanism, sample_rate=0.1, contributors=1, coalition=1).mu)
    assert lone["server"] == lone["peer_hospital"] == lone["coalition"] == lone["collusion"]  # no other share
    ledger = _ledger()
    ledger.record(
        release_of(mechanism, sample_rate=0.1, contributors=5, coalition=2), run_id="0123abcd", round_number=1
    )
    server, peer, coalition, collusion = (ledger.epsilon(1e-5, view=v) for v in VIEWS)
    assert 0 < server < peer < coalition < collusion
    assert ledger.worst_epsilon(1e-5, up_to="peer_hospital") == (peer, "peer_hospital")
    assert ledger.worst_epsilon(1e-5, up_to="coalition") == (coalition, "coalition")
    with pytest.raises(ValueError, match="unknown view"):
        PrivacyBudget(epsilon=1.0, delta=1e-5, view="the server's friends")


def test_a_record_of_the_shared_key_round_is_read_with_the_coalition_seeing_its_collusion_view():
    """Before one-time keys the server with any one hospital decrypted each update on its own: a
    record written then, without a coalition view, is charged in that view as its collusion view."""
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    record = release.to_record()
    del record["mu"]["coalition"]
    old = Release.from_record(record)
    assert dict(old.mu)["coalition"] == dict(old.mu)["collusion"] < dict(release.mu)["coalition"]


def test_no_noise_costs_everything_and_nothing_costs_nothing():
    ledger = _ledger()
    ledger.record(
        release_of(_mechanism(noise_multiplier=0.0), sample_rate=0.1, contributors=3, coalition=1),
        run_id="0123abcd",
        round_number=1,
    )
    assert ledger.epsilon(1e-5) == math.inf
    assert PrivacyLedger().epsilon(1e-5) == 0.0


def test_the_ledger_survives_a_restart(tmp_path):
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.05, contributors=3, coalition=1)
    ledger = _ledger(path)
    for round_number in range(1, 11):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
    before = ledger.epsilon(1e-4)
    del ledger
    restarted = PrivacyLedger(path, key=KEY)
    assert restarted.steps == 10 and restarted.epsilon(1e-4) == pytest.approx(before)
    projected = restarted.epsilon(1e-4, extra=release)
    assert projected > before and restarted.steps == 10


def test_a_void_cancels_one_round_s_charge_durably_once_and_keeps_it_the_run_s_last(tmp_path):
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.05, contributors=3, coalition=1)
    ledger = _ledger(path)
    for round_number in (1, 2):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
    one_round = _ledger().epsilon(1e-4, extra=release)
    ledger.finish_run("0123abcd")  # the last round's void may come after the run is over for the ledger
    ledger.void(run_id="0123abcd", round_number=2, evidence={"tallier-1": "ab"})
    assert ledger.steps == 1 and ledger.epsilon(1e-4) == pytest.approx(one_round) and ledger.voids("0123abcd") == 1
    for round_number in (2, 3):  # voided already; never charged
        with pytest.raises(LedgerError, match="not charged here, or is void already"):
            ledger.void(run_id="0123abcd", round_number=round_number, evidence={})
    ledger.close()
    restarted = PrivacyLedger(path, key=KEY)
    assert restarted.steps == 1 and restarted.epsilon(1e-4) == pytest.approx(one_round)
    assert restarted.voids("0123abcd") == 1 and restarted.last_round("0123abcd") == 2  # not voted in again


def test_one_writer_at_a_time(tmp_path):
    """Two processes on one ledger would each count only their own releases."""
    path = tmp_path / "ledger.jsonl"
    writer = _ledger(path)
    with pytest.raises(LedgerError, match="in use by another writer"):
        PrivacyLedger(path, key=KEY).begin_run("feedc0de", "feedc0de:settings")
    reader = PrivacyLedger(path, key=KEY)  # reading needs no lock
    writer.record(
        release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1), run_id="0123abcd", round_number=1
    )
    del writer
    with pytest.raises(LedgerError, match="changed since it was read"):
        reader.begin_run("feedc0de", "feedc0de:settings")


def test_a_reused_run_id_cannot_lower_a_ledgers_epsilon(tmp_path):
    """The server names runs and rounds; the ledger keys records itself and refuses a run id with other settings."""
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    ledger = _ledger(path, run="feedc0de")
    for _ in range(3):  # a server replaying round 1 three times
        ledger.record(release, run_id="feedc0de", round_number=1)
    spent = ledger.epsilon(1e-5)
    assert ledger.steps == 3
    with pytest.raises(LedgerError, match="already in this privacy ledger with other settings"):
        ledger.begin_run("feedc0de", "feedc0de:other-settings")
    with pytest.raises(LedgerError, match="not begun"):
        ledger.record(release, run_id="0badc0de", round_number=1)
    del ledger
    with pytest.raises(LedgerError, match="already in this privacy ledger with other settings"):
        PrivacyLedger(path, key=KEY).begin_run("feedc0de", "feedc0de:other-settings")
    assert PrivacyLedger(path, key=KEY).steps == 3 and PrivacyLedger(path, key=KEY).epsilon(1e-5) == pytest.approx(
        spent
    )


def test_a_run_resumes_after_its_last_recorded_round_and_keeps_its_charges(tmp_path):
    """A restarted party resumes the same run (same fingerprint) only after the rounds it was charged for."""
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    ledger = _ledger(path, run="feedc0de")
    ledger.begin_run("0badc0de", "0badc0de:settings")
    for round_number in (1, 2, 7):
        ledger.record(release, run_id="feedc0de", round_number=round_number)
    ledger.record(release, run_id="0badc0de", round_number=9)
    spent = ledger.epsilon(1e-5)
    assert ledger.begin_run("feedc0de", "feedc0de:settings") == 7
    del ledger
    resumed = PrivacyLedger(path, key=KEY)
    assert resumed.begin_run("feedc0de", "feedc0de:settings") == 7
    assert resumed.begin_run("0badc0de", "0badc0de:settings") == 9
    assert resumed.steps == 4 and resumed.epsilon(1e-5) == pytest.approx(spent)
    assert path.read_text().count('"fingerprint"') == 2  # resuming writes nothing


def test_a_version_2_ledger_keeps_counting(tmp_path):
    """Gaussian steps recorded before the integer mechanism still count, and new records follow them."""
    path = tmp_path / "ledger.jsonl"
    header = {"format": "consilium-privacy-ledger", "version": 2}
    step = {"sample_rate": 0.1, "noise_multipliers": {"server": 2.1, "peer_hospital": 1.7}}
    path.write_text("".join(json.dumps(r) + "\n" for r in [header, {"key": "old/1", **step}, {"key": "old/2", **step}]))
    with pytest.raises(LedgerError, match="written before ledgers were chained"):
        PrivacyLedger(
            path, key=KEY
        )  # or a chained ledger replaced by an unchained one: read only when its party says so
    ledger = PrivacyLedger(path, key=KEY, accept_unchained=True)
    central = RDPAccountant()
    central.history = [(2.1, 0.1, 2)]
    assert ledger.steps == 2 and ledger.epsilon(1e-5) == pytest.approx(central.get_epsilon(1e-5), rel=1e-3)
    path.write_text(path.read_text() + json.dumps({"key": "old/2", **step}) + "\n")  # a key replaced by the server
    ledger = PrivacyLedger(path, key=KEY, accept_unchained=True)
    assert ledger.steps == 3  # every version 2 line counts
    assert ledger.epsilon(1e-5, view="collusion") == math.inf  # version 2 did not record it
    ledger.begin_run("0123abcd", "0123abcd:settings")
    ledger.record(
        release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1), run_id="0123abcd", round_number=1
    )
    del ledger
    assert PrivacyLedger(path, key=KEY).steps == 4  # chained from then on, the old lines under a digest
    path.write_text(path.read_text().replace('"old/1"', '"old/3"'))
    with pytest.raises(LedgerError, match="lines before its chained header were altered"):
        PrivacyLedger(path, key=KEY)


def test_an_unreadable_ledger_stops_everything(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text("{ not json")
    with pytest.raises(LedgerError, match="only record of the privacy"):
        PrivacyLedger(path, key=KEY)
    path.write_text('{"format":"something else","version":3}\n')
    with pytest.raises(LedgerError):
        PrivacyLedger(path, key=KEY)
    ledger_path = tmp_path / "real.jsonl"
    written = _ledger(ledger_path)
    written.record(
        release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1), run_id="0123abcd", round_number=1
    )
    del written
    ledger_path.write_text(ledger_path.read_text().replace('"sample_rate":0.1', '"sample_rate":7'))
    with pytest.raises(LedgerError, match="altered"):
        PrivacyLedger(ledger_path, key=KEY)


def _three_rounds(path):
    ledger = _ledger(path)
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    for round_number in (1, 2, 3):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
    spent = ledger.epsilon(1e-5)
    del ledger
    return spent


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda lines: lines[:-1], "truncated"),  # the last record cut off, at a line's end
        (lambda lines: lines[:2] + lines[3:], "altered"),  # a record in the middle deleted
        (lambda lines: [lines[0], lines[1], lines[3], lines[2], *lines[4:]], "altered"),  # two swapped
        (
            lambda lines: [lines[0], lines[1], lines[2].replace('"round":1', '"round":9'), *lines[3:]],
            "altered",
        ),  # edited
        (lambda lines: lines[:2], "truncated"),
        (lambda lines: [], "truncated"),
    ],
)
def test_a_ledger_cut_edited_or_reordered_is_refused_rather_than_counted_lower(tmp_path, damage, reason):
    """Each record carries a MAC chained to the one before (keyed by the party's secret), and a head
    beside the file says how far the chain reaches: whatever is lost or changed shows."""
    path = tmp_path / "ledger.jsonl"
    _three_rounds(path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(damage(lines)))
    with pytest.raises(LedgerError, match=reason):
        PrivacyLedger(path, key=KEY)


def test_a_ledger_s_head_must_be_there_and_its_own_and_a_forged_chain_fails(tmp_path):
    path = tmp_path / "ledger.jsonl"
    spent = _three_rounds(path)
    head = path.with_name(path.name + ".head")
    with pytest.raises(LedgerError, match="does not verify"):
        PrivacyLedger(path, key=bytes(32))  # another party's key, or a guess
    saved = head.read_bytes()
    head.unlink()
    with pytest.raises(LedgerError, match="head .* is missing"):
        PrivacyLedger(path, key=KEY)
    head.write_bytes(saved.replace(b'"lines": 5', b'"lines": 4'))
    with pytest.raises(LedgerError, match="head .* is damaged"):
        PrivacyLedger(path, key=KEY)
    head.write_bytes(saved)
    assert PrivacyLedger(path, key=KEY).epsilon(1e-5) == pytest.approx(spent)
    with pytest.raises(ValueError, match="MAC key"):
        PrivacyLedger(path)


def _after_one_round(path):
    """A ledger charged for one round, its release, its head file and the head's bytes then."""
    ledger = _ledger(path)
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    ledger.record(release, run_id="0123abcd", round_number=1)
    head = path.with_name(path.name + ".head")
    return ledger, release, head, head.read_bytes()


def test_an_old_head_put_back_or_another_ledger_s_file_is_refused(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger, release, head, old_head = _after_one_round(path)
    for round_number in (2, 3, 4):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
    del ledger
    head.write_bytes(old_head)  # from a backup: the chain still passes through it
    with pytest.raises(LedgerError, match="an old head was put back"):
        PrivacyLedger(path, key=KEY)
    head.unlink()
    path.write_text(json.dumps({"format": "consilium-privacy-ledger", "version": 3}) + "\n")  # "a fresh, old ledger"
    with pytest.raises(LedgerError, match="written before ledgers were chained"):
        PrivacyLedger(path, key=KEY)
    other = tmp_path / "other.jsonl"  # the same party's other ledger, moved in under this name
    _three_rounds(other)
    path.write_bytes(other.read_bytes())
    head.write_bytes(other.with_name(other.name + ".head").read_bytes())
    with pytest.raises(LedgerError, match="altered"):
        PrivacyLedger(path, key=KEY)


def test_a_new_ledger_s_first_line_cut_short_by_a_full_disk_is_dropped(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger(path, key=KEY)
    original = ledger._append

    def short_write(record):  # the first line reaches the disk only in part
        path.write_bytes(json.dumps(record).encode()[:20])
        raise LedgerError("no space left on device")

    ledger._append = short_write
    with pytest.raises(LedgerError):
        ledger.begin_run("0123abcd", "0123abcd:settings")
    del ledger, original
    restarted = _ledger(path)
    restarted.record(
        release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1), run_id="0123abcd", round_number=1
    )
    del restarted
    assert PrivacyLedger(path, key=KEY).steps == 1


def test_a_record_written_before_a_crash_left_its_head_behind_still_counts(tmp_path):
    """Written, fsynced, then the process died before the head moved: over-counting is the safe side."""
    path = tmp_path / "ledger.jsonl"
    ledger, release, head, before = _after_one_round(path)
    ledger.record(release, run_id="0123abcd", round_number=2)
    del ledger
    head.write_bytes(before)
    assert PrivacyLedger(path, key=KEY).steps == 2


def test_a_finished_run_is_never_begun_again(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = _ledger(path)
    ledger.record(
        release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1), run_id="0123abcd", round_number=1
    )
    ledger.finish_run("0123abcd")
    del ledger
    with pytest.raises(LedgerError, match="is over for this party"):
        PrivacyLedger(path, key=KEY).begin_run("0123abcd", "0123abcd:settings")


def test_a_record_cut_short_by_a_crash_is_dropped_and_the_rest_kept(tmp_path):
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    ledger = _ledger(path)
    for round_number in (1, 2):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
    expected = ledger.epsilon(1e-5, extra=release)
    del ledger
    with path.open("a") as handle:
        handle.write('{"key":"c","sample_ra')
    restarted = PrivacyLedger(path, key=KEY)
    assert restarted.steps == 2
    restarted.record(release, run_id="0123abcd", round_number=3)
    assert PrivacyLedger(path, key=KEY).steps == 3 and '"sample_ra{' not in path.read_text()  # the torn line was cut
    del restarted
    assert PrivacyLedger(path, key=KEY).epsilon(1e-5) == pytest.approx(expected)


def test_each_record_is_one_appended_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    ledger = _ledger(path)
    sizes = []
    for round_number in range(50):
        ledger.record(release, run_id="0123abcd", round_number=round_number)
        sizes.append(path.stat().st_size)
    growth = np.diff(sizes)
    assert growth.max() - growth.min() <= 4  # constant cost per round, not a rewrite of the file
    assert len(path.read_text().splitlines()) == 52  # header, run, 50 records


def test_malformed_releases_are_refused():
    record = Release(0.1, 10.0, 30.0, (("server", 5.0), ("peer_hospital", 4.0), ("collusion", 1.0))).to_record()
    assert Release.from_record(dict(record)) == Release.from_record(record)
    for broken in (
        {**record, "mu": {"server": 1.0}},
        {**record, "l2_sensitivity": float("nan")},
        {**record, "mechanism": "x"},
    ):
        with pytest.raises(ValueError):
            Release.from_record(broken)
    assert rdp_to_epsilon(ORDERS, np.full(len(ORDERS), np.inf), 1e-5) == math.inf


@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-9])
def test_the_conversion_to_epsilon_is_opacus_s(delta):
    from opacus.accountants.analysis.rdp import get_privacy_spent

    curves = [
        gaussian_rdp(ORDERS, noise_multiplier=1.1) * 300,
        poisson_subsampled_rdp(ORDERS, 0.1, gaussian_rdp(ORDERS, noise_multiplier=2.3)) * 100,
        skellam_rdp(ORDERS, l2_sensitivity=207.3, l1_sensitivity=2000.0, mu=5e4),
        np.where(ORDERS > 40, np.inf, 0.01 * ORDERS),
    ]
    for rdp in curves:
        expected, _ = get_privacy_spent(orders=list(map(float, ORDERS)), rdp=rdp, delta=delta)
        assert rdp_to_epsilon(ORDERS, rdp, delta) == pytest.approx(float(expected), rel=1e-12)


def _renyi(log_p, log_q, alpha):
    return logsumexp(alpha * log_p + (1 - alpha) * log_q) / (alpha - 1)


@pytest.mark.parametrize("mu", [0.5, 5.0, 100.0])
def test_both_directions_of_the_exact_one_dimensional_subsampled_skellam_stay_within_the_bound(mu):
    """The binomial bound is an exact expansion for removal; addition is checked here numerically.

    Exact Renyi divergences of the 1-D Skellam mechanism, subsampled, against the accountant's bound."""
    orders = np.arange(2, 40)
    for shift in (1, 3):
        support = np.arange(-int(40 * np.sqrt(mu) + 60 + shift), int(40 * np.sqrt(mu) + 60 + shift) + 1)
        log_without, log_with = skellam.logpmf(support, mu, mu), skellam.logpmf(support - shift, mu, mu)
        base = np.array([_renyi(log_with, log_without, a) for a in orders])
        assert np.all(base <= skellam_rdp(orders, l2_sensitivity=shift, l1_sensitivity=shift, mu=mu) * (1 + 1e-9))
        for q in (0.01, 0.1, 0.6):
            log_mixture = np.logaddexp(np.log1p(-q) + log_without, np.log(q) + log_with)
            bound = poisson_subsampled_rdp(orders, q, base)
            removal = np.array([_renyi(log_mixture, log_without, a) for a in orders])
            addition = np.array([_renyi(log_without, log_mixture, a) for a in orders])
            tolerance = 1e-6 * bound + 1e-12  # the removal side is an exact identity, up to rounding
            assert np.all(removal <= bound + tolerance) and np.all(addition <= bound + tolerance)


def _certificate(r, w, alpha, k):
    """``M(r, w)``: the right minus the left side of the pointwise inequality in ``training/privacy/rdp.py``
    with the weight ``3w / (3w + k)``, ``q = 1/(1+w)`` and ``u = 1 + w``, multiplied by
    ``(3w+k) u^alpha r^(alpha-1) (w+r)^(alpha-1) > 0``."""
    a, u = alpha, 1 + w
    slope = (1 - a) * (3 * w + k) - 3 * w * a - k * (u - a)  # c (3w + k) u
    return (
        3 * w * (w + r) ** (2 * a - 1) * r ** (a - 1)
        + k * (w * r + 1) ** a * (w + r) ** (a - 1)
        + slope * (r - 1) * r ** (a - 1) * (w + r) ** (a - 1) * u ** (a - 1)
        - (3 * w + k) * u ** (2 * a - 1) * r ** (a - 1)
    )


def _certificate_coefficients(alpha, k):
    """``M``'s coefficients, ``m[i, j]`` of ``r^i w^j``, from the binomial expansion of each term of ``_certificate``."""
    a = alpha
    m = np.zeros((3 * a - 1, 2 * a + 1), dtype=object)
    i = np.arange(2 * a)  # 3 w (w + r)^(2a-1) r^(a-1)
    m[i + a - 1, 2 * a - i] += 3 * _binomials(2 * a - 1)
    i, j = np.meshgrid(
        np.arange(a + 1), np.arange(a), indexing="ij"
    )  # k (w r)^i of (wr + 1)^a, r^j w^(a-1-j) of (w + r)^(a-1)
    m[i + j, i + a - 1 - j] += k * np.outer(_binomials(a), _binomials(a - 1))
    # slope (r - 1) r^(a-1) (w + r)^(a-1) u^(a-1): the slope's constant terms cancel, leaving s w
    s = (1 - a) * 3 - 3 * a - k
    i, j = np.meshgrid(np.arange(a), np.arange(a), indexing="ij")  # r^i w^(a-1-i) of (w + r)^(a-1), w^j of u^(a-1)
    product = s * np.outer(_binomials(a - 1), _binomials(a - 1))
    m[i + a, a - i + j] += product
    m[i + a - 1, a - i + j] -= product
    m[a - 1, : 2 * a] -= k * _binomials(2 * a - 1)  # -(3w + k) u^(2a-1) r^(a-1)
    m[a - 1, 1:] -= 3 * _binomials(2 * a - 1)
    return m


def _binomials(n):
    return np.array([math.comb(n, i) for i in range(n + 1)], dtype=object)


def _negative_certificate_coefficients(alpha, k):
    """The number of negative coefficients of ``M / (r-1)^4`` (``None`` if ``(r-1)^4`` does not
    divide ``M``): zero means ``M >= 0``, hence the inequality, for all ``r, w > 0``."""
    coefficients = _certificate_coefficients(alpha, k)
    for _ in range(4):  # synthetic division by (r - 1), one power of w at a time
        if any(coefficients.sum(axis=0)):
            return None
        coefficients = np.cumsum(coefficients[::-1], axis=0)[::-1][1:]
    return int(np.sum(coefficients < 0))


@pytest.mark.parametrize("alpha", [2, 3, 20, 40])
def test_the_certificate_s_coefficients_are_its_polynomial(alpha):
    """Exact, by Kronecker substitution. Each term of ``M`` has degree at most ``2 alpha`` in ``w``, so
    with ``w = B`` and ``r = B^(2 alpha + 1)`` each monomial ``r^i w^j`` becomes its own power of ``B``.
    ``M``'s coefficients are below ``2^(2 alpha + 12)`` in absolute value here (for each term, the
    product of its factors' absolute coefficient sums), and the array's are checked, so with ``B``
    above twice both, equal values mean equal coefficients."""
    k = 2 * alpha - 1
    coefficients = _certificate_coefficients(alpha, k)
    width, bits = coefficients.shape[1], 2 * alpha + 14  # B = 2^bits
    assert max(abs(int(c)) for c in coefficients.flat) < 2 ** (bits - 2)
    substituted = sum(int(c) << (bits * (i * width + j)) for (i, j), c in np.ndenumerate(coefficients))
    assert substituted == _certificate(2 ** (bits * width), 2**bits, alpha, k)


def test_the_subsampling_bound_covers_the_addition_direction_at_every_order():
    """The certificate behind the addition direction, exact, at every order the accountant uses."""
    for alpha in ORDERS:
        assert _negative_certificate_coefficients(int(alpha), 2 * int(alpha) - 1) == 0, alpha
    for alpha in (3, 8, 20):  # a weight off by one step of alpha is not a certificate
        assert _negative_certificate_coefficients(alpha, 2 * alpha + 1) != 0


def test_random_pairs_stay_within_the_bound_in_both_directions():
    """For arbitrary discrete pairs, with eps(j) the larger of the two directions' divergences."""
    rng = np.random.default_rng(7)
    orders = np.arange(2, 12)
    for _ in range(300):
        size = rng.integers(2, 6)
        log_without, log_with = (np.log(rng.dirichlet(np.full(size, rng.choice([0.3, 1.0, 5.0])))) for _ in range(2))
        base = np.array([max(_renyi(log_with, log_without, a), _renyi(log_without, log_with, a)) for a in orders])
        q = rng.choice([1e-3, 0.05, 0.3, 0.8])
        log_mixture = np.logaddexp(np.log1p(-q) + log_without, np.log(q) + log_with)
        bound = poisson_subsampled_rdp(orders, q, base)
        addition = np.array([_renyi(log_without, log_mixture, a) for a in orders])
        removal = np.array([_renyi(log_mixture, log_without, a) for a in orders])
        assert np.all(addition <= bound + 1e-9) and np.all(removal <= bound + 1e-9)


def test_a_shift_in_one_coordinate_is_not_the_skellam_mechanism_s_worst_case():
    """Why the accountant stays RDP: a privacy-loss-distribution accountant needs a dominating pair,
    and the natural one, a shift by Delta_2 in one coordinate, is not one for Skellam noise. Spread
    over two coordinates, a shift of the same L2 norm (and a larger L1 norm) has the larger
    hockey-stick divergence delta(epsilon) = sum max(0, P - e^epsilon Q), computed exactly here
    (the tails left out weigh below 1e-15)."""
    mu = 100.0  # each coordinate carries Sk(mu): standard deviation about 14, as a shift of 5 is small
    support = np.arange(-150, 151)
    noise = skellam.pmf(support, mu, mu)

    def hockey_stick(shift: tuple[int, int], epsilon: float) -> float:
        shifted = [skellam.pmf(support - k, mu, mu) for k in shift]
        p = np.multiply.outer(shifted[0], shifted[1])
        q = np.multiply.outer(noise, noise)
        return float(np.maximum(p - math.exp(epsilon) * q, 0.0).sum())

    for epsilon, ratio in ((1.0, 1.01), (2.0, 1.3)):  # 1.020 and 1.366
        assert hockey_stick((3, 4), epsilon) > ratio * hockey_stick((5, 0), epsilon)


def test_a_round_s_endorsement_and_release_are_recorded_once_and_survive_a_restart(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = _ledger(path)
    ledger.record(
        release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1), run_id="0123abcd", round_number=1
    )
    ledger.record_step("endorsed", run_id="0123abcd", round_number=1)
    ledger.record_step("released", run_id="0123abcd", round_number=1)
    with pytest.raises(LedgerError, match="released round 1 of run 0123abcd already"):
        ledger.record_step("released", run_id="0123abcd", round_number=1)
    with pytest.raises(LedgerError, match="unknown step"):
        ledger.record_step("opened", run_id="0123abcd", round_number=1)
    del ledger
    restarted = PrivacyLedger(path, key=KEY)
    assert restarted.begin_run("0123abcd", "0123abcd:settings") == 1 and restarted.steps == 1
    with pytest.raises(LedgerError, match="released round 1 of run 0123abcd already"):
        restarted.record_step("released", run_id="0123abcd", round_number=1)
    restarted.record_step("endorsed", run_id="0123abcd", round_number=2)
    del restarted
    lines = path.read_text().splitlines()
    step = json.loads(lines[-1])
    step["step"] = "opened"  # an edited step record breaks the chain
    path.write_text("\n".join([*lines[:-1], json.dumps(step)]) + "\n")
    with pytest.raises(LedgerError, match="unreadable"):
        PrivacyLedger(path, key=KEY)


def test_a_run_the_server_narrowed_to_a_few_hospitals_is_charged_for_half_the_consortium():
    """A consortium of 10; the server runs a victim with two hospitals working with it (tau = 2): those
    two hold every share, so the coalition view counts them all, as the collusion view does (review 5, finding 6)."""
    assert tolerated_coalition(2, 10) == 5 and tolerated_coalition(6, 10) == 5 and tolerated_coalition(3, 3) == 2
    mechanism = _mechanism(quorum=3)
    release = dict(release_of(mechanism, sample_rate=0.1, contributors=3, coalition=tolerated_coalition(2, 10)).mu)
    assert release["coalition"] == release["collusion"] == pytest.approx(mechanism.share_mu)


def test_a_closed_ledger_lets_the_next_writer_in_at_once_and_takes_the_lock_again_to_write(tmp_path):
    """A service's next run opens its ledger while the last run's role may still be uncollected."""
    path = tmp_path / "ledger.jsonl"
    release = release_of(_mechanism(), sample_rate=0.1, contributors=3, coalition=1)
    last_run = _ledger(path)
    last_run.close()
    next_run = PrivacyLedger(path, key=KEY)
    next_run.record(release, run_id="0123abcd", round_number=1)  # would be "in use by another writer"
    with pytest.raises(LedgerError, match="in use by another writer"):
        last_run.record(release, run_id="0123abcd", round_number=2)
    next_run.close()
    assert PrivacyLedger(path, key=KEY).steps == 1
