"""The benchmark's plaintext stand-ins sum exactly what the encrypted path sums, and refuse malformed input."""

import numpy as np
import pytest

from consilium.crypto.bfv import BfvError
from consilium.crypto.bfv_parameters import select_bfv_parameters
from consilium.crypto.insecure_plaintext import InsecurePlaintextSum, InsecurePlaintextUploads


def test_the_plaintext_sum_is_the_sum_modulo_2_to_the_32():
    params = select_bfv_parameters(max_contributors=3, vector_length=1000, sum_bound=3000)
    uploads = InsecurePlaintextUploads(params)
    rng = np.random.default_rng(0)
    updates = [rng.integers(-1000, 1001, size=1000) for _ in range(3)]
    updates[0][:2], updates[1][:2] = (2**40 + 5, -(2**33)), (-(2**40), 2**33 - 7)  # leave the bound, sum within it
    total = InsecurePlaintextSum(params)
    for index, update in enumerate(updates):
        total.add(uploads.encrypt_update(update, round_number=1, hospital=f"hospital-{index}"))
    decoded = uploads.decrypt_sum(
        total.to_chunks(), round_number=1, contributors=["hospital-0", "hospital-1", "hospital-2"]
    )
    np.testing.assert_array_equal(decoded, np.sum(updates, axis=0))
    assert total.contributions == 3
    with pytest.raises(BfvError, match="the most these parameters allow"):  # t holds no more than K_max of them
        total.add(uploads.encrypt_update(updates[0], round_number=1, hospital="hospital-3"))


def test_malformed_plaintext_uploads_change_nothing():
    params = select_bfv_parameters(max_contributors=2, vector_length=10, sum_bound=100)
    total = InsecurePlaintextSum(params)
    total.add(InsecurePlaintextUploads(params).encrypt_update(np.arange(10), round_number=1, hospital="hospital-1"))
    before = total.to_chunks()
    for chunks in ([b"\0" * 39], [b"\0" * 40, b""], [b"\0" * 41], ["\0" * 40]):
        with pytest.raises(BfvError):
            total.add(chunks)
    assert total.to_chunks() == before and total.contributions == 1
    with pytest.raises(BfvError, match="empty"):
        InsecurePlaintextSum(params).to_chunks()
