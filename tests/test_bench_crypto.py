"""The crypto benchmark's one-time-key scheme runs the real round and sums exactly."""

from scripts.bench_crypto import _measure, build_parser


def test_the_one_time_scheme_sums_exactly_and_counts_the_shares_it_sends():
    args = build_parser().parse_args(["--contributions", "3"])
    one_time = _measure("consilium-one-time", 3000, 3, args)
    seeded = _measure("consilium-seeded", 3000, 3, args)
    assert one_time.max_error == 0 and seeded.max_error == 0
    # Three sealed shares of one polynomial each ride with the upload.
    assert one_time.upload_bytes > seeded.upload_bytes
    assert one_time.download_seconds > 0
