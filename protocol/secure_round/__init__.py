"""The secure round on one-time keys: each party's part (one_time_round) and the server's collection
phases (collection). The protocol on paper is docs/explanation/secure-round.md."""
