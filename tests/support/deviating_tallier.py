"""A tallier that deviates in the checked arithmetic: ``python deviating_tallier.py WHERE MODULE ARGS...``.

It runs the tallier ``MODULE`` (``consilium.scripts.bench_tallier`` with ``--party``, or
``consilium.scripts.tallier``) with ``ARGS`` as an honest tallier would, except that in
one product of the ballot checks or the labels (``tallier.authenticated``) it adds 1 to its own share of the
local product before resharing it, as a tallier that sends a wrong resharing does, or to its share of one
opened value. ``WHERE`` picks which, the first of its kind in the round:

- ``input-mac``: the ballot checks' first product, the inputs' MACs;
- ``ballot-check``: the ballot checks' first inner product (a bit check);
- ``multiplication``: an argmax selection (a winner's total and class);
- ``comparison``: a product of a comparison's bitwise step;
- ``random-bit``: a comparison's random bits (``u^2`` and ``alpha u``);
- ``opening``: the share it sends of a comparison's masked difference (off the line of the others');
- ``local-fault``: not a deviation: a ``MemoryError`` of its own in a comparison's product, as on a machine out of
  memory.

Or, in a tally of a round again once its output began (``kept``), it deviates in what it brings:

- ``again-input``: 200 more in its share of every ballot's first noise bit, as a tallier that re-chooses a
  colluding hospital's ballot would input other shares;
- ``again-kept``: 1 more in its kept share of the first query's first total.

Or, in step 1 (``tallier.voter_marks``), it marks hospital-1's box, which opens, otherwise in every round:

- ``mark-bad``: BAD (with the box's true digest), as a tallier that would leave an honest hospital out;
- ``mark-bad-interrupted``: BAD, and it then tells the server its MPC did not finish (no dispute of its own);
- ``mark-none``: NONE, as a tallier that says it was given no box.

Or, in a round every tallier fails for too few voters before its output began:

- ``no-void``: it answers with the others' reason, but 64 bytes that are no signature for its void, as a tallier
  that would keep the hospitals charged for a round that released nothing.

It opens values without checking the others' shares (it never aborts a round itself, as a deviant that hides
would not): so that an honest tallier is the one that catches it.
"""

import runpy
import sys

import numpy as np

from dataclasses import replace

from consilium.protocol.voting.ballots import BAD, NONE, MarkedBox
from consilium.tallier import authenticated, mpc, mpc_values
from consilium.tallier import tallier as tallier_module
from consilium.tallier.authenticated import Authenticated
from mpyc import asyncoro, thresha

_TARGETS = {
    "input-mac": None,
    "ballot-check": None,
    "multiplication": "argmax",
    "comparison": "less_than_zero",
    "random-bit": "random_bits",
    "opening": None,
    "local-fault": "less_than_zero",
    "again-input": None,
    "again-kept": None,
    "mark-bad": None,
    "mark-bad-interrupted": None,
    "mark-none": None,
    "no-void": None,
}
_where = sys.argv[1]
_target = _TARGETS[_where]
_stack: list[str] = []
_done = []
_honest_product, _honest_inner = Authenticated.product, Authenticated.inner


def _product(self, a, b):
    if _done or (_where != "input-mac" and (not _stack or _stack[-1] != _target)):
        return _honest_product(self, a, b)
    _done.append(True)
    return (_out_of_memory if _where == "local-fault" else _off_by_one)(self.runtime, a, b)


def _inner(self, a, b):
    if _done or _where != "ballot-check":
        return _honest_inner(self, a, b)
    _done.append(True)
    return _inner_off_by_one(self.runtime, a, b)


@asyncoro.mpc_coro
async def _off_by_one(runtime, a, b):
    """MPyC's ``np_multiply`` for two secure arrays (broadcast), with 1 added to this tallier's product share."""
    await runtime.returnType((type(a), np.broadcast_shapes(a.shape, b.shape)))
    a, b = await runtime.gather(a, b)
    return runtime._reshare(a * b + 1)


@asyncoro.mpc_coro
async def _out_of_memory(runtime, a, b):
    await runtime.returnType((type(a), np.broadcast_shapes(a.shape, b.shape)))
    await runtime.gather(a, b)
    raise MemoryError("the machine is out of memory")


@asyncoro.mpc_coro
async def _inner_off_by_one(runtime, a, b):
    """MPyC's ``np_matmul`` for a secure matrix and vector (``Authenticated.inner_product``: a value and its MAC), with
    1 added to this tallier's share of each local inner product."""
    await runtime.returnType((type(a), a.shape[:-1]))
    a, b = await runtime.gather(a, b)
    return runtime._reshare(a @ b + 1)


def _marked(name):
    honest = getattr(Authenticated, name)

    async def step(self, *args):
        _stack.append(name)
        try:
            return await honest(self, *args)
        finally:
            _stack.pop()

    return step


def _open(runtime, x):
    shift = 0
    if not _done and _where == "opening" and _stack[-1:] == ["less_than_zero"]:
        _done.append(True)
        shift = 1  # added to the share it sends alone
    return _open_unchecked(runtime, x, shift)


@asyncoro.mpc_coro
async def _open_unchecked(runtime, x, shift):
    """``mpc_values.open_checked`` as this tallier runs it: it sends its share plus ``shift``, and takes the value
    from its own share and the next ``t`` talliers' without checking the rest."""
    await runtime.returnType(asyncoro.Future)
    field = x.sectype.field
    (own,) = await runtime.gather([x])
    own = own.value.reshape(-1)
    codec = mpc_values._mpyc_runtime.pickle
    others = [pid for pid in range(len(runtime.parties)) if pid != runtime.pid]
    payload = codec.dumps((own + shift) % field.modulus)
    for pid in others:
        runtime._send_message(pid, payload)
    received = await runtime.gather([runtime._receive_message(pid) for pid in others])
    points = [(runtime.pid + 1, own)] + [(pid + 1, codec.loads(data)) for pid, data in zip(others, received)]
    value = thresha.np_recombine(field, points[: runtime.threshold + 1]).value
    half = field.modulus // 2
    return [int(v) - field.modulus if int(v) > half else int(v) for v in value]


authenticated.open_checked = mpc.open_checked = _open
_honest_run_round = mpc.run_round


def _run_round(party, round_number, shares, **settings):
    kept = settings.get("kept")
    if kept is not None and _where == "again-input":
        start = settings["layout"].parts[0].values  # the noise: the second part
        shares = {name: share.copy() for name, share in shares.items()}
        for share in shares.values():
            share[start] = (int(share[start]) + 200) % settings["field"].modulus
    if kept is not None and _where == "again-kept":
        totals = kept.totals.astype(object)
        totals[0] = (totals[0] + 1) % settings["field"].modulus
        settings["kept"] = replace(kept, totals=totals.astype(np.uint64))
    try:
        return _honest_run_round(party, round_number, shares, **settings)
    except mpc.VoterError as error:
        if _where == "mark-bad-interrupted":
            raise mpc.MpcError(f"pretending the MPC did not finish ({error})") from None
        raise


mpc.run_round = tallier_module.run_round = _run_round  # the tallier module took its name when imported above
_honest_mark_box = tallier_module.mark_box


def _mark_box(box, **settings):
    marked = _honest_mark_box(box, **settings)
    if _where.startswith("mark-") and settings["hospital"] == "hospital-1":
        return MarkedBox(NONE if _where == "mark-none" else BAD, marked.digest, reason=f"{_where}, deviating")
    return marked


tallier_module.mark_box = _mark_box
if _where == "no-void":
    tallier_module.sign_void = lambda signing, **statement: bytes(64)
Authenticated.product = _product
Authenticated.inner = _inner
for _name in set(_TARGETS.values()) - {None}:
    setattr(Authenticated, _name, _marked(_name))
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__")
