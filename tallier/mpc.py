"""The talliers' MPC: agree on the voters, check every ballot, then a secure argmax over the totals.

Tallier ``j`` holds one share of each voting hospital's ballot (``protocol.voting.ballots``: its
votes, its noise and a slack, each as checked shares, modulo the prime ``p`` of MPyC's
``SecInt(l)``, ``crypto.mpc_field``). A round, on one screen:

1. **Voters** (``tallier.voter_marks``). Each tallier inputs the round number and its mark of each
   hospital's box (OK, NONE, or BAD with the box's digest); all are opened. The voters are the
   hospitals every tallier holds a share from; one whose box more than ``t`` talliers could not open
   is refused and named; a box fewer marked BAD is disputed, and one some talliers say they do not
   hold voids the round. Fewer voters than the quorum: no label (``VoterError``).
2. **Inputs.** Each tallier inputs its shares of every voter's bits and keys (MPyC Shamir-shares
   them among all talliers: nobody learns them), and waits until every tallier's inputs are in.
3. **Challenge.** Each tallier inputs a random field element; their sum, opened, is the round's
   seed: the checks' coefficients and the noise's signs and places follow from it
   (``tallier.ballot_checks``). No ballot could be chosen knowing them.
4. **Checks** (``tallier.ballot_checks``), over authenticated pairs (``tallier.authenticated``):
   every input gets its MAC under the round's secret key. Each tallier inputs its share of each
   voter's tag combinations, and the talliers compute four numbers per voter: its tag check (zero
   unless a tallier changed its input, or the hospital sent wrong tags), its bit check (its "bits"
   are bits), its sum check (``s`` votes to a query) and its energy check (its noise's ``sum n^2``
   at most ``E_max``). Each is multiplied by a fresh secret random factor, never opened bare (a
   bare check could carry a hospital's bits to a tallier that provoked it), and every product so
   far is MAC-checked before any of them opens (``DeviationError``: a tallier that bends a check's
   product stops the run, and can neither refuse an honest ballot nor pass a failing one); then
   the tag checks are opened first. A failed
   tag check ends the round, and the run with it: no label is released (``TamperError``, naming
   the ballots), and no other check is opened. A ballot that fails another check is left out of
   every tallier's count, named with the check in ``MpcResult.refused``; fewer counted voters
   than the quorum: no label.
5. **Totals.** Each counted voter's votes plus its noise, signed and placed by the round's
   challenge, summed: every total lies within ``VotingConfig.totals_bound``, which the field's
   comparisons are sized for, by construction, and free of communication. Each tallier keeps its
   shares of them, the placement and the counted voters (``run_state.KeptOutput``) before any
   output is computed; in a tally of the round again once that began (the talliers' pins, opened
   after step 1, agree), steps 2 to 5 are skipped and the kept shares counted: no new input, the
   same labels, nothing new shown.
6. **Labels**, checked (``tallier.authenticated``): a secure argmax along the classes finds each
   query's label with ``C - 1`` comparisons, ties to the lowest class index, as in NumPy; with a
   label threshold ``T > 0``, one more per query withholds the label (opened as ``C``) where the top
   total is below ``T``. All of it runs over pairs ``([x], [alpha x])`` under a secret key: a tallier
   that reshares a wrong value anywhere in it is caught by the MAC checks before any label is opened,
   and comparisons open masked values only with random bits checked first (``DeviationError``).

Every opening goes through ``tallier.mpc_values.open_checked``: from all ``J`` shares, refused
unless they lie on one polynomial of degree ``t``. ``reveal="histogram"`` opens the totals
themselves instead of step 6 (a secure sum): cheaper, and it shows the noisy totals to the
talliers and the server; the talliers draw the labels from them by the same rule
(``_released_labels``). It is for users who accept that, never a fallback.

MPyC is honest-majority: ``t = floor((J - 1) / 2)`` corrupt talliers learn nothing, and every
tallier must stay online; a silent peer ends the round at its deadline (``MpcError``). With
``J = 2``, ``t = 0`` and MPyC's shares are the inputs themselves, so three talliers at least, and an
odd number (``J = 2t + 1``, which the MAC checks assume). From step 4 on, a wrong share or any message
no honest tallier sends is a deviation, not an interruption; and how a round ended stands however the
shutdown after it goes (a peer that never joins it cannot turn a failed check into an interruption).

The talliers connect with ``tallier.mpc_network`` (pinned certificates, no peer's bytes unpickled:
``tallier.mpc_values``); a peer that sends what no honest tallier sends aborts the round (``MpcError``
naming it). Each round runs on an event loop of its own, closed with every connection and pending
step however the round ends, so the next round, or the same one tallied again, starts clean.
"""

from __future__ import annotations
from typing import Callable

import asyncio
from dataclasses import dataclass

import numpy as np

from consilium.errors import ConsiliumError
from consilium.crypto.mpc_field import MpcField, mpyc_runtime
from consilium.protocol.voting.ballots import BallotLayout
from consilium.tallier.authenticated import Authenticated, DeviationError, DrawError, joint_seed, pair_part
from consilium.tallier.mpc_network import MpcNetwork, MpcParty
from consilium.tallier.round_loop import round_loop
from consilium.tallier.run_state import KeptOutput
from consilium.tallier.ballot_checks import REFUSALS, BallotChecks, CheckedBallot
from consilium.tallier.mpc_values import MpcPeerError, harden_mpyc, message_limit, open_checked
from consilium.tallier.voter_marks import VoterError, Voters, decide, marks_input
from consilium.training.voting.vote_privacy import REVEAL_MODES

__all__ = ["DeviationError", "MpcError", "MpcParty", "MpcResult", "TamperError", "VoterError", "run_round"]


class MpcError(ConsiliumError, RuntimeError):
    """The MPC could not finish: a tallier left, or did not answer before the deadline."""


class TamperError(RuntimeError):
    """A voter's tag check failed: a tallier changed its input (or the hospital sent wrong tags); no label."""

    def __init__(self, ballots: tuple[str, ...], round_number: int) -> None:
        self.ballots = ballots
        super().__init__(
            f"round {round_number}: the talliers' inputs of {', '.join(ballots)}'s ballot fail its tag check: a "
            "tallier changed its input (or the hospital sent wrong tags); no label of this round is released"
        )


@dataclass(frozen=True)
class MpcResult:
    voters: tuple[str, ...]  # whose votes the labels count, in the run's order
    refused: dict[str, str]  # hospitals whose boxes or ballots failed a check, left out of the count: why
    labels: np.ndarray  # (Q,) int64: a class, or C where the label is withheld
    totals: np.ndarray | None  # (Q, C) int64, only when revealed
    bytes_sent: int  # by this tallier, to all others
    seed: int  # the seed of the noise's signs and places (``noise_placement``): the first tally's challenge


def run_round(
    party: MpcParty,
    round_number: int,
    shares: dict[str, np.ndarray],
    *,
    hospitals: tuple[str, ...],
    quorum: int,
    layout: BallotLayout,
    field: MpcField,
    reveal: str,
    label_threshold: int,
    timeout_s: float,
    bad: dict[str, bytes],
    on_voters: Callable[[tuple[str, ...]], None] = lambda voters: None,
    kept: KeptOutput | None = None,
    on_output: Callable[[KeptOutput], None] = lambda output: None,
) -> MpcResult:
    """One round of the protocol above for this tallier, holding ``shares`` (checked shares, by hospital) and
    ``bad`` (the digests of the boxes hospitals signed for it that do not open to a share). ``on_voters`` is given
    the agreed voters before anything else of the round is opened (a tallier pins them: ``tallier.run_state``); a
    ``ValueError`` from it ends the round. ``kept`` is what this tallier kept of the round when its output began in an
    earlier tally (None if it did not): it is counted again, with no input; else ``on_output`` is given what to keep
    before any output is computed. ``MpcError`` if it does not finish in time, or a peer deviates before the checks
    began; ``VoterError`` if the talliers disagree on the round or the voters (``DisputeError``: a disputed box), or
    count fewer than ``quorum``; ``TamperError`` if a voter's tag check fails; ``DeviationError`` if a MAC check fails,
    or a peer sends what no honest tallier sends once the checks began (the run stops: no retry with fresh masks)."""
    _check_inputs(shares, bad, hospitals=hospitals, layout=layout, reveal=reveal)
    harden_mpyc(field.modulus)
    with round_loop() as loop:
        runtime, secint = _runtime(party, field, loop)
        network = MpcNetwork(
            runtime,
            party,
            max_message_bytes=message_limit(layout, len(hospitals), field, secint.field.byte_length),
            hospitals=len(hospitals),
        )
        tally = _Tally(runtime, secint, layout, round_number, party.names)
        protocol = _protocol(
            network,
            tally,
            shares,
            bad,
            hospitals=hospitals,
            quorum=quorum,
            reveal=reveal,
            label_threshold=label_threshold,
            timeout_s=timeout_s,
            on_voters=on_voters,
            kept=kept,
            on_output=on_output,
        )
        try:
            return runtime.run(asyncio.wait_for(protocol, timeout_s))
        except (VoterError, TamperError, DeviationError):
            raise
        except BaseException as error:
            failure = _failure(error, network, tally, timeout_s)
            if failure is error:
                raise
            raise failure from None


def _check_inputs(
    shares: dict[str, np.ndarray],
    bad: dict[str, bytes],
    *,
    hospitals: tuple[str, ...],
    layout: BallotLayout,
    reveal: str,
) -> None:
    if reveal not in REVEAL_MODES:
        raise ValueError(f"unknown reveal mode {reveal!r}; choose from {', '.join(REVEAL_MODES)}")
    if not set(shares) | set(bad) <= set(hospitals):
        raise ValueError(f"boxes from {sorted(set(shares) | set(bad) - set(hospitals))}, not hospitals of the run")
    if set(shares) & set(bad):
        raise ValueError(f"{sorted(set(shares) & set(bad))} both sent a valid share and a box that does not open")
    if any(len(vector) != layout.values for vector in shares.values()):
        raise ValueError(f"every share must hold {layout.values} values, a ballot's")


def _runtime(party: MpcParty, field: MpcField, loop: asyncio.AbstractEventLoop):
    """MPyC's runtime for this round, on the round's own event loop, and its secure integers in the run's field."""
    # No --ssl: MPyC reads it only in Runtime.start, which MpcNetwork.connect replaces with pinned TLS.
    runtime = mpyc_runtime([f"-P{host}:{port}" for host, port in party.addresses] + ["-I", str(party.index)])
    if runtime._loop is not loop:
        raise RuntimeError("MPyC's runtime did not take the round's event loop")
    secint = runtime.SecInt(field.bit_length)
    if secint.field.modulus != field.modulus:  # the hospitals shared over another field: the sums would be noise
        raise ValueError(
            f"the hospitals shared modulo {field.modulus}, but {field.bit_length}-bit MPC computes modulo {secint.field.modulus}"
        )
    return runtime, secint


async def _protocol(
    network: MpcNetwork,
    tally: _Tally,
    shares: dict[str, np.ndarray],
    bad: dict[str, bytes],
    *,
    hospitals: tuple[str, ...],
    quorum: int,
    reveal: str,
    label_threshold: int,
    timeout_s: float,
    on_voters: Callable[[tuple[str, ...]], None],
    kept: KeptOutput | None,
    on_output: Callable[[KeptOutput], None],
) -> MpcResult:
    """The round's steps, in order: connect, agree on the voters, check their ballots and add them (or count what
    an earlier tally kept), and open the labels (or the totals)."""
    runtime = tally.runtime
    await network.connect(timeout_s)
    try:
        agreed = await tally.agree_on_voters(hospitals, shares, bad, quorum)
        try:
            on_voters(agreed.voters)
        except ValueError as error:
            raise VoterError(str(error)) from None
        if await tally.agree_on_placement(kept.placement if kept else 0):  # the output began in an earlier tally
            output, totals = kept, tally.kept_totals(kept)
        else:
            output, totals = await tally.output(shares, agreed, quorum)
            try:
                on_output(output)  # the tallier keeps it: no void from here on, and a tally again counts it
            except ValueError as error:
                raise VoterError(str(error)) from None
        await open_checked(runtime, tally.summed([0]))  # a barrier: every tallier kept it before any output
        if reveal == "histogram":
            labels, revealed = await tally.histogram(totals, label_threshold)
        else:
            labels, revealed = await tally.labels(totals, label_threshold), None
    except (VoterError, TamperError, DeviationError) as error:
        tally.ended = error  # it stands if a peer leaves during the shutdown, or never joins it (Review 5)
        await runtime.shutdown()
        raise
    sent = sum(peer.protocol.nbytes_sent for peer in runtime.parties if peer.pid != runtime.pid)
    await runtime.shutdown()
    return MpcResult(
        voters=output.voters,
        refused=output.refused,
        labels=labels,
        totals=revealed,
        bytes_sent=sent,
        seed=output.placement,
    )


class _Tally:
    """Steps 1 to 6 of the module docstring, for one round of one tallier."""

    def __init__(self, runtime, secint, layout: BallotLayout, round_number: int, talliers: tuple[str, ...]) -> None:
        self.runtime, self.secint, self.layout, self.round = runtime, secint, layout, round_number
        self.talliers = talliers
        self.modulus = secint.field.modulus
        self.ballots: list[CheckedBallot] = []  # each voter's, in the order of the voters
        self.seed = 0  # the round's public challenge, opened once every input is in
        self.ended: VoterError | TamperError | DeviationError | None = None
        self.checks: BallotChecks | None = None
        self.pairs: Authenticated | None = None  # the round's key and recorded products, from step 4 on

    def inputs(self, values: list[int]) -> list:
        """Every tallier's input of ``len(values)`` field elements (this one's ``values``), as secret arrays."""
        field = self.secint.field
        return self.runtime.input(self.secint.array(field.array(np.array(values, dtype=object))))

    def summed(self, values: list[int]):
        arrays = self.inputs(values)
        return sum(arrays[1:], arrays[0])

    async def agree_on_voters(self, hospitals: tuple[str, ...], shares: dict, bad: dict, quorum: int) -> Voters:
        inputs = self.inputs(marks_input(self.round, hospitals, shares, bad))
        rows = [await open_checked(self.runtime, vector) for vector in inputs]
        return decide(rows, round_number=self.round, hospitals=hospitals, talliers=self.talliers, quorum=quorum)

    async def check(self, shares: list[np.ndarray], voters: tuple[str, ...]) -> tuple[list[int], dict[str, str]]:
        """Steps 2 to 4: the indices of the voters whose ballots count, and why each refused one is. Every product of
        the checks is a product of authenticated pairs, checked before any check is opened (``DeviationError``)."""
        runtime, layout = self.runtime, self.layout
        ballots = [layout.split(vector) for vector in shares]
        committed = self.summed(
            [int(v) for ballot in ballots for bits, _, key in ballot for v in (*bits.reshape(-1), *key)]
        )
        await runtime.gather([committed])  # every tallier's inputs are in before anyone learns the challenge
        self.seed = await joint_seed(runtime, self.secint)
        if self.seed == 0:  # probability 1/p; 0 is no placement (``agree_on_placement``)
            raise DrawError(f"round {self.round}: its challenge opened as zero; the round is tallied again")
        self.checks = BallotChecks(runtime, self.secint, layout, self.seed)
        pairs = self.pairs = Authenticated(runtime, self.secint, self.round)
        committed = pairs.authenticate(committed)
        tags = pairs.authenticate(self.summed([c for ballot in ballots for c in self.checks.tag_combinations(ballot)]))
        width, parts = layout.committed_values, len(layout.parts)
        self.ballots = [
            self.checks.check(
                pairs, pair_part(committed, v * width, (v + 1) * width), pair_part(tags, v * parts, (v + 1) * parts)
            )
            for v in range(len(voters))
        ]
        masked = pairs.masked([getattr(ballot, kind) for kind in ("tag", *REFUSALS) for ballot in self.ballots])
        await pairs.check(of="the ballot checks' arithmetic")  # before any opens: an error fails this, not a ballot
        failed = _nonzero(await open_checked(runtime, masked[: len(voters)]))
        if failed:
            raise TamperError(tuple(voters[v] for v in failed), self.round)
        refused: dict[str, str] = {}
        for index in _nonzero(await open_checked(runtime, masked[len(voters) :])):
            kind, v = divmod(index, len(voters))
            refused.setdefault(voters[v], list(REFUSALS.values())[kind].format(s=layout.votes_per_query))
        return [v for v in range(len(voters)) if voters[v] not in refused], refused

    async def agree_on_placement(self, pinned: int) -> int:
        """The placement every tallier kept of this round in an earlier tally, whose output began (``pinned``, this
        tallier's), or 0 if none did; ``DeviationError`` if their pins differ (never a void)."""
        opened = set(await open_checked(self.runtime, self.runtime.np_concatenate(self.inputs([pinned]))))
        if len(opened) > 1:
            raise DeviationError(self.round, "the talliers kept different outputs of it (one lost or changed its pin)")
        return opened.pop()

    async def output(self, shares: dict[str, np.ndarray], agreed: Voters, quorum: int):
        """Steps 2 to 5: what this tallier keeps of the round (its noise placed by this tally's challenge), and the
        secret ``(Q, C)`` totals of the counted voters' votes and their noise, signed and placed."""
        voters = agreed.voters
        counted, checked = await self.check([shares[name] for name in voters], voters)
        refused = {**agreed.refused, **checked}
        if len(counted) < quorum:
            raise VoterError(
                f"{len(counted)} of the {len(voters)} voters' ballots pass their checks, fewer than the quorum of "
                f"{quorum}; refused: " + "; ".join(f"{name} ({why})" for name, why in refused.items())
            )
        placed = [self.checks.placed(self.ballots[v], voters[v], self.seed) for v in counted]
        totals = sum(placed[1:], placed[0])
        own = np.array((await self.runtime.gather(totals)).value, dtype=object).astype(np.uint64)
        kept = KeptOutput(self.seed, tuple(voters[v] for v in counted), refused, own)
        return kept, self.runtime.np_reshape(totals, (self.layout.queries, self.layout.classes))

    def kept_totals(self, kept: KeptOutput):
        """Step 5 of a tally again once the output began: the totals from this tallier's kept shares of them (the
        honest talliers' fix them), under a fresh key for step 6."""
        if kept.totals.size != self.layout.queries * self.layout.classes:
            raise VoterError(f"the kept totals of round {self.round} do not fit its queries and classes")
        self.pairs = Authenticated(self.runtime, self.secint, self.round)
        totals = self.secint.array(self.secint.field.array(kept.totals.astype(object)))
        return self.runtime.np_reshape(totals, (self.layout.queries, self.layout.classes))

    async def histogram(self, totals, label_threshold: int) -> tuple[np.ndarray, np.ndarray]:
        """Instead of step 6: the ``(Q, C)`` totals opened, and the labels drawn from them by the same rule."""
        opened = await open_checked(self.runtime, self.runtime.np_reshape(totals, (-1,)))
        revealed = np.array(opened, dtype=np.int64).reshape(-1, self.layout.classes)
        return _released_labels(revealed, label_threshold), revealed

    async def labels(self, totals, label_threshold: int) -> np.ndarray:
        """Step 6: each query's label, or ``C`` where its top total falls short of ``label_threshold``, computed
        over authenticated pairs and opened only once their check passed (``tallier.authenticated``)."""
        return await self.pairs.labels(totals, self.secint.bit_length, label_threshold)


def _failure(error: BaseException, network: MpcNetwork, tally: _Tally, timeout_s: float) -> BaseException:
    """Why a round failed: how it ended here (however the shutdown after it went), or a wrong share
    seen here once the checked arithmetic began (step 4: not a crash, nor another's word; as a retry it would let a
    tallier that saw a check fail escape it, Review 4, finding 3); else the ``MpcError`` that says why (the first
    abort a peer caused, if any), or ``error`` itself."""
    caught = network.caught + ([str(error)] if isinstance(error, MpcPeerError) else [])
    if tally.ended is not None or (caught and tally.pairs is not None):
        return tally.ended or DeviationError(tally.round, f"once the checked arithmetic began, {caught[0]}")
    if isinstance(error, DrawError):
        return MpcError(str(error))
    aborts = network.aborts
    if aborts or isinstance(error, MpcPeerError):
        return MpcError(f"the talliers' MPC was aborted: {aborts[0] if aborts else error}")
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return MpcError(f"the talliers' MPC did not finish within {timeout_s:g} s (a tallier left or is unreachable)")
    if isinstance(error, (OSError, ConnectionError)):
        return MpcError(f"the talliers' MPC failed: {error}")
    return error


def _nonzero(values: list[int]) -> list[int]:
    return [i for i, value in enumerate(values) if value]


def _released_labels(totals: np.ndarray, label_threshold: int) -> np.ndarray:
    """What the MPC opens, computed in the clear from ``(Q, C)`` totals: each row's first largest
    class, or ``C`` where a positive ``label_threshold`` exceeds the row's largest total."""
    labels = totals.argmax(axis=1)
    if label_threshold:
        labels = np.where(totals.max(axis=1) >= label_threshold, labels, totals.shape[1])
    return labels
