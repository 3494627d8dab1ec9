"""Private voting (AE-DPFL, kNN-DPFL): the voting run's configuration, its server and rounds, the
hospital's part, and the sealed, checked ballots the talliers count."""
