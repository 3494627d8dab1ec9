import numpy as np

from consilium.crypto.endorsement import one_time_statement

BASE = dict(
    run="0123abcd:00ff",
    round_number=4,
    contributors=("hospital-1", "hospital-2"),
    upload_digests=(b"a" * 32, b"b" * 32),
    sum_digest=b"s" * 32,
    round_state={},
    box_keys_digest=b"k" * 32,
    previous_result=b"p" * 32,
)


def test_a_statement_binds_the_run_the_round_the_set_every_upload_the_sum_the_keys_the_past_and_the_round_state():
    variants = [
        dict(run="0123abcd:00fe"),
        dict(round_number=5),
        dict(contributors=("hospital-2", "hospital-1")),
        dict(contributors=("hospital-1hospital-2",), upload_digests=(b"a" * 32,)),
        dict(upload_digests=(b"a" * 32, b"c" * 32)),
        dict(upload_digests=(b"a" * 31, b"a" + b"b" * 32)),  # the same bytes split differently
        dict(sum_digest=b"t" * 32),
        dict(box_keys_digest=b"l" * 32),
        dict(previous_result=b"q" * 32),
        dict(round_state={"subclients": 3}),  # contributors that trained with different v
        dict(round_state={"subclients": 4, "max_update_norm": 0.5}),  # ... or a different clipping bound
        dict(round_state={"subclients": 4, "max_update_norm": float(np.nextafter(np.float32(0.5), np.float32(1)))}),
    ]
    statements = {one_time_statement(**{**BASE, **change}) for change in variants}
    assert len(statements) == len(variants) and one_time_statement(**BASE) not in statements
