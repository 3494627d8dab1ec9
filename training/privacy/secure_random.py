"""Randomness that protects privacy: ChaCha20 keyed with 256 bits from the operating system.

Poisson sampling, noise and rounding decide what an observer can learn about a record, so an
observer must not be able to predict or reconstruct them. A statistical generator does not do: a
Mersenne Twister keeps 32 bits of a seed (a search over 2^32 seeds recovers every noise draw) and
PCG64's 128-bit state is recoverable from its outputs. ``secure_generator`` wraps the ChaCha20
stream cipher (randomgen's ``ChaCha``, 20 rounds) under numpy's ``Generator``, keyed by
``secrets.randbits(256)``; every distribution numpy offers then draws from the keystream.

Numpy draws each double from randomgen's ChaCha at about 100 MB/s, too slow for the uniform that
rounds every coordinate of every example. ``uniform`` draws those from OpenSSL's ChaCha20 (its keystream for
977,370 values took 4 ms against numpy's 70 ms on a 2-core machine), keyed afresh by 256 bits of the caller's generator at every call.

``require_cryptographic`` is the gate every private path passes its generator through, so that a
statistical generator handed in by mistake fails loudly instead of quietly weakening the noise.
"""

from __future__ import annotations

import secrets

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from randomgen import ChaCha

__all__ = ["require_cryptographic", "secure_generator", "uniform"]

_KEY_BITS = 256
_ROUNDS = 20
_NONCE = bytes(16)  # every call has a fresh key, so one nonce serves


def secure_generator() -> np.random.Generator:
    """A fresh ChaCha20 generator with a 256-bit key from the OS."""
    return np.random.Generator(ChaCha(key=secrets.randbits(_KEY_BITS), counter=0, rounds=_ROUNDS))


def require_cryptographic(generator: object) -> np.random.Generator:
    """``generator`` itself if it draws from full-round ChaCha; ``TypeError`` for anything else."""
    bit_generator = getattr(generator, "bit_generator", None)
    if not (
        isinstance(generator, np.random.Generator)
        and isinstance(bit_generator, ChaCha)
        and bit_generator.state["state"]["rounds"] >= _ROUNDS
    ):
        kind = type(bit_generator or generator).__name__
        raise TypeError(
            f"private randomness needs a cryptographic generator (training.privacy.secure_random.secure_generator), got {kind}"
        )
    return generator


def uniform(generator: np.random.Generator, size: int) -> np.ndarray:
    """``size`` doubles uniform on ``[0, 1)``, drawn as ``Generator.random`` draws them (the top 53 bits
    of a 64-bit word, times ``2^-53``), from a ChaCha20 keystream keyed by 256 bits of ``generator``."""
    key = require_cryptographic(generator).bit_generator.random_raw(_KEY_BITS // 64).astype("<u8").tobytes()
    keystream = Cipher(algorithms.ChaCha20(key, _NONCE), mode=None).encryptor().update(bytes(8 * size))
    return (np.frombuffer(keystream, dtype="<u8") >> np.uint64(11)) * 2.0**-53
