"""What a peer's MPC messages may hold, and how a value opened from them is checked.

MPyC sends secure arrays as pickles (``_distribute``, ``output``, ``_reshare``), and ``transfer``,
which ``shutdown`` calls, unpickles whatever a peer sent: a crafted pickle runs code here. This
module replaces those decoders, and MPyC's own opening (points 2 and 4 of ``tallier.mpc_network``):

- **Only data is decoded.** Where MPyC would pickle (secure arrays' shares in ``_distribute``,
  ``output`` and ``_reshare``; the party numbers ``shutdown`` exchanges through ``transfer``), it
  gets ``_Codec`` instead: a one-dimensional array of field elements as fixed-width little-endian
  numbers, each checked to lie below the round's modulus, or one integer. Nothing else is parsed,
  and nothing a peer sends is ever unpickled. Single field elements travel as MPyC's fixed-width
  bytes, checked the same way (``_field_elements``).
- **Values are opened from every share, checked** (``open_checked``, instead of
  ``Runtime.output``, which rebuilds a value from ``t + 1`` shares and so takes a wrong share from
  a peer as the truth): every tallier sends its share to every other, and each checks that all
  ``J`` shares lie on one polynomial of degree ``t`` before it takes the value. With ``J = 3`` and
  ``t = 1``, a peer's wrong share puts the three points off one line, and the round ends.

- **Messages are bounded** (``message_limit``): about twice the largest an honest tallier sends in
  a round of the run's size.

``harden_mpyc`` also replaces MPyC's Shamir sharing (``thresha.np_random_split``, under every input
and resharing) by one that draws its random coefficients from the OS all at once
(``crypto.secret_sharing.random_array``) instead of one ``secrets.randbelow`` call each, and computes
the shares in ``uint64`` instead of Python integers: the same source and distribution, in a fraction of
the time, which was half of a tallier's CPU; and its pseudorandom sharing (PRSS,
``thresha.np_pseudorandom_share``) by one that draws each key's values from its SHAKE-128 stream in
NumPy, by rejection below the bound (every party computes the same stream, so the shares agree).

A peer whose message fails either check raises ``MpcPeerError``, naming the peer where the
network tagged the message with its sender. ``harden_mpyc`` installs the decoders in this process,
for the round's field; ``tests/integration/test_mpc_network.py`` fails if an MPyC upgrade moves the
places that unpickle.
"""

from __future__ import annotations

import hashlib

import numpy as np

from consilium.crypto.mpc_field import MpcField, import_mpyc
from consilium.crypto.secret_sharing import random_array, uniform_below
from consilium.protocol.voting.ballots import BallotLayout

_mpyc_runtime = import_mpyc()
from mpyc import asyncoro, finfields, thresha  # noqa: E402  (imported safely on the line above)

_mpyc_random_split, _mpyc_pseudorandom_share = thresha.np_random_split, thresha.np_pseudorandom_share

__all__ = ["MpcPeerError", "harden_mpyc", "message_limit", "open_checked"]

_ARRAY, _INTEGER = b"A", b"I"
_MESSAGE_SLACK_BYTES = 1 << 16


class MpcPeerError(RuntimeError):
    """A peer sent what an honest tallier never sends; the round is aborted."""


def harden_mpyc(modulus: int) -> None:
    """Make every decoder MPyC applies to a peer's bytes refuse what is not data (module docstring),
    for a round computing modulo ``modulus``."""
    _mpyc_runtime.pickle = _Codec(modulus)
    finfields.FiniteFieldElement.from_bytes = classmethod(_field_elements)
    thresha.np_random_split = _random_split
    thresha.np_pseudorandom_share = _pseudorandom_share


def _random_split(field, secrets, t: int, m: int):
    """``thresha.np_random_split``: the ``m`` parties' Shamir shares (a row each) of the 1-D ``secrets`` on random
    polynomials of degree ``t``, their coefficients drawn in one call and the shares computed in ``uint64``, for a
    prime field small enough that no step overflows; MPyC's own split for any other field."""
    p = field.modulus
    if not isinstance(p, int) or 2 * p * m >= 2**64:
        return _mpyc_random_split(field, secrets, t, m)
    if isinstance(secrets, field.array):
        secrets = secrets.value
    values = np.asarray(secrets, dtype=object).astype(np.uint64)
    coefficients = random_array(t * len(values), p).reshape(t, len(values))
    shares = np.empty((m, len(values)), dtype=np.uint64)
    for party in range(1, m + 1):  # Horner's rule: every sum below 2p, every product below 2pm
        y = np.zeros(len(values), dtype=np.uint64)
        for coefficient in coefficients:
            y = (y + coefficient) % np.uint64(p) * np.uint64(party) % np.uint64(p)
        shares[party - 1] = (y + values) % np.uint64(p)
    return shares.astype(object)


def _pseudorandom_share(field, m: int, i: int, prfs: dict, uci: bytes, n: int):
    """``thresha.np_pseudorandom_share``: party ``i``'s Shamir shares of ``n`` pseudorandom values (PRSS), each key's
    values drawn in NumPy by rejection from its SHAKE-128 stream (``uniform_below``) instead of one Python integer at a
    time, for a prime field and bounds below 2^64; MPyC's own for any other."""
    if not isinstance(field.modulus, int) or any(prf.max >= 2**64 for prf in prfs.values()):
        return _mpyc_pseudorandom_share(field, m, i, prfs, uci, n)
    total = np.zeros(n, dtype=object)
    for subset, prf in prfs.items():
        values = uniform_below(prf.max, n, lambda size, seed=prf.key + uci: hashlib.shake_128(seed).digest(size))
        total = total + values.astype(object) * thresha._f_S_i(field, m, i, subset)
    return field.array(total)


@asyncoro.mpc_coro
async def open_checked(runtime, x):  # no return annotation: MPyC would take it for the placeholder type
    """The value of the 1-D secure array ``x``, opened to every party from every party's share (module
    docstring), as signed integers in ``[-p/2, p/2)``; ``MpcPeerError`` unless the shares lie on one
    polynomial of degree ``t``."""
    await runtime.returnType(asyncoro.Future)
    field = x.sectype.field
    (own,) = await runtime.gather([x])
    own = own.value.reshape(-1)
    codec = _mpyc_runtime.pickle
    others = [pid for pid in range(len(runtime.parties)) if pid != runtime.pid]
    payload = codec.dumps(own)
    for pid in others:
        runtime._send_message(pid, payload)
    received = await runtime.gather([runtime._receive_message(pid) for pid in others])
    for data in received:  # refused before it is decoded (about 9x its size); an integer can be as long
        if len(data) != len(payload) or data[:1] != _ARRAY:
            raise MpcPeerError(f"{_sender(data)} sent a share of an opened value of the wrong length or kind")
    points = sorted([(runtime.pid + 1, own)] + [(pid + 1, codec.loads(data)) for pid, data in zip(others, received)])
    base, rest = points[: runtime.threshold + 1], points[runtime.threshold + 1 :]
    rebuilt = thresha.np_recombine(field, base, x_rs=[0] + [at for at, _ in rest]).value
    for row, (_, share) in zip(rebuilt[1:], rest):
        if any(int(a) != int(b) for a, b in zip(row, share)):
            raise MpcPeerError(
                "the talliers' shares of an opened value do not lie on one polynomial: a tallier sent a wrong share"
            )
    half = field.modulus // 2
    return [int(v) - field.modulus if int(v) > half else int(v) for v in rebuilt[0]]


def message_limit(layout: BallotLayout, hospitals: int, field: MpcField, element_bytes: int) -> int:
    """The most bytes a peer may send in one MPC message of this round, about twice an honest one's.

    The largest honest messages are a tallier's inputs (every voter's bits and key) and the
    resharing of the argmax's first comparisons' random bits (``tallier.authenticated``): ``u^2``
    and ``alpha u`` for ``l - 1`` bits of each of ``Q floor(C / 2)`` comparisons, at most ``l - 1``
    field elements per query and class."""
    inputs = hospitals * layout.committed_values
    comparisons = layout.queries * layout.classes * 2 * field.bit_length
    return max(2 * inputs, comparisons, hospitals + 1) * element_bytes + _MESSAGE_SLACK_BYTES


class _Codec:
    """What MPyC's ``pickle.dumps`` and ``pickle.loads`` become: shares as fixed-width numbers, or one integer.

    ``A`` then ``n`` numbers of ``width`` bytes (the modulus's), little-endian, each below the
    modulus: a one-dimensional array of field elements, as NumPy object arrays hold them. ``I``
    then eight bytes, signed: an integer (a party number). Anything else is refused unread."""

    def __init__(self, modulus: int) -> None:
        if not 1 < modulus < 2**64:
            raise ValueError(f"shares travel as at most 64-bit numbers; the modulus has {modulus.bit_length()} bits")
        self.modulus, self.width = modulus, (modulus.bit_length() + 7) // 8

    def dumps(self, value) -> bytes:
        if isinstance(value, np.ndarray) and value.ndim == 1:
            words = value.astype(np.uint64).astype("<u8").view(np.uint8).reshape(-1, 8)[:, : self.width]
            return _ARRAY + words.tobytes()
        if type(value) is int:
            return _INTEGER + value.to_bytes(8, "little", signed=True)
        raise TypeError(f"the MPC sends arrays of field elements and integers only, not {type(value).__name__}")

    def loads(self, data: bytes):
        kind, body = data[:1], data[1:]
        if kind == _INTEGER and len(body) == 8:
            return int.from_bytes(body, "little", signed=True)
        if kind != _ARRAY or len(body) % self.width:
            raise MpcPeerError(
                f"{_sender(data)} sent an MPC message that is neither whole field elements nor an integer"
            )
        words = np.zeros((len(body) // self.width, 8), dtype=np.uint8)
        words[:, : self.width] = np.frombuffer(body, dtype=np.uint8).reshape(-1, self.width)
        values = words.view("<u8").reshape(-1)
        if values.size and int(values.max()) >= self.modulus:
            raise MpcPeerError(f"{_sender(data)} sent a value outside the field")
        return values.astype(object)


def _field_elements(cls, data: bytes) -> list[int]:
    """``FiniteFieldElement.from_bytes``, refusing anything but whole elements of the field."""
    width = cls.byte_length
    if len(data) % width:
        raise MpcPeerError(f"{_sender(data)} sent {len(data)} bytes, not a whole number of {width}-byte field elements")
    values = [int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)]
    if values and max(values) >= cls.order:
        raise MpcPeerError(f"{_sender(data)} sent a value outside the field")
    return values


def _sender(data: bytes) -> str:
    return getattr(data, "sender", "a peer")
