"""Privacy: the Skellam mechanism and its RDP, the accountant's views, the durable ledger that holds a
hospital's budget, and the cryptographic randomness every private draw comes from."""
