"""The library under the launchers: a local federation specified, run, reported and planned.

- ``orchestration.spec``: ``RunSpec``, a typed run specification, and ``resolve``, its defaults;
- ``orchestration.local``: ``run_local_federation(spec)``, one OS process per party on this machine;
- ``orchestration.report``: the merged report, its plots and summary lines;
- ``orchestration.planning``: the epsilon a run will spend, and ``least_noise_multiplier``;
- ``orchestration.run_flags``: which method reads which flag, and the run configuration they make.

It sits between the roles (``protocol``, ``tallier``) and the launchers (``scripts``), which are
thin argparse wrappers over it and never import each other.
"""
