"""Who leaves the run when a round fails: the server weighs each refusal's evidence and each failed opening
(review 4, finding 2; review 5, findings 2 and 4), so that a liar costs the run no more than itself and one
other, and a round that fails naming nobody cannot be repeated for ever."""

from __future__ import annotations

from typing import Callable

from consilium.protocol.run.config import RunConfig
from consilium.protocol.secure_round.checks import check_opening
from consilium.protocol.secure_round.statement import Proved, RoundRefused
from consilium.protocol.secure_round.sum_round import SumRound
from consilium.protocol.wire.messages import ProtocolError, Refused

__all__ = ["MAX_ANONYMOUS_FAILURES", "MAX_UNPROVEN_REFUSALS", "Blame", "Evidence"]

MAX_UNPROVEN_REFUSALS = 2  # a hospital's refusals of rounds that no evidence bears out, before it leaves the run
MAX_ANONYMOUS_FAILURES = 2  # rounds in a row whose sum did not open and nobody is named, before the run ends


class Blame:
    """The server's counts of unproven refusals, disputes and anonymous failures over a run, and whom they expel."""

    def __init__(self, expel: Callable[[str, str], None], run: Callable[[], RunConfig]) -> None:
        # The run's configuration as it is when a round is weighed: narrowed to the hospitals that joined,
        # whose key threshold tau is the one that counts (never the roster's).
        self._expel, self._run = expel, run
        self._unproven: dict[str, int] = {}  # hospital -> its refusals that no evidence bore out
        self._anonymous_failures = 0  # rounds in a row whose sum did not open, naming nobody
        self._disputes: dict[tuple[str, str], int] = {}  # (accuser, dealer) -> rounds it named that dealer

    def opened(self) -> None:
        """A sum opened: the anonymous failures are no longer in a row."""
        self._anonymous_failures = 0

    def weigh(self, round_number: int, refusals: dict[str, Refused], evidence: Evidence) -> None:
        """Act on refusals (review 4, finding 2; review 5, finding 2):

        - a dealer that an opening convicts (``protocol.secure_round.checks.check_opening``) leaves the run;
        - a refusal that shows no opening for whom it names (the server, say) is its refuser's word
          alone, since this server checked every box signature, endorsement, proof and release it
          relayed: after ``MAX_UNPROVEN_REFUSALS`` of them the refuser leaves the run;
        - a refusal that names dealers and shows their boxes' keys, which do not convict them (a
          signed box that does not decrypt, which nobody can prove either way), is a dispute between
          two hospitals. A dealer that ``tau`` or
          more hospitals name so in one round leaves the run (at most ``tau - 1`` are dishonest, so
          one of them told the truth); a pair in dispute ``MAX_UNPROVEN_REFUSALS`` times leaves the
          run together, so that a liar costs the run no more than itself and one other.
        """
        accusers: dict[str, set[str]] = {}
        for name, refusal in refusals.items():
            convicted = [dealer for dealer, key in refusal.openings.items() if evidence.convicts(name, dealer, key)]
            for dealer in convicted:
                self._expel(dealer, f"round {round_number}: {name}'s opening shows it dealt a wrong share")
            disputed = [  # named, with the box's key shown, but not convicted by it
                dealer for dealer in refusal.named if dealer in refusal.openings and dealer in self._run().hospitals
            ]
            if convicted:
                continue
            if not disputed:
                self._unproven[name] = self._unproven.get(name, 0) + 1
                if self._unproven[name] >= MAX_UNPROVEN_REFUSALS:
                    self._expel(name, f"refused {self._unproven[name]} rounds without evidence")
            for dealer in disputed:
                accusers.setdefault(dealer, set()).add(name)
        for dealer, names in accusers.items():
            if len(names) >= self._run().key_threshold:
                self._expel(dealer, f"round {round_number}: {len(names)} hospitals name it as a dealer")
                continue
            for name in names:
                pair = (name, dealer)
                self._disputes[pair] = self._disputes.get(pair, 0) + 1
                if self._disputes[pair] >= MAX_UNPROVEN_REFUSALS:
                    reason = f"in dispute with {{}} over {self._disputes[pair]} rounds; neither side can be proven"
                    self._expel(name, reason.format(dealer))
                    self._expel(dealer, reason.format(name))

    def failed_opening(self, refusal: RoundRefused) -> None:
        """Every member released, yet the sum did not open. A member a check names signed what convicts
        it, and leaves the run. A failure that names nobody is an upload made under another key than
        its dealer shared, which nothing yet pins on its maker (review 5, finding 4): after
        ``MAX_ANONYMOUS_FAILURES`` of them in a row the run ends, rather than charge every ledger on."""
        for name in refusal.named:
            self._expel(name, str(refusal))
        if refusal.named:
            return
        self._anonymous_failures += 1
        if self._anonymous_failures >= MAX_ANONYMOUS_FAILURES:
            raise ProtocolError(
                f"{self._anonymous_failures} rounds in a row did not open after every release, and no check names "
                "whom: an upload was made under another key than its dealer shared"
            )


class Evidence:
    """What the server holds to weigh a refusal's openings: the round's statement, boxes and proofs."""

    def __init__(self, total: SumRound, updates: dict, box_keys: dict[str, bytes], identities: dict) -> None:
        self._total, self._updates, self._box_keys, self._identities = total, updates, box_keys, identities
        self.proofs: dict[str, Proved] = {}

    def convicts(self, recipient: str, dealer: str, key: bytes) -> bool:
        if dealer not in self._updates or recipient not in self._box_keys:
            return False
        return check_opening(
            self._total.setting,
            self._total.public,
            statement=self._total.statement_bytes,
            dealer=dealer,
            recipient=recipient,
            box=self._updates[dealer].boxes[recipient],
            key=key,
            dealer_upload=self._total.digests[dealer],
            recipient_box_key=self._box_keys[recipient],
            identities=self._identities,
            proved=self.proofs.get(dealer),
        )
