"""The crypto benchmark's Consilium scheme runs the real one-time-key round and sums exactly."""

import pytest

from consilium.scripts.bench_crypto import _measure, build_parser


def test_consilium_sums_exactly_and_counts_the_shares_it_sends():
    args = build_parser().parse_args(["--contributions", "3"])
    consilium = _measure("consilium", 3000, 3, args)
    plaintext = _measure("plaintext-float32", 3000, None, args)
    assert consilium.max_error == 0 and consilium.download_seconds > 0
    # The ciphertexts and three sealed shares of one polynomial each.
    assert consilium.upload_bytes > plaintext.upload_bytes


def test_consilium_needs_every_hospital_to_contribute():
    with pytest.raises(ValueError, match="quorum is K"):
        _measure("consilium", 3000, 5, build_parser().parse_args(["--contributions", "3"]))
