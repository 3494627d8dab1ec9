"""Client-level accounting: a hospital of v sub-clients is a sub-client at noise multiplier z / v."""

import numpy as np
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from training.client_accounting import ClientRelease, client_epsilons


@pytest.mark.parametrize("accountant, reference", [("prv", PRVAccountant), ("rdp", RDPAccountant)])
def test_hospital_level_epsilon_is_the_subclient_epsilon_at_z_over_v(accountant, reference):
    z, v, rounds = 2.0, 4, 30
    epsilons = client_epsilons([ClientRelease(z, 1.0, v)] * rounds, 1e-5, accountant=accountant)
    at_z_over_v = client_epsilons([ClientRelease(z / v, 1.0, 1)] * rounds, 1e-5, accountant=accountant)
    assert epsilons["hospital"] == pytest.approx(at_z_over_v["subclient"], rel=1e-9)
    assert epsilons["hospital"] > 2 * epsilons["subclient"]  # v sub-clients are protected far less together
    plain = reference()
    for _ in range(rounds):
        plain.step(noise_multiplier=z, sample_rate=1.0)
    assert epsilons["subclient"] == pytest.approx(plain.get_epsilon(1e-5), rel=1e-9)


def test_a_changing_split_composes_round_by_round():
    splits = [1, 2, 4, 4, 3]
    mixed = client_epsilons([ClientRelease(3.0, 1.0, v) for v in splits], 1e-5, accountant="rdp")["hospital"]
    bounds = [client_epsilons([ClientRelease(3.0, 1.0, v)] * len(splits), 1e-5, accountant="rdp")["hospital"] for v in (1, 4)]
    assert bounds[0] < mixed < bounds[1]


def test_no_release_spends_nothing_and_nonsense_is_refused():
    assert client_epsilons([], 1e-5) == {"subclient": 0.0, "hospital": 0.0}
    for bad in ((0.0, 1.0, 1), (1.0, 0.0, 1), (1.0, 1.0, 0)):
        with pytest.raises(ValueError):
            ClientRelease(*bad)
    with pytest.raises(ValueError, match="unknown accountant"):
        client_epsilons([ClientRelease(1.0, 1.0, 1)], 1e-5, accountant="moments")
    assert np.isfinite(client_epsilons([ClientRelease(1.0, 0.1, 2)] * 10, 1e-5)["subclient"])
