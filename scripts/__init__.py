"""Command-line launchers: provision a federation, run a server or a hospital, or a whole local
federation. Each prints a one-line error (exit status 2) for anything a user can fix."""
