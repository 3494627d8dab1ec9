"""Randomness that protects privacy: ChaCha20 keyed with 256 bits from the operating system.

Poisson sampling, noise and rounding decide what an observer can learn about a record, so an
observer must not be able to predict or reconstruct them. A statistical generator does not do: a
Mersenne Twister keeps 32 bits of a seed (a search over 2^32 seeds recovers every noise draw) and
PCG64's 128-bit state is recoverable from its outputs. ``secure_generator`` wraps the ChaCha20
stream cipher (randomgen's ``ChaCha``, 20 rounds) under numpy's ``Generator``, keyed by
``secrets.randbits(256)``; every distribution numpy offers then draws from the keystream.

``require_cryptographic`` is the gate every private path passes its generator through, so that a
statistical generator handed in by mistake fails loudly instead of quietly weakening the noise.
"""

from __future__ import annotations

import secrets

import numpy as np
from randomgen import ChaCha

__all__ = ["require_cryptographic", "secure_generator"]

_KEY_BITS = 256
_ROUNDS = 20


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
            f"private randomness needs a cryptographic generator (training.secure_random.secure_generator), got {kind}"
        )
    return generator
