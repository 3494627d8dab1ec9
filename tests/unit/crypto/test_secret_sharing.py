import numpy as np
import pytest
from scipy import stats

from consilium.crypto.secret_sharing import ShareError, add, check_fits, from_bytes, reconstruct, share, to_bytes

P = 2**61 - 1  # a Mersenne prime


def test_shares_reconstruct_signed_votes_and_their_sums():
    votes = [np.array([-7, 0, 3, 2**40, -(2**40)]), np.array([1, 1, -1, 5, 6])]
    shared = [share(v, 3, P) for v in votes]
    assert np.array_equal(reconstruct(shared[0], P), votes[0])
    # What a tallier does: add the shares it holds; the totals reconstruct to the sum of the votes.
    totals = [add(list(map(int, a)), b, P) for a, b in zip(shared[0], shared[1])]
    assert np.array_equal(reconstruct([np.array(t, dtype=np.uint64) for t in totals], P), votes[0] + votes[1])


def test_any_two_of_three_shares_are_independent_of_the_votes():
    """All-zero votes and extreme votes: for every pair of shares, linear combinations of the pair (which
    would expose a reused mask, say) are uniform and a two-sample test cannot tell the vote sets apart."""
    count = 4000
    zeros = share(np.zeros(count, dtype=np.int64), 3, P)
    extreme = share(np.full(count, 2**59, dtype=np.int64), 3, P)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        for a, b in ((1, 0), (1, 1), (1, -1), (1, 2), (2, 1)):
            combined = [
                np.array([(a * int(x) + b * int(y)) % P for x, y in zip(s[i], s[j])]) / P for s in (zeros, extreme)
            ]
            # 45 tests at 1e-9 each: a false failure about once in 20 million runs. A reused mask makes
            # one combination constant, which every one of these tests rejects at p far below 1e-100.
            assert stats.ks_2samp(*combined).pvalue > 1e-9
            assert (
                stats.kstest(combined[0], "uniform").pvalue > 1e-9
                and stats.kstest(combined[1], "uniform").pvalue > 1e-9
            )


def test_a_value_outside_the_field_range_is_refused():
    with pytest.raises(ShareError, match="does not fit"):
        share(np.array([P // 2]), 3, P)
    with pytest.raises(ShareError, match="do not fit"):
        check_fits(P // 2, P)
    check_fits(P // 2 - 1, P)


def test_shares_from_the_wire_are_checked():
    vector = share(np.arange(4), 2, P)[0]
    assert np.array_equal(from_bytes(to_bytes(vector), 4, P), vector)
    with pytest.raises(ShareError, match="has 32 bytes, got 24"):
        from_bytes(to_bytes(vector)[:24], 4, P)
    with pytest.raises(ShareError, match="outside the field"):
        from_bytes(np.array([0, P, 0, 0], dtype="<u8").tobytes(), 4, P)
