"""A training run: its configuration, who takes part (participants, the run skeleton both servers share),
the server and its checkpoint and report, and the hospital with its metrics."""
