"""BFV on SEAL (``tenseal.sealapi``): the parameters' context, and the exact moves between SEAL's objects
and numpy's arrays that the one-time keys are built from (``crypto.one_time_keys``).

``PublicContext`` is built from the agreed parameters alone: it holds no key, and every party has
one. Slots hold integers modulo ``t``, each the digits of ``k`` values (``crypto.slot_digits``). A
slot is a coefficient of the plaintext polynomial: a sum only adds, and adding ciphertexts adds
their plaintexts coefficient by coefficient, so SEAL's batching (an NTT modulo ``t`` each way) would
buy nothing. A plaintext is loaded from its coefficients through SEAL's validating loader (each
below ``t``) and read back from SEAL's own serialisation; a pair of polynomials of ``R_q`` is loaded
as a ciphertext, in NTT form or not (each coefficient below ``q``), and read back the same way.
Everything SEAL serialises besides the coefficients (parameter id, sizes, the NTT flag, the scale)
is fixed by the parameters, so every party rebuilds it from them instead of reading it off the wire.
Polynomials travel packed to ``ceil(log2 q)`` bits a coefficient (``pack_words``).
"""

from __future__ import annotations

import os
import struct
import numpy as np
import tenseal.sealapi as seal
import zstandard

from consilium.errors import ConsiliumError
from consilium.crypto.bfv_parameters import BfvParameters

__all__ = ["BfvError", "PublicContext", "pack_words", "unpack_words"]

_SEAL_MAGIC = 0xA15E
_HEADER = struct.Struct("<HBBBBHQ")  # magic, header size, version major, minor, compression, reserved, size
_COMPRESSION_NONE = 0


class BfvError(ConsiliumError, ValueError):
    """A polynomial, plaintext or ciphertext that does not fit the agreed parameters."""


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
        self.evaluator = seal.Evaluator(self.seal)
        self._version = _seal_version()
        self._full_plaintext_prefix = self._plaintext_prefix(params.poly_modulus_degree)

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
    """An in-memory file through which SEAL saves and loads by path: a key never touches a disk.

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
