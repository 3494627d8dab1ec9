"""The schemes consilium-bench-crypto measures, one class each (``bench_crypto``'s docstring says
what each is), by the name ``--schemes`` gives it in ``BACKENDS``.

Each is built from ``(d, K, the launcher's arguments)`` and offers the benchmark's three steps on
updates it draws itself, with values its scheme can sum without overflow:

- ``update(rng)``: one hospital's update, of ``d`` values;
- ``upload(update, index)``: the ``index``-th hospital's upload of it: encoded, encrypted and serialised;
- ``new_sum()`` and ``add(total, upload)``: the server's sum, one upload at a time;
- ``download(total, contributions)``: the sum back at a hospital, decoded;
- ``parameters``: the scheme's parameters in words, for the results table.

A backend that runs other parties' steps inside ``download`` leaves their time in ``untimed``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tenseal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from consilium.crypto.bfv import PublicContext
from consilium.crypto.bfv_parameters import BfvParameters, select_bfv_parameters
from consilium.crypto.sealed_box import certify_key
from consilium.protocol.secure_round.hospital_round import HospitalRound
from consilium.protocol.secure_round.statement import RoundSetting, box_key_context
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.training.privacy.skellam import SkellamMechanism

_TENSEAL_BFV_PLAIN_MODULUS = 1032193  # TenSEAL's tutorials' batching prime for N = 4096
_TENSEAL_BFV_SCALE = 2**10  # fixed point: its sums of up to K values must stay below t / 2
_CKKS_SCALE_BITS = 40
_RUN_ID = "0123456789abcdef"


class Plaintext:
    parameters = "float32"

    def __init__(self, length: int, hospitals: int, args: argparse.Namespace) -> None:
        self.length = length

    def update(self, rng: np.random.Generator) -> np.ndarray:
        return rng.normal(0, 0.01, self.length).astype(np.float32)

    def upload(self, update: np.ndarray, index: int) -> bytes:
        return update.astype("<f4").tobytes()

    def new_sum(self) -> np.ndarray:
        return np.zeros(self.length, dtype=np.float32)

    def add(self, total: np.ndarray, upload: bytes) -> np.ndarray:
        total += np.frombuffer(upload, dtype="<f4")
        return total

    def download(self, total: np.ndarray, contributions: int) -> np.ndarray:
        return np.frombuffer(total.tobytes(), dtype="<f4")


class _TenSeal:
    """A TenSEAL vector scheme; the server holds a public copy of the context (no secret key)."""

    def __init__(self, length: int, context) -> None:
        self.length = length
        self._secret = context
        self._public = tenseal.context_from(context.serialize(save_public_key=False, save_secret_key=False))

    def new_sum(self):
        return None

    def add(self, total, upload: bytes):
        vector = self._vector_from(self._public, upload)
        if total is None:
            return vector
        total += vector
        return total

    def download(self, total, contributions: int) -> np.ndarray:
        received = self._vector_from(self._secret, total.serialize())
        return self._decode(np.asarray(received.decrypt(), dtype=np.float64))


class TenSealBfv(_TenSeal):
    parameters = (
        f"N=4096, q=[36,36,37] (TenSEAL default), t={_TENSEAL_BFV_PLAIN_MODULUS}, fixed point x{_TENSEAL_BFV_SCALE}"
    )

    def __init__(self, length: int, hospitals: int, args: argparse.Namespace) -> None:
        super().__init__(
            length, tenseal.context(tenseal.SCHEME_TYPE.BFV, 4096, plain_modulus=_TENSEAL_BFV_PLAIN_MODULUS)
        )
        self._bound = _TENSEAL_BFV_PLAIN_MODULUS // 2 // hospitals  # no sum of K values can wrap

    def update(self, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(-self._bound, self._bound, self.length, endpoint=True) / _TENSEAL_BFV_SCALE

    def upload(self, update: np.ndarray, index: int) -> bytes:
        return tenseal.bfv_vector(
            self._secret, np.rint(update * _TENSEAL_BFV_SCALE).astype(np.int64).tolist()
        ).serialize()

    def _vector_from(self, context, data: bytes):
        return tenseal.bfv_vector_from(context, data)

    def _decode(self, values: np.ndarray) -> np.ndarray:
        return values / _TENSEAL_BFV_SCALE


class TenSealCkks(_TenSeal):
    parameters = f"N=8192, q=[60,40,40], scale 2^{_CKKS_SCALE_BITS} (NVFlare's defaults)"

    def __init__(self, length: int, hospitals: int, args: argparse.Namespace) -> None:
        context = tenseal.context(tenseal.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40])
        context.global_scale = 2**_CKKS_SCALE_BITS
        super().__init__(length, context)

    def update(self, rng: np.random.Generator) -> np.ndarray:
        return rng.normal(0, 0.01, self.length)

    def upload(self, update: np.ndarray, index: int) -> bytes:
        return tenseal.ckks_vector(self._secret, update).serialize()

    def _vector_from(self, context, data: bytes):
        return tenseal.ckks_vector_from(context, data)

    def _decode(self, values: np.ndarray) -> np.ndarray:
        return values


class Consilium:
    """The one-time-key round's cryptography, every party in this process (``protocol.secure_round``),
    at the parameters a Dopamine run with ``K`` hospitals and ``d`` parameters gets."""

    def __init__(self, length: int, hospitals: int, args: argparse.Namespace) -> None:
        if args.contributions < hospitals:
            raise ValueError(
                f"consilium sums every hospital's upload (its quorum is K): --contributions {args.contributions} "
                f"is below K = {hospitals}"
            )
        mechanism = SkellamMechanism.calibrate(
            dimension=length, max_grad_norm=args.max_grad_norm, noise_multiplier=args.noise_multiplier, quorum=hospitals
        )
        bound = mechanism.sum_bound(contributors=hospitals, expected_batch_size=args.expected_batch_size).levels
        self.params: BfvParameters = select_bfv_parameters(
            max_contributors=hospitals, vector_length=length, sum_bound=bound, key_shares=hospitals
        )
        self.length = length
        self._hospitals = hospitals
        self._public = PublicContext(self.params)
        q_bits = self.params.ciphertext_modulus.bit_length()
        self.parameters = (
            f"N={self.params.poly_modulus_degree}, q={q_bits} bits, t={self.params.plain_modulus} "
            f"({self.params.plain_modulus.bit_length()} bits), {self.params.values_per_slot} value(s) a slot, sum bound {bound:,}"
        )
        self._names = tuple(f"hospital-{index}" for index in range(hospitals))
        self._signing = {name: Ed25519PrivateKey.generate() for name in self._names}
        self._identities = {name: key.public_key() for name, key in self._signing.items()}
        self._setting = RoundSetting(
            _RUN_ID, 1, self._names, threshold=hospitals // 2 + 1, quorum=hospitals, params=self.params
        )
        self._rounds: dict[str, HospitalRound] = {}
        self._boxes: dict[str, dict[str, bytes]] = {}

    def update(self, rng: np.random.Generator) -> np.ndarray:
        share = self.params.sum_bound // self._hospitals  # no sum of K shares can leave the bound
        return rng.integers(-share, share, self.length, endpoint=True)

    def upload(self, update: np.ndarray, index: int) -> tuple[list[bytes], dict[str, bytes]]:
        name = self._names[index]
        if index == 0:  # a new round: every hospital's box key for it
            self._box = {n: X25519PrivateKey.generate() for n in self._names}
            self._box_keys = {
                n: certify_key(key.public_key(), signer=self._signing[n], context=box_key_context(_RUN_ID, n, 1))
                for n, key in self._box.items()
            }
            self._rounds, self._boxes = {}, {}
        self._rounds[name] = HospitalRound(
            self._setting, self._public, name=name, signing=self._signing[name], box=self._box[name]
        )
        slots = self.params.slots_of(update)
        chunks, self._boxes[name] = self._rounds[name].upload(slots, self._box_keys, self._identities)
        return chunks, self._boxes[name]

    def new_sum(self) -> SumRound:
        return SumRound(self._setting, self._public)

    def add(self, total: SumRound, upload: tuple[list[bytes], dict[str, bytes]]) -> SumRound:
        chunks, _ = upload
        total.add(self._names[len(total.digests)], chunks)
        return total

    def download(self, total: SumRound, contributions: int) -> np.ndarray:
        """One round's steps for every member; ``bench_crypto._measure`` times the whole and subtracts
        ``untimed``, the steps of every member but the first, so that the figure is one hospital's part."""
        members = self._names[:contributions]
        signers = self._identities
        state = dict(round_state={}, previous_result=bytes(32))
        summed = total.total(members, self._box_keys, **state)
        others = 0.0

        def each(step, name):
            nonlocal others
            start = time.perf_counter()
            result = step()
            if name != members[0]:
                others += time.perf_counter() - start
            return result

        rounds = {name: self._rounds[name] for name in members}
        endorsements = {
            name: each(
                lambda r=r, name=name: r.endorse(
                    members, total.digests, summed, {d: self._boxes[d][name] for d in members}, signers, **state
                ),
                name,
            )
            for name, r in rounds.items()
        }
        proofs = {name: each(lambda r=r: r.prove(endorsements, signers), name) for name, r in rounds.items()}
        releases = {name: each(lambda r=r: r.release(proofs, signers), name) for name, r in rounds.items()}
        slots = each(lambda: rounds[members[0]].open(releases, signers), members[0])
        self.untimed = others
        return self.params.values_of(slots)


BACKENDS = {
    "plaintext-float32": Plaintext,
    "tenseal-bfv-default": TenSealBfv,
    "tenseal-ckks-nvflare": TenSealCkks,
    "consilium": Consilium,
}
