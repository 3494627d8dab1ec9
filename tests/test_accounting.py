import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from training.accounting import LedgerError, PrivacyLedger, aggregate_noise_multiplier, round_noise_multipliers


def test_noise_present_in_a_sum_of_shares():
    assert aggregate_noise_multiplier(1.5, contributors=4, quorum=4) == pytest.approx(1.5)
    assert aggregate_noise_multiplier(1.5, contributors=9, quorum=4) == pytest.approx(1.5 * 1.5)
    assert aggregate_noise_multiplier(1.5, contributors=4, quorum=4, known_shares=1) == pytest.approx(1.5 * math.sqrt(3 / 4))
    views = round_noise_multipliers(2.0, contributors=1, quorum=1)
    assert views == {"server": 2.0, "peer_hospital": 2.0}  # no contributing peer to know a share


def test_a_quorum_of_shares_is_central_dp_sgd():
    """K hospitals adding sigma^2/K each: the same epsilon as central DP-SGD with sigma."""
    ledger = PrivacyLedger()
    for round_number in range(200):
        ledger.record(str(round_number), sample_rate=0.1, noise_multipliers=round_noise_multipliers(2.7, 3, 3))
    central = RDPAccountant()
    for _ in range(200):
        central.step(noise_multiplier=2.7, sample_rate=0.1)
    assert ledger.epsilon(1e-5) == pytest.approx(central.get_epsilon(1e-5))
    # And Opacus's calibration, run backwards, recovers sigma from that epsilon.
    sigma = get_noise_multiplier(target_epsilon=ledger.epsilon(1e-5), target_delta=1e-5, sample_rate=0.1, steps=200)
    assert sigma == pytest.approx(2.7, rel=0.02)
    assert ledger.epsilon(1e-5, view="peer_hospital") > ledger.epsilon(1e-5)


def test_more_noise_costs_less_and_no_noise_costs_everything():
    low, high = PrivacyLedger(), PrivacyLedger()
    low.record("1", sample_rate=0.1, noise_multipliers=round_noise_multipliers(1.0, 3, 3))
    high.record("1", sample_rate=0.1, noise_multipliers=round_noise_multipliers(1.0, 6, 3))
    assert high.epsilon(1e-5) < low.epsilon(1e-5)
    none = PrivacyLedger()
    none.record("1", sample_rate=0.1, noise_multipliers=round_noise_multipliers(0.0, 3, 3))
    assert none.epsilon(1e-5) == math.inf
    assert PrivacyLedger().epsilon(1e-5) == 0.0


def test_the_ledger_survives_a_restart_and_a_step_can_be_settled(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path)
    for round_number in range(10):
        ledger.record(f"run/{round_number}", sample_rate=0.05, noise_multipliers=round_noise_multipliers(1.1, 2, 2))
    before = ledger.epsilon(1e-4)
    restarted = PrivacyLedger(path)
    assert restarted.steps == 10 and restarted.epsilon(1e-4) == pytest.approx(before)
    restarted.record("run/9", sample_rate=0.05, noise_multipliers=round_noise_multipliers(1.1, 4, 2))
    assert PrivacyLedger(path).steps == 10
    assert PrivacyLedger(path).epsilon(1e-4) < before
    projected = restarted.epsilon(1e-4, extra=(1.1, 0.05))
    assert projected > restarted.epsilon(1e-4) and restarted.steps == 10


def test_prv_accountant_is_available_and_not_looser_than_rdp():
    rdp, prv = PrivacyLedger(), PrivacyLedger(accountant="prv")
    for round_number in range(100):
        for ledger in (rdp, prv):
            ledger.record(str(round_number), sample_rate=0.1, noise_multipliers=round_noise_multipliers(2.0, 3, 3))
    assert 0 < prv.epsilon(1e-5) <= rdp.epsilon(1e-5)


def test_an_unreadable_ledger_stops_everything(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("{ not json")
    with pytest.raises(LedgerError, match="only record of the privacy"):
        PrivacyLedger(path)
    path.write_text('{"format":"something else","version":2}\n')
    with pytest.raises(LedgerError):
        PrivacyLedger(path)
    ledger_path = tmp_path / "real.json"
    PrivacyLedger(ledger_path).record("a", sample_rate=0.1, noise_multipliers=round_noise_multipliers(1.0, 2, 2))
    ledger_path.write_text(ledger_path.read_text().replace('"sample_rate":0.1', '"sample_rate":7'))
    with pytest.raises(LedgerError, match="malformed record"):
        PrivacyLedger(ledger_path)


def test_a_record_cut_short_by_a_crash_is_dropped_and_the_rest_kept(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path)
    for key in ("a", "b"):
        ledger.record(key, sample_rate=0.1, noise_multipliers=round_noise_multipliers(1.0, 2, 2))
    with path.open("a") as handle:
        handle.write('{"key":"c","sample_ra')
    restarted = PrivacyLedger(path)
    assert restarted.steps == 2
    restarted.record("c", sample_rate=0.1, noise_multipliers=round_noise_multipliers(1.0, 2, 2))
    assert PrivacyLedger(path).steps == 3 and PrivacyLedger(path).epsilon(1e-5) == pytest.approx(ledger.epsilon(1e-5, extra=(1.0, 0.1)))


def test_each_record_is_one_appended_line(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path)
    sizes = []
    for key in range(50):
        ledger.record(str(key), sample_rate=0.1, noise_multipliers=round_noise_multipliers(1.0, 2, 2))
        sizes.append(path.stat().st_size)
    growth = np.diff(sizes)
    assert growth.max() - growth.min() <= 4  # constant cost per round, not a rewrite of the file
    assert len(path.read_text().splitlines()) == 51
