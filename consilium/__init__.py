"""Consilium: secure-aggregation-first federated learning for hospitals.

Installed, everything lives under this one name: ``consilium.crypto``, ``consilium.training``,
``consilium.protocol``, ``consilium.tallier``, ``consilium.orchestration`` and ``consilium.scripts``.
In the repository those are the top-level folders of the same names (pyproject.toml maps them): the
layers of docs/explanation/architecture.md, each a folder a newcomer opens first. ``consilium.errors``
holds the one base of every error a launcher reports in one line.
"""
