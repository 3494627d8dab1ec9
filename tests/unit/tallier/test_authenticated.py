"""The labels over authenticated pairs (``tallier.authenticated``), by one MPyC party: right at every edge, and
every error a resharing could add caught by the checks before a label, or a comparison's masked value, opens.

One party isolates the arithmetic and the checks (MPyC reshares nothing with ``t = 0``); an error is put where a
deviating tallier's resharing would put it, into a product. ``tests/integration/test_tallier_mpc.py`` runs three
real talliers, one of them deviating."""

import numpy as np
import pytest
from consilium.crypto.mpc_field import mpyc_runtime
from consilium.tallier import authenticated
from consilium.tallier.authenticated import Authenticated, DeviationError
from consilium.tallier.mpc_values import harden_mpyc, open_checked


def _labelled(bit_length, totals, threshold=0, product=None, monkeypatch=None):
    """The opened labels of ``totals`` and the recorded products, with ``product`` in place of the honest one."""
    runtime = mpyc_runtime([])
    secint = runtime.SecInt(bit_length)
    harden_mpyc(secint.field.modulus)
    if product is not None:
        monkeypatch.setattr(Authenticated, "product", product)
    found = {}

    async def labels():
        await runtime.start()
        arithmetic = Authenticated(runtime, secint, round_number=1)
        found["recorded"] = arithmetic.recorded
        try:
            found["labels"] = await arithmetic.labels(secint.array(arithmetic.public(totals)), bit_length, threshold)
        finally:
            await runtime.shutdown()

    runtime.run(labels())
    return found["labels"], found["recorded"]


@pytest.mark.parametrize("bit_length", [8, 11, 20])
def test_each_comparison_is_right_at_the_edges_of_its_range(bit_length):
    runtime = mpyc_runtime([])
    secint = runtime.SecInt(bit_length)
    harden_mpyc(secint.field.modulus)
    k = bit_length - 1
    values = [-(1 << k), -(1 << k) + 1, -1, 0, 1, (1 << k) - 1] + [
        int(v) for v in np.random.randint(-(1 << k), 1 << k, 40)
    ]

    async def compare():
        await runtime.start()
        arithmetic = Authenticated(runtime, secint, round_number=1)
        below = await arithmetic.less_than_zero(
            arithmetic.authenticate(secint.array(arithmetic.public(values))), bit_length
        )
        await arithmetic.check()
        opened = await open_checked(runtime, below[0])
        await runtime.shutdown()
        return opened

    assert runtime.run(compare()) == [int(v < 0) for v in values]


def test_the_labels_are_numpy_s_argmax_ties_to_the_lower_class_and_the_threshold_withholds():
    totals = np.random.default_rng().integers(-300, 301, size=(60, 7))
    totals[:10] = 4  # all tied
    totals[10:20, [1, 5]] = 400  # two tied at the top
    labels, _ = _labelled(12, totals, threshold=100)
    expected = np.where(totals.max(axis=1) >= 100, totals.argmax(axis=1), 7)
    assert np.array_equal(labels, expected)
    assert set(labels[:10]) == {7} and set(labels[10:20]) == {1}


@pytest.mark.parametrize("which", [1, 2, 3, 4, 8, 20, -3, -2, -1, None])
def test_an_error_in_any_product_is_caught_before_a_label_opens(monkeypatch, which):
    """An error in one product (counted from the end where negative: the threshold's, then the check's own), or in
    every one (``None``); the first is the totals' MACs, the next two a comparison's random bits and their squares' MACs,
    then the check's own two."""
    honest, calls = Authenticated.product, []
    totals = np.random.default_rng().integers(-100, 101, size=(20, 6))

    def counted(self, a, b):
        calls.append(True)
        return honest(self, a, b)

    _labelled(10, totals, threshold=20, product=counted, monkeypatch=monkeypatch)
    target, calls[:] = (len(calls) + 1 + which if which and which < 0 else which), []

    def product(self, a, b):
        calls.append(True)
        both = honest(self, a, b)
        return both + 1 if target is None or len(calls) == target else both

    with pytest.raises(DeviationError, match="a tallier deviated; no label of the round is released"):
        _labelled(10, totals, threshold=20, product=product, monkeypatch=monkeypatch)
    assert target is None or len(calls) >= target


def test_a_square_shifted_to_another_square_is_caught_before_any_square_or_comparison_opens(monkeypatch):
    """The attack a shifted ``u^2`` allows (a "bit" the tallier knows up to a sign) needs the square to stay one;
    the squares' check catches it before ``u^2``, or the comparison's masked value, is opened, and the products'
    check alone would not: ``u`` and ``alpha u`` are right."""
    honest, calls, opened = Authenticated.product, [], []

    def product(self, a, b):  # the second product is the first random bits' (u, u) times (u, alpha): give (u + 1)^2
        calls.append(True)
        both = honest(self, a, b)
        if len(calls) != 2:
            return both
        count = a.size // 2
        shifted = a[:count] + 1
        return self.runtime.np_concatenate((shifted * shifted, both[count:]))

    def open_values(runtime, x):
        opened.append(x.size)
        return open_checked(runtime, x)

    monkeypatch.setattr(authenticated, "open_checked", open_values)
    totals = np.random.default_rng().integers(-100, 101, size=(20, 6))
    with pytest.raises(DeviationError, match="the MAC check of the labels' arithmetic failed"):
        _labelled(10, totals, product=product, monkeypatch=monkeypatch)
    assert opened == [1]  # the check, times a secret factor: no coefficient, no square, no masked difference


@pytest.mark.parametrize("which", [6, 12, 25])  # in a comparison's bitwise step, a selection, a later comparison
def test_after_an_error_in_a_product_nothing_but_checks_is_opened(monkeypatch, which):
    """However large, an error could move a later masked difference past its mask and show a total's bits; so
    every product is checked before the next opening of anything a product made (Review 3, finding 1)."""
    honest, calls, opened = Authenticated.product, [], []

    def product(self, a, b):
        calls.append(True)
        both = honest(self, a, b)
        return both + (1 << 20) if len(calls) == which else both

    def open_values(runtime, x):
        opened.append((len(calls) >= which, x.size))
        return open_checked(runtime, x)

    monkeypatch.setattr(authenticated, "open_checked", open_values)
    with pytest.raises(DeviationError, match="the MAC check of the labels' arithmetic failed"):
        _labelled(
            10, np.random.default_rng().integers(-100, 101, size=(20, 6)), product=product, monkeypatch=monkeypatch
        )
    assert len(calls) >= which and {size for after, size in opened if after} == {1}


def test_an_error_in_the_check_s_own_inner_product_is_caught(monkeypatch):
    honest = Authenticated.inner
    monkeypatch.setattr(Authenticated, "inner", lambda self, a, b: honest(self, a, b) + 1)
    with pytest.raises(DeviationError, match="the MAC check of the labels' arithmetic failed"):
        _labelled(10, np.random.default_rng().integers(-100, 101, size=(20, 6)))


def test_honest_arithmetic_passes_the_check_round_after_round():
    generator = np.random.default_rng()
    for _ in range(20):
        totals = generator.integers(-200, 201, size=(15, 10))
        labels, recorded = _labelled(11, totals, threshold=50)
        assert np.array_equal(labels, np.where(totals.max(axis=1) >= 50, totals.argmax(axis=1), 10))
        assert recorded
