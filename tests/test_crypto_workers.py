"""The work on ciphertexts spread over worker processes (crypto.workers): the same bytes, sums and refusals."""

import numpy as np
import pytest

from crypto.bfv import BfvError, CiphertextSum, PublicContext, SecretContext, upload_bytes
from crypto.bfv_parameters import select_bfv_parameters
from crypto.workers import WorkerError

RUN = "0123456789abcdef"
HOSPITALS = ("hospital-1", "hospital-2", "hospital-3")


@pytest.fixture(scope="module")
def params():
    """Several ciphertexts an upload (N = 4096), so that two workers each hold a shard."""
    chosen = select_bfv_parameters(max_contributors=3, vector_length=100_000, sum_bound=1_000)
    assert chosen.chunk_count >= 3
    return chosen


def _updates(params):
    bound = params.sum_bound // params.max_contributors
    return [
        np.random.default_rng(seed).integers(-bound, bound, params.vector_length, endpoint=True) for seed in range(3)
    ]


def test_workers_encrypt_add_and_decrypt_exactly_what_one_process_does(params):
    secret = SecretContext.generate(params, run_id=RUN)
    public = PublicContext(params)
    updates = _updates(params)
    try:
        secret.use_workers(2)
        public.use_workers(2)
        assert len(public.workers.shards) == 2 and secret.to_bytes()  # the key stayed usable here too
        uploads = [secret.encrypt_update(u, round_number=3, hospital=h) for u, h in zip(updates, HOSPITALS)]
        assert all(len(chunk) == upload_bytes(params) for upload in uploads for chunk in upload)
        total = CiphertextSum(public)
        for upload in uploads:
            total.add(upload)
        summed = secret.decrypt_sum(total.to_chunks(), round_number=3, contributors=HOSPITALS)
        assert np.array_equal(summed, np.sum(updates, axis=0))
        one_process = SecretContext.from_bytes(secret.to_bytes(), params, run_id=RUN)  # checks the workers' checks
        assert np.array_equal(
            one_process.decrypt_sum(total.to_chunks(), round_number=3, contributors=HOSPITALS), summed
        )
        with pytest.raises(BfvError, match="not one fresh contribution"):
            secret.decrypt_sum(total.to_chunks(), round_number=3, contributors=HOSPITALS[:2])
        alone = CiphertextSum(PublicContext(params))  # one process adds the same uploads to the same sum
        for upload in uploads:
            alone.add(upload)
        assert np.array_equal(secret.decrypt_sum(alone.to_chunks(), round_number=3, contributors=HOSPITALS), summed)
    finally:
        secret.close()
        public.close()


def test_an_upload_one_worker_refuses_changes_no_worker_s_sum(params):
    secret = SecretContext.generate(params, run_id=RUN)
    public = PublicContext(params)
    updates = _updates(params)
    try:
        public.use_workers(2)
        uploads = [secret.encrypt_update(u, round_number=1, hospital=h) for u, h in zip(updates, HOSPITALS)]
        total = CiphertextSum(public)
        total.add(uploads[0])
        for broken in (
            uploads[1][:-1] + [uploads[1][-1][:-1]],  # the last shard's ciphertext cut short
            [uploads[1][0][:10] + bytes(len(uploads[1][0]) - 10)] + uploads[1][1:],  # the first one's zeroed
            uploads[1][:-1],  # one ciphertext too few
        ):
            with pytest.raises(BfvError):
                total.add(broken)
        total.add(uploads[1])
        total.add(uploads[2])
        assert total.contributions == 3
        summed = secret.decrypt_sum(total.to_chunks(), round_number=1, contributors=HOSPITALS)
        assert np.array_equal(summed, np.sum(updates, axis=0))
    finally:
        public.close()


def test_a_worker_that_dies_is_one_line_not_a_hang(params):
    public = PublicContext(params)
    public.use_workers(2)
    try:
        public.workers._processes[0].kill()
        with pytest.raises(WorkerError, match="a crypto worker"):
            CiphertextSum(public)
    finally:
        public.close()


def test_one_worker_or_one_ciphertext_uses_no_process():
    small = select_bfv_parameters(max_contributors=3, vector_length=100, sum_bound=1_000)
    public = PublicContext(small)
    public.use_workers(4)
    assert public.workers is None and small.chunk_count == 1
