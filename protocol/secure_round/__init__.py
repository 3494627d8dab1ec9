"""The secure round on one-time keys (the protocol on paper: docs/explanation/secure-round.md).

``statement``: what every party agrees on, signs and hashes; ``checks``: what anyone can check of
another's step; ``hospital_round`` and ``sum_round``: a hospital's side and the server's, without the
network; ``box_keys``: the per-round keys key shares are sealed to; ``member_messages``: a hospital's
side on the wire; and ``collection``: the server's collection phases over the network.
"""
