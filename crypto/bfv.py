"""BFV secure summation on SEAL (``tenseal.sealapi``): who can do what is carried by the type.

- ``SecretContext`` (hospitals) holds the federation's shared secrets: the BFV secret key and the
  check key of ``crypto.membership``. It encrypts an update with its check slots and decrypts only
  a sum whose check slots prove it adds one fresh contribution from each listed contributor.
  Encryption is symmetric: every hospital holds the secret key anyway, and the aggregator then has
  no public key, so it cannot encrypt.
- ``PublicContext`` (aggregator) is built from the agreed parameters alone: it holds no key.
- ``CiphertextSum`` (aggregator) adds contributions; one either adds completely or changes nothing.

**Wire format.** An upload is SEAL's *seeded* symmetric ciphertext: the first polynomial ``c0``,
and for the second only the 64-byte seed of the PRNG that expands it, which halves the bytes. We
send ``c0``'s coefficients packed to ``ceil(log2 q)`` bits each, then SEAL's PRNG record
(1 byte of type, 64 of seed); an aggregate is both polynomials, packed the same way. Everything
else SEAL serialises (parameter id, sizes, the NTT flag, the scale) is fixed by the parameters,
so every party rebuilds it from them instead of reading it off the wire. A received blob must
have exactly the packed length; it is then framed as SEAL's uncompressed serialisation and loaded
with SEAL's validating loader (every coefficient below its modulus), and the loaded ciphertext
must have two polynomials, not be in NTT form, be at the data level and not be transparent.

Slots hold integers modulo ``t``, each the digits of ``k`` values (``crypto.slot_digits``): values
are never clamped, and a decrypted sum is exact wherever it lies within the agreed sum bound. A
slot is a coefficient of the plaintext polynomial: a sum only adds, and adding ciphertexts adds
their plaintexts coefficient by coefficient, so SEAL's batching (an NTT modulo ``t`` each way)
would buy nothing and cost an encode and a decode per ciphertext. A plaintext is loaded from its
coefficients through SEAL's validating loader (each below ``t``) and read back from SEAL's own
serialisation.
"""

from __future__ import annotations

import os
import struct
from typing import Iterator, Sequence

import numpy as np
import tenseal.sealapi as seal
import zstandard

from crypto.bfv_parameters import BfvParameters
from crypto.membership import CHECK_KEY_BYTES, CheckKey, MembershipError
from crypto.workers import CryptoWorkers

__all__ = ["BfvError", "CiphertextSum", "PublicContext", "SecretContext", "aggregate_bytes", "upload_bytes"]

_SEAL_MAGIC = 0xA15E
_HEADER = struct.Struct("<HBBBBHQ")  # magic, header size, version major, minor, compression, reserved, size
_COMPRESSION_NONE = 0
_PRNG_RECORD_BYTES = 1 + 64  # SEAL's UniformRandomGeneratorInfo: PRNG type, then a 512-bit seed
# Ciphertexts packed or unpacked in one numpy call: one at a time, numpy's cost per call outweighed
# its cost per coefficient (3x slower); beyond a few dozen nothing is gained, and the temporary
# arrays would grow with the message.
_BATCH = 64


class BfvError(ValueError):
    """A key, ciphertext or sum that does not fit the agreed parameters, key or contributors."""


def upload_bytes(params: BfvParameters) -> int:
    """The exact size of one uploaded (seeded) ciphertext: the packed ``c0`` and the PRNG record."""
    return _packed_bytes(params.poly_modulus_degree, params) + _PRNG_RECORD_BYTES


def aggregate_bytes(params: BfvParameters) -> int:
    """The exact size of one summed (two-polynomial) ciphertext."""
    return _packed_bytes(2 * params.poly_modulus_degree, params)


class PublicContext:
    """The aggregator's BFV context: the agreed parameters and nothing else."""

    def __init__(self, params: BfvParameters) -> None:
        encryption = seal.EncryptionParameters(seal.SCHEME_TYPE.BFV)
        encryption.set_poly_modulus_degree(params.poly_modulus_degree)
        encryption.set_coeff_modulus(
            seal.CoeffModulus.Create(params.poly_modulus_degree, list(params.coeff_mod_bit_sizes))
        )
        encryption.set_plain_modulus(params.plain_modulus)
        self.seal = seal.SEALContext(encryption, True, seal.SEC_LEVEL_TYPE.TC128)
        if not self.seal.parameters_set():
            raise BfvError(f"SEAL refuses these BFV parameters: {self.seal.parameters_error_message()}")
        data_level = self.seal.first_context_data()
        if data_level.parms().coeff_modulus()[0].value() != params.ciphertext_modulus:
            raise BfvError("SEAL chose a different ciphertext modulus than the agreed parameters")
        self.params = params
        self._bits = _coefficient_bits(params)
        self.evaluator = seal.Evaluator(self.seal)
        self._version = _seal_version()
        self._seeded_prefix = self._prefix(coefficients=params.poly_modulus_degree)
        self._full_prefix = self._prefix(coefficients=2 * params.poly_modulus_degree)
        self._full_plaintext_prefix = self._plaintext_prefix(params.poly_modulus_degree)
        self.workers: CryptoWorkers | None = None

    def use_workers(self, count: int, *, secret: bytes | None = None, run_id: str = "") -> None:
        """Spread the work on ciphertexts over ``count`` processes (``crypto.workers``), where there are several."""
        if count > 1 and self.params.chunk_count > 1 and self.workers is None:
            self.workers = CryptoWorkers(self.params.to_dict(), count, secret=secret, run_id=run_id)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def load_upload(self, chunks: Sequence[bytes], shard: range | None = None) -> list[seal.Ciphertext]:
        """An upload's ciphertexts, or those of ``shard`` (their indices in the upload), validated."""
        degree = self.params.poly_modulus_degree
        return self._load(chunks, self._seeded_prefix, degree, seeded=True, what="upload", shard=shard)

    def load_aggregate(self, chunks: Sequence[bytes], shard: range | None = None) -> list[seal.Ciphertext]:
        degree = 2 * self.params.poly_modulus_degree
        return self._load(chunks, self._full_prefix, degree, seeded=False, what="aggregate", shard=shard)

    def pack_uploads(self, serialized: Sequence[bytes]) -> list[bytes]:
        """Our wire form of SEAL's own seeded serialisations (``Serializable.save``)."""
        start = len(self._seeded_prefix)
        end = start + 8 * self.params.poly_modulus_degree
        polynomials, seeds = [], []
        for one in serialized:
            body = self._body(one, self._seeded_prefix)
            suffix = body[end:]
            if len(suffix) != _HEADER.size + _PRNG_RECORD_BYTES:
                raise BfvError("SEAL's seeded ciphertext layout is not the one this module packs")
            polynomials.append(body[start:end])
            seeds.append(suffix[_HEADER.size :])
        return [packed + seed for packed, seed in zip(self._pack_each(polynomials), seeds)]

    def pack_aggregate(self, ciphertexts: Sequence[seal.Ciphertext]) -> list[bytes]:
        with _MemoryFile() as file:
            serialized = [file.save(ciphertext) for ciphertext in ciphertexts]
        polynomials = []
        for one in serialized:
            coefficients = self._body(one, self._full_prefix)[len(self._full_prefix) :]
            if len(coefficients) != 16 * self.params.poly_modulus_degree:
                raise BfvError("SEAL's ciphertext layout is not the one this module packs")
            polynomials.append(coefficients)
        return self._pack_each(polynomials)

    def _pack_each(self, polynomials: list[bytes]) -> list[bytes]:
        packed = []
        for start in range(0, len(polynomials), _BATCH):
            batch = polynomials[start : start + _BATCH]
            size = len(batch[0]) // 64 * self._bits  # 8 bytes a coefficient, eight of them to `bits` bytes
            joined = pack_words(b"".join(batch), self._bits)
            packed += [joined[i : i + size] for i in range(0, len(joined), size)]
        return packed

    def _each_unpacked(self, chunks: Sequence[bytes], packed_bytes: int, coefficients: int) -> Iterator[bytes]:
        """Each chunk's first ``packed_bytes`` unpacked to SEAL's 64-bit coefficients."""
        for start in range(0, len(chunks), _BATCH):
            batch = chunks[start : start + _BATCH]
            words = unpack_words(
                b"".join(chunk[:packed_bytes] for chunk in batch), coefficients * len(batch), self._bits
            )
            yield from (words[i : i + 8 * coefficients] for i in range(0, len(words), 8 * coefficients))

    def _load(
        self,
        chunks: Sequence[bytes],
        prefix: bytes,
        coefficients: int,
        *,
        seeded: bool,
        what: str,
        shard: range | None,
    ) -> list[seal.Ciphertext]:
        shard = shard or range(self.params.chunk_count)
        if len(chunks) != len(shard):
            raise BfvError(f"an {what} has {len(shard)} ciphertexts, got {len(chunks)}")
        packed_bytes = _packed_bytes(coefficients, self.params)
        size = packed_bytes + (_PRNG_RECORD_BYTES if seeded else 0)
        for index, chunk in zip(shard, chunks):
            if type(chunk) is not bytes or len(chunk) != size:
                got = f"{len(chunk)}" if type(chunk) is bytes else type(chunk).__name__
                raise BfvError(f"{what} ciphertext {index} must be {size} bytes, got {got}")
        ciphertexts = []
        unpacked = self._each_unpacked(chunks, packed_bytes, coefficients)
        with _MemoryFile() as file:
            for index, chunk, polynomial in zip(shard, chunks, unpacked, strict=True):
                body = prefix + polynomial
                if seeded:
                    body += self._header(_HEADER.size + _PRNG_RECORD_BYTES) + chunk[packed_bytes:]
                ciphertext = seal.Ciphertext()
                try:
                    file.load(ciphertext, self.seal, self._header(_HEADER.size + len(body)) + body)
                except Exception as error:  # SEAL raises ValueError, RuntimeError or its logic_error on invalid data
                    raise BfvError(f"{what} ciphertext {index} is not valid for these parameters: {error}") from None
                if (
                    ciphertext.size() != 2
                    or ciphertext.is_ntt_form()
                    or ciphertext.parms_id() != self.seal.first_parms_id()
                    or ciphertext.is_transparent()
                ):
                    raise BfvError(f"{what} ciphertext {index} is not a fresh-form two-polynomial ciphertext")
                ciphertexts.append(ciphertext)
        return ciphertexts

    def _body(self, serialized: bytes, prefix: bytes) -> bytes:
        magic, header_size, _, _, compression, _, size = _HEADER.unpack_from(serialized)
        payload = serialized[header_size:size]
        if compression != _COMPRESSION_NONE:
            payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=64 * 1024 * 1024)
        if magic != _SEAL_MAGIC or not payload.startswith(prefix):
            raise BfvError("SEAL's serialisation is not the layout this module reads")
        return payload

    def _prefix(self, *, coefficients: int, ntt: bool = False) -> bytes:
        """What SEAL writes before a ciphertext's coefficients: fixed by the parameters."""
        degree = self.params.poly_modulus_degree
        array_bytes = _HEADER.size + 8 + 8 * coefficients
        return (
            struct.pack("<4Q", *self.seal.first_parms_id())
            + struct.pack("<?QQQdQ", ntt, 2, degree, 1, 1.0, 1)  # NTT form, size, N, moduli, scale, correction
            + self._header(array_bytes)
            + struct.pack("<Q", coefficients)
        )

    def _plaintext_prefix(self, coefficients: int, *, ntt: bool = False) -> bytes:
        """What SEAL writes before a plaintext's coefficients: its parameter id (zero unless in NTT
        form, then the data level's), the coefficient count, the scale, then the coefficient array's
        header and length."""
        return (
            (struct.pack("<4Q", *self.seal.first_parms_id()) if ntt else bytes(32))
            + struct.pack("<Qd", coefficients, 1.0)
            + self._header(_HEADER.size + 8 + 8 * coefficients)
            + struct.pack("<Q", coefficients)
        )

    def load_plaintext(self, file: "_MemoryFile", coefficients: np.ndarray) -> seal.Plaintext:
        """The plaintext of ``N`` coefficients in ``[0, t)`` (SEAL's loader refuses any other)."""
        body = self._full_plaintext_prefix + np.ascontiguousarray(coefficients, dtype="<u8").tobytes()
        plaintext = seal.Plaintext()
        try:
            file.load(plaintext, self.seal, self._header(_HEADER.size + len(body)) + body)
        except Exception as error:  # SEAL's loader: a coefficient at or above t
            raise BfvError(f"not a plaintext for these parameters: {error}") from None
        return plaintext

    def plaintext_coefficients(self, file: "_MemoryFile", plaintext: seal.Plaintext) -> np.ndarray:
        """A plaintext's ``N`` coefficients (int64, below ``t < 2^60``), read from SEAL's serialisation
        of it, which leaves out the highest coefficients where they are zero."""
        count = plaintext.coeff_count()
        degree = self.params.poly_modulus_degree
        prefix = self._plaintext_prefix(count)
        body = self._body(file.save(plaintext), prefix)
        if count > degree or len(body) != len(prefix) + 8 * count:
            raise BfvError("SEAL's plaintext layout is not the one this module reads")
        coefficients = np.zeros(degree, dtype=np.int64)
        coefficients[:count] = np.frombuffer(body, dtype="<u8", offset=len(prefix))
        return coefficients

    def load_ring_elements(self, file: "_MemoryFile", polynomials: np.ndarray, *, ntt: bool) -> seal.Ciphertext:
        """Two polynomials of ``R_q`` (``N`` coefficients each, below ``q``) as one ciphertext, in NTT
        form or not: the form in which SEAL multiplies and transforms them (``crypto.one_time_keys``)."""
        body = self._prefix(coefficients=2 * self.params.poly_modulus_degree, ntt=ntt)
        body += np.ascontiguousarray(polynomials, dtype="<u8").tobytes()
        ciphertext = seal.Ciphertext()
        try:
            file.load(ciphertext, self.seal, self._header(_HEADER.size + len(body)) + body)
        except Exception as error:  # SEAL's loader: a coefficient at or above q
            raise BfvError(f"not two polynomials of R_q for these parameters: {error}") from None
        return ciphertext

    def ring_elements(self, file: "_MemoryFile", ciphertext: seal.Ciphertext) -> np.ndarray:
        """A ciphertext's two polynomials, ``(2, N)`` uint64 below ``q``, read from SEAL's serialisation."""
        prefix = self._prefix(coefficients=2 * self.params.poly_modulus_degree, ntt=ciphertext.is_ntt_form())
        body = self._body(file.save(ciphertext), prefix)
        if len(body) != len(prefix) + 16 * self.params.poly_modulus_degree:
            raise BfvError("SEAL's ciphertext layout is not the one this module reads")
        return np.frombuffer(body, dtype="<u8", offset=len(prefix)).reshape(2, -1)

    def load_ntt_plaintext(self, file: "_MemoryFile", coefficients: np.ndarray) -> seal.Plaintext:
        """A polynomial of ``R_q`` in NTT form (``N`` values below ``q``), as SEAL multiplies by it."""
        degree = self.params.poly_modulus_degree
        body = self._plaintext_prefix(degree, ntt=True) + np.ascontiguousarray(coefficients, dtype="<u8").tobytes()
        plaintext = seal.Plaintext()
        try:
            file.load(plaintext, self.seal, self._header(_HEADER.size + len(body)) + body)
        except Exception as error:  # SEAL's loader: a value at or above q
            raise BfvError(f"not a polynomial of R_q in NTT form for these parameters: {error}") from None
        return plaintext

    def _header(self, size: int) -> bytes:
        return _HEADER.pack(_SEAL_MAGIC, _HEADER.size, *self._version, _COMPRESSION_NONE, 0, size)


class SecretContext:
    """A hospital's view of the run's shared secrets: the BFV secret key and the check key."""

    def __init__(self, public: PublicContext, secret_key: seal.SecretKey, check_key: CheckKey) -> None:
        self._public = public
        self._secret_key = secret_key
        self._check = check_key
        self._encryptor = seal.Encryptor(public.seal, secret_key)
        self._decryptor = seal.Decryptor(public.seal, secret_key)
        self.params = public.params
        self._data_slots = self.params.digits.slots_for(self.params.vector_length)  # the check slots follow

    @classmethod
    def generate(cls, params: BfvParameters, *, run_id: str) -> "SecretContext":
        public = PublicContext(params)
        secret_key = seal.KeyGenerator(public.seal).secret_key()
        return cls(public, secret_key, CheckKey.generate(run_id=run_id, plain_modulus=params.plain_modulus))

    @classmethod
    def from_bytes(cls, data: bytes, params: BfvParameters, *, run_id: str) -> "SecretContext":
        public = PublicContext(params)
        secret_key = seal.SecretKey()
        try:
            with _MemoryFile() as file:
                file.load(secret_key, public.seal, data[CHECK_KEY_BYTES:])
        except Exception as error:  # SEAL's loader rejects foreign or corrupt keys
            raise BfvError(f"not a BFV secret key for these parameters: {error}") from None
        try:
            check_key = CheckKey(data[:CHECK_KEY_BYTES], run_id=run_id, plain_modulus=params.plain_modulus)
        except MembershipError as error:
            raise BfvError(str(error)) from None
        return cls(public, secret_key, check_key)

    def to_bytes(self) -> bytes:
        """The run's secrets. They only ever leave a hospital sealed to another hospital."""
        return self._check.to_bytes() + _save(self._secret_key)

    def encrypt_update(
        self, values: np.ndarray, *, round_number: int, hospital: str, seeded: bool = True
    ) -> list[bytes]:
        """The upload of an integer vector, as slots (``crypto.slot_digits``) and their check slots.

        ``seeded=False`` sends both polynomials, in the aggregate's form: twice the bytes. The protocol
        always seeds; the crypto benchmark uses the other form to show what seeding saves.
        """
        values = np.asarray(values)
        if values.shape != (self.params.vector_length,) or not np.issubdtype(values.dtype, np.integer):
            raise BfvError(
                f"expected a vector of {self.params.vector_length} integers, got {values.dtype} of shape {values.shape}"
            )
        workers = self._public.workers
        if seeded and workers is not None:
            return workers.encrypt(
                values,
                round_number=round_number,
                check_slots=lambda products: self._check.check_slots(
                    products, round_number=round_number, hospital=hospital
                ),
            )
        everything = range(self.params.chunk_count)
        slots, products = self.shard_slots(values, everything, round_number=round_number)
        checks = self._check.check_slots(products, round_number=round_number, hospital=hospital)
        return self.encrypt_slots(self.with_checks(slots, everything, checks), seeded=seeded)

    def shard_slots(self, values: np.ndarray, shard: range, *, round_number: int) -> tuple[np.ndarray, list[int]]:
        """The slots of ``shard``'s ciphertexts, holding its piece of an update's ``values`` (the values
        of those slots only) with the check slots left zero, and that piece's part of the check products."""
        data = self.params.digits.to_slots(values)
        slots = np.zeros(len(shard) * self.params.poly_modulus_degree, dtype=np.int64)
        slots[: data.size] = data
        return slots, self.data_products(slots, shard, round_number=round_number)

    def with_checks(self, slots: np.ndarray, shard: range, checks: Sequence[int]) -> np.ndarray:
        """``shard``'s slots with the check slots that fall among them: they follow the data slots."""
        first = self._data_slots - shard.start * self.params.poly_modulus_degree
        for position, check in enumerate(checks, start=first):
            if 0 <= position < slots.size:
                slots[position] = check
        return slots

    def data_products(self, slots: np.ndarray, shard: range, *, round_number: int) -> list[int]:
        """The check products (``crypto.membership``) of the data slots among ``shard``'s ``slots``."""
        first = shard.start * self.params.poly_modulus_degree
        data = slots[: max(0, min(slots.size, self._data_slots - first))]
        return self._check.products(data, round_number=round_number, first=first)

    def use_workers(self, count: int) -> None:
        """Encrypt and decrypt in ``count`` processes (``crypto.workers``), each given this run's secrets."""
        self._public.use_workers(count, secret=self.to_bytes(), run_id=self._check.run_id)

    def close(self) -> None:
        self._public.close()

    def encrypt_slots(self, slots: np.ndarray, *, seeded: bool = True) -> list[bytes]:
        """The ciphertexts of whole ciphertexts' worth of slots, packed for the wire."""
        encrypted = []
        with _MemoryFile() as file:
            for start in range(0, slots.size, self.params.poly_modulus_degree):
                plaintext = self._public.load_plaintext(file, slots[start : start + self.params.poly_modulus_degree])
                if seeded:
                    encrypted.append(file.save(self._encryptor.encrypt_symmetric(plaintext)))
                else:
                    ciphertext = seal.Ciphertext()
                    self._encryptor.encrypt_symmetric(plaintext, ciphertext)
                    encrypted.append(ciphertext)
        return self._public.pack_uploads(encrypted) if seeded else self._public.pack_aggregate(encrypted)

    def decrypt_sum(self, chunks: Sequence[bytes], *, round_number: int, contributors: Sequence[str]) -> np.ndarray:
        """The sum (int64, exact within the sum bound) of ``contributors``' updates for this round.

        ``BfvError`` unless the aggregate is exactly one fresh contribution from each of them.
        """
        workers = self._public.workers
        if workers is not None:
            slots, products = workers.decrypt(list(chunks), round_number=round_number)
        else:
            slots = self.decrypt_slots(chunks)
            products = self.data_products(slots, range(self.params.chunk_count), round_number=round_number)
        checks = slots[self._data_slots : self.params.slot_count]
        try:
            self._check.verify(checks, products=products, round_number=round_number, contributors=contributors)
        except MembershipError as error:
            raise BfvError(str(error)) from None
        return self.params.digits.from_slots(slots[: self._data_slots], self.params.vector_length)

    def decrypt_slots(self, chunks: Sequence[bytes], shard: range | None = None) -> np.ndarray:
        """The slots (int64, in [0, t)) of an aggregate's ciphertexts, or of its ``shard``, unchecked."""
        slots = []
        with _MemoryFile() as file:
            for ciphertext in self._public.load_aggregate(chunks, shard):
                plaintext = seal.Plaintext()
                self._decryptor.decrypt(ciphertext, plaintext)
                slots.append(self._public.plaintext_coefficients(file, plaintext))
        return np.concatenate(slots)


class CiphertextSum:
    """Adds uploads. A contribution that fails validation, or whose addition fails, changes nothing.

    ``seeded=False`` adds uploads sent with both polynomials (``SecretContext.encrypt_update``). Where
    the context has workers (``PublicContext.use_workers``), they hold the sum, each its shard; a
    worker's own sum covers its ``shard`` of the ciphertexts.
    """

    def __init__(self, context: PublicContext, *, seeded: bool = True, shard: range | None = None) -> None:
        self._context = context
        self._load = context.load_upload if seeded else context.load_aggregate
        self._shard = shard
        self._workers = context.workers if seeded and shard is None else None
        if self._workers is not None:
            self._workers.reset_sum()
        self._totals: list[seal.Ciphertext] | None = None
        self.contributions = 0

    def add(self, chunks: Sequence[bytes]) -> None:
        if self.contributions >= self._context.params.max_contributors:
            raise BfvError(
                f"this sum already holds {self.contributions} contributions, the most these parameters allow"
            )
        if self._workers is not None:
            self._workers.add(list(chunks))
        else:
            self.keep(self.staged(chunks))
        self.contributions += 1

    def staged(self, chunks: Sequence[bytes]) -> list[seal.Ciphertext]:
        """The totals with ``chunks`` added, not yet kept (``BfvError`` where they cannot be)."""
        incoming = self._load(chunks, self._shard)
        if self._totals is not None:
            added = []
            for total, ciphertext in zip(self._totals, incoming):
                result = seal.Ciphertext()
                try:
                    self._context.evaluator.add(total, ciphertext, result)
                except Exception as error:  # e.g. SEAL refusing a transparent result
                    raise BfvError(f"cannot add this contribution: {error}") from None
                added.append(result)
            incoming = added
        return incoming

    def keep(self, totals: list[seal.Ciphertext]) -> None:
        self._totals = totals

    def to_chunks(self) -> list[bytes]:
        if self._workers is not None and self.contributions:
            return self._workers.sum_chunks()
        if self._totals is None:
            raise BfvError("the sum is empty")
        return self._context.pack_aggregate(self._totals)


def _coefficient_bits(params: BfvParameters) -> int:
    return params.ciphertext_modulus.bit_length()


def _packed_bytes(coefficients: int, params: BfvParameters) -> int:
    return -(-coefficients * _coefficient_bits(params) // 8)


def pack_words(coefficients: bytes, bits: int) -> bytes:
    """Little-endian 64-bit words below ``2^bits`` to ``bits`` bits each, back to back (``N`` is a multiple of 8: no padding).

    Eight coefficients fill exactly ``bits`` bytes, so each group of eight is shifted into eight
    64-bit words (at most 480 bits) and their low ``bits`` bytes are kept.
    """
    columns = np.frombuffer(coefficients, dtype="<u8").reshape(-1, 8).T  # column j: coefficient j of each group
    words = np.zeros((8, columns.shape[1]), dtype="<u8")
    for j in range(8):
        word, shift = divmod(j * bits, 64)
        words[word] |= columns[j] << np.uint64(shift)
        if shift + bits > 64:
            words[word + 1] |= columns[j] >> np.uint64(64 - shift)
    return np.ascontiguousarray(words.T).view(np.uint8)[:, :bits].tobytes()


def unpack_words(packed: bytes, coefficients: int, bits: int) -> bytes:
    groups = coefficients // 8
    padded = np.zeros((groups, 64), dtype=np.uint8)
    padded[:, :bits] = np.frombuffer(packed, dtype=np.uint8).reshape(groups, bits)
    words = np.ascontiguousarray(padded.view("<u8").T)
    columns = np.empty((8, groups), dtype="<u8")
    for j in range(8):
        word, shift = divmod(j * bits, 64)
        column = words[word] >> np.uint64(shift)
        if shift + bits > 64:
            column |= words[word + 1] << np.uint64(64 - shift)
        columns[j] = column & np.uint64(2**bits - 1)
    return np.ascontiguousarray(columns.T).tobytes()


def _seal_version() -> tuple[int, int]:
    _, _, major, minor, *_ = _HEADER.unpack_from(_save(seal.Plaintext()))
    return major, minor


class _MemoryFile:
    """An in-memory file through which SEAL saves and loads by path: a secret key never touches a disk.

    One file serves a whole batch of ciphertexts: a file per ciphertext took a fifth of the
    server's time to add an upload at d = 1e5.
    """

    def __enter__(self) -> "_MemoryFile":
        self._descriptor = os.memfd_create("consilium-seal", os.MFD_CLOEXEC)
        self._path = f"/proc/self/fd/{self._descriptor}"
        return self

    def __exit__(self, *_) -> None:
        os.close(self._descriptor)

    def save(self, obj) -> bytes:
        obj.save(self._path)  # SEAL opens the path anew and truncates it
        return os.pread(self._descriptor, os.fstat(self._descriptor).st_size, 0)

    def load(self, obj, context: seal.SEALContext, data: bytes) -> None:
        os.ftruncate(self._descriptor, 0)
        if os.pwrite(self._descriptor, data, 0) != len(data):
            raise OSError("an in-memory file took only part of a write")
        obj.load(context, self._path)


def _save(obj) -> bytes:
    """SEAL's serialisation of one object (a secret key, too: the file is in memory)."""
    with _MemoryFile() as file:
        return file.save(obj)
