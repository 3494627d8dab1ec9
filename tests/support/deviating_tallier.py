"""A tallier that deviates in the labels' arithmetic: ``python deviating_tallier.py WHERE MODULE ARGS...``.

It runs the tallier ``MODULE`` (``consilium.scripts.bench_tallier`` with ``--party``, or
``consilium.scripts.tallier``) with ``ARGS`` as an honest tallier would, except that in
one product of the labels step (``tallier.authenticated``) it adds 1 to its own share of the local
product before resharing it, as a tallier that sends a wrong resharing does, or to its share of one
opened value. ``WHERE`` picks which, the first of its kind in the round:

- ``multiplication``: an argmax selection (a winner's total and class);
- ``comparison``: a product of a comparison's bitwise step;
- ``random-bit``: a comparison's random bits (``u^2`` and ``alpha u``);
- ``opening``: the share it sends of a comparison's masked difference (off the line of the others').
"""

import runpy
import sys

from consilium.tallier import authenticated
from consilium.tallier.authenticated import Authenticated
from mpyc import asyncoro

_TARGETS = {"multiplication": "argmax", "comparison": "less_than_zero", "random-bit": "random_bits", "opening": None}
_where = sys.argv[1]
_target = _TARGETS[_where]
_stack: list[str] = []
_done = []
_honest_product = Authenticated.product


def _product(self, a, b):
    if _done or not _stack or _stack[-1] != _target:
        return _honest_product(self, a, b)
    _done.append(True)
    return _off_by_one(self.runtime, a, b)


@asyncoro.mpc_coro
async def _off_by_one(runtime, a, b):
    """MPyC's ``np_multiply`` for two secure arrays of one shape, with 1 added to this tallier's product share."""
    await runtime.returnType((type(a), a.shape))
    a, b = await runtime.gather(a, b)
    return runtime._reshare(a * b + 1)


def _marked(name):
    honest = getattr(Authenticated, name)

    async def step(self, *args):
        _stack.append(name)
        try:
            return await honest(self, *args)
        finally:
            _stack.pop()

    return step


_honest_open = authenticated.open_checked


def _open(runtime, x):
    if _done or _where != "opening" or _stack[-1:] != ["less_than_zero"]:
        return _honest_open(runtime, x)
    _done.append(True)
    return _honest_open(runtime, x + 1)  # 1 added to this tallier's share alone


authenticated.open_checked = _open
Authenticated.product = _product
for _name in set(_TARGETS.values()) - {None}:
    setattr(Authenticated, _name, _marked(_name))
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__")
