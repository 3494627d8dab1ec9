"""Step 4 of a round, the ballot checks, over authenticated pairs (``tallier.mpc``, ``tallier.ballot_checks``), by one
MPyC party: a ballot that is not votes and noise is refused, an honest one never is, and an error a resharing could add
to any product of the checks stops the round before any check is opened, so that it can neither refuse an honest
ballot nor pass a failing one.

One party isolates the arithmetic (MPyC reshares nothing with ``t = 0``); an error is put where a deviating tallier's
resharing would put it, into a product, without knowing the key. ``tests/integration/test_tallier_mpc.py`` runs three
real talliers, one of them deviating in these products."""

import types

import numpy as np
import pytest
from consilium.crypto.mpc_field import mpyc_runtime
from consilium.tallier import authenticated, mpc
from consilium.tallier.authenticated import Authenticated, DeviationError
from consilium.tallier.mpc_values import harden_mpyc, open_checked
from tally_inputs import ballot_bits, forged_ballot, layout_for

LAYOUT = layout_for(6, 4, 1, noise_range=5, energy_cap=6 * 4 * 25)
VOTERS = ("hospital-1", "hospital-2", "hospital-3")


def _ballot_bits(generator) -> list[np.ndarray]:
    votes = np.eye(LAYOUT.vote_columns, dtype=np.int64)[generator.integers(0, LAYOUT.classes, LAYOUT.queries)]
    noise = generator.integers(-LAYOUT.noise_range, LAYOUT.noise_range + 1, LAYOUT.pool_values)
    return ballot_bits(LAYOUT, votes, noise, LAYOUT.energy_cap - int(noise @ noise))


def _not_bits(bits: list[np.ndarray]) -> list[np.ndarray]:
    """The same votes and noise, but one noise value's lowest two "bits" 2 and 0 instead of 0 and 1: only the bit
    check fails."""
    bits = [part.copy() for part in bits]
    entry = int(np.flatnonzero((bits[1][:, 0] == 0) & (bits[1][:, 1] == 1))[0])
    bits[1][entry, :2] = (2, 0)
    return bits


def _checked(parts_bits: list[list[np.ndarray]], monkeypatch=None, **patches):
    """What one party's step 4 makes of the ballots with these parts' bits (under valid tags), with ``patches``
    (``Authenticated`` methods) in place of the honest ones; and every value it opened, in order."""
    runtime = mpyc_runtime([])
    secint = runtime.SecInt(11)
    harden_mpyc(secint.field.modulus)
    modulus = secint.field.modulus
    shares = [sum(share.astype(object) for share in forged_ballot(bits, 2, modulus)) % modulus for bits in parts_bits]
    tally = mpc._Tally(runtime, secint, LAYOUT, round_number=1, talliers=("tallier-1",))
    opened, honest_open = [], mpc.open_checked

    def recording(rt, x):
        result = honest_open(rt, x)
        result.add_done_callback(lambda done: opened.append(done.result()))
        return result

    if monkeypatch is not None:
        monkeypatch.setattr(mpc, "open_checked", recording)
        monkeypatch.setattr(authenticated, "open_checked", recording)
        for name, method in patches.items():
            monkeypatch.setattr(Authenticated, name, method(tally, getattr(Authenticated, name)))

    async def check():
        await runtime.start()
        try:
            return await tally.check([np.array(share, dtype=np.uint64) for share in shares], VOTERS[: len(shares)])
        finally:
            await runtime.shutdown()

    try:
        return runtime.run(check()), opened
    except DeviationError as error:
        return error, opened


def test_honest_ballots_count_and_one_that_is_not_bits_is_refused_round_after_round():
    generator = np.random.default_rng()
    for _ in range(5):
        honest = [_ballot_bits(generator) for _ in range(2)]
        (counted, refused), _ = _checked([honest[0], _not_bits(_ballot_bits(generator)), honest[1]])
        assert counted == [0, 2] and refused == {"hospital-2": "its bits are not bits"}


def _with_error(kind: str, which: int):
    """A patch of ``Authenticated.product`` or ``inner`` that adds 1 to the ``which``-th call's result (from 1):
    what a tallier that reshares a wrong value adds, knowing no key."""

    def patch(tally, honest):
        calls = []

        def erring(self, a, b):
            calls.append(True)
            result = honest(self, a, b)
            return result + 1 if len(calls) == which else result

        return erring

    return {kind: patch}


@pytest.mark.parametrize(
    "kind, which",
    [("product", 1), ("product", 2), ("product", 3), ("product", 4), ("inner", 1), ("inner", 2), ("inner", 7)],
    ids=["input-macs", "tag-macs", "masking", "check-itself", "bit-check", "tag-check", "energy-check"],
)
def test_an_error_in_any_product_of_the_checks_stops_the_round_before_any_check_opens(monkeypatch, kind, which):
    """The products, in order: the inputs' MACs, the tag combinations' MACs, each check times its factor, then the
    CHECK's own; the inner products, per voter and part, a bit check and a tag check, then the energy check."""
    generator = np.random.default_rng()
    error, opened = _checked(
        [_ballot_bits(generator), _ballot_bits(generator)], monkeypatch, **_with_error(kind, which)
    )
    assert isinstance(error, DeviationError) and "the MAC check of the ballot checks' arithmetic failed" in str(error)
    assert [len(values) for values in opened] == [1, 1]  # the challenge and the CHECK (a secret multiple): no check


@pytest.mark.parametrize("mac_error", ["none", "the same"])
def test_a_failing_bit_check_cancelled_in_its_resharing_is_caught_and_the_ballot_never_counts(monkeypatch, mac_error):
    """A tallier working with the hospital knows its bit check's value ``z`` and adds ``-z`` to the inner product's
    resharing, and to its MAC nothing, or ``-z`` too (it cannot add ``-alpha z``: it does not know ``alpha``)."""
    bits = _not_bits(_ballot_bits(np.random.default_rng()))

    def cancelling(tally, honest):
        calls = []

        def inner(self, a, b):
            calls.append(True)
            result = honest(self, a, b)
            if len(calls) != 3:  # the noise part's bit check (votes: bit, tag; noise: bit)
                return result
            values = bits[1].reshape(-1).astype(object)
            z = int(np.dot(np.array(tally.checks.spreads[1], dtype=object), values * (values - 1))) % self.modulus
            return result - self.public([z, z if mac_error == "the same" else 0])

        return inner

    error, opened = _checked([bits], monkeypatch, inner=cancelling)
    assert isinstance(error, DeviationError) and "the MAC check of the ballot checks' arithmetic failed" in str(error)
    assert len(opened) == 2


def test_a_check_is_opened_masked_so_a_failing_one_shows_nothing_of_its_value():
    """``Authenticated.masked``: a failing check of 5 opens as neither 5 nor the same twice (a bare check could
    carry a hospital's bits), a passing one as 0."""
    runtime = mpyc_runtime([])
    secint = runtime.SecInt(11)
    harden_mpyc(secint.field.modulus)

    async def twice():
        await runtime.start()
        found = []
        for _ in range(2):
            pairs = Authenticated(runtime, secint, round_number=1)
            checks = pairs.authenticate(secint.array(pairs.public([5, 0])))
            masked = pairs.masked([checks])
            await pairs.check()
            found.append(await open_checked(runtime, masked))
        await runtime.shutdown()
        return found

    (first, zero_1), (second, zero_2) = runtime.run(twice())
    assert zero_1 == zero_2 == 0 and 5 not in (first, second) and first != second


def test_a_failed_tag_check_stands_when_a_peer_leaves_during_the_shutdown(monkeypatch):
    """A tallier that lets the tag checks open, then leaves (or never answers) the shutdown after them, must not turn
    the failed check into an interruption, which would have the round tallied again (Review 5): the round still
    ends as the check said. (The network is left out: one party, whose shutdown fails as a peer's leaving makes it.)"""
    runtime = mpyc_runtime([])
    secint = runtime.SecInt(11)
    harden_mpyc(secint.field.modulus)
    modulus = secint.field.modulus
    share = sum(s.astype(object) for s in forged_ballot(_ballot_bits(np.random.default_rng()), 2, modulus)) % modulus
    tag = LAYOUT.parts[0].entries * LAYOUT.parts[0].bits  # the votes' first tag
    share[tag] = (share[tag] + 200) % modulus
    tally = mpc._Tally(runtime, secint, LAYOUT, round_number=4, talliers=("tallier-1",))

    async def leaving(self):
        raise ConnectionResetError("tallier-3 left the MPC before the round ended")

    async def connected(deadline_s):
        await runtime.start()

    network = types.SimpleNamespace(connect=connected, caught=[], aborts=[])

    async def tag_check_fails():
        monkeypatch.setattr(type(runtime), "shutdown", leaving)
        await mpc._protocol(
            network,
            tally,
            {"hospital-1": np.array(share, dtype=np.uint64)},
            {},
            hospitals=("hospital-1",),
            quorum=1,
            reveal="labels",
            label_threshold=0,
            timeout_s=30.0,
            on_voters=lambda voters: None,
            kept=None,
            on_output=lambda output: None,
        )

    with pytest.raises(ConnectionResetError) as left:
        runtime.run(tag_check_fails())
    ended = mpc._failure(left.value, network, tally, 30.0)
    assert isinstance(ended, mpc.TamperError) and "hospital-1's ballot fail its tag check" in str(ended)
