"""Consilium: secure-aggregation-first federated learning for hospitals.

Installed, everything lives under this one name: ``consilium.crypto``, ``consilium.training``,
``consilium.protocol``, ``consilium.tallier``, ``consilium.orchestration`` and ``consilium.scripts``.
In the repository those are the top-level folders of the same names (pyproject.toml maps them), so
that the folders a newcomer opens are the design card's.
"""
