"""Private voting (AE-DPFL, kNN-DPFL): the voting run's configuration, its server with its rounds,
ledgers, tallier keys, report and resumption, the hospital's part, and the sealed, checked ballots the
talliers count."""
