"""One MPC party for the tests: reads its summed shares from a .npz, runs a round, writes the result.

    python tests/mpc_party.py IN.npz OUT.npz INDEX CERTS|- PORT [PORT ...]
"""

import sys
from pathlib import Path

import numpy as np

from tallier.mpc import MpcError, MpcParty, run_round

if __name__ == "__main__":
    source, target, index, certificates, *ports = sys.argv[1:]
    with np.load(source, allow_pickle=False) as data:
        local_sum = [int(v) for v in data["local_sums"][int(index)]]
        queries, classes, bit_length = (int(data[k]) for k in ("queries", "classes", "bit_length"))
        reveal, timeout = str(data["reveal"]), float(data["timeout"])
    party = MpcParty(
        index=int(index),
        addresses=tuple(("127.0.0.1", int(port)) for port in ports),
        certificates=None if certificates == "-" else Path(certificates),
    )
    try:
        result = run_round(party, local_sum, queries=queries, classes=classes, bit_length=bit_length, reveal=reveal, timeout_s=timeout)
    except MpcError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    extra = {} if result.totals is None else {"totals": result.totals}
    np.savez(target, labels=result.labels, bytes_sent=result.bytes_sent, **extra)
