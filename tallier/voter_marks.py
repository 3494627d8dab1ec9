"""Step 1 of a voting round (``tallier.mpc``): the talliers' marks of the boxes they hold, opened, and who votes.

Each tallier inputs the round number and, for each hospital of the run, its mark of the box the
server relayed it from that hospital (``protocol.voting.ballots.mark_box``: OK, NONE or BAD) and,
for a BAD one, the box's SHA-256 in 32 one-byte limbs. Every input is opened (``open_checked``:
every tallier sees the same rows; who sent a box is no secret, the server relayed it, and a digest
is of a ciphertext). With ``t`` the corrupt talliers tolerated, for each hospital the first rule
that applies:

- every mark NONE: it sent no box, or none was relayed: not a voter;
- every mark OK: a voter;
- ``t + 1`` or more BAD: an honest tallier holds a box the hospital signed that does not open to a
  share: it is refused and named, and the round goes on without it;
- 1 to ``t`` BAD: a marking tallier lies, or the hospital sent a bad box to it alone; nobody can
  tell yet, so the round is void (``DisputeError``, before any output) and each such box is
  disputed (``protocol.voting.box_dispute``): the hospital reveals that box's ephemeral secret, and
  whoever is at fault is named;
- OK and NONE: the server verified every box and relays each tallier its own, so a tallier that
  says NONE beside OKs lies, or the server relayed otherwise; the round is void, and each NONE is
  disputed too: the server, which knows what it relayed, names that tallier.

A tallier therefore cannot leave an honest hospital out of a count: a BAD mark gets it named once the
hospital reveals, a NONE mark by the server. A mark that is none of the three names its tallier
(``DeviationError``).
"""

from __future__ import annotations

from dataclasses import dataclass

from consilium.protocol.voting.ballots import BAD, NONE, OK
from consilium.tallier.authenticated import DeviationError

__all__ = ["DIGEST_BYTES", "MARKS", "DisputeError", "VoterError", "Voters", "decide", "marks_input"]

DIGEST_BYTES = 32  # a box's SHA-256, one field element a byte (the smallest field exceeds 2^8)
MARKS = {NONE: "NONE", OK: "OK", BAD: "BAD"}


class VoterError(RuntimeError):
    """The talliers do not agree on the round, or hold shares from fewer valid voters than the quorum."""


class DisputeError(VoterError):
    """A hospital whose box the talliers marked differently (and not ``t + 1`` of them BAD): the round is void, and
    every mark of that box is disputed (``protocol.voting.box_dispute``)."""

    def __init__(self, round_number: int, disputes: tuple[tuple[str, str, int, bytes], ...]) -> None:
        self.disputes = disputes  # (hospital, tallier, its mark, the box's SHA-256 if BAD, else zeros)
        hospitals = dict.fromkeys(hospital for hospital, *_ in disputes)
        named = "; ".join(
            f"{hospital}'s box: "
            + ", ".join(f"{tallier} {MARKS[mark]}" for h, tallier, mark, _ in disputes if h == hospital)
            for hospital in hospitals
        )
        super().__init__(f"round {round_number}: the talliers' marks differ ({named}): the round is void and disputed")


@dataclass(frozen=True)
class Voters:
    voters: tuple[str, ...]  # every tallier holds a valid share from each, in the run's order
    refused: dict[str, str]  # hospitals whose boxes more than t talliers could not open: why


def marks_input(round_number: int, hospitals: tuple[str, ...], shares: dict, bad: dict[str, bytes]) -> list[int]:
    """This tallier's input to step 1: the round, then each hospital's mark and (for a BAD one) its box's digest."""
    values = [round_number]
    for name in hospitals:
        if name in shares:
            values += [OK, *bytes(DIGEST_BYTES)]
        elif name in bad:
            values += [BAD, *bad[name]]
        else:
            values += [NONE, *bytes(DIGEST_BYTES)]
    return values


def decide(
    rows: list[list[int]], *, round_number: int, hospitals: tuple[str, ...], talliers: tuple[str, ...], quorum: int
) -> Voters:
    """The voters and the refused hospitals from every tallier's opened input (``rows``, in party order), by the rules
    above; ``DisputeError``, ``VoterError`` or ``DeviationError`` where the round cannot go on."""
    if {row[0] for row in rows} != {round_number}:  # never a void: no tallier may void a round unnamed
        raise DeviationError(round_number, f"the talliers are not all in round {round_number}")
    corrupt = (len(rows) - 1) // 2
    width = 1 + DIGEST_BYTES
    voters, refused, disputes = [], {}, []
    for i, name in enumerate(hospitals):
        start = 1 + i * width
        marks = [row[start] for row in rows]
        for j, row in enumerate(rows):
            if marks[j] not in (NONE, OK, BAD) or not all(0 <= limb < 256 for limb in row[start + 1 : start + width]):
                raise DeviationError(round_number, f"{talliers[j]} marked {name}'s box with what is no mark")
        bad = [j for j, mark in enumerate(marks) if mark == BAD]
        if all(mark == NONE for mark in marks):
            continue
        if all(mark == OK for mark in marks):
            voters.append(name)
        elif len(bad) > corrupt:
            refused[name] = f"its boxes to {', '.join(talliers[j] for j in bad)} do not open to a share"
        else:
            disputes += [
                (name, talliers[j], marks[j], bytes(rows[j][start + 1 : start + width])) for j in range(len(rows))
            ]
    if disputes:
        raise DisputeError(round_number, tuple(disputes))
    if len(voters) < quorum:
        raise VoterError(
            f"the talliers share valid votes from {len(voters)} hospitals, fewer than the quorum of {quorum}"
            + "".join(f"; {name} refused: {why}" for name, why in refused.items())
        )
    return Voters(tuple(voters), refused)
