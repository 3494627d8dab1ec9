"""One MPC party for the tests: reads its summed shares from a .npz, runs the round ``rounds`` times
in this one process, and writes each result.

    python tests/mpc_party.py IN.npz OUT_PREFIX INDEX CERTIFICATES PORT [PORT ...]
"""

import sys

import numpy as np

from tallier.mpc import MpcError, MpcParty, run_round

if __name__ == "__main__":
    source, target, index, certificates, *ports = sys.argv[1:]
    with np.load(source, allow_pickle=False) as data:
        local_sum = [int(v) for v in data["local_sums"][int(index)]]
        settings = {k: int(data[k]) for k in ("queries", "classes", "bit_length")}
        reveal, timeout, rounds = str(data["reveal"]), float(data["timeout"]), int(data["rounds"])
        modulus = int(str(data["modulus"]))
    party = MpcParty(index=int(index), addresses=tuple(("127.0.0.1", int(port)) for port in ports), certificates=certificates)
    for round_number in range(1, rounds + 1):
        try:
            result = run_round(party, local_sum, **settings, modulus=modulus, reveal=reveal, timeout_s=timeout)
        except MpcError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        extra = {} if result.totals is None else {"totals": result.totals}
        np.savez(f"{target}-{round_number}.npz", labels=result.labels, bytes_sent=result.bytes_sent, **extra)
