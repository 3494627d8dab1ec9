"""The secure round on one-time keys (the protocol on paper: docs/explanation/secure-round.md).

``statement``: what every party agrees on, signs and hashes; ``checks``: what anyone can check of
another's step; ``hospital_round`` and ``sum_round``: a hospital's side and the server's; and
``collection``: the server's collection phases over the network.
"""
