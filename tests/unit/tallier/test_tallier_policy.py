"""A tallier's policy file: read whole or refused in one line, and each run outside it refused with its reason."""

import pytest

from consilium.protocol.run.policy_file import PolicyError
from consilium.protocol.voting.voting_config import VotingConfig
from consilium.tallier.tallier_policy import TallierPolicy
from consilium.training.models.spec import ModelSpec
from consilium.training.voting.vote_privacy import VotingSettings

POLICY = 'methods = ["knn-dpfl"]\nreveal = "labels"\nmax_queries_per_run = 200\nmin_quorum = 2\nmin_noise_std = 10\n'


def _run(method="knn-dpfl", reveal="labels", rounds=2, quorum=3, noise_std=15.0):
    return VotingConfig(
        run_id="0123abcd",
        dataset="digits",
        hospitals=("hospital-1", "hospital-2", "hospital-3"),
        talliers=("tallier-1", "tallier-2", "tallier-3"),
        rounds=rounds,
        queries_per_round=20,
        delta=1e-5,
        voting=VotingSettings(method, noise_std=noise_std, quorum=quorum, neighbours=30 if method == "knn-dpfl" else 1),
        reveal=reveal,
        label_threshold=0,
        model=ModelSpec("mlp", (64,), 10),
        teacher_epochs=1,
        teacher_confidence=0.0,
        feature_dimensions=10,
    )


def test_a_run_outside_the_policy_is_refused_with_the_policy_s_reason(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    policy = TallierPolicy.load(path)
    assert policy.refusal(_run()) == ""
    assert "tallies knn-dpfl runs, not 'ae-dpfl'" in policy.refusal(_run(method="ae-dpfl"))
    assert "reveal the noisy histogram; this tallier opens labels only" in policy.refusal(_run(reveal="histogram"))
    assert "220 queries, more than the 200" in policy.refusal(_run(rounds=11))  # 20 queries a round
    assert "a quorum of 1, fewer hospitals than the 2" in policy.refusal(_run(quorum=1))
    assert "noise of standard deviation 5, less than this tallier's 10" in policy.refusal(_run(noise_std=5.0))
    assert TallierPolicy().refusal(_run(reveal="histogram"))  # without a file: labels only
    assert not TallierPolicy(reveal="histogram").refusal(_run(reveal="histogram"))
    assert not TallierPolicy(reveal="histogram").refusal(_run())  # opening totals, it opens labels too
    assert not TallierPolicy().refusal(_run(method="ae-dpfl", rounds=500, quorum=1, noise_std=0.1))


@pytest.mark.parametrize(
    "text, why",
    [
        (POLICY + "max_epsilon = 3\n", "unknown key max_epsilon"),
        (POLICY.replace("min_quorum = 2\n", ""), "missing min_quorum"),
        (POLICY.replace('"labels"', '"totals"'), "reveal must be one of 'labels', 'histogram'"),
        (POLICY.replace('reveal = "labels"', 'reveal = ["labels"]'), "reveal must be one of"),
        (POLICY.replace('["knn-dpfl"]', "[]"), "methods must be a list of at least one"),
        (POLICY.replace("= 200", "= 0"), "max_queries_per_run must be a positive whole number"),
        (POLICY.replace("min_quorum = 2", "min_quorum = true"), "min_quorum must be a positive whole number"),
        (POLICY.replace("min_noise_std = 10", "min_noise_std = -1"), "min_noise_std must be a number at least 0"),
        (POLICY.replace("min_noise_std = 10", 'min_noise_std = "10"'), "min_noise_std must be a number"),
        ("methods = [", "policy file"),
    ],
)
def test_a_policy_file_that_cannot_be_used_is_refused_in_one_line(tmp_path, text, why):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=why):
        TallierPolicy.load(path)
