"""Command-line launchers: make a party's keys, assemble and check a roster, run a server, a hospital
or a tallier, or a whole local federation. Each prints a one-line error (exit status 2) for anything a user can fix."""
