"""Shares of a bounded integer vector that the talliers can check, as bits under an information-theoretic tag.

Additive shares (``crypto.secret_sharing``) of a vote vector hide it, but nothing in them says it
is a vote: a hospital may share any field element, and a tallier may shift its own share. A
checked share carries, for a vector ``v`` of ``n`` entries that should lie in ``[low, high]``:

- **bits** ``b[i, k]`` with ``v[i] = low + sum_k w[k] b[i, k]`` (``n m`` values). The weights are
  ``1, 2, ..., 2^(m-2)`` and a last one, ``B - (2^(m-1) - 1)`` for ``B = high - low``: whatever
  the bits, the entry lies in ``[low, high]`` exactly, and every entry there has bits (the usual
  range-proof decomposition for a range that is not a power of two);
- **a key** ``c`` of ``m`` uniform field elements, the sender's secret;
- **tags** ``t[i] = sum_k c[k] b[i, k]`` (``n`` values),

each additively shared among the ``J`` talliers modulo ``p``. Inside the MPC (``tallier.mpc``) the
talliers, once every share of bits and keys is input, draw public coefficients from a jointly
random seed (``challenge``) and compute two numbers per sender:

- the **tag check** ``y = sum_i r[i] t[i] - sum_k c[k] (sum_i r[i] b[i,k])``, zero when nobody
  changed anything. A tallier that adds ``d != 0`` to its share of the bits before the challenge
  changes ``y`` by ``-sum_k c[k] (sum_i r[i] d[i,k])`` (plus terms it controls): a nonzero multiple
  of the key it does not know, but with probability ``1/p`` over ``r``, so it would have to guess
  ``c``. ``y = 0`` then with probability at most ``2/p``. Changing its share of the tags alone
  makes ``y`` nonzero; changing its share of ``c[k]`` alone does too, unless no entry has bit
  ``k`` set, when it changes nothing at all. The tallier's part of ``sum_i r[i] t[i]`` is one
  number, computed locally (``tag_combination``) and input after the challenge, on purpose: it
  cannot help, since ``c`` stays unknown. One multiplication of secret values.
- the **bit check** ``z = sum_{i,k} s[i,k] b[i,k] (b[i,k] - 1)``, zero for bits. If some
  ``b[i,k]`` is not 0 or 1, ``z`` is a nonzero linear form in the uniform ``s``, zero with
  probability ``1/p``. One inner product of secret vectors: one resharing.

The talliers never open ``y`` or ``z`` themselves: a tallier that shifted its share on purpose
could read a hospital's bits out of them. They open each times a fresh secret random factor
(zero if and only if the check is, but with probability ``1/p``), the tag checks first and the bit
checks only if every tag check passed.

The entry rebuilt from the bits lies in ``[low, high]`` whatever the sender did, so a total of
``H`` counted vectors lies in ``[H low, H high]``: a range fixed before anything is shared, which
the MPC's comparisons are sized for. Any ``J - 1`` shares of the three parts are uniform and
independent of ``v`` and ``c``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from consilium.crypto.secret_sharing import ShareError, random_elements, share_elements

__all__ = ["CheckedLayout", "challenge", "share_checked", "tag_combination"]

_EXTRA_BITS = 64  # a coefficient is reduced from 64 bits more than p: within 2^-64 of uniform


@dataclass(frozen=True)
class CheckedLayout:
    """Where each part lies in a checked share of ``entries`` values in ``[low, high]``."""

    entries: int  # n
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.entries < 1 or not 0 <= self.high - self.low < 2**62:
            raise ValueError(f"a checked share needs at least one entry and a range of under 2^62, got {self}")

    @property
    def bits(self) -> int:
        """``m``: bits per entry."""
        return max(1, (self.high - self.low).bit_length())

    @property
    def weights(self) -> list[int]:
        """What each bit adds to an entry: powers of two, and a last weight that ends the range at ``high``."""
        powers = [2**k for k in range(self.bits - 1)]
        return [*powers, self.high - self.low - sum(powers)]

    def totals_bound(self, senders: int) -> int:
        """``|every total|`` of ``senders`` vectors rebuilt from their bits, whatever each sent."""
        return senders * max(-self.low, self.high)

    @property
    def values(self) -> int:
        """Field elements in one tallier's share: the bits, the tags, the key."""
        return self.entries * self.bits + self.entries + self.bits

    def split(self, vector: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A share's bits ``(n, m)``, tags ``(n,)`` and key ``(m,)``."""
        if len(vector) != self.values:
            raise ShareError(f"a checked share holds {self.values} values, got {len(vector)}")
        bits_end = self.entries * self.bits
        tags_end = bits_end + self.entries
        return vector[:bits_end].reshape(self.entries, self.bits), vector[bits_end:tags_end], vector[tags_end:]

    def decompose(self, values: np.ndarray) -> np.ndarray:
        """The ``(n, m)`` bits of entries in ``[low, high]``: the last bit takes the last weight where the
        others cannot hold the entry alone."""
        offset = np.asarray(values, dtype=np.int64) - self.low
        last = self.weights[-1]
        top = offset > 2 ** (self.bits - 1) - 1
        rest = offset - top * last
        return np.concatenate([(rest[:, None] >> np.arange(self.bits - 1)) & 1, top[:, None].astype(np.int64)], axis=1)


def share_checked(values: np.ndarray, layout: CheckedLayout, parties: int, modulus: int) -> list[np.ndarray]:
    """``parties`` checked shares of the integer vector ``values``, each a ``uint64`` vector of ``layout.values``.

    ``ShareError`` if an entry lies outside ``[layout.low, layout.high]``."""
    values = np.asarray(values)
    if values.shape != (layout.entries,) or not np.issubdtype(values.dtype, np.integer):
        raise ShareError(f"a checked share is of {layout.entries} integers")
    if values.size and (int(values.min()) < layout.low or int(values.max()) > layout.high):
        raise ShareError(f"an entry lies outside [{layout.low}, {layout.high}]")
    return _share_bits(layout.decompose(values), parties, modulus)


def _share_bits(bits: np.ndarray, parties: int, modulus: int) -> list[np.ndarray]:
    """Checked shares of the ``(n, m)`` ``bits`` as given, under a fresh key (tests forge non-bits with it)."""
    key = random_elements(bits.shape[1], modulus)
    rows = [[int(b) % modulus for b in row] for row in bits.tolist()]
    tags = [sum(k * b for k, b in zip(key, row)) % modulus for row in rows]
    return share_elements([b for row in rows for b in row] + tags + key, parties, modulus)


def challenge(seed: int, count: int, modulus: int, purpose: str) -> list[int]:
    """``count`` public coefficients in ``Z_p`` drawn from the talliers' jointly random ``seed``, for ``purpose``."""
    width = (modulus.bit_length() + _EXTRA_BITS + 7) // 8
    stream = hashlib.shake_256(f"consilium/checked-shares/v1|{purpose}|{seed}".encode()).digest(width * count)
    return [int.from_bytes(stream[i : i + width], "little") % modulus for i in range(0, width * count, width)]


def tag_combination(tags: np.ndarray, coefficients: list[int], modulus: int) -> int:
    """This tallier's share of ``sum_i r[i] t[i]``, from its share of the tags."""
    return sum(int(t) * r for t, r in zip(tags, coefficients, strict=True)) % modulus
